//! `causal_attention` on CUDA against the CPU reference computed in f32 from
//! the same (bf16, f16) inputs: the tensor-core kernel for D in {64, 128,
//! 256}, the scalar kernel for f32 and other head dims. Each case prints its
//! largest error (`--nocapture`).

use berrylm_kernels::{causal_attention, Result};
use candle_core::{DType, Tensor};

use super::{gpu, random, to_gpu};
use crate::common::{f32_values, Rng};

/// `[B, Hq, Hkv, T, L, D]`.
type Shape = [usize; 6];

/// The largest difference between the CUDA result and the CPU reference,
/// and the largest reference magnitude.
fn max_error(cuda: &Tensor, reference: &Tensor) -> Result<(f32, f32)> {
    assert_eq!(cuda.dims(), reference.dims());
    let got = f32_values(&cuda.to_device(&candle_core::Device::Cpu)?)?;
    let want = f32_values(reference)?;
    let scale = want.iter().fold(0f32, |m, w| m.max(w.abs()));
    let error = got
        .iter()
        .zip(&want)
        .fold(0f32, |m, (g, w)| m.max((g - w).abs()));
    Ok((error, scale))
}

/// Runs one case, its inputs drawn from `Rng::new(seed)`: q and k uniform in
/// [-2, 2), v in [-1, 1), all in `dtype`; q lives token-major
/// (`[B, T, Hq, D]`, the projections' layout) and k and v in a cache of
/// `capacity` positions narrowed to the first L (all read in place on the
/// GPU). Asserts the CUDA result token-major in memory and within `tol`
/// (times the largest |v|, 1) of the f32 CPU reference, and prints the
/// errors against it and against the CPU reference in `dtype`.
fn check(seed: u64, shape: Shape, capacity: usize, scale: f32, dtype: DType) -> Result<()> {
    let [batch, heads, kv_heads, queries, keys, head_dim] = shape;
    let rng = &mut Rng::new(seed);
    let cache = [batch, kv_heads, capacity, head_dim];
    let q = random(rng, &[batch, queries, heads, head_dim], -2.0, 2.0, dtype)?.transpose(1, 2)?;
    let k_cache = random(rng, &cache, -2.0, 2.0, dtype)?;
    let v_cache = random(rng, &cache, -1.0, 1.0, dtype)?;
    let (k, v) = (k_cache.narrow(2, 0, keys)?, v_cache.narrow(2, 0, keys)?);
    let device = gpu();
    let k_gpu = to_gpu(&k_cache, &device)?.narrow(2, 0, keys)?;
    let v_gpu = to_gpu(&v_cache, &device)?.narrow(2, 0, keys)?;
    let q_gpu = to_gpu(&q.transpose(1, 2)?, &device)?.transpose(1, 2)?;
    let cuda = causal_attention(&q_gpu, &k_gpu, &v_gpu, scale)?;
    assert!(cuda.transpose(1, 2)?.is_contiguous());
    assert_eq!(cuda.dtype(), dtype);
    let f32 = |t: &Tensor| t.to_dtype(DType::F32);
    let reference = causal_attention(&f32(&q)?, &f32(&k)?, &f32(&v)?, scale)?;
    let (error, magnitude) = max_error(&cuda, &reference)?;
    let (oracle_error, _) = max_error(&cuda, &causal_attention(&q, &k, &v, scale)?)?;
    // Rounding P to the dtype moves each output by at most half a step of
    // the dtype relative to sum_j p_j |v_j| <= 1, the output's rounding by
    // half a step of |o| <= 1: one step in all, 2 for margin (the f32
    // reference is exact to ~1e-6). f32 runs the same f32 arithmetic.
    let tol = match dtype {
        DType::BF16 => 2.0 / 256.0,
        DType::F16 => 2.0 / 2048.0,
        _ => 1e-5,
    };
    println!(
        "causal_attention {shape:?} (cache {capacity}) scale {scale} {dtype:?}: \
         max error {error:.3e} vs f32 reference, {oracle_error:.3e} vs the {dtype:?} CPU op \
         (max |o| {magnitude:.3})"
    );
    assert!(
        error <= tol,
        "{shape:?} {dtype:?}: max error {error:e} exceeds {tol:e}"
    );
    Ok(())
}

/// [`check`]s each `(seed, shape, capacity, scale, dtype)`.
fn check_all(cases: &[(u64, Shape, usize, f32, DType)]) -> Result<()> {
    for &(seed, shape, capacity, scale, dtype) in cases {
        check(seed, shape, capacity, scale, dtype)?;
    }
    Ok(())
}

const HALF: [DType; 2] = [DType::BF16, DType::F16];

/// The tensor-core kernel at BerryLM's shape (16 query heads over 2 KV heads,
/// D 256) and at D 64 and 128: one query with and without a prefix, prompts
/// shorter than, equal to and not a multiple of the 64-query tile (D 64) and
/// of the 128-query tile of the sm_90a kernel (D 128, 256: a tile whose
/// second warpgroup has no queries, or a few), a cached prefix, batch 2, GQA
/// groups 1, 2 and 8.
#[test]
fn causal_attention_matches_cpu_on_tensor_cores() -> Result<()> {
    let cases: [(Shape, usize); 10] = [
        ([2, 16, 2, 1, 1, 256], 8),
        ([2, 16, 2, 1, 77, 256], 80),
        ([1, 16, 2, 37, 37, 256], 64),
        ([1, 16, 2, 64, 64, 256], 64),
        ([2, 16, 2, 130, 200, 256], 256),
        ([1, 16, 2, 300, 300, 256], 300),
        ([1, 8, 1, 100, 100, 128], 128),
        ([2, 4, 2, 129, 250, 128], 256),
        ([2, 4, 4, 70, 75, 64], 96),
        ([1, 16, 2, 200, 333, 64], 333),
    ];
    let mut seed = 7000;
    for (shape, capacity) in cases {
        for dtype in HALF {
            seed += 1;
            let scale = 1.0 / (shape[5] as f32).sqrt();
            check(seed, shape, capacity, scale, dtype)?;
        }
    }
    // A sharp softmax: the running max moves by large steps between tiles.
    check_all(&[
        (7100, [1, 2, 1, 150, 190, 64], 190, 1.5, DType::BF16),
        (7101, [1, 2, 1, 150, 190, 256], 190, 0.5, DType::F16),
    ])
}

/// The scalar kernel: f32 at BerryLM's shape, and half precision at a head
/// dim the tensor-core kernel does not take.
#[test]
fn causal_attention_matches_cpu_on_the_scalar_kernel() -> Result<()> {
    check_all(&[
        (7200, [2, 16, 2, 70, 90, 256], 90, 0.0625, DType::F32),
        (7201, [1, 4, 2, 1, 33, 48], 40, 0.2, DType::F32),
        (7202, [1, 4, 2, 20, 33, 80], 40, 0.2, DType::BF16),
        (7203, [1, 4, 1, 20, 33, 512], 40, 0.05, DType::F16),
    ])
}

/// Layouts the kernel cannot read in place (a cache view starting off the
/// 16-byte alignment, transposed k/v and q) are copied first, and a
/// head-major q is read in place: all give the results of contiguous
/// inputs.
#[test]
fn causal_attention_copies_other_layouts_on_cuda() -> Result<()> {
    let mut rng = Rng::new(7300);
    let dtype = DType::BF16;
    let device = gpu();
    let q = to_gpu(
        &random(&mut rng, &[1, 16, 40, 256], -2.0, 2.0, dtype)?,
        &device,
    )?;
    let k = to_gpu(
        &random(&mut rng, &[1, 2, 51, 256], -2.0, 2.0, dtype)?,
        &device,
    )?;
    let v = to_gpu(
        &random(&mut rng, &[1, 2, 51, 256], -1.0, 1.0, dtype)?,
        &device,
    )?;
    let expected = f32_values(&causal_attention(
        &q,
        &k.narrow(2, 1, 50)?.contiguous()?.force_contiguous()?,
        &v.narrow(2, 1, 50)?.force_contiguous()?,
        0.0625,
    )?)?;
    // Off by one element: start offsets of 256 elements are aligned, so
    // narrow the flattened storage instead.
    let shifted = |t: &Tensor| -> candle_core::Result<Tensor> {
        t.flatten_all()?
            .narrow(0, 3, 2 * 50 * 256)?
            .reshape((1, 2, 50, 256))
    };
    let k_off = shifted(&k)?;
    let v_off = shifted(&v)?;
    let expected_off = f32_values(&causal_attention(
        &q,
        &k_off.force_contiguous()?,
        &v_off.force_contiguous()?,
        0.0625,
    )?)?;
    assert_eq!(
        f32_values(&causal_attention(&q, &k_off, &v_off, 0.0625)?)?,
        expected_off
    );
    let transposed = |t: &Tensor| -> candle_core::Result<Tensor> {
        t.narrow(2, 1, 50)?
            .transpose(2, 3)?
            .contiguous()?
            .transpose(2, 3)
    };
    let q_t = q.transpose(2, 3)?.contiguous()?.transpose(2, 3)?;
    assert_eq!(
        f32_values(&causal_attention(
            &q_t,
            &transposed(&k)?,
            &transposed(&v)?,
            0.0625
        )?)?,
        expected
    );
    let q_token_major = q.transpose(1, 2)?.contiguous()?.transpose(1, 2)?;
    assert_eq!(
        f32_values(&causal_attention(
            &q_token_major,
            &k.narrow(2, 1, 50)?,
            &v.narrow(2, 1, 50)?,
            0.0625
        )?)?,
        expected
    );
    Ok(())
}
