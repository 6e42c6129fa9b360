//! Gated Block AttnRes: before every layer the residual stream is replaced by a
//! softmax-over-depth mixture of the committed block streams and itself.

use candle_core::{DType, Result, Tensor};

use crate::config::BerryLmConfig;
use crate::weights::Weights;

#[derive(Debug, Clone)]
pub struct AttnRes {
    pseudo_query: Tensor,
    /// The raw gate parameter `g` (the blend uses `tanh(g)`); `None` when ungated.
    gate: Option<f32>,
    eps: f64,
}

impl AttnRes {
    pub fn load(weights: &Weights, cfg: &BerryLmConfig) -> crate::error::Result<AttnRes> {
        let module = weights.pp("attn_res");
        // In f32 (exact), the dtype the kernel computes in.
        let pseudo_query = module
            .get(cfg.hidden_size, "pseudo_query")?
            .to_dtype(DType::F32)?;
        let gate = if cfg.attn_res_gated {
            let gate = module.get((), "gate")?;
            Some(gate.to_dtype(DType::F32)?.to_scalar::<f32>()?)
        } else {
            None
        };
        Ok(AttnRes {
            pseudo_query,
            gate,
            eps: cfg.attn_res_eps,
        })
    }

    /// Mixes `committed` block streams (oldest first) with the current stream `x`,
    /// all `[N, hidden]`.
    pub fn forward(&self, committed: &[Tensor], x: &Tensor) -> Result<Tensor> {
        let mut sources: Vec<Tensor> = committed.to_vec();
        sources.push(x.clone());
        Ok(berrylm_kernels::attn_res_mix(
            &sources,
            &self.pseudo_query,
            self.gate,
            self.eps,
        )?)
    }
}
