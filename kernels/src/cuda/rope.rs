//! Bindings of the gated full attention's kernels: `rope.cu` (the q/k norm
//! and rotary embedding) and `gate_mul.cu` (the output gate).
//!
//! Unlike the other launches, these read one input in place when its rows
//! lie at a stride (the query and gate halves of the per-head interleaved
//! `q_proj` output): the kernel gets the view's first element and its row
//! stride instead of a contiguous copy.

use std::ffi::{c_int, c_void};

use candle_core::{DType, Layout, Shape, Tensor};

use super::{
    c_size, check, cuda_device, dtype_code, input_ptr, into_tensor, output_ptr, Input, Launch,
};
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

/// The distance in elements between consecutive rows of `layout`'s last
/// dimension, when that dimension is contiguous and the leading dimensions
/// collapse to rows at one stride of at least the row width (rows that do
/// not overlap); `None` for any other layout.
fn row_stride(layout: &Layout) -> Option<usize> {
    let (&width, leading) = layout.dims().split_last()?;
    let strides = layout.stride();
    if width > 1 && strides[leading.len()] != 1 {
        return None;
    }
    let mut row_stride = None;
    // Rows spanned by one step of the dimension being checked.
    let mut rows_inside = 1;
    for (&size, &stride) in leading.iter().zip(strides).rev() {
        if size == 1 {
            continue;
        }
        match row_stride {
            None => row_stride = Some(stride),
            Some(row) if stride == row * rows_inside => {}
            Some(_) => return None,
        }
        rows_inside *= size;
    }
    let row_stride = row_stride.unwrap_or(width);
    (row_stride >= width).then_some(row_stride)
}

/// A tensor read as rows of its last dimension at one stride: the tensor
/// itself when its layout has one (see [`row_stride`]), else a contiguous
/// copy (whose stride is the row width).
struct Rows {
    input: Input,
    stride: usize,
}

impl Rows {
    fn new(tensor: &Tensor) -> Result<Self> {
        if let Some(stride) = row_stride(tensor.layout()) {
            let input = Input {
                tensor: tensor.clone(),
            };
            return Ok(Self { input, stride });
        }
        let input = Input::new(tensor, None)?;
        let stride = input.tensor.dims().last().copied().unwrap_or(1);
        Ok(Self { input, stride })
    }
}

/// CUDA `offset_rms_norm_rope`; arguments already validated by the caller
/// (`x` `[B, T, H, D]`, `scale` `f32` `[D]`, `cos` and `sin` `[B, T, rotary]`
/// in the dtype of `x`).
pub(crate) fn offset_rms_norm_rope(
    x: &Tensor,
    scale: &Tensor,
    eps: f64,
    cos: &Tensor,
    sin: &Tensor,
    rotary: usize,
) -> Result<Tensor> {
    const OP: &str = "offset_rms_norm_rope";
    let launch = Launch::new(cuda_device(OP, x)?)?;
    let (batch, seq_len, heads, width) = x.dims4()?;
    let x = Rows::new(x)?;
    let scale = Input::new(scale, Some(DType::F32))?;
    let cos = Input::new(cos, None)?;
    let sin = Input::new(sin, None)?;
    let dtype = x.input.dtype();
    let shape = Shape::from_dims(&[batch, seq_len, heads, width]);
    let rows = batch * seq_len * heads;
    // What candle's `mean_keepdim` multiplies the sum by, and the `eps` its
    // `+ eps` adds, both rounded to f32 as candle rounds them.
    let inv_width = (1.0 / width as f64) as f32;
    let mut out = launch.alloc(&shape, dtype)?;
    {
        input_ptrs!(OP, launch,
            x_p <- x.input, scale_p <- scale, cos_p <- cos, sin_p <- sin);
        let out_p = output_ptr(&mut out, &launch.stream)?;
        // SAFETY: as in `kda_gate`; `x` is read as `rows` rows of `width`
        // elements, `x.stride` elements apart from its first element, which
        // its layout spans.
        let code = unsafe {
            berrylm_offset_rms_norm_rope(
                dtype_code(OP, dtype)?,
                x_p.0 as *const c_void,
                x.stride as i64,
                scale_p.0 as *const f32,
                cos_p.0 as *const c_void,
                sin_p.0 as *const c_void,
                out_p.0 as *mut c_void,
                rows as i64,
                c_size(OP, "x", heads)?,
                c_size(OP, "x", width)?,
                c_size(OP, "cos", rotary)?,
                inv_width,
                eps as f32,
                launch.raw_stream(),
            )
        };
        check(OP, code)?;
    }
    Ok(into_tensor(out, shape))
}

/// CUDA `sigmoid_gate_mul`; arguments already validated by the caller (`x`
/// and `gate` of shape `dims` and one dtype).
pub(crate) fn sigmoid_gate_mul(x: &Tensor, gate: &Tensor, dims: &[usize; 4]) -> Result<Tensor> {
    const OP: &str = "sigmoid_gate_mul";
    let launch = Launch::new(cuda_device(OP, x)?)?;
    let x = Input::new(x, None)?;
    let gate = Rows::new(gate)?;
    let [batch, seq_len, heads, width] = *dims;
    let shape = Shape::from_dims(dims);
    let rows = batch * seq_len * heads;
    let mut out = launch.alloc(&shape, x.dtype())?;
    {
        input_ptrs!(OP, launch, x_p <- x, gate_p <- gate.input);
        let out_p = output_ptr(&mut out, &launch.stream)?;
        // SAFETY: as in `kda_gate`; `gate` is read as `rows` rows of `width`
        // elements, `gate.stride` elements apart from its first element,
        // which its layout spans.
        let code = unsafe {
            berrylm_sigmoid_gate_mul(
                dtype_code(OP, x.dtype())?,
                x_p.0 as *const c_void,
                gate_p.0 as *const c_void,
                gate.stride as i64,
                out_p.0 as *mut c_void,
                rows as i64,
                c_size(OP, "x", width)?,
                launch.raw_stream(),
            )
        };
        check(OP, code)?;
    }
    Ok(into_tensor(out, shape))
}
