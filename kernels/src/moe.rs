//! The routed experts of the MoE block (spec 3.7 step 3), with the
//! reference's rounding points.

use std::collections::hash_map::Entry;
use std::collections::HashMap;

use candle_core::quantized::QTensor;
use candle_core::{DType, IndexOp, Tensor};

use crate::quantized::gguf_dims;
use crate::{
    ensure, expect_dim, expect_like, expect_on_device, expect_same_device, expect_same_dtype,
    float_dims, invalid_argument, round_to_dtype, silu, tensor_from_f32, to_f32_vec, Result,
};

const OP: &str = "moe_experts";

/// The weighted sum of every token's routed experts:
///
/// ```text
/// for each of the token's experts e = ids[n, s], weight w = weights[n, s]:
///   gate | up = round(W_gu[e] x_n)           (2I dot products in f32)
///   h         = round(round(silu(gate)) * up)
///   out_e     = round(W_d[e] h)              (H dot products in f32)
///   term_e    = round(w * out_e)
/// y_n = the terms added in increasing expert id, each addition rounded,
///       starting from zero
/// ```
///
/// where `round` rounds to the dtype of `x`: the reference's loop over the
/// experts it hit, in order, each `expert(x) * w` accumulated with
/// `index_add_` in the activation dtype.
///
/// * `x`: `[N, H]`.
/// * `weights`: `[N, k]`, any float dtype (read as f32; [`crate::moe_route`]'s
///   weights hold values of the activation dtype).
/// * `ids`: `[N, k]` `u32`, distinct within a row and below `E`.
/// * `gate_up`: `[E, 2I, H]`, each expert's gate rows then its up rows;
///   `down`: `[E, H, I]`; both in the dtype of `x`.
///
/// Returns `[N, H]` in the dtype of `x`.
///
/// On CUDA, [`MoeExpertsAlgorithm::for_rows`] picks how (see
/// [`moe_experts_with`]): fewer than 128 routed rows `N * k` (a decode step
/// of up to 15 sequences at top-8) stream each chosen expert's weights once
/// per group of up to 8 of its rows; more rows (prompts, larger decode
/// batches) run both projections as grouped GEMMs on the tensor cores,
/// grouped by expert on the device (bf16, f16), or through cuBLAS after
/// reading the ids back (f32, the exactness path).
/// The CPU and the f32 grouped path fail on an id at or above `E`; the
/// other CUDA paths cannot check the ids without waiting for the device and
/// skip such an id (its term is left out of the sum).
pub fn moe_experts(
    x: &Tensor,
    weights: &Tensor,
    ids: &Tensor,
    gate_up: &Tensor,
    down: &Tensor,
) -> Result<Tensor> {
    let routed = ids.dims().iter().product();
    let algorithm = MoeExpertsAlgorithm::for_rows(routed);
    moe_experts_with(algorithm, x, weights, ids, gate_up, down)
}

/// How [`moe_experts_with`] computes the routed experts on CUDA.
///
/// The choice only matters for CUDA tensors; on the CPU both run the same
/// reference. Both have the reference's rounding points and differ from it
/// (and from each other) only in the order of the f32 sums of the
/// projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MoeExpertsAlgorithm {
    /// `moe.cu`'s decode kernels: a block per chosen expert and 8 of its
    /// weight rows streams them once per group of up to 8 of the expert's
    /// routed rows (f32 dot products on the CUDA cores). Takes up to 4096
    /// routed rows; larger calls run [`MoeExpertsAlgorithm::Grouped`].
    Streamed,
    /// The routed rows grouped by expert and both projections as grouped
    /// GEMMs: for bf16 and f16 `moe_grouped.cu` on the tensor cores
    /// (`mma.sync`, f32 accumulation, the SwiGLU fused into the `gate | up`
    /// GEMM), the grouping computed on the device, so nothing waits for it
    /// (shapes it does not take, see `CUDA.md`, run as for f32); for f32,
    /// the exactness path, two cuBLAS grouped GEMMs with f32 arithmetic after
    /// the ids are read back to the host.
    Grouped,
}

/// From this many routed rows (tokens x top-k) on [`moe_experts`] runs
/// [`MoeExpertsAlgorithm::Grouped`], below it
/// [`MoeExpertsAlgorithm::Streamed`]: on an H200 at BerryLM-OS shapes (bf16)
/// the grouped GEMMs measured faster at 128 routed rows (0.202 against 0.222
/// ms) and at every larger size timed; fewer rows were not timed, so they
/// keep the streamed kernels (`CUDA.md`).
const GROUPED_MIN_ROUTED_ROWS: usize = 128;

impl MoeExpertsAlgorithm {
    /// The algorithm [`moe_experts`] picks for `routed_rows` routed rows.
    pub fn for_rows(routed_rows: usize) -> MoeExpertsAlgorithm {
        if routed_rows >= GROUPED_MIN_ROUTED_ROWS {
            MoeExpertsAlgorithm::Grouped
        } else {
            MoeExpertsAlgorithm::Streamed
        }
    }
}

/// [`moe_experts`] with an explicit [`MoeExpertsAlgorithm`] for CUDA
/// tensors (a test and benchmark reference; the CPU ignores it).
pub fn moe_experts_with(
    algorithm: MoeExpertsAlgorithm,
    x: &Tensor,
    weights: &Tensor,
    ids: &Tensor,
    gate_up: &Tensor,
    down: &Tensor,
) -> Result<Tensor> {
    let gate_up_dims = float_dims::<3>(OP, "gate_up", gate_up)?;
    let down_dims = float_dims::<3>(OP, "down", down)?;
    let sizes = RoutedSizes::checked(OP, x, weights, ids, gate_up_dims, down_dims)?;
    for (arg, tensor) in [("gate_up", gate_up), ("down", down)] {
        expect_same_dtype(OP, arg, tensor, x.dtype(), "the activations'")?;
    }
    let device = x.device();
    let others = [
        ("weights", weights),
        ("ids", ids),
        ("gate_up", gate_up),
        ("down", down),
    ];
    expect_on_device(OP, device, others)?;
    let args = sizes.args(x, weights, ids, gate_up, down);
    on_device!(
        OP,
        device,
        {
            // One reference for both algorithms (the choice is CUDA-only).
            let _ = algorithm;
            cpu_moe_experts(&args)
        },
        crate::cuda::moe_experts(&args, algorithm),
    )
}

/// [`moe_experts`] for experts quantized in GGUF blocks (the host's in-situ
/// quantization), for decode steps: `gate_up` `[E, 2I, H]` and `down`
/// `[E, H, I]` of a type [`crate::takes_gguf_dtype`] takes, on the device of `x`.
/// A weight is the value its block defines (ggml's dequantization, in f32);
/// the rounding points are [`moe_experts`]'s, in the dtype of `x`.
///
/// On CUDA, `moe.cu`'s decode kernels decode the blocks as they stream the
/// weights (up to 4096 routed rows `N * k`); the CPU reference dequantizes
/// the experts and runs [`moe_experts`]'s.
pub fn moe_experts_quantized(
    x: &Tensor,
    weights: &Tensor,
    ids: &Tensor,
    gate_up: &QTensor,
    down: &QTensor,
) -> Result<Tensor> {
    let gate_up_dims = gguf_dims::<3>(OP, "gate_up", gate_up)?;
    let down_dims = gguf_dims::<3>(OP, "down", down)?;
    let sizes = RoutedSizes::checked(OP, x, weights, ids, gate_up_dims, down_dims)?;
    let device = x.device();
    expect_on_device(OP, device, [("weights", weights), ("ids", ids)])?;
    for (arg, tensor) in [("gate_up", gate_up), ("down", down)] {
        expect_same_device(OP, arg, &tensor.device(), device)?;
    }
    on_device!(
        OP,
        device,
        {
            let gate_up = gate_up.dequantize(device)?;
            let down = down.dequantize(device)?;
            cpu_moe_experts(&sizes.args(x, weights, ids, &gate_up, &down))
        },
        crate::cuda::moe_experts_quantized(&sizes, x, weights, ids, gate_up, down),
    )
}

const BLOCK_OP: &str = "moe_block_decode";

/// The most experts per token [`moe_block_decode`] takes.
pub const MOE_BLOCK_DECODE_MAX_TOP_K: usize = 8;

/// A MoE block's full-precision weights, in the activations' dtype: the
/// routed experts' `gate_up` `[E, 2I, H]` (gate rows, then up rows) and
/// `down` `[E, H, I]`, and the shared expert's down projection
/// `shared_down` `[H, Is]`.
#[derive(Clone, Copy)]
pub struct MoeBlockWeights<'a> {
    pub gate_up: &'a Tensor,
    pub down: &'a Tensor,
    pub shared_down: &'a Tensor,
}

/// What a batch brings to a MoE block, `N` tokens: `x` `[N, H]` (the
/// normed stream), `residual` `[N, H]`, the routing (`weights` `[N, k]`, any
/// float dtype, and `ids` `[N, k]` `u32`, as [`crate::moe_route`] gives
/// them), the shared expert's packed `gate | up` projection `[N, 2 Is]` and
/// its gate's logit `[N, 1]` (both may be column views of a stacked
/// projection's output, read in place on CUDA).
#[derive(Clone, Copy)]
pub struct MoeBlockInputs<'a> {
    pub x: &'a Tensor,
    pub residual: &'a Tensor,
    pub weights: &'a Tensor,
    pub ids: &'a Tensor,
    pub shared_gate_up: &'a Tensor,
    pub shared_gate_logit: &'a Tensor,
}

/// The residual stream after a MoE block, for the few tokens of a decode
/// step:
///
/// ```text
/// routed = moe_experts(x, weights, ids, gate_up, down)
/// shared = round(swiglu(shared_gate_up) shared_down^T)   (f32 sums)
/// y      = add_moe_output(residual, routed, shared, shared_gate_logit)
/// ```
///
/// with each operation's rounding points (`round` to the activations'
/// dtype). At most [`MOE_BLOCK_DECODE_MAX_TOP_K`] experts per token.
///
/// On CUDA two launches: [`moe_experts`]'s `gate | up` kernel, then one
/// that reads, for each output column, the down rows of the token's experts
/// and of the shared expert together and writes the column of `y` (the
/// expert outputs, the combine, the shared expert and the residual add
/// never leave registers). The CPU reference runs the four operations.
pub fn moe_block_decode(
    inputs: &MoeBlockInputs<'_>,
    weights: &MoeBlockWeights<'_>,
) -> Result<Tensor> {
    let MoeBlockInputs {
        x,
        residual,
        weights: routing_weights,
        ids,
        shared_gate_up,
        shared_gate_logit,
    } = *inputs;
    let gate_up_dims = float_dims::<3>(BLOCK_OP, "gate_up", weights.gate_up)?;
    let down_dims = float_dims::<3>(BLOCK_OP, "down", weights.down)?;
    let sizes = RoutedSizes::checked(BLOCK_OP, x, routing_weights, ids, gate_up_dims, down_dims)?;
    ensure(
        sizes.top_k <= MOE_BLOCK_DECODE_MAX_TOP_K,
        BLOCK_OP,
        "ids",
        || {
            format!(
                "{} experts per token; at most {MOE_BLOCK_DECODE_MAX_TOP_K}",
                sizes.top_k
            )
        },
    )?;
    let [hidden, shared_inter] = float_dims::<2>(BLOCK_OP, "shared_down", weights.shared_down)?;
    expect_dim(
        BLOCK_OP,
        "shared_down",
        "its number of rows (the hidden size)",
        hidden,
        sizes.hidden,
    )?;
    let tokens = sizes.tokens;
    for (arg, tensor, dims) in [
        ("residual", residual, [tokens, sizes.hidden]),
        ("shared_gate_up", shared_gate_up, [tokens, 2 * shared_inter]),
        ("shared_gate_logit", shared_gate_logit, [tokens, 1]),
    ] {
        expect_like(BLOCK_OP, arg, tensor, &dims, ("x", x))?;
    }
    for (arg, tensor) in [
        ("gate_up", weights.gate_up),
        ("down", weights.down),
        ("shared_down", weights.shared_down),
    ] {
        expect_same_dtype(BLOCK_OP, arg, tensor, x.dtype(), "the activations'")?;
        expect_same_device(BLOCK_OP, arg, tensor.device(), x.device())?;
    }
    expect_on_device(
        BLOCK_OP,
        x.device(),
        [("weights", routing_weights), ("ids", ids)],
    )?;
    on_device!(
        BLOCK_OP,
        x.device(),
        {
            let routed = moe_experts(x, routing_weights, ids, weights.gate_up, weights.down)?;
            let shared =
                crate::decode_matmul(&crate::swiglu(shared_gate_up)?, weights.shared_down)?;
            crate::add_moe_output(residual, &routed, &shared, shared_gate_logit)
        },
        crate::cuda::moe_block_decode(inputs, weights, &sizes, shared_inter),
    )
}

/// The sizes of a [`moe_experts`] call: `x` `[tokens, hidden]`, `weights`
/// and `ids` `[tokens, top_k]`, `gate_up` `[experts, 2 * inter, hidden]` and
/// `down` `[experts, hidden, inter]`.
#[derive(Clone, Copy)]
pub(crate) struct RoutedSizes {
    pub tokens: usize,
    pub top_k: usize,
    pub experts: usize,
    pub hidden: usize,
    pub inter: usize,
}

impl RoutedSizes {
    /// The sizes of `x`, `weights` and `ids` with expert weights of the
    /// shapes `gate_up` and `down`, checked against each other (errors
    /// name the operation `op`).
    fn checked(
        op: &'static str,
        x: &Tensor,
        weights: &Tensor,
        ids: &Tensor,
        gate_up: [usize; 3],
        down: [usize; 3],
    ) -> Result<RoutedSizes> {
        let [tokens, hidden] = float_dims::<2>(op, "x", x)?;
        let [weight_rows, top_k] = float_dims::<2>(op, "weights", weights)?;
        let [experts, _, _] = gate_up;
        let [_, _, inter] = down;
        ensure(
            ids.dtype() == DType::U32 && ids.dims() == [tokens, top_k],
            op,
            "ids",
            || {
                format!(
                    "expected u32 [{tokens}, {top_k}], got {:?} {:?}",
                    ids.dtype(),
                    ids.dims()
                )
            },
        )?;
        ensure(weight_rows == tokens, op, "weights", || {
            format!("{weight_rows} rows for {tokens} tokens")
        })?;
        let expected = [
            ("gate_up", gate_up, [experts, 2 * inter, hidden]),
            ("down", down, [experts, hidden, inter]),
        ];
        for (arg, dims, want) in expected {
            ensure(dims == want, op, arg, || {
                format!("shape {dims:?}, expected {want:?} (E, 2I, H from the inputs)")
            })?;
        }
        ensure(inter > 0 && experts > 0 && top_k > 0, op, "gate_up", || {
            format!("empty experts: E {experts}, I {inter}, k {top_k}")
        })?;
        Ok(RoutedSizes {
            tokens,
            top_k,
            experts,
            hidden,
            inter,
        })
    }

    fn args<'a>(
        self,
        x: &'a Tensor,
        weights: &'a Tensor,
        ids: &'a Tensor,
        gate_up: &'a Tensor,
        down: &'a Tensor,
    ) -> MoeExpertsArgs<'a> {
        MoeExpertsArgs {
            x,
            weights,
            ids,
            gate_up,
            down,
            sizes: self,
        }
    }
}

/// The validated arguments of a [`moe_experts`] call and its sizes (see
/// [`RoutedSizes`]).
pub(crate) struct MoeExpertsArgs<'a> {
    pub x: &'a Tensor,
    pub weights: &'a Tensor,
    pub ids: &'a Tensor,
    pub gate_up: &'a Tensor,
    pub down: &'a Tensor,
    pub sizes: RoutedSizes,
}

/// `sum_c row[c] * v[c]` in f32, in index order.
fn dot(row: &[f32], v: &[f32]) -> f32 {
    row.iter().zip(v).map(|(a, b)| a * b).sum()
}

fn cpu_moe_experts(args: &MoeExpertsArgs<'_>) -> Result<Tensor> {
    let RoutedSizes {
        tokens,
        top_k,
        experts,
        hidden,
        inter,
    } = args.sizes;
    let (gate_up, down) = (args.gate_up, args.down);
    let dtype = args.x.dtype();
    let x = to_f32_vec(args.x)?;
    let weights = to_f32_vec(args.weights)?;
    let ids: Vec<u32> = args.ids.flatten_all()?.to_vec1()?;
    if let Some(&bad) = ids.iter().find(|&&id| id as usize >= experts) {
        return Err(invalid_argument(
            OP,
            "ids",
            format!("expert id {bad} is not below the {experts} experts"),
        ));
    }
    // Only the experts some token chose are widened to f32.
    let mut expert_weights: HashMap<u32, (Vec<f32>, Vec<f32>)> = HashMap::new();
    let mut y = Vec::with_capacity(tokens * hidden);
    for token in 0..tokens {
        let x_n = &x[token * hidden..(token + 1) * hidden];
        let mut slots: Vec<usize> = (0..top_k).collect();
        slots.sort_by_key(|&slot| ids[token * top_k + slot]);
        let mut acc = vec![0f32; hidden];
        for slot in slots {
            let expert = ids[token * top_k + slot];
            if let Entry::Vacant(entry) = expert_weights.entry(expert) {
                let index = expert as usize;
                entry.insert((
                    to_f32_vec(&gate_up.i(index)?)?,
                    to_f32_vec(&down.i(index)?)?,
                ));
            }
            let (gate_up_e, down_e) = &expert_weights[&expert];
            let projected = round_to_dtype(
                gate_up_e
                    .chunks_exact(hidden)
                    .map(|row| dot(row, x_n))
                    .collect(),
                dtype,
            )?;
            let (gate, up) = projected.split_at(inter);
            let activated = round_to_dtype(gate.iter().map(|&g| silu(g)).collect(), dtype)?;
            let h = round_to_dtype(
                activated.iter().zip(up).map(|(a, u)| a * u).collect(),
                dtype,
            )?;
            let out = round_to_dtype(
                down_e.chunks_exact(inter).map(|row| dot(row, &h)).collect(),
                dtype,
            )?;
            let weight = weights[token * top_k + slot];
            let terms = round_to_dtype(out.iter().map(|o| weight * o).collect(), dtype)?;
            acc = round_to_dtype(acc.iter().zip(&terms).map(|(a, t)| a + t).collect(), dtype)?;
        }
        y.extend(acc);
    }
    tensor_from_f32(y, &[tokens, hidden], dtype)
}
