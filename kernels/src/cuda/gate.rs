//! Bindings of `gate.cu`: the KDA forget gate and write strength.
//!
//! The write strength's input is read in place when its rows lie at a stride
//! (the b columns of a KDA layer's stacked input projection, at more than one
//! token).

use std::ffi::{c_int, c_void};

use candle_core::{DType, Tensor};

use super::{c_size, dtype_code, Launch};
use crate::gate::KdaGateArgs;
use crate::Result;

extern "C" {
    fn berrylm_kda_gate(
        raw_dtype: c_int,
        raw: *const c_void,
        a_log: *const f32,
        dt_bias: *const f32,
        out: *mut f32,
        tokens: i64,
        width: c_int,
        head_dim: c_int,
        has_lower_bound: c_int,
        lower_bound: f32,
        stream: *mut c_void,
    ) -> c_int;

    fn berrylm_kda_beta(
        b_dtype: c_int,
        b: *const c_void,
        b_stride: i64,
        out: *mut f32,
        rows: i64,
        width: c_int,
        stream: *mut c_void,
    ) -> c_int;
}

impl KdaGateArgs<'_> {
    /// CUDA `kda_gate`; arguments already validated by the caller.
    pub(crate) fn cuda(&self) -> Result<Tensor> {
        const OP: &str = "kda_gate";
        let mut launch = Launch::new(OP, self.raw)?;
        let raw = launch.input("raw", self.raw)?;
        let a_log = launch.input_as("a_log", self.a_log, DType::F32)?;
        let dt_bias = launch.input_as("dt_bias", self.dt_bias, DType::F32)?;
        let raw_dtype = launch.dtype(raw);
        let out = launch.output(&[self.tokens, self.num_heads, self.head_dim], DType::F32)?;
        let (has_lb, lb) = match self.lower_bound {
            Some(bound) => (1, bound),
            None => (0, 0.0),
        };
        let outputs = run_kernel!(launch => berrylm_kda_gate(
            dtype(raw_dtype), input(raw), input(a_log), input(dt_bias), output(out),
            self.tokens as i64,
            c_size(OP, "raw", self.num_heads * self.head_dim)?,
            c_size(OP, "raw", self.head_dim)?,
            has_lb, lb
        ))?;
        Ok(outputs.tensor(out))
    }
}

/// CUDA `kda_beta`; the dtype already validated by the caller.
pub(crate) fn kda_beta(b: &Tensor) -> Result<Tensor> {
    const OP: &str = "kda_beta";
    let mut launch = Launch::new(OP, b)?;
    let (b, b_stride) = launch.input_rows("b", b)?;
    let b_dtype = launch.dtype(b);
    let shape = launch.shape(b).clone();
    let width = shape.dims().last().copied().unwrap_or(1);
    let rows = shape.elem_count() / width.max(1);
    let out = launch.output(shape, DType::F32)?;
    // SAFETY (with `run_kernel!`'s): `b` is read as `rows` rows of `width` elements, `b_stride`
    // elements apart from its first element, which its layout spans.
    let outputs = run_kernel!(launch => berrylm_kda_beta(
        dtype(b_dtype), input(b), b_stride as i64, output(out), rows as i64,
        c_size(OP, "b", width)?
    ))?;
    Ok(outputs.tensor(out))
}
