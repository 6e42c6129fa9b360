//! Binding of `gate_mul.cu`: the attention output times the sigmoid of its
//! gate.
//!
//! The gate is read in place when its rows lie at a stride (the gate half
//! of the per-head interleaved `q_proj` output): the kernel gets the view's
//! first element and its row stride instead of a contiguous copy
//! ([`Launch::input_rows`]).

use std::ffi::{c_int, c_void};

use candle_core::Tensor;

use super::{c_size, dtype_code, Launch};
use crate::Result;

extern "C" {
    fn berrylm_sigmoid_gate_mul(
        dtype: c_int,
        x: *const c_void,
        gate: *const c_void,
        gate_row_stride: i64,
        out: *mut c_void,
        rows: i64,
        width: c_int,
        stream: *mut c_void,
    ) -> c_int;
}

/// CUDA `sigmoid_gate_mul`; arguments already validated by the caller (`x`
/// and `gate` of shape `dims` and one dtype).
pub(crate) fn sigmoid_gate_mul(x: &Tensor, gate: &Tensor, dims: &[usize; 4]) -> Result<Tensor> {
    const OP: &str = "sigmoid_gate_mul";
    let mut launch = Launch::new(OP, x)?;
    let x = launch.input("x", x)?;
    let (gate, gate_stride) = launch.input_rows("gate", gate)?;
    let dtype = launch.dtype(x);
    let [batch, seq_len, heads, width] = *dims;
    let rows = batch * seq_len * heads;
    let out = launch.output(dims, dtype)?;
    // SAFETY (with `run_kernel!`'s): `gate` is read as `rows` rows of `width` elements, `gate_stride`
    // elements apart from its first element, which its layout spans.
    let outputs = run_kernel!(launch => berrylm_sigmoid_gate_mul(
        dtype(dtype), input(x), input(gate), gate_stride as i64, output(out),
        rows as i64, c_size(OP, "x", width)?
    ))?;
    Ok(outputs.tensor(out))
}
