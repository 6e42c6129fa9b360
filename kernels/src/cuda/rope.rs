//! Binding of `rope.cu`: the q/k `(1 + w)` RMSNorm and the partial rotary
//! embedding.
//!
//! Unlike most launches, this one reads `x` in place when its rows lie at a
//! stride (the query half of the per-head interleaved `q_proj` output): the
//! kernel gets the view's first element and its row stride instead of a
//! contiguous copy ([`Launch::input_rows`]).

use std::ffi::{c_int, c_void};

use candle_core::{DType, Tensor};

use super::{c_size, dtype_code, Launch};
use crate::rope::NormRopeArgs;
use crate::Result;

extern "C" {
    fn berrylm_offset_rms_norm_rope(
        dtype: c_int,
        x: *const c_void,
        x_row_stride: i64,
        scale: *const f32,
        cos_table: *const c_void,
        sin_table: *const c_void,
        out: *mut c_void,
        rows: i64,
        heads: c_int,
        width: c_int,
        rotary: c_int,
        inv_width: f32,
        eps: f32,
        stream: *mut c_void,
    ) -> c_int;
}

impl NormRopeArgs<'_> {
    /// CUDA `offset_rms_norm_rope`; arguments already validated by the caller.
    pub(crate) fn cuda(&self) -> Result<Tensor> {
        const OP: &str = "offset_rms_norm_rope";
        let (batch, seq_len, heads, width) = self.x.dims4()?;
        let mut launch = Launch::new(OP, self.x)?;
        let (x, x_stride) = launch.input_rows("x", self.x)?;
        let scale = launch.input_as("scale", self.scale, DType::F32)?;
        let [cos, sin] = launch.inputs([("cos", self.cos), ("sin", self.sin)])?;
        let dtype = launch.dtype(x);
        let rows = batch * seq_len * heads;
        // What candle's `mean_keepdim` multiplies the sum by, and the `eps` its
        // `+ eps` adds, both rounded to f32 as candle rounds them.
        let inv_width = (1.0 / width as f64) as f32;
        let out = launch.output(&[batch, seq_len, heads, width], dtype)?;
        // SAFETY (with `run_kernel!`'s): `x` is read as `rows` rows of `width`
        // elements, `x_stride` elements apart from its first element, which its
        // layout spans.
        let outputs = run_kernel!(launch => berrylm_offset_rms_norm_rope(
            dtype(dtype), input(x), x_stride as i64,
            input(scale), input(cos), input(sin), output(out),
            rows as i64,
            c_size(OP, "x", heads)?,
            c_size(OP, "x", width)?,
            c_size(OP, "cos", self.rotary)?,
            inv_width, self.eps as f32
        ))?;
        Ok(outputs.tensor(out))
    }
}
