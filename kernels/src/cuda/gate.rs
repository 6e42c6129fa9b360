//! Bindings of `gate.cu`: the KDA forget gate and write strength.

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
        out: *mut f32,
        total: i64,
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
    let b = launch.input("b", b)?;
    let b_dtype = launch.dtype(b);
    let shape = launch.shape(b).clone();
    let total = shape.elem_count() as i64;
    let out = launch.output(shape, DType::F32)?;
    let outputs = run_kernel!(launch => berrylm_kda_beta(
        dtype(b_dtype), input(b), output(out), total
    ))?;
    Ok(outputs.tensor(out))
}
