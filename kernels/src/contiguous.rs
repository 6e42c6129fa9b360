//! A tensor's elements in contiguous memory.

use candle_core::Tensor;

use crate::Result;

/// `tensor` itself when contiguous, else a contiguous copy of it (candle's
/// `Tensor::contiguous` on the CPU).
///
/// On CUDA the copy takes the view's layout as kernel arguments: candle's
/// strided copy uploads its dims and strides from host memory on every call,
/// which a CUDA graph of the decode step would record as a read of that host
/// memory, freed by the time the graph replays. Views of up to 8 dimensions
/// in `f32`, `bf16`, `f16` and `u32`; others take candle's copy.
pub fn contiguous(tensor: &Tensor) -> Result<Tensor> {
    if tensor.is_contiguous() {
        return Ok(tensor.clone());
    }
    #[cfg(feature = "cuda")]
    if tensor.device().is_cuda()
        && matches!(
            tensor.dtype(),
            candle_core::DType::F32
                | candle_core::DType::BF16
                | candle_core::DType::F16
                | candle_core::DType::U32
        )
        && tensor.rank() <= MAX_RANK
    {
        return crate::cuda::contiguous(tensor);
    }
    Ok(tensor.contiguous()?)
}

/// The most dimensions the CUDA copy takes (`kMaxRank` in `contiguous.cu`).
#[cfg(feature = "cuda")]
pub(crate) const MAX_RANK: usize = 8;
