//! BerryLM's (1+w) RMSNorm, used for the layer norms, q/k norms and the final norm.

use candle_core::{DType, Module, Result, Tensor};

use crate::weights::Weights;

/// `y = (x_f32 * rsqrt(mean(x_f32^2) + eps) * (1 + w)).to(dtype)` over the last dim.
#[derive(Debug, Clone)]
pub struct OffsetRmsNorm {
    /// `1 + w` in f32.
    scale: Tensor,
    /// `w` as the checkpoint holds it, under its checkpoint name.
    weight: (String, Tensor),
    eps: f64,
}

impl OffsetRmsNorm {
    pub fn load(
        weights: &Weights,
        name: &str,
        dim: usize,
        eps: f64,
    ) -> crate::error::Result<OffsetRmsNorm> {
        let module = weights.pp(name);
        let weight = module.get(dim, "weight")?;
        let scale = (weight.to_dtype(DType::F32)? + 1.0)?;
        Ok(OffsetRmsNorm {
            scale,
            weight: (module.full_name("weight"), weight),
            eps,
        })
    }

    /// `1 + w` in f32, the factor the kernels apply.
    pub fn scale(&self) -> &Tensor {
        &self.scale
    }

    /// The epsilon added to the mean square.
    pub fn eps(&self) -> f64 {
        self.eps
    }

    /// Its weight under its checkpoint name.
    pub fn checkpoint_tensor(&self) -> (String, Tensor) {
        self.weight.clone()
    }

    /// The residual add `x + delta` (rounded to the dtype) and this norm of
    /// it, in one kernel; returns `(sum, normed)`.
    pub fn forward_residual(&self, x: &Tensor, delta: &Tensor) -> Result<(Tensor, Tensor)> {
        Ok(berrylm_kernels::add_offset_rms_norm(
            x,
            delta,
            &self.scale,
            self.eps,
        )?)
    }

    /// This norm over the head dim of `x` `[B, T, heads, head_dim]`, then the
    /// partial NeoX rotation of each head's first `rotary_dim` channels by
    /// its token's `cos`/`sin` `[B, T, rotary_dim]`, in one kernel
    /// (`berrylm_kernels::offset_rms_norm_rope`). `x` may be a view whose
    /// heads lie at a stride (the query half of the interleaved `q_proj`
    /// output), read in place on CUDA.
    pub fn forward_rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        Ok(berrylm_kernels::offset_rms_norm_rope(
            x,
            &self.scale,
            self.eps,
            cos,
            sin,
        )?)
    }
}

impl Module for OffsetRmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(berrylm_kernels::offset_rms_norm(x, &self.scale, self.eps)?)
    }
}
