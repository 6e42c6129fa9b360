//! The sparse MoE of every layer: softmax top-k routing over SwiGLU experts plus
//! a sigmoid-gated shared expert.
//!
//! The routing (fp32 softmax, top-k with `torch.topk`'s order of exact ties,
//! renormalisation, weights rounded to the activation dtype) is one kernel
//! (`berrylm_kernels::moe_route`, one launch on CUDA). On CUDA in f16/bf16 the
//! experts' weights live in the host's fused MoE and
//! `berrylm_kernels::moe_experts` runs on them (the reference's rounding and
//! order of accumulation: decode steps in its own kernels, prompts as grouped
//! tensor-core GEMMs; a decode step's whole block, the shared expert and the
//! residual add included, in two launches: `berrylm_kernels::moe_block_decode`);
//! otherwise (the CPU, f32, or sizes the host's fused
//! layout does not take) the ids and weights are read back once and each
//! chosen expert runs on its tokens: on the CPU in f32, the exact oracle of
//! the reference. The router, the shared expert's input projections and its
//! gate are one stacked projection.
//!
//! When the host quantizes in this load (in-situ quantization, or a UQFF
//! file), the experts' projections are the host's layers
//! (`crate::layers::projection`): on CUDA, for the quantization types the
//! host has indexed MoE kernels for (its GGUF types, `q4k`, `q8_0`, ...) and
//! for UQFF files, every expert's gate | up and down projections stacked
//! into two layers that run on the routed ids where they lie, as the host's
//! own MoE models do (decode steps in BerryLM's kernels for q8_0 and q4_K
//! blocks, with the reference's rounding points); otherwise each expert's
//! projections one by one, every expert run on its own tokens. The router
//! and the shared expert's gate stay in full precision.

use std::collections::HashMap;
use std::sync::Arc;

use berrylm_kernels::{
    MoeBlockInputs, MoeBlockWeights, MoeExpertsAlgorithm, MOE_BLOCK_DECODE_MAX_TOP_K,
};
use candle_core::quantized::QTensor;
use candle_core::{DType, IndexOp, Module, Result, Tensor};
use mistralrs_core::layers::Activation;
use mistralrs_core::plugin_api::{MoEExperts, MoEExpertsConfig};
use mistralrs_quant::{Comm, Id, ShardedSafeTensors};

use crate::config::BerryLmConfig;
use crate::layers::linear::Linear;
use crate::layers::norm::OffsetRmsNorm;
use crate::layers::projection::{HostLayer, Projected, Projection, ProjectionSpec, Projections};
use crate::weights::Weights;

/// One SwiGLU expert: `down(silu(gate x) * up x)`.
#[derive(Debug, Clone)]
struct Expert {
    /// The gate and up projections; in full precision one `[2I, H]` weight,
    /// rows `0..I` the gate projection, `I..2I` the up projection.
    gate_up: Projections,
    down: Projection,
}

impl Expert {
    /// The expert at `weights` (`…experts.{e}`), by its projections' names.
    fn load(weights: &Weights, hidden: usize, inter: usize) -> crate::error::Result<Expert> {
        Ok(Expert {
            gate_up: Projections::load(
                weights,
                &[
                    ProjectionSpec::quantizable("gate_proj", hidden, inter),
                    ProjectionSpec::quantizable("up_proj", hidden, inter),
                ],
            )?,
            down: Projection::load(
                weights,
                ProjectionSpec::quantizable("down_proj", inter, hidden),
            )?,
        })
    }

    /// The full-precision expert at `weights` (`…experts.{e}`, for its
    /// projections' names) holding `gate_up` `[2I, H]` and `down` `[H, I]`.
    fn full_precision(weights: &Weights, gate_up: Linear, down: Linear, inter: usize) -> Expert {
        Expert {
            gate_up: Projections::stacked(
                gate_up,
                vec![
                    (weights.full_name("gate_proj"), inter),
                    (weights.full_name("up_proj"), inter),
                ],
            ),
            down: Projection::full_precision(weights.full_name("down_proj"), down),
        }
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let activated = berrylm_kernels::swiglu(&self.gate_up.forward(x)?.span(0..2)?)?;
        self.down.forward(&activated)
    }

    fn host_layers_mut<'a>(&'a mut self, out: &mut Vec<&'a mut HostLayer>) {
        self.gate_up.host_layers_mut(out);
        self.down.host_layers_mut(out);
    }

    fn checkpoint_tensors(&self, out: &mut Vec<(String, Tensor)>) -> Result<()> {
        self.gate_up.full_precision_tensors(out)?;
        self.down.full_precision_tensors(out)
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
    /// Quantized by the host (or filled from a UQFF file) on CUDA: every
    /// expert's gate | up `[E, 2I, H]` and down `[E, H, I]` projections as
    /// two host layers, run on the routed ids by BerryLM's kernels for
    /// quantized weights (q8_0, q4_K) or the host's indexed kernels.
    Gathered { gate_up: HostLayer, down: HostLayer },
}

/// Tokens and weights routed to each expert, in token order.
type Routed = Vec<(Vec<u32>, Vec<f32>)>;

#[derive(Clone)]
pub struct SparseMoe {
    /// The shared expert's gate and up projections, the router and the
    /// shared expert's sigmoid gate: their outputs are the shared expert's
    /// gate | up, the router logits, then its gate logit. Stacked into one
    /// projection (one launch per step) when the host quantizes none of
    /// them; under ISQ two: the shared expert's (quantized), then the two
    /// kept in full precision, stacked.
    input_proj: Projections,
    experts: Experts,
    shared_down: Projection,
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
        let experts = if fused_experts_apply(weights, cfg) {
            let tensors = read_experts(&experts_weights, cfg)?;
            Experts::Fused(Arc::new(load_fused(tensors, weights, cfg)?))
        } else if gathered_experts_apply(weights) {
            load_gathered(&experts_weights, cfg)?
        } else if stacked && !weights.host_quantizes() {
            let gate_up =
                experts_weights.get((cfg.num_experts, 2 * inter, hidden), "gate_up_proj")?;
            let down = experts_weights.get((cfg.num_experts, hidden, inter), "down_proj")?;
            Experts::PerExpert(
                (0..cfg.num_experts)
                    .map(|e| {
                        Ok(Expert::full_precision(
                            &experts_weights.pp(e),
                            Linear::new(gate_up.i(e)?.contiguous()?, None),
                            Linear::new(down.i(e)?.contiguous()?, None),
                            inter,
                        ))
                    })
                    .collect::<crate::error::Result<Vec<_>>>()?,
            )
        } else {
            let per_expert = if stacked {
                split_stacked_experts(&experts_weights, cfg)?
            } else {
                experts_weights
            };
            Experts::PerExpert(
                (0..cfg.num_experts)
                    .map(|e| Expert::load(&per_expert.pp(e), hidden, inter))
                    .collect::<crate::error::Result<Vec<_>>>()?,
            )
        };
        let shared_inter = cfg.shared_expert_intermediate_size;
        // The router and the shared expert's gate stay in full precision, as
        // in the reference implementations.
        let input_proj = Projections::load(
            &mlp,
            &[
                ProjectionSpec::quantizable("shared_expert.gate_proj", hidden, shared_inter),
                ProjectionSpec::quantizable("shared_expert.up_proj", hidden, shared_inter),
                ProjectionSpec::full_precision("gate", hidden, cfg.num_experts),
                ProjectionSpec::full_precision("shared_expert_gate", hidden, 1),
            ],
        )?;
        Ok(SparseMoe {
            input_proj,
            experts,
            shared_down: Projection::load(
                &mlp,
                ProjectionSpec::quantizable("shared_expert.down_proj", shared_inter, hidden),
            )?,
            top_k: cfg.num_experts_per_tok,
            norm_topk_prob: cfg.norm_topk_prob,
        })
    }

    /// Its projections the host quantizes or fills, in order.
    pub fn host_layers_mut<'a>(&'a mut self, out: &mut Vec<&'a mut HostLayer>) {
        self.input_proj.host_layers_mut(out);
        match &mut self.experts {
            Experts::PerExpert(experts) => {
                for expert in experts {
                    expert.host_layers_mut(out);
                }
            }
            Experts::Gathered { gate_up, down } => {
                out.push(gate_up);
                out.push(down);
            }
            Experts::Fused(_) => {}
        }
        self.shared_down.host_layers_mut(out);
    }

    /// Its full-precision tensors under their checkpoint names (the experts
    /// one by one, as `experts.{e}.gate_proj` ...).
    pub fn checkpoint_tensors(&self, out: &mut Vec<(String, Tensor)>) -> Result<()> {
        self.input_proj.full_precision_tensors(out)?;
        match &self.experts {
            Experts::PerExpert(experts) => {
                for expert in experts {
                    expert.checkpoint_tensors(out)?;
                }
            }
            Experts::Fused(_) => candle_core::bail!(
                "the fused CUDA experts are not exported: they are loaded only when the host \
                 quantizes nothing"
            ),
            // Host layers: the UQFF file holds them.
            Experts::Gathered { .. } => {}
        }
        self.shared_down.full_precision_tensors(out)
    }

    /// The residual stream after this block from its layer's mixer on:
    /// `h + moe(norm(h))` with `h = x + mixed`, all `[B * T, hidden]` (`B`
    /// sequences of `T` tokens). A decode step computes the sum, its norm
    /// and this block's input projections in one kernel.
    pub fn forward_after_mixer(
        &self,
        x: &Tensor,
        mixed: &Tensor,
        norm: &OffsetRmsNorm,
        (rows, seq_len): (usize, usize),
    ) -> Result<Tensor> {
        let (h, normed, projected) = self.input_proj.forward_residual_norm(x, mixed, norm)?;
        let hidden = normed.dim(1)?;
        self.forward(&normed.reshape((rows, seq_len, hidden))?, &projected, &h)
    }

    /// The residual stream after this block: `residual + moe(x)`, where `x`
    /// is `[B, T, hidden]` (the normed stream), `projected` its input
    /// projections and `residual` is `[B * T, hidden]`, like the result.
    fn forward(&self, x: &Tensor, projected: &Projected<'_>, residual: &Tensor) -> Result<Tensor> {
        let (rows, seq_len, hidden) = x.dims3()?;
        let dtype = x.dtype();
        let flat = x.reshape((rows * seq_len, hidden))?;
        // Views of the stacked projection's columns (contiguous for one token).
        let shared_gate_up = projected.span(0..2)?;
        let router_logits = projected.part(2)?;
        let shared_gate_logit = projected.part(3)?;
        let (weights, ids) =
            berrylm_kernels::moe_route(&router_logits, self.top_k, self.norm_topk_prob, dtype)?;
        if let Some(block_weights) = self.decode_block_weights(rows * seq_len) {
            let inputs = MoeBlockInputs {
                x: &flat,
                residual,
                weights: &weights,
                ids: &ids,
                shared_gate_up: &shared_gate_up,
                shared_gate_logit: &shared_gate_logit,
            };
            return Ok(berrylm_kernels::moe_block_decode(&inputs, &block_weights)?);
        }
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
            // Prompts: the experts dequantized for the call and run as the
            // full-precision ones, with the reference's rounding points.
            Experts::Gathered { gate_up, down }
                if ids.elem_count() >= DEQUANTIZED_EXPERTS_MIN_ROUTED_ROWS =>
            {
                berrylm_kernels::moe_experts(
                    &flat,
                    &weights,
                    &ids,
                    &gate_up.dequantized(dtype)?,
                    &down.dequantized(dtype)?,
                )?
            }
            // Decode steps: BerryLM's kernels on the blocks where they lie,
            // with the same rounding points, when they take the type; else
            // the host's indexed kernels.
            Experts::Gathered { gate_up, down } => match expert_kernel_blocks(gate_up, down) {
                Some((gate_up_blocks, down_blocks)) => berrylm_kernels::moe_experts_quantized(
                    &flat,
                    &weights,
                    &ids,
                    &gate_up_blocks,
                    &down_blocks,
                )?,
                None => {
                    let gate_up = gate_up.gather_forward(&flat.unsqueeze(1)?, &ids)?;
                    let expert_out =
                        down.gather_forward(&berrylm_kernels::swiglu(&gate_up)?, &ids)?;
                    weighted_sum(&expert_out, &weights, dtype)?
                }
            },
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

impl SparseMoe {
    /// Whether its decode steps run in BerryLM's kernels only: not the
    /// host's indexed kernels for quantized experts of a type BerryLM's do
    /// not take, which (with the candle operations around them) upload
    /// their tensors' layouts from host memory on every call, memory a
    /// replayed CUDA graph would read after it was freed.
    pub fn decodes_in_berrylm_kernels(&self) -> bool {
        match &self.experts {
            Experts::Gathered { gate_up, down } => expert_kernel_blocks(gate_up, down).is_some(),
            Experts::PerExpert(_) | Experts::Fused(_) => true,
        }
    }

    /// The weights [`berrylm_kernels::moe_block_decode`] runs the block of
    /// `tokens` tokens on, when it does: a decode step (the routed rows that
    /// [`MoeExpertsAlgorithm::Streamed`] takes) on the host's fused expert
    /// weights (CUDA, f16/bf16, nothing quantized) with a full-precision
    /// shared expert, at most [`MOE_BLOCK_DECODE_MAX_TOP_K`] experts a token.
    fn decode_block_weights(&self, tokens: usize) -> Option<MoeBlockWeights<'_>> {
        let Experts::Fused(experts) = &self.experts else {
            return None;
        };
        let streamed =
            MoeExpertsAlgorithm::for_rows(tokens * self.top_k) == MoeExpertsAlgorithm::Streamed;
        if !streamed || self.top_k > MOE_BLOCK_DECODE_MAX_TOP_K {
            return None;
        }
        let (gate_up, down) = experts.fused_weights()?;
        Some(MoeBlockWeights {
            gate_up,
            down,
            shared_down: self.shared_down.full_precision_weight()?,
        })
    }
}

/// From this many routed rows (tokens x top-k) the quantized experts of
/// [`Experts::Gathered`] are dequantized for the call and run on the tensor
/// cores. Below it BerryLM's kernels stream each chosen expert's blocks once
/// per group of up to 8 of its rows (the host's indexed kernels, for the
/// types those do not take, once per row) and compute on the CUDA cores:
/// at BerryLM-OS's size in q4k a layer's experts are 226 MB of blocks, where
/// dequantizing them costs ~5.6 GB of memory traffic (the host's f16 and an
/// f32 copy). By those byte counts and the CUDA cores' rate the two meet
/// near 2048 routed rows, a 256-token prompt (an estimate, not a
/// measurement); every decode batch up to 255 sequences streams.
const DEQUANTIZED_EXPERTS_MIN_ROUTED_ROWS: usize = 2048;

/// Whether the experts run in the host's fused MoE kernels: on CUDA, in f16 or
/// bf16 (their only dtypes), when the host quantizes nothing in this load (it
/// may quantize experts, one by one), and with `hidden` and the expert width
/// multiples of 64 (the decode GEMM's K tile; the other kernels need
/// multiples of 8).
fn fused_experts_apply(weights: &Weights, cfg: &BerryLmConfig) -> bool {
    weights.device().is_cuda()
        && matches!(weights.dtype(), DType::F16 | DType::BF16)
        && cfg.hidden_size.is_multiple_of(64)
        && cfg.moe_intermediate_size.is_multiple_of(64)
        && !weights.host_quantizes()
}

/// Whether the host's quantized experts run stacked, on the routed ids
/// ([`Experts::Gathered`]): on CUDA (as the host's own MoE models), when the
/// host quantizes them to a type it has indexed MoE kernels for (its GGUF
/// types) or fills them from a UQFF file (the layout `mistralrs quantize`
/// writes on CUDA).
fn gathered_experts_apply(weights: &Weights) -> bool {
    if !weights.device().is_cuda() || !weights.host_quantizes() {
        return false;
    }
    match mistralrs_quant::get_immediate_isq() {
        Some(isq) => isq
            .ty
            .is_some_and(crate::quantization::stacked_experts_quantizable),
        None => true,
    }
}

/// The experts of `experts` as [`Experts::Gathered`], from either checkpoint
/// layout (stacked `gate_up_proj` / `down_proj`, or one by one); read onto
/// the CPU when the host quantizes them while loading.
fn load_gathered(experts: &Weights, cfg: &BerryLmConfig) -> crate::error::Result<Experts> {
    let (count, hidden, inter) = (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size);
    let stacked = experts.contains("gate_up_proj");
    let withheld = !stacked && experts.pp(0).pp("gate_proj").withheld("weight");
    let (gate_up, down) = if withheld {
        (None, None)
    } else {
        let quantized_at_load = mistralrs_quant::should_apply_immediate_isq(
            experts.pp(0).pp("gate_proj").var_builder(),
        );
        let source = if quantized_at_load {
            experts.on_cpu()
        } else {
            experts.clone()
        };
        let mut gate_up = Vec::with_capacity(count);
        let mut down = Vec::with_capacity(count);
        for [gate, up, expert_down] in read_experts(&source, cfg)? {
            gate_up.push(Tensor::cat(&[gate, up], 0)?);
            down.push(expert_down);
        }
        (Some(gate_up), Some(down))
    };
    Ok(Experts::Gathered {
        gate_up: HostLayer::stacked_experts(
            experts,
            "gate_proj",
            (count, 2 * inter, hidden),
            gate_up,
            2 * count,
        )?,
        down: HostLayer::stacked_experts(
            experts,
            "down_proj",
            (count, hidden, inter),
            down,
            count,
        )?,
    })
}

/// The quantized experts' gate | up and down blocks where BerryLM's kernels
/// take them (on CUDA, both of one type they take, without bias).
fn expert_kernel_blocks(
    gate_up: &HostLayer,
    down: &HostLayer,
) -> Option<(Arc<QTensor>, Arc<QTensor>)> {
    match (gate_up.kernel_blocks(), down.kernel_blocks()) {
        (Some((gate_up, None)), Some((down, None))) if gate_up.dtype() == down.dtype() => {
            Some((gate_up, down))
        }
        _ => None,
    }
}

/// `Σ_j weights[n, j] · expert_out[n, j]`: `expert_out` `[N, k, H]` and the
/// routing `weights` `[N, k]` (f32) -> `[N, H]`, summed in f32 and rounded
/// once to `dtype`.
fn weighted_sum(expert_out: &Tensor, weights: &Tensor, dtype: DType) -> Result<Tensor> {
    expert_out
        .to_dtype(DType::F32)?
        .broadcast_mul(&weights.unsqueeze(2)?)?
        .sum(1)?
        .to_dtype(dtype)
}

/// Each expert's `[gate [I, H], up [I, H], down [H, I]]` from `experts` in
/// either checkpoint layout: stacked (`gate_up_proj` `[E, 2I, H]`, gate rows
/// first, and `down_proj` `[E, H, I]`; views of them) or one by one
/// (`{e}.gate_proj.weight` ...).
fn read_experts(experts: &Weights, cfg: &BerryLmConfig) -> crate::error::Result<Vec<[Tensor; 3]>> {
    let (count, hidden, inter) = (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size);
    if experts.contains("gate_up_proj") {
        let gate_up = experts.get((count, 2 * inter, hidden), "gate_up_proj")?;
        let down = experts.get((count, hidden, inter), "down_proj")?;
        (0..count)
            .map(|e| {
                let gate_up = gate_up.i(e)?;
                Ok([
                    gate_up.narrow(0, 0, inter)?,
                    gate_up.narrow(0, inter, inter)?,
                    down.i(e)?,
                ])
            })
            .collect()
    } else {
        (0..count)
            .map(|e| {
                let expert = experts.pp(e);
                Ok([
                    expert.pp("gate_proj").get((inter, hidden), "weight")?,
                    expert.pp("up_proj").get((inter, hidden), "weight")?,
                    expert.pp("down_proj").get((hidden, inter), "weight")?,
                ])
            })
            .collect()
    }
}

/// The stacked experts (`gate_up_proj` `[E, 2I, H]`, `down_proj` `[E, H, I]`)
/// read as one-by-one experts (`{e}.gate_proj.weight` ...), the names the
/// host's ISQ predicates and UQFF files use. Read onto the CPU when the host
/// quantizes while loading (the experts it quantizes are quantized from
/// there; the others are read back onto the device).
fn split_stacked_experts(experts: &Weights, cfg: &BerryLmConfig) -> crate::error::Result<Weights> {
    let source = if mistralrs_quant::get_immediate_isq().is_some() {
        experts.on_cpu()
    } else {
        experts.clone()
    };
    // Each in its own storage: the host's quantizers read a weight's storage
    // from its start, whatever the view's offset.
    let mut tensors = HashMap::with_capacity(3 * cfg.num_experts);
    for (e, [gate, up, down]) in read_experts(&source, cfg)?.into_iter().enumerate() {
        tensors.insert(format!("{e}.gate_proj.weight"), gate.force_contiguous()?);
        tensors.insert(format!("{e}.up_proj.weight"), up.force_contiguous()?);
        tensors.insert(format!("{e}.down_proj.weight"), down.force_contiguous()?);
    }
    Ok(experts.from_tensors(tensors))
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn routed_outputs_are_summed_with_their_f32_weights_into_the_activation_dtype() {
        // Two tokens, two experts each, hidden 2; outputs in bf16 as the
        // host's indexed kernels give them, routing weights in f32 as
        // `moe_route` gives them.
        let expert_out = Tensor::new(
            &[[[1.0f32, 2.0], [3.0, 4.0]], [[-1.0, 0.5], [2.0, -2.0]]],
            &Device::Cpu,
        )
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
        let weights = Tensor::new(&[[0.75f32, 0.25], [0.5, 0.5]], &Device::Cpu).unwrap();
        let sum = weighted_sum(&expert_out, &weights, DType::BF16).unwrap();
        assert_eq!(sum.dtype(), DType::BF16);
        let sum: Vec<Vec<f32>> = sum.to_dtype(DType::F32).unwrap().to_vec2().unwrap();
        assert_eq!(sum, [[1.5, 2.5], [0.5, -0.75]]);
    }
}
