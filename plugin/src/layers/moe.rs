//! The sparse MoE of every layer: softmax top-k routing over SwiGLU experts plus
//! a sigmoid-gated shared expert.

use candle_core::{DType, IndexOp, Module, Result, Tensor, D};
use candle_nn::ops::{sigmoid, softmax_last_dim};

use crate::config::BerryLmConfig;
use crate::layers::linear::Linear;
use crate::weights::Weights;

/// One SwiGLU expert: `down(silu(gate x) * up x)`.
#[derive(Debug, Clone)]
struct Expert {
    /// `[2I, H]`: rows `0..I` are the gate projection, `I..2I` the up projection.
    gate_up: Linear,
    down: Linear,
    intermediate: usize,
}

impl Expert {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let gate_up = self.gate_up.forward(x)?;
        let gate = gate_up.narrow(D::Minus1, 0, self.intermediate)?;
        let up = gate_up.narrow(D::Minus1, self.intermediate, self.intermediate)?;
        self.down.forward(&(candle_nn::ops::silu(&gate)? * up)?)
    }
}

#[derive(Debug, Clone)]
pub struct SparseMoe {
    router: Linear,
    experts: Vec<Expert>,
    shared_expert: Expert,
    shared_expert_gate: Linear,
    top_k: usize,
    norm_topk_prob: bool,
}

impl SparseMoe {
    pub fn load(weights: &Weights, cfg: &BerryLmConfig) -> crate::error::Result<SparseMoe> {
        let mlp = weights.pp("mlp");
        let hidden = cfg.hidden_size;
        let inter = cfg.moe_intermediate_size;
        let experts_weights = mlp.pp("experts");
        let experts = if experts_weights.contains("gate_up_proj") {
            let gate_up =
                experts_weights.get((cfg.num_experts, 2 * inter, hidden), "gate_up_proj")?;
            let down = experts_weights.get((cfg.num_experts, hidden, inter), "down_proj")?;
            (0..cfg.num_experts)
                .map(|e| {
                    Ok(Expert {
                        gate_up: Linear::new(gate_up.i(e)?.contiguous()?, None),
                        down: Linear::new(down.i(e)?.contiguous()?, None),
                        intermediate: inter,
                    })
                })
                .collect::<crate::error::Result<Vec<_>>>()?
        } else {
            (0..cfg.num_experts)
                .map(|e| load_split_expert(&experts_weights.pp(e), hidden, inter))
                .collect::<crate::error::Result<Vec<_>>>()?
        };
        let shared_expert = load_split_expert(
            &mlp.pp("shared_expert"),
            hidden,
            cfg.shared_expert_intermediate_size,
        )?;
        Ok(SparseMoe {
            router: Linear::load(&mlp, "gate", hidden, cfg.num_experts, false)?,
            experts,
            shared_expert,
            shared_expert_gate: Linear::load(&mlp, "shared_expert_gate", hidden, 1, false)?,
            top_k: cfg.num_experts_per_tok,
            norm_topk_prob: cfg.norm_topk_prob,
        })
    }

    /// `x` is `[N, hidden]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        let router_logits = self.router.forward(x)?;
        let probs = softmax_last_dim(&router_logits.to_dtype(DType::F32)?)?;
        let probs: Vec<Vec<f32>> = probs.to_vec2()?;

        // Tokens and (renormalised, dtype-rounded) weights per expert.
        let mut routed: Vec<(Vec<u32>, Vec<f32>)> =
            vec![(Vec::new(), Vec::new()); self.experts.len()];
        for (token, row) in probs.iter().enumerate() {
            let mut order: Vec<usize> = (0..row.len()).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            let chosen = &order[..self.top_k];
            let total: f32 = chosen.iter().map(|&e| row[e]).sum();
            for &expert in chosen {
                let weight = if self.norm_topk_prob {
                    row[expert] / total
                } else {
                    row[expert]
                };
                routed[expert].0.push(token as u32);
                routed[expert].1.push(weight);
            }
        }

        let mut out = x.zeros_like()?;
        for (expert, (tokens, token_weights)) in self.experts.iter().zip(routed) {
            if tokens.is_empty() {
                continue;
            }
            let count = tokens.len();
            let index = Tensor::from_vec(tokens, count, x.device())?;
            let expert_out = expert.forward(&x.index_select(&index, 0)?)?;
            let token_weights =
                Tensor::from_vec(token_weights, (count, 1), x.device())?.to_dtype(dtype)?;
            let weighted = expert_out.broadcast_mul(&token_weights)?;
            out = out.index_add(&index, &weighted, 0)?;
        }

        let shared = self.shared_expert.forward(x)?;
        let shared_gate = sigmoid(&self.shared_expert_gate.forward(x)?)?;
        out + shared.broadcast_mul(&shared_gate)?
    }
}

fn load_split_expert(
    weights: &Weights,
    hidden: usize,
    inter: usize,
) -> crate::error::Result<Expert> {
    let gate = weights.pp("gate_proj").get((inter, hidden), "weight")?;
    let up = weights.pp("up_proj").get((inter, hidden), "weight")?;
    Ok(Expert {
        gate_up: Linear::new(Tensor::cat(&[&gate, &up], 0)?, None),
        down: Linear::load(weights, "down_proj", inter, hidden, false)?,
        intermediate: inter,
    })
}
