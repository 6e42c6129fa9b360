//! `paged_decode_attention`'s CPU reference against `causal_attention` of the
//! same keys and values laid out contiguously, and its argument errors.

use berrylm_kernels::{causal_attention, paged_decode_attention, PagedKv, Result};
use candle_core::{DType, Device, IndexOp, Tensor};

use crate::common::{assert_identical, assert_rejects, paged_cache, random, PagedCache, Rng};

fn kv(cache: &PagedCache) -> PagedKv<'_> {
    PagedKv {
        key_cache: &cache.key_cache,
        value_cache: &cache.value_cache,
        block_tables: &cache.block_tables,
        context_lens: &cache.context_lens,
    }
}

/// Three sequences of 1, 9 and 20 tokens in blocks of 4 (a block table
/// wider than they need), 4 query heads over 2 key/value heads of 16
/// channels: each sequence's output equals `causal_attention` of its last
/// position over its keys and values, bit for bit.
#[test]
fn pages_read_as_the_contiguous_keys_and_values() -> Result<()> {
    let mut rng = Rng::new(41);
    for dtype in [DType::F32, DType::BF16] {
        let lens = [1, 9, 20];
        let keys: Vec<Tensor> = lens
            .iter()
            .map(|&len| random(&mut rng, &[2, len, 16], -2.0, 2.0, dtype))
            .collect::<Result<_>>()?;
        let values: Vec<Tensor> = lens
            .iter()
            .map(|&len| random(&mut rng, &[2, len, 16], -2.0, 2.0, dtype))
            .collect::<Result<_>>()?;
        let cache = paged_cache(&mut rng, &keys, &values, 4, 16, 7)?;
        let q = random(&mut rng, &[3, 4, 16], -2.0, 2.0, dtype)?;
        let paged = paged_decode_attention(&q, &kv(&cache), 0.25)?;
        assert_eq!(paged.dims(), &[3, 4, 16]);
        for n in 0..3 {
            let expected = causal_attention(
                &q.i(n)?.reshape((1, 4, 1, 16))?,
                &keys[n].unsqueeze(0)?,
                &values[n].unsqueeze(0)?,
                0.25,
            )?;
            assert_identical(&paged.i(n)?, &expected.reshape((4, 16))?)?;
        }
    }
    Ok(())
}

#[test]
fn bad_arguments_are_rejected_with_the_argument_named() -> Result<()> {
    let mut rng = Rng::new(42);
    let keys = [random(&mut rng, &[2, 5, 16], -2.0, 2.0, DType::F32)?];
    let values = [random(&mut rng, &[2, 5, 16], -2.0, 2.0, DType::F32)?];
    let cache = paged_cache(&mut rng, &keys, &values, 4, 6, 3)?;
    let q = random(&mut rng, &[1, 4, 16], -2.0, 2.0, DType::F32)?;
    let op = "paged_decode_attention";
    let lens = |len: u32| Tensor::new(&[len], &Device::Cpu);
    // No tokens, and 13 tokens in 3 blocks of 4.
    for context_lens in [&lens(0)?, &lens(13)?] {
        let kv = PagedKv {
            context_lens,
            ..kv(&cache)
        };
        assert_rejects(paged_decode_attention(&q, &kv, 0.25), op, "context_lens");
    }
    let bad_table = Tensor::new(&[[0u32, 9, 1]], &Device::Cpu)?;
    let flat_values = cache.value_cache.flatten(2, 3)?;
    let three_heads = random(&mut rng, &[1, 3, 16], -2.0, 2.0, DType::F32)?;
    let half_q = q.to_dtype(DType::BF16)?;
    let cases = [
        (
            &q,
            PagedKv {
                block_tables: &bad_table,
                ..kv(&cache)
            },
            0.25,
            "block_tables",
        ),
        (
            &q,
            PagedKv {
                value_cache: &flat_values,
                ..kv(&cache)
            },
            0.25,
            "value_cache",
        ),
        (&three_heads, kv(&cache), 0.25, "key_cache"),
        (&half_q, kv(&cache), 0.25, "key_cache"),
        (&q, kv(&cache), f32::NAN, "softmax_scale"),
    ];
    for (q, kv, scale, arg) in cases {
        assert_rejects(paged_decode_attention(q, &kv, scale), op, arg);
    }
    Ok(())
}
