//! The kernels for weights in GGUF blocks (`quantized_matmul`,
//! `quantized_matmul_with_dense`, `moe_experts_quantized`) on CUDA against their CPU references, which
//! dequantize the same blocks with candle: q8_0 and q4_K, every activation
//! dtype, decode batches of one to more than one group of 8 rows, BerryLM-OS
//! widths and small ones; and the same kernel on full-precision weights
//! alone (`decode_matmul`).

use std::borrow::Cow;

use berrylm_kernels::{
    decode_matmul, moe_experts_quantized, quantized_matmul, quantized_matmul_with_dense, Result,
};
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::DType;

use super::{
    gpu, moe_routing, output_tol, random, to_gpu, within, ALL_DTYPES, HIDDEN, MOE_INTERMEDIATE,
    TIGHT, TOP_K,
};
use crate::common::Rng;

const FORMATS: [GgmlDType; 2] = [GgmlDType::Q8_0, GgmlDType::Q4K];

/// Random f32 weights of `dims` quantized to `format` on the CPU.
fn quantized(rng: &mut Rng, dims: &[usize], format: GgmlDType) -> Result<QTensor> {
    let weights = random(rng, dims, -0.05, 0.05, DType::F32)?;
    Ok(QTensor::quantize(&weights, format)?)
}

/// The same blocks on the GPU.
fn quantized_to_gpu(weights: &QTensor) -> Result<QTensor> {
    let blocks = weights.data()?.into_owned();
    // Borrowed: candle 0.10.2's `from_data` reads an owned buffer after
    // dropping it.
    let storage = QStorage::from_data(Cow::Borrowed(&blocks), &gpu(), weights.dtype())?;
    Ok(QTensor::new(storage, weights.shape().clone())?)
}

/// f32 results agree up to the order of the f32 sums (q8_0's kernels factor
/// a block's scale out of its sum, q4_K's single-row calls a run's scale and
/// min out of its sums); half precision within a rounding step.
fn tolerance(dtype: DType) -> super::Tol {
    match dtype {
        DType::F32 => TIGHT,
        other => output_tol(other),
    }
}

fn matmul_case(
    seed: u64,
    tokens: usize,
    dims: [usize; 2],
    format: GgmlDType,
    dtype: DType,
) -> Result<()> {
    let [out_dim, in_dim] = dims;
    let rng = &mut Rng::new(seed);
    // Starting one element into its storage: the kernel's 16-byte loads take a copy.
    let x = random(rng, &[tokens * in_dim + 1], -2.0, 2.0, dtype)?
        .narrow(0, 1, tokens * in_dim)?
        .reshape((tokens, in_dim))?;
    let weight = quantized(rng, &[out_dim, in_dim], format)?;
    let cpu = quantized_matmul(&x, &weight)?;
    let cuda = quantized_matmul(&to_gpu(&x, &gpu())?, &quantized_to_gpu(&weight)?)?;
    let what = format!("quantized_matmul N={tokens} [{out_dim}, {in_dim}] {format:?} {dtype:?}");
    within(&what, &cuda, &cpu, tolerance(dtype))?;
    Ok(())
}

/// Batches of 1, 3, 8 and 13 rows (two groups of 8), at BerryLM-OS's KDA
/// input projection width (2048 -> 1024 rows here) and at widths of one and
/// two blocks with an output count that leaves a block's warps idle.
#[test]
fn quantized_matmul_matches_cpu() -> Result<()> {
    let mut seed = 3000;
    for format in FORMATS {
        for dtype in ALL_DTYPES {
            for tokens in [1, 3, 8, 13] {
                for dims in [[1024, HIDDEN], [13, 256], [5, 512]] {
                    matmul_case(seed, tokens, dims, format, dtype)?;
                    seed += 1;
                }
            }
        }
    }
    Ok(())
}

fn with_dense_case(
    seed: u64,
    tokens: usize,
    dims: [usize; 3],
    format: GgmlDType,
    dtype: DType,
) -> Result<()> {
    let [out_dim, dense_out, in_dim] = dims;
    let rng = &mut Rng::new(seed);
    let x = random(rng, &[tokens, in_dim], -2.0, 2.0, dtype)?;
    let weight = quantized(rng, &[out_dim, in_dim], format)?;
    let dense = random(rng, &[dense_out, in_dim], -0.05, 0.05, dtype)?;
    let cpu = quantized_matmul_with_dense(&x, &weight, &dense)?;
    let dev = gpu();
    let cuda = quantized_matmul_with_dense(
        &to_gpu(&x, &dev)?,
        &quantized_to_gpu(&weight)?,
        &to_gpu(&dense, &dev)?,
    )?;
    let what = format!(
        "quantized_matmul_with_dense N={tokens} [{out_dim} + {dense_out}, {in_dim}] {format:?} {dtype:?}"
    );
    within(&what, &cuda, &cpu, tolerance(dtype))?;
    Ok(())
}

/// BerryLM-OS's groups: KDA's q|k|v|z quantized with β and the forget gate's
/// down projection (32 + 128 rows) in full precision, the shared expert's
/// gate|up with the router and the shared expert's gate (128 + 1 rows,
/// padded to 136); and small widths, at batches 1, 5 and 11.
#[test]
fn quantized_matmul_with_dense_matches_cpu() -> Result<()> {
    let mut seed = 3200;
    for format in FORMATS {
        for dtype in ALL_DTYPES {
            for tokens in [1, 5, 11] {
                for dims in [[1536, 160, HIDDEN], [1024, 136, HIDDEN], [7, 3, 256]] {
                    with_dense_case(seed, tokens, dims, format, dtype)?;
                    seed += 1;
                }
            }
        }
    }
    Ok(())
}

/// Decode-step projections of BerryLM-OS (the KDA in-projection's 12,448
/// rows, one warp a column; `out_proj`'s 4096-wide input and the MoE's
/// stacked input projection, several warps a column; the shared expert's
/// down projection) and small, odd widths, at batches 1, 5 and 11, with `x`
/// 16-byte aligned (the vector path where the width allows) and a view one
/// element into its storage (the scalar path).
#[test]
fn decode_matmul_matches_cpu() -> Result<()> {
    let mut seed = 3300;
    let shapes = [
        [12448, HIDDEN],
        [HIDDEN, 4096],
        [1160, HIDDEN],
        [HIDDEN, 512],
        [7, 37],
    ];
    for dtype in ALL_DTYPES {
        for (tokens, offset) in [(1, 0), (1, 1), (5, 0), (11, 1)] {
            for [out_dim, in_dim] in shapes {
                let rng = &mut Rng::new(seed);
                seed += 1;
                let x = random(rng, &[tokens * in_dim + offset], -2.0, 2.0, dtype)?
                    .narrow(0, offset, tokens * in_dim)?
                    .reshape((tokens, in_dim))?;
                let weight = random(rng, &[out_dim, in_dim], -0.05, 0.05, dtype)?;
                let cpu = decode_matmul(&x, &weight)?;
                let dev = gpu();
                let cuda = decode_matmul(&to_gpu(&x, &dev)?, &to_gpu(&weight, &dev)?)?;
                let what =
                    format!("decode_matmul N={tokens} [{out_dim}, {in_dim}] +{offset} {dtype:?}");
                within(&what, &cuda, &cpu, tolerance(dtype))?;
            }
        }
    }
    Ok(())
}

fn experts_case(
    seed: u64,
    tokens: usize,
    dims: [usize; 4],
    format: GgmlDType,
    dtype: DType,
) -> Result<()> {
    let [experts, top_k, hidden, inter] = dims;
    let rng = &mut Rng::new(seed);
    let x = random(rng, &[tokens, hidden], -2.0, 2.0, dtype)?;
    let gate_up = quantized(rng, &[experts, 2 * inter, hidden], format)?;
    let down = quantized(rng, &[experts, hidden, inter], format)?;
    let (weights, ids) = moe_routing(rng, tokens, experts, top_k)?;
    let cpu = moe_experts_quantized(&x, &weights, &ids, &gate_up, &down)?;
    let dev = gpu();
    let cuda = moe_experts_quantized(
        &to_gpu(&x, &dev)?,
        &to_gpu(&weights, &dev)?,
        &to_gpu(&ids, &dev)?,
        &quantized_to_gpu(&gate_up)?,
        &quantized_to_gpu(&down)?,
    )?;
    let what = format!(
        "moe_experts_quantized N={tokens} E={experts} k={top_k} H={hidden} I={inter} {format:?} {dtype:?}"
    );
    within(&what, &cuda, &cpu, output_tol(dtype))?;
    Ok(())
}

/// BerryLM-OS widths (hidden 2048, expert width 512, top-8) with 16 experts,
/// at decode batches 1 (a block per routed row), 8 and 40 (a block per
/// expert, more than 8 rows for some experts); and widths of one block.
#[test]
fn moe_experts_quantized_matches_cpu() -> Result<()> {
    let mut seed = 3100;
    for format in FORMATS {
        for dtype in ALL_DTYPES {
            for tokens in [1, 8, 40] {
                experts_case(
                    seed,
                    tokens,
                    [16, TOP_K, HIDDEN, MOE_INTERMEDIATE],
                    format,
                    dtype,
                )?;
                seed += 1;
            }
            experts_case(seed, 5, [6, 2, 256, 256], format, dtype)?;
            seed += 1;
        }
    }
    Ok(())
}
