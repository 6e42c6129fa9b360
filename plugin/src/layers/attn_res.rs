//! Gated Block AttnRes: before every layer the residual stream is replaced by a
//! softmax-over-depth mixture of the committed block streams and itself.

use candle_core::{DType, Result, Tensor};

use crate::config::BerryLmConfig;
use crate::layers::norm::OffsetRmsNorm;
use crate::weights::Weights;

#[derive(Debug, Clone)]
pub struct AttnRes {
    /// The module's checkpoint name (`model.layers.0.attn_res`).
    name: String,
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
            name: weights.full_name("attn_res"),
            pseudo_query,
            gate,
            eps: cfg.attn_res_eps,
        })
    }

    /// Its parameters under their checkpoint names, in `dtype` (they go back
    /// exactly: they were read in it).
    pub fn checkpoint_tensors(&self, dtype: DType, out: &mut Vec<(String, Tensor)>) -> Result<()> {
        let name = &self.name;
        out.push((
            format!("{name}.pseudo_query"),
            self.pseudo_query.to_dtype(dtype)?,
        ));
        if let Some(gate) = self.gate {
            out.push((
                format!("{name}.gate"),
                Tensor::new(gate, self.pseudo_query.device())?.to_dtype(dtype)?,
            ));
        }
        Ok(())
    }

    /// Mixes `committed` block streams (oldest first) with the current stream `x`,
    /// all `[N, hidden]`, and applies the layer's input `norm` to the mix, in
    /// one kernel on CUDA: returns `(mix, norm(mix))`.
    pub fn forward_norm(
        &self,
        committed: &[Tensor],
        x: &Tensor,
        norm: &OffsetRmsNorm,
    ) -> Result<(Tensor, Tensor)> {
        let mut sources: Vec<Tensor> = committed.to_vec();
        sources.push(x.clone());
        Ok(berrylm_kernels::attn_res_mix_norm(
            &sources,
            &self.pseudo_query,
            self.gate,
            self.eps,
            norm.scale(),
            norm.eps(),
        )?)
    }
}
