//! Bindings of `norm.cu`: the gated RMSNorm and the `(1 + w)` RMSNorm, with
//! or without the residual add before it.

use std::ffi::{c_int, c_void};

use candle_core::{DType, Tensor};

use super::quantized::aligned16;
use super::{c_size, dtype_code, Launch};
use crate::norm::GatedRmsNormArgs;
use crate::Result;

extern "C" {
    fn berrylm_gated_rms_norm(
        out_dtype: c_int,
        x_dtype: c_int,
        z_dtype: c_int,
        x: *const c_void,
        z: *const c_void,
        weight: *const f32,
        out: *mut c_void,
        rows: i64,
        width: c_int,
        eps: f32,
        stream: *mut c_void,
    ) -> c_int;

    fn berrylm_offset_rms_norm(
        x_dtype: c_int,
        x: *const c_void,
        delta: *const c_void,
        scale: *const f32,
        sum_out: *mut c_void,
        out: *mut c_void,
        rows: i64,
        width: c_int,
        inv_width: f32,
        eps: f32,
        stream: *mut c_void,
    ) -> c_int;

    fn berrylm_add_offset_rms_norm_matmul(
        dtype: c_int,
        x: *const c_void,
        delta: *const c_void,
        scale: *const f32,
        sum_out: *mut c_void,
        normed_out: *mut c_void,
        weight: *const c_void,
        y: *mut c_void,
        tokens: c_int,
        width: c_int,
        out_dim: c_int,
        inv_width: f32,
        eps: f32,
        stream: *mut c_void,
    ) -> c_int;
}

/// The most rows, the widest rows and the most bytes of normed rows the
/// fused kernel of `add_offset_rms_norm_matmul` takes (norm.cu).
const NORM_MATMUL_MAX_ROWS: usize = 8;
const NORM_MATMUL_MAX_WIDTH: usize = 2048;
const NORM_MATMUL_MAX_STAGED_BYTES: usize = 48 * 1024;

/// CUDA `add_offset_rms_norm_matmul` in one kernel, for decode steps: `(sum,
/// normed, y)`, or `None` where the kernel does not take the sizes (up to
/// 8 rows of `x` `[rows, width]`, `width` a multiple of 8 up to 2048).
/// Arguments validated by the caller (`delta` as `x`, `scale` f32 `[width]`,
/// `weight` `[out_dim, width]` in the dtype of `x`, all on one device).
pub(crate) fn add_offset_rms_norm_matmul(
    x: &Tensor,
    delta: &Tensor,
    scale: &Tensor,
    eps: f64,
    weight: &Tensor,
) -> Result<Option<(Tensor, Tensor, Tensor)>> {
    const OP: &str = "add_offset_rms_norm_matmul";
    let (rows, width) = x.dims2()?;
    let (out_dim, _) = weight.dims2()?;
    if rows > NORM_MATMUL_MAX_ROWS
        || width > NORM_MATMUL_MAX_WIDTH
        || !width.is_multiple_of(8)
        || rows * width * x.dtype().size_in_bytes() > NORM_MATMUL_MAX_STAGED_BYTES
    {
        return Ok(None);
    }
    let mut launch = Launch::new(OP, x)?;
    let x = launch.input("x", &aligned16(x)?)?;
    let delta = launch.input("delta", &aligned16(delta)?)?;
    let scale = launch.input_as("scale", scale, DType::F32)?;
    let weight = launch.input("weight", &aligned16(weight)?)?;
    let dtype = launch.dtype(x);
    let sum = launch.output(&[rows, width], dtype)?;
    let normed = launch.output(&[rows, width], dtype)?;
    let y = launch.output(&[rows, out_dim], dtype)?;
    let outputs = launch.run(|p| {
        // SAFETY: as in `run_kernel!`; `x`, `delta` contiguous `[rows,
        // width]` and `weight` `[out_dim, width]` at 16-byte boundaries of
        // their (aligned) allocations, the outputs freshly allocated.
        Ok(unsafe {
            berrylm_add_offset_rms_norm_matmul(
                dtype_code(OP, dtype)?,
                p.input(x),
                p.input(delta),
                p.input(scale),
                p.output(sum),
                p.output(normed),
                p.input(weight),
                p.output(y),
                c_size(OP, "x", rows)?,
                c_size(OP, "x", width)?,
                c_size(OP, "weight", out_dim)?,
                (1.0 / width as f64) as f32,
                eps as f32,
                p.stream(),
            )
        })
    })?;
    Ok(Some((
        outputs.tensor(sum),
        outputs.tensor(normed),
        outputs.tensor(y),
    )))
}

impl GatedRmsNormArgs<'_> {
    /// CUDA `gated_rms_norm`; arguments already validated by the caller.
    pub(crate) fn cuda(&self) -> Result<Tensor> {
        const OP: &str = "gated_rms_norm";
        let (rows, width) = (self.rows, self.width);
        let mut launch = Launch::new(OP, self.x)?;
        let out_dtype = self.dtype;
        // x and z are read in the output dtype when they have it, else as f32
        // (x then rounded to the output dtype as it is read).
        let read_dtype = |tensor: &Tensor| {
            if tensor.dtype() == out_dtype {
                out_dtype
            } else {
                DType::F32
            }
        };
        let x = launch.input_as("x", self.x, read_dtype(self.x))?;
        let z = launch.input_as("z", self.z, read_dtype(self.z))?;
        let (x_dtype, z_dtype) = (launch.dtype(x), launch.dtype(z));
        let weight = launch.input_as("weight", self.weight, DType::F32)?;
        let out = launch.output(&[rows, width], out_dtype)?;
        let outputs = run_kernel!(launch => berrylm_gated_rms_norm(
            dtype(out_dtype), dtype(x_dtype), dtype(z_dtype), input(x), input(z), input(weight),
            output(out), rows as i64, c_size(OP, "x", width)?, self.eps as f32
        ))?;
        Ok(outputs.tensor(out))
    }
}

/// CUDA `offset_rms_norm` and `add_offset_rms_norm`; arguments already
/// validated by the caller (`x` has a positive last dimension, `scale` is
/// `f32`, `delta` has the shape and dtype of `x`). Returns the normed rows
/// and, with `delta`, the sums `x + delta` they were computed from.
pub(crate) fn offset_rms_norm(
    x: &Tensor,
    delta: Option<&Tensor>,
    scale: &Tensor,
    eps: f64,
) -> Result<(Tensor, Option<Tensor>)> {
    const OP: &str = "offset_rms_norm";
    let width = x.dim(candle_core::D::Minus1)?;
    let mut launch = Launch::new(OP, x)?;
    let x = launch.input("x", x)?;
    let delta = delta
        .map(|delta| launch.input("delta", delta))
        .transpose()?;
    let scale = launch.input_as("scale", scale, DType::F32)?;
    let x_dtype = launch.dtype(x);
    let shape = launch.shape(x).clone();
    let rows = shape.elem_count() / width;
    // What candle's `mean_keepdim` multiplies the sum by, and the `eps` its
    // `+ eps` adds, both rounded to f32 as candle rounds them.
    let inv_width = (1.0 / width as f64) as f32;
    let out = launch.output(&shape, x_dtype)?;
    let sum = delta.map(|_| launch.output(&shape, x_dtype)).transpose()?;
    let outputs = launch.run(|p| {
        // SAFETY: as in `run_kernel!`; `delta` and `sum_out` are null or
        // buffers of the size of `x`.
        Ok(unsafe {
            berrylm_offset_rms_norm(
                dtype_code(OP, x_dtype)?,
                p.input(x),
                delta.map_or(std::ptr::null(), |delta| p.input(delta)),
                p.input(scale),
                sum.map_or(std::ptr::null_mut(), |sum| p.output(sum)),
                p.output(out),
                rows as i64,
                c_size(OP, "x", width)?,
                inv_width,
                eps as f32,
                p.stream(),
            )
        })
    })?;
    Ok((outputs.tensor(out), sum.map(|sum| outputs.tensor(sum))))
}
