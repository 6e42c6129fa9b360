//! The routed experts of the MoE block (spec 3.7 step 3) for decode-sized
//! batches, with the reference's rounding points.

use std::collections::hash_map::Entry;
use std::collections::HashMap;

use candle_core::{DType, IndexOp, Tensor};

use crate::{
    ensure, expect_on_device, expect_same_dtype, float_dims, invalid_argument, round_to_dtype,
    silu, tensor_from_f32, to_f32_vec, Result,
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
/// On CUDA, up to 256 routed rows `N * k` (a decode step of 32 sequences at
/// top-8) take three launches in which each expert's weights are read once
/// per group of up to 8 of the tokens routed to it; more rows (prompts, larger
/// decode batches) read the ids back once, gather the rows by expert and run
/// both projections as cuBLAS grouped GEMMs on the tensor cores (f32
/// accumulation, one rounding per output, as the reference's `Linear`), with
/// the same SwiGLU and combine.
/// The CPU and the grouped path fail on an id at or above `E`; the decode
/// kernels cannot check the ids without waiting for the device and skip such
/// an id.
pub fn moe_experts(
    x: &Tensor,
    weights: &Tensor,
    ids: &Tensor,
    gate_up: &Tensor,
    down: &Tensor,
) -> Result<Tensor> {
    let [tokens, hidden] = float_dims::<2>(OP, "x", x)?;
    let [weight_rows, top_k] = float_dims::<2>(OP, "weights", weights)?;
    let [experts, _, _] = float_dims::<3>(OP, "gate_up", gate_up)?;
    let [_, _, inter] = float_dims::<3>(OP, "down", down)?;
    ensure(
        ids.dtype() == DType::U32 && ids.dims() == [tokens, top_k],
        OP,
        "ids",
        || {
            format!(
                "expected u32 [{tokens}, {top_k}], got {:?} {:?}",
                ids.dtype(),
                ids.dims()
            )
        },
    )?;
    ensure(weight_rows == tokens, OP, "weights", || {
        format!("{weight_rows} rows for {tokens} tokens")
    })?;
    let expected = [
        ("gate_up", gate_up, [experts, 2 * inter, hidden]),
        ("down", down, [experts, hidden, inter]),
    ];
    for (arg, tensor, want) in expected {
        ensure(tensor.dims() == want, OP, arg, || {
            format!(
                "shape {:?}, expected {want:?} (E, 2I, H from the inputs)",
                tensor.dims()
            )
        })?;
    }
    for (arg, tensor, _) in expected {
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
    ensure(inter > 0 && experts > 0 && top_k > 0, OP, "gate_up", || {
        format!("empty experts: E {experts}, I {inter}, k {top_k}")
    })?;
    let args = MoeExpertsArgs {
        x,
        weights,
        ids,
        gate_up,
        down,
        tokens,
        top_k,
        experts,
        hidden,
        inter,
    };
    on_device!(
        OP,
        device,
        cpu_moe_experts(&args),
        crate::cuda::moe_experts(&args),
    )
}

/// The validated arguments of a [`moe_experts`] call and its sizes: `x`
/// `[tokens, hidden]`, `weights` and `ids` `[tokens, top_k]`, `gate_up`
/// `[experts, 2 * inter, hidden]` and `down` `[experts, hidden, inter]`.
pub(crate) struct MoeExpertsArgs<'a> {
    pub x: &'a Tensor,
    pub weights: &'a Tensor,
    pub ids: &'a Tensor,
    pub gate_up: &'a Tensor,
    pub down: &'a Tensor,
    pub tokens: usize,
    pub top_k: usize,
    pub experts: usize,
    pub hidden: usize,
    pub inter: usize,
}

/// `sum_c row[c] * v[c]` in f32, in index order.
fn dot(row: &[f32], v: &[f32]) -> f32 {
    row.iter().zip(v).map(|(a, b)| a * b).sum()
}

fn cpu_moe_experts(args: &MoeExpertsArgs<'_>) -> Result<Tensor> {
    let (tokens, top_k, experts) = (args.tokens, args.top_k, args.experts);
    let (hidden, inter) = (args.hidden, args.inter);
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
