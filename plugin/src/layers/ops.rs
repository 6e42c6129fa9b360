//! The matrix product and scaling of the model, rounded where the PyTorch
//! reference rounds them (the MoE's SwiGLU and shared-expert gate and the
//! attention's output gate are kernels of `berrylm_kernels`).
//!
//! In bf16 on the CPU, PyTorch's GEMMs accumulate in f32 and round each result
//! (bias included) to bf16 once, and its scalar product computes in f32 and
//! rounds once. candle's CPU backend has no bf16 matmul and its bf16 scaling
//! rounds the factor to bf16 first, so on the CPU these operations widen bf16
//! operands to f32 and round the result once. Other dtypes and devices use
//! candle's operations as they are.

use candle_core::{DType, Result, Tensor};

/// Whether `x` is computed in f32 and rounded back to bf16 once.
fn widened(x: &Tensor) -> bool {
    x.dtype() == DType::BF16 && x.device().is_cpu()
}

/// `a @ b` with `b` broadcast over the leading dims of `a`, in the dtype of `a`.
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    matmul_add(a, b, None)
}

/// `a @ b + bias` (bias broadcast over the rows), in the dtype of `a`.
///
/// A matrix `b` (a layer's weight) is applied to the rows of `a` flattened to
/// two dimensions: broadcasting it over `a`'s leading dimensions instead
/// would materialise one copy of the weight per batch row before the batched
/// product.
pub fn matmul_add(a: &Tensor, b: &Tensor, bias: Option<&Tensor>) -> Result<Tensor> {
    if b.rank() == 2 && a.rank() > 2 {
        let mut dims = a.dims().to_vec();
        let y = matmul_add(&a.flatten_to(a.rank() - 2)?, b, bias)?;
        if let Some(last) = dims.last_mut() {
            *last = b.dim(1)?;
        }
        return y.reshape(dims);
    }
    if widened(a) {
        let y = a
            .to_dtype(DType::F32)?
            .broadcast_matmul(&b.to_dtype(DType::F32)?)?;
        let y = match bias {
            Some(bias) => y.broadcast_add(&bias.to_dtype(DType::F32)?)?,
            None => y,
        };
        return y.to_dtype(DType::BF16);
    }
    let y = a.broadcast_matmul(b)?;
    match bias {
        Some(bias) => y.broadcast_add(bias),
        None => Ok(y),
    }
}

/// `x * factor`.
pub fn scale(x: &Tensor, factor: f64) -> Result<Tensor> {
    if widened(x) {
        return (x.to_dtype(DType::F32)? * factor)?.to_dtype(DType::BF16);
    }
    x * factor
}
