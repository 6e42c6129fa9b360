//! Binding of `quantized_matmul.cu`, and what the bindings of weights in GGUF
//! blocks share: the kernels' format codes, the blocks' device address, and
//! activations at the 16-byte alignment the kernels load them at.

use std::ffi::{c_int, c_void};

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Tensor;

use super::{c_size, dtype_code, Launch};
use crate::{invalid_argument, Result};

/// Format codes of the kernels (`berrylm::rows::GgufCode` in weight_rows.cuh).
const GGUF_Q8_0: c_int = 0;
const GGUF_Q4K: c_int = 1;

extern "C" {
    fn berrylm_quantized_matmul(
        dtype: c_int,
        format: c_int,
        x: *const c_void,
        weight: *const c_void,
        dense: *const c_void,
        y: *mut c_void,
        tokens: c_int,
        in_dim: c_int,
        quantized_rows: c_int,
        dense_rows: c_int,
        stream: *mut c_void,
    ) -> c_int;

    fn berrylm_dense_matmul(
        dtype: c_int,
        x: *const c_void,
        weight: *const c_void,
        y: *mut c_void,
        tokens: c_int,
        in_dim: c_int,
        out_dim: c_int,
        stream: *mut c_void,
    ) -> c_int;
}

/// The kernels' format code of `dtype`.
pub(super) fn gguf_code(op: &'static str, arg: &'static str, dtype: GgmlDType) -> Result<c_int> {
    match dtype {
        GgmlDType::Q8_0 => Ok(GGUF_Q8_0),
        GgmlDType::Q4K => Ok(GGUF_Q4K),
        other => Err(invalid_argument(
            op,
            arg,
            format!("no kernel for weights quantized to {other:?}"),
        )),
    }
}

/// The device address of `weight`'s first block (the weights outlive the
/// launch: the caller holds them).
pub(super) fn blocks_address(weight: &QTensor) -> Result<*const c_void> {
    Ok(weight.device_ptr()?.cast())
}

/// `tensor` contiguous and starting at a 16-byte boundary of its storage
/// (whose allocation is aligned), as the kernels load activations: itself,
/// or a copy into storage of its own (`Tensor::copy` keeps the offset).
pub(super) fn aligned16(tensor: &Tensor) -> Result<Tensor> {
    let offset_bytes = tensor.layout().start_offset() * tensor.dtype().size_in_bytes();
    if tensor.is_contiguous() && offset_bytes.is_multiple_of(16) {
        Ok(tensor.clone())
    } else {
        Ok(tensor.force_contiguous()?)
    }
}

/// CUDA `quantized_matmul` (with `dense` rows after the quantized ones);
/// arguments validated by the caller (`x` `[tokens, in_dim]`, `weight`
/// `[quantized_rows, in_dim]` of a type the kernels take, `dense`
/// `[dense_rows, in_dim]` in the dtype of `x`, all on the device of `x`).
pub(crate) fn quantized_matmul(
    op: &'static str,
    x: &Tensor,
    weight: &QTensor,
    dense: Option<&Tensor>,
) -> Result<Tensor> {
    let (tokens, in_dim) = x.dims2()?;
    let (quantized_rows, _) = weight.shape().dims2()?;
    let format = gguf_code(op, "weight", weight.dtype())?;
    let blocks = blocks_address(weight)?;
    let mut launch = Launch::new(op, x)?;
    let x = launch.input("x", &aligned16(x)?)?;
    let dtype = launch.dtype(x);
    let (dense, dense_rows) = match dense {
        Some(dense) => {
            let rows = dense.dims2()?.0;
            (Some(launch.input("dense", dense)?), rows)
        }
        None => (None, 0),
    };
    let y = launch.output(&[tokens, quantized_rows + dense_rows], dtype)?;
    let outputs = launch.run(|p| {
        // SAFETY: `x` is contiguous `[tokens, in_dim]` and 16-byte aligned,
        // `blocks` the `[quantized_rows, in_dim]` weight's blocks (held by
        // the caller), `dense` contiguous `[dense_rows, in_dim]` (or null
        // with no rows), `y` freshly allocated `[tokens, quantized_rows +
        // dense_rows]`; all on candle's stream.
        Ok(unsafe {
            berrylm_quantized_matmul(
                dtype_code(op, dtype)?,
                format,
                p.input(x),
                blocks,
                dense.map_or(std::ptr::null(), |dense| p.input(dense)),
                p.output(y),
                c_size(op, "x", tokens)?,
                c_size(op, "x", in_dim)?,
                c_size(op, "weight", quantized_rows)?,
                c_size(op, "dense", dense_rows)?,
                p.stream(),
            )
        })
    })?;
    Ok(outputs.tensor(y))
}

/// CUDA `decode_matmul`; arguments validated by the caller (`x` `[tokens,
/// in_dim]`, `weight` `[out_dim, in_dim]` in its dtype on its device).
pub(crate) fn dense_matmul(op: &'static str, x: &Tensor, weight: &Tensor) -> Result<Tensor> {
    let (tokens, in_dim) = x.dims2()?;
    let (out_dim, _) = weight.dims2()?;
    let mut launch = Launch::new(op, x)?;
    let x = launch.input("x", &aligned16(x)?)?;
    let weight = launch.input("weight", weight)?;
    let dtype = launch.dtype(x);
    let y = launch.output(&[tokens, out_dim], dtype)?;
    let outputs = launch.run(|p| {
        // SAFETY: `x` is contiguous `[tokens, in_dim]`, `weight` contiguous
        // `[out_dim, in_dim]` of its dtype, `y` freshly allocated `[tokens,
        // out_dim]`; all on candle's stream.
        Ok(unsafe {
            berrylm_dense_matmul(
                dtype_code(op, dtype)?,
                p.input(x),
                p.input(weight),
                p.output(y),
                c_size(op, "x", tokens)?,
                c_size(op, "x", in_dim)?,
                c_size(op, "weight", out_dim)?,
                p.stream(),
            )
        })
    })?;
    Ok(outputs.tensor(y))
}
