use berrylm_kernels::{moe_experts, moe_experts_quantized, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, IndexOp, Tensor};

use crate::common::{assert_close, assert_rejects, f32_values, f64_values, tensor, Rng};

const TOKENS: usize = 4;
const HIDDEN: usize = 16;
const INTER: usize = 6;
const EXPERTS: usize = 5;
const TOP_K: usize = 3;

struct Inputs {
    x: Tensor,
    weights: Tensor,
    ids: Tensor,
    gate_up: Tensor,
    down: Tensor,
}

fn inputs(seed: u64, dtype: DType) -> Result<Inputs> {
    let mut rng = Rng::new(seed);
    let mut random = |dims: &[usize], scale: f32| -> Result<Tensor> {
        let len = dims.iter().product();
        Ok(tensor(rng.uniform_vec(len, -scale, scale), dims)?.to_dtype(dtype)?)
    };
    let x = random(&[TOKENS, HIDDEN], 2.0)?;
    let gate_up = random(&[EXPERTS, 2 * INTER, HIDDEN], 0.5)?;
    let down = random(&[EXPERTS, HIDDEN, INTER], 0.5)?;
    // Distinct experts per token, in no particular order.
    let ids: Vec<u32> = vec![3, 0, 4, 1, 2, 3, 4, 3, 0, 2, 1, 0];
    let weights = tensor(
        Rng::new(seed + 1).uniform_vec(TOKENS * TOP_K, 0.05, 0.6),
        &[TOKENS, TOP_K],
    )?;
    Ok(Inputs {
        x,
        weights,
        ids: Tensor::from_vec(ids, (TOKENS, TOP_K), &candle_core::Device::Cpu)?,
        gate_up,
        down,
    })
}

fn run(inputs: &Inputs) -> Result<Tensor> {
    moe_experts(
        &inputs.x,
        &inputs.weights,
        &inputs.ids,
        &inputs.gate_up,
        &inputs.down,
    )
}

#[test]
fn f32_matches_f64_reference() -> Result<()> {
    let inputs = inputs(1, DType::F32)?;
    let y = run(&inputs)?;
    assert_eq!(y.dims(), &[TOKENS, HIDDEN]);
    let x = f64_values(&inputs.x)?;
    let weights = f64_values(&inputs.weights)?;
    let ids: Vec<u32> = inputs.ids.flatten_all()?.to_vec1()?;
    let mut expected = vec![0f64; TOKENS * HIDDEN];
    for token in 0..TOKENS {
        for slot in 0..TOP_K {
            let expert = ids[token * TOP_K + slot] as usize;
            let gate_up = f64_values(&inputs.gate_up.i(expert)?)?;
            let down = f64_values(&inputs.down.i(expert)?)?;
            let project = |row: usize| -> f64 {
                (0..HIDDEN)
                    .map(|c| gate_up[row * HIDDEN + c] * x[token * HIDDEN + c])
                    .sum()
            };
            let h: Vec<f64> = (0..INTER)
                .map(|j| {
                    let gate = project(j);
                    gate / (1.0 + (-gate).exp()) * project(INTER + j)
                })
                .collect();
            for i in 0..HIDDEN {
                let out: f64 = (0..INTER).map(|j| down[i * INTER + j] * h[j]).sum();
                expected[token * HIDDEN + i] += weights[token * TOP_K + slot] * out;
            }
        }
    }
    assert_close(&f32_values(&y)?, &expected, 1e-5, 1e-4);
    Ok(())
}

/// The reference's loop with candle operations on the CPU: per expert in
/// increasing id, its tokens' `down(silu(gate) * up) * w` with every step
/// rounded to the dtype (products in f32, then rounded), added with
/// `index_add` in the dtype.
fn reference_loop(inputs: &Inputs, dtype: DType) -> Result<Tensor> {
    let ids: Vec<u32> = inputs.ids.flatten_all()?.to_vec1()?;
    let weights: Vec<f32> = inputs.weights.flatten_all()?.to_vec1()?;
    let mut out = Tensor::zeros((TOKENS, HIDDEN), dtype, &candle_core::Device::Cpu)?;
    for expert in 0..EXPERTS as u32 {
        let (tokens, token_weights): (Vec<u32>, Vec<f32>) = (0..TOKENS * TOP_K)
            .filter(|&r| ids[r] == expert)
            .map(|r| ((r / TOP_K) as u32, weights[r]))
            .unzip();
        if tokens.is_empty() {
            continue;
        }
        let count = tokens.len();
        let index = Tensor::from_vec(tokens, count, &candle_core::Device::Cpu)?;
        let rows = inputs.x.index_select(&index, 0)?.to_dtype(DType::F32)?;
        let round = |t: Tensor| -> Result<Tensor> { Ok(t.to_dtype(dtype)?.to_dtype(DType::F32)?) };
        let gate_up = inputs.gate_up.i(expert as usize)?.to_dtype(DType::F32)?;
        let projected = round(rows.matmul(&gate_up.t()?)?)?;
        let gate = projected.narrow(1, 0, INTER)?;
        let up = projected.narrow(1, INTER, INTER)?;
        let h = round((round(gate.silu()?)? * up)?)?;
        let down = inputs.down.i(expert as usize)?.to_dtype(DType::F32)?;
        let expert_out = round(h.matmul(&down.t()?)?)?;
        let w = Tensor::from_vec(token_weights, (count, 1), &candle_core::Device::Cpu)?;
        let terms = expert_out.broadcast_mul(&w)?.to_dtype(dtype)?;
        out = out.index_add(&index, &terms, 0)?;
    }
    Ok(out)
}

#[test]
fn every_dtype_rounds_like_the_reference_loop() -> Result<()> {
    for (seed, dtype) in [(2, DType::F32), (3, DType::BF16), (4, DType::F16)] {
        let inputs = inputs(seed, dtype)?;
        let y = run(&inputs)?;
        assert_eq!(y.dtype(), dtype);
        let expected = f64_values(&reference_loop(&inputs, dtype)?)?;
        // The dot products' summation order is the only difference (candle's
        // GEMM blocks the sums): a rounding step of the dtype at most, twice.
        let rtol = match dtype {
            DType::BF16 => 2.0 / 128.0,
            DType::F16 => 2.0 / 1024.0,
            _ => 1e-5,
        };
        assert_close(&f32_values(&y)?, &expected, rtol * 0.1, rtol);
    }
    Ok(())
}

/// The terms are added in increasing expert id, whatever order the router
/// listed a token's experts in: permuting the slots changes nothing.
#[test]
fn the_order_of_a_tokens_slots_does_not_matter() -> Result<()> {
    let inputs = inputs(5, DType::BF16)?;
    let y = run(&inputs)?;
    let reversed = |t: &Tensor| -> Result<Tensor> {
        let columns: Vec<Tensor> = (0..TOP_K)
            .rev()
            .map(|s| t.narrow(1, s, 1))
            .collect::<candle_core::Result<_>>()?;
        Ok(Tensor::cat(&columns, 1)?)
    };
    let permuted = Inputs {
        ids: reversed(&inputs.ids)?,
        weights: reversed(&inputs.weights)?,
        ..inputs
    };
    assert_eq!(f32_values(&run(&permuted)?)?, f32_values(&y)?);
    Ok(())
}

#[test]
fn bad_arguments_are_rejected_with_the_argument_named() -> Result<()> {
    let inputs = inputs(6, DType::F32)?;
    let out_of_range = Tensor::full(EXPERTS as u32, (TOKENS, TOP_K), &candle_core::Device::Cpu)?;
    let cases = [
        (
            "ids",
            moe_experts(
                &inputs.x,
                &inputs.weights,
                &out_of_range,
                &inputs.gate_up,
                &inputs.down,
            ),
        ),
        (
            "ids",
            moe_experts(
                &inputs.x,
                &inputs.weights,
                &inputs.ids.to_dtype(DType::F32)?,
                &inputs.gate_up,
                &inputs.down,
            ),
        ),
        (
            "down",
            moe_experts(
                &inputs.x,
                &inputs.weights,
                &inputs.ids,
                &inputs.gate_up,
                &inputs.down.narrow(1, 0, HIDDEN - 1)?,
            ),
        ),
        (
            "gate_up",
            moe_experts(
                &inputs.x,
                &inputs.weights,
                &inputs.ids,
                &inputs.gate_up.to_dtype(DType::BF16)?,
                &inputs.down,
            ),
        ),
    ];
    for (expected_arg, result) in cases {
        assert_rejects(result, "moe_experts", expected_arg);
    }
    Ok(())
}

/// Integer weights whose every q8_0 block (32 weights) holds ±127: the
/// blocks hold them exactly (scale 1), so the quantized experts compute what
/// the experts in full precision do, bit for bit, in every dtype (integers
/// up to 127 are exact in bf16 and f16 too).
#[test]
fn quantized_experts_holding_their_weights_exactly_match_the_experts() -> Result<()> {
    let (experts, hidden, inter) = (3, 64, 32);
    let exact = |dims: &[usize], salt: usize| -> Result<Tensor> {
        let len: usize = dims.iter().product();
        let values = (0..len)
            .map(|i| match i % 32 {
                0 => 127.0,
                1 => -127.0,
                k => ((k * 37 + i / 32 * 11 + salt) % 255) as f32 - 127.0,
            })
            .collect();
        tensor(values, dims)
    };
    let gate_up = exact(&[experts, 2 * inter, hidden], 0)?;
    let down = exact(&[experts, hidden, inter], 5)?;
    let x = tensor(
        Rng::new(7).uniform_vec(2 * hidden, -1e-3, 1e-3),
        &[2, hidden],
    )?;
    let ids = Tensor::from_vec(vec![2u32, 0, 1, 2], (2, 2), &candle_core::Device::Cpu)?;
    let weights = tensor(vec![0.25, 0.75, 0.5, 0.5], &[2, 2])?;
    let gate_up_blocks = QTensor::quantize(&gate_up, GgmlDType::Q8_0)?;
    let down_blocks = QTensor::quantize(&down, GgmlDType::Q8_0)?;
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let x = x.to_dtype(dtype)?;
        let expected = moe_experts(
            &x,
            &weights,
            &ids,
            &gate_up.to_dtype(dtype)?,
            &down.to_dtype(dtype)?,
        )?;
        let got = moe_experts_quantized(&x, &weights, &ids, &gate_up_blocks, &down_blocks)?;
        assert_eq!(f32_values(&got)?, f32_values(&expected)?, "{dtype:?}");
    }
    Ok(())
}
