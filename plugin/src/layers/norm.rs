//! BerryLM's (1+w) RMSNorm, used for the layer norms, q/k norms and the final norm.

use candle_core::{DType, Module, Result, Tensor};

use crate::weights::Weights;

/// `y = (x_f32 * rsqrt(mean(x_f32^2) + eps) * (1 + w)).to(dtype)` over the last dim.
#[derive(Debug, Clone)]
pub struct OffsetRmsNorm {
    /// `1 + w` in f32.
    scale: Tensor,
    eps: f64,
}

impl OffsetRmsNorm {
    pub fn load(
        weights: &Weights,
        name: &str,
        dim: usize,
        eps: f64,
    ) -> crate::error::Result<OffsetRmsNorm> {
        let weight = weights.pp(name).get(dim, "weight")?;
        let scale = (weight.to_dtype(DType::F32)? + 1.0)?;
        Ok(OffsetRmsNorm { scale, eps })
    }
}

impl Module for OffsetRmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(berrylm_kernels::offset_rms_norm(x, &self.scale, self.eps)?)
    }
}
