//! `paged_decode_attention` on CUDA (bf16, f16) against `causal_attention`'s
//! f32 CPU reference of the same keys and values laid out contiguously: one
//! partition of 512 tokens and several (the combine), sequences of different
//! lengths in one batch, batches of 1-3 and 64 sequences (a block per query
//! head, and per KV head's whole group), block tables wider than the contexts, GQA groups of
//! 8, 3, 2 and 1, head dims 256, 128 and 64, blocks of 16 and 32 tokens. Each
//! case prints its largest error (`--nocapture`).

use berrylm_kernels::{causal_attention, paged_decode_attention, PagedKv, Result};
use candle_core::{DType, Device, IndexOp, Tensor};

use super::{gpu, random, to_gpu};
use crate::common::{f32_values, paged_cache, Rng};

/// `[heads, kv_heads, head_dim, block_size]` and the sequences' lengths.
type Case = ([usize; 4], Vec<usize>);

fn check(seed: u64, (sizes, lens): &Case, dtype: DType) -> Result<()> {
    let [heads, kv_heads, head_dim, block_size] = *sizes;
    let rng = &mut Rng::new(seed);
    let keys: Vec<Tensor> = lens
        .iter()
        .map(|&len| random(rng, &[kv_heads, len, head_dim], -2.0, 2.0, dtype))
        .collect::<Result<_>>()?;
    let values: Vec<Tensor> = lens
        .iter()
        .map(|&len| random(rng, &[kv_heads, len, head_dim], -1.0, 1.0, dtype))
        .collect::<Result<_>>()?;
    let longest = lens.iter().copied().max().unwrap_or(1);
    // A table two blocks wider than the longest sequence needs, in a cache
    // with spare blocks.
    let max_blocks = longest.div_ceil(block_size) + 2;
    let blocks = lens
        .iter()
        .map(|len| len.div_ceil(block_size))
        .sum::<usize>()
        + 3;
    let cache = paged_cache(rng, &keys, &values, block_size, blocks, max_blocks)?;
    let q = random(rng, &[lens.len(), heads, head_dim], -2.0, 2.0, dtype)?;
    let scale = 1.0 / (head_dim as f32).sqrt();
    let device = gpu();
    let on_gpu = |t: &Tensor| to_gpu(t, &device);
    let (key_cache, value_cache) = (on_gpu(&cache.key_cache)?, on_gpu(&cache.value_cache)?);
    let (block_tables, context_lens) = (on_gpu(&cache.block_tables)?, on_gpu(&cache.context_lens)?);
    let kv = PagedKv {
        key_cache: &key_cache,
        value_cache: &value_cache,
        block_tables: &block_tables,
        context_lens: &context_lens,
    };
    let cuda = paged_decode_attention(&on_gpu(&q)?, &kv, scale)?;
    assert_eq!(cuda.dims(), &[lens.len(), heads, head_dim]);
    assert_eq!(cuda.dtype(), dtype);
    let got = f32_values(&cuda.to_device(&Device::Cpu)?)?;
    let f32 = |t: &Tensor| t.to_dtype(DType::F32);
    // Rounding the output to the dtype moves it by half a step of |o| <= 1;
    // 2 steps for margin (the f32 reference is exact to ~1e-6).
    let tol = match dtype {
        DType::BF16 => 2.0 / 256.0,
        _ => 2.0 / 2048.0,
    };
    let mut worst = 0f32;
    for (n, &len) in lens.iter().enumerate() {
        let reference = causal_attention(
            &f32(&q.i(n)?)?.reshape((1, heads, 1, head_dim))?,
            &f32(&keys[n])?.unsqueeze(0)?,
            &f32(&values[n])?.unsqueeze(0)?,
            scale,
        )?;
        let want = f32_values(&reference)?;
        let row = &got[n * heads * head_dim..][..heads * head_dim];
        let error = row
            .iter()
            .zip(&want)
            .fold(0f32, |m, (g, w)| m.max((g - w).abs()));
        assert!(
            error <= tol,
            "sequence {n} of {len} tokens, heads {heads}/{kv_heads}, D {head_dim}, blocks of \
             {block_size}, {dtype:?}: max error {error:e} exceeds {tol:e}"
        );
        worst = worst.max(error);
    }
    println!(
        "paged_decode_attention {heads}/{kv_heads} heads D {head_dim} blocks of {block_size} \
         lengths {lens:?} {dtype:?}: max error {worst:.3e}"
    );
    Ok(())
}

#[test]
fn paged_decode_attention_matches_cpu() -> Result<()> {
    let cases: [Case; 7] = [
        // BerryLM-OS: 16 query heads over 2 KV heads of 256, blocks of 32;
        // one partition, then 1, 2 and 3 partitions in one batch (a few
        // sequences: a block per query head).
        ([16, 2, 256, 32], vec![1, 17, 512]),
        ([16, 2, 256, 32], vec![513, 40, 1100]),
        // 64 sequences (blocks of all 8 query heads of a KV head).
        (
            [16, 2, 256, 32],
            (0..64).map(|n| 1 + n * 37 % 700).collect(),
        ),
        ([16, 2, 128, 16], vec![300, 7]),
        ([4, 2, 64, 16], vec![65, 1, 600]),
        ([8, 8, 64, 32], vec![33]),
        ([6, 3, 64, 16], vec![15, 16, 1030]),
    ];
    let mut seed = 9100;
    for case in &cases {
        for dtype in [DType::BF16, DType::F16] {
            seed += 1;
            check(seed, case, dtype)?;
        }
    }
    Ok(())
}
