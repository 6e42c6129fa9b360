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

/// CUDA `quantized_matmul`; arguments validated by the caller (`x`
/// `[tokens, in_dim]`, `weight` `[out_dim, in_dim]` of a type the kernels
/// take, on the device of `x`).
pub(crate) fn quantized_matmul(x: &Tensor, weight: &QTensor) -> Result<Tensor> {
    const OP: &str = "quantized_matmul";
    let (tokens, in_dim) = x.dims2()?;
    let (out_dim, _) = weight.shape().dims2()?;
    let format = gguf_code(OP, "weight", weight.dtype())?;
    let blocks = blocks_address(weight)?;
    let mut launch = Launch::new(OP, x)?;
    let x = launch.input("x", &aligned16(x)?)?;
    let dtype = launch.dtype(x);
    let y = launch.output(&[tokens, out_dim], dtype)?;
    let outputs = run_kernel!(launch => berrylm_quantized_matmul(
        dtype(dtype), format, input(x), blocks, output(y),
        c_size(OP, "x", tokens)?, c_size(OP, "x", in_dim)?, c_size(OP, "weight", out_dim)?
    ))?;
    Ok(outputs.tensor(y))
}
