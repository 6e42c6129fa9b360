//! The sparse MoE of every layer: softmax top-k routing over SwiGLU experts plus
//! a sigmoid-gated shared expert.
//!
//! The routing (fp32 softmax, top-k with `torch.topk`'s order of exact ties,
//! renormalisation, weights rounded to the activation dtype) is one kernel
//! (`berrylm_kernels::moe_route`, one launch on CUDA). On CUDA in f16/bf16 the
//! experts' weights live in the host's fused MoE and
//! `berrylm_kernels::moe_experts` runs on them (the reference's rounding and
//! order of accumulation: decode steps in its own kernels, prompts as grouped
//! tensor-core GEMMs); otherwise (the CPU, f32, or sizes the host's fused
//! layout does not take) the ids and weights are read back once and each
//! chosen expert runs on its tokens: on the CPU in f32, the exact oracle of
//! the reference. The router, the shared expert's input projections and its
//! gate are one stacked projection.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, IndexOp, Module, Result, Tensor};
use mistralrs_core::layers::Activation;
use mistralrs_core::plugin_api::{MoEExperts, MoEExpertsConfig};
use mistralrs_quant::{Comm, Id, ShardedSafeTensors};

use crate::config::BerryLmConfig;
use crate::layers::linear::Linear;
use crate::weights::Weights;

/// One SwiGLU expert: `down(silu(gate x) * up x)`.
#[derive(Debug, Clone)]
struct Expert {
    /// `[2I, H]`: rows `0..I` are the gate projection, `I..2I` the up projection.
    gate_up: Linear,
    down: Linear,
}

impl Expert {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let activated = berrylm_kernels::swiglu(&self.gate_up.forward(x)?)?;
        self.down.forward(&activated)
    }
}

/// The routed experts' weights.
#[derive(Clone)]
enum Experts {
    /// Each expert on its own, run on the tokens routed to it.
    PerExpert(Vec<Expert>),
    /// The host's fused MoE (CUDA, f16/bf16): every routed token of every
    /// expert in one launch per projection.
    Fused(Arc<MoEExperts>),
}

/// Tokens and weights routed to each expert, in token order.
type Routed = Vec<(Vec<u32>, Vec<f32>)>;

#[derive(Clone)]
pub struct SparseMoe {
    /// The router, the shared expert's gate and up projections and its
    /// sigmoid gate stacked into one projection (one launch per step instead
    /// of three): output columns `0..E` are the router logits, then `2 Is`
    /// the shared expert's gate | up, then its gate logit.
    input_proj: Linear,
    experts: Experts,
    shared_down: Linear,
    num_experts: usize,
    shared_intermediate: usize,
    top_k: usize,
    norm_topk_prob: bool,
}

impl SparseMoe {
    pub fn load(weights: &Weights, cfg: &BerryLmConfig) -> crate::error::Result<SparseMoe> {
        let mlp = weights.pp("mlp");
        let hidden = cfg.hidden_size;
        let inter = cfg.moe_intermediate_size;
        let experts_weights = mlp.pp("experts");
        let stacked = experts_weights.contains("gate_up_proj");
        let experts = if fused_experts_apply(weights.device(), weights.dtype(), cfg) {
            let tensors = if stacked {
                let gate_up =
                    experts_weights.get((cfg.num_experts, 2 * inter, hidden), "gate_up_proj")?;
                let down = experts_weights.get((cfg.num_experts, hidden, inter), "down_proj")?;
                (0..cfg.num_experts)
                    .map(|e| {
                        let gate_up = gate_up.i(e)?;
                        Ok([
                            gate_up.narrow(0, 0, inter)?,
                            gate_up.narrow(0, inter, inter)?,
                            down.i(e)?,
                        ])
                    })
                    .collect::<crate::error::Result<Vec<_>>>()?
            } else {
                (0..cfg.num_experts)
                    .map(|e| {
                        let expert = experts_weights.pp(e);
                        Ok([
                            expert.pp("gate_proj").get((inter, hidden), "weight")?,
                            expert.pp("up_proj").get((inter, hidden), "weight")?,
                            expert.pp("down_proj").get((hidden, inter), "weight")?,
                        ])
                    })
                    .collect::<crate::error::Result<Vec<_>>>()?
            };
            Experts::Fused(Arc::new(load_fused(tensors, weights, cfg)?))
        } else if stacked {
            let gate_up =
                experts_weights.get((cfg.num_experts, 2 * inter, hidden), "gate_up_proj")?;
            let down = experts_weights.get((cfg.num_experts, hidden, inter), "down_proj")?;
            Experts::PerExpert(
                (0..cfg.num_experts)
                    .map(|e| {
                        Ok(Expert {
                            gate_up: Linear::new(gate_up.i(e)?.contiguous()?, None),
                            down: Linear::new(down.i(e)?.contiguous()?, None),
                        })
                    })
                    .collect::<crate::error::Result<Vec<_>>>()?,
            )
        } else {
            Experts::PerExpert(
                (0..cfg.num_experts)
                    .map(|e| load_split_expert(&experts_weights.pp(e), hidden, inter))
                    .collect::<crate::error::Result<Vec<_>>>()?,
            )
        };
        let shared_expert = load_split_expert(
            &mlp.pp("shared_expert"),
            hidden,
            cfg.shared_expert_intermediate_size,
        )?;
        let input_proj = Linear::stacked(&[
            Linear::load(&mlp, "gate", hidden, cfg.num_experts, false)?,
            shared_expert.gate_up,
            Linear::load(&mlp, "shared_expert_gate", hidden, 1, false)?,
        ])?;
        Ok(SparseMoe {
            input_proj,
            experts,
            shared_down: shared_expert.down,
            num_experts: cfg.num_experts,
            shared_intermediate: cfg.shared_expert_intermediate_size,
            top_k: cfg.num_experts_per_tok,
            norm_topk_prob: cfg.norm_topk_prob,
        })
    }

    /// The residual stream after this block: `residual + moe(x)`, where `x`
    /// is `[B, T, hidden]` (`B` sequences of `T` tokens, the normed stream)
    /// and `residual` is `[B * T, hidden]`, like the result.
    pub fn forward(&self, x: &Tensor, residual: &Tensor) -> Result<Tensor> {
        let (rows, seq_len, hidden) = x.dims3()?;
        let dtype = x.dtype();
        let flat = x.reshape((rows * seq_len, hidden))?;
        // Views of the stacked projection's columns (contiguous for one token).
        let projected = self.input_proj.forward(&flat)?;
        let shared_width = 2 * self.shared_intermediate;
        let router_logits = projected.narrow(1, 0, self.num_experts)?;
        let shared_gate_up = projected.narrow(1, self.num_experts, shared_width)?;
        let shared_gate_logit = projected.narrow(1, self.num_experts + shared_width, 1)?;
        let (weights, ids) =
            berrylm_kernels::moe_route(&router_logits, self.top_k, self.norm_topk_prob, dtype)?;
        let routed_out = match &self.experts {
            // BerryLM's experts on the host's weights, rounded like the
            // reference: decode steps in its own kernels, prompts as grouped
            // GEMMs on the tensor cores.
            Experts::Fused(experts) => match experts.fused_weights() {
                Some((gate_up, down)) => {
                    berrylm_kernels::moe_experts(&flat, &weights, &ids, gate_up, down)?
                }
                None => experts
                    .forward(&x.contiguous()?, weights, &ids)?
                    .reshape((rows * seq_len, hidden))?,
            },
            Experts::PerExpert(experts) => {
                run_experts(experts, &flat, by_expert(&weights, &ids, experts.len())?)?
            }
        };

        let shared = self
            .shared_down
            .forward(&berrylm_kernels::swiglu(&shared_gate_up)?)?;
        Ok(berrylm_kernels::add_moe_output(
            residual,
            &routed_out,
            &shared,
            &shared_gate_logit,
        )?)
    }
}

/// Whether the experts run in the host's fused MoE kernels: on CUDA, in f16 or
/// bf16 (their only dtypes), without immediate ISQ (with it the host would pick
/// another backend), and with `hidden` and the expert width multiples of 64
/// (the decode GEMM's K tile; the other kernels need multiples of 8).
fn fused_experts_apply(device: &Device, dtype: DType, cfg: &BerryLmConfig) -> bool {
    device.is_cuda()
        && matches!(dtype, DType::F16 | DType::BF16)
        && cfg.hidden_size.is_multiple_of(64)
        && cfg.moe_intermediate_size.is_multiple_of(64)
        && mistralrs_quant::get_immediate_isq().is_none()
}

/// The host's fused experts from `[gate, up, down]` per expert (`[I, H]`,
/// `[I, H]`, `[H, I]`), given to it under the per-expert names it loads
/// (unambiguous, unlike a stacked `gate_up_proj` whose two layouts have the
/// same shape when `H = 2I`).
fn load_fused(
    tensors: Vec<[Tensor; 3]>,
    weights: &Weights,
    cfg: &BerryLmConfig,
) -> crate::error::Result<MoEExperts> {
    let mut named = HashMap::with_capacity(3 * tensors.len());
    for (e, [gate, up, down]) in tensors.into_iter().enumerate() {
        named.insert(format!("{e}.gate_proj.weight"), gate);
        named.insert(format!("{e}.up_proj.weight"), up);
        named.insert(format!("{e}.down_proj.weight"), down);
    }
    let device = weights.device().clone();
    let comm = Arc::new(Comm::from_device(Id::new(), &device, 0, 1)?);
    let experts = MoEExperts::new_direct(
        &MoEExpertsConfig {
            num_experts: cfg.num_experts,
            num_experts_per_tok: cfg.num_experts_per_tok,
            hidden_size: cfg.hidden_size,
            moe_intermediate_size: cfg.moe_intermediate_size,
        },
        ShardedSafeTensors::wrap(Box::new(named), weights.dtype(), device),
        &comm,
        false,
        &None,
        Activation::Silu,
    )?;
    Ok(experts)
}

/// The routing `weights` / `ids` `[N, k]` regrouped per expert, in token order.
fn by_expert(weights: &Tensor, ids: &Tensor, experts: usize) -> Result<Routed> {
    let mut routed: Routed = vec![(Vec::new(), Vec::new()); experts];
    let ids: Vec<Vec<u32>> = ids.to_vec2()?;
    let weights: Vec<Vec<f32>> = weights.to_vec2()?;
    for (token, (token_ids, token_weights)) in ids.iter().zip(&weights).enumerate() {
        for (&expert, &weight) in token_ids.iter().zip(token_weights) {
            routed[expert as usize].0.push(token as u32);
            routed[expert as usize].1.push(weight);
        }
    }
    Ok(routed)
}

/// Runs each expert on the tokens of `x` `[N, hidden]` routed to it and sums
/// the weighted outputs (weights cast to the activation dtype) in expert order.
fn run_experts(experts: &[Expert], x: &Tensor, routed: Routed) -> Result<Tensor> {
    let mut out = x.zeros_like()?;
    for (expert, (tokens, token_weights)) in experts.iter().zip(routed) {
        if tokens.is_empty() {
            continue;
        }
        let count = tokens.len();
        let index = Tensor::from_vec(tokens, count, x.device())?;
        let expert_out = expert.forward(&x.index_select(&index, 0)?)?;
        let token_weights =
            Tensor::from_vec(token_weights, (count, 1), x.device())?.to_dtype(x.dtype())?;
        let weighted = expert_out.broadcast_mul(&token_weights)?;
        out = out.index_add(&index, &weighted, 0)?;
    }
    Ok(out)
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
    })
}
