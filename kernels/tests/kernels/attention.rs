use berrylm_kernels::{causal_attention, Result};
use candle_core::{DType, Device, Tensor, D};

use crate::common::{assert_close, assert_rejects, f32_values, f64_values, tensor, Rng};

/// `[B, Hq, T, D]` queries and `[B, Hkv, L, D]` keys and values in `dtype`,
/// uniform in `[-2, 2)`.
fn inputs(
    seed: u64,
    [batch, heads, kv_heads, queries, keys, head_dim]: [usize; 6],
    dtype: DType,
) -> Result<(Tensor, Tensor, Tensor)> {
    let mut rng = Rng::new(seed);
    let mut random = |dims: &[usize]| -> Result<Tensor> {
        let len = dims.iter().product();
        Ok(tensor(rng.uniform_vec(len, -2.0, 2.0), dims)?.to_dtype(dtype)?)
    };
    let q = random(&[batch, heads, queries, head_dim])?;
    let k = random(&[batch, kv_heads, keys, head_dim])?;
    let v = random(&[batch, kv_heads, keys, head_dim])?;
    Ok((q, k, v))
}

/// The plugin's eager attention before this operation (`attend` in
/// plugin/src/layers/attention.rs), op by op with candle tensors: q read as
/// `[B, Hkv, groups * T, D]`, the scores a matmul in the input dtype (bf16
/// widened to f32 and rounded once, as the plugin's CPU matmul), scaled in
/// that dtype (bf16 again widened), the `[T, L]` causal mask added, the
/// softmax in f32 rounded back, and the matmul with `v`.
fn plugin_attend(q: &Tensor, k: &Tensor, v: &Tensor, scale: f32) -> Result<Tensor> {
    let dtype = q.dtype();
    let widened = dtype == DType::BF16;
    let matmul = |a: &Tensor, b: &Tensor| -> Result<Tensor> {
        Ok(if widened {
            a.to_dtype(DType::F32)?
                .broadcast_matmul(&b.to_dtype(DType::F32)?)?
                .to_dtype(dtype)?
        } else {
            a.broadcast_matmul(b)?
        })
    };
    let (batch, heads, queries, head_dim) = q.dims4()?;
    let (_, kv_heads, keys, _) = k.dims4()?;
    let groups = heads / kv_heads;
    let grouped = q.reshape((batch, kv_heads, groups * queries, head_dim))?;
    let scores = matmul(&grouped, &k.t()?)?;
    let scores = if widened {
        (scores.to_dtype(DType::F32)? * f64::from(scale))?.to_dtype(dtype)?
    } else {
        (scores * f64::from(scale))?
    };
    let prefix = keys - queries;
    let mask: Vec<f32> = (0..queries)
        .flat_map(|i| {
            (0..keys).map(move |j| {
                if j <= prefix + i {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    let mask = tensor(mask, &[queries, keys])?.to_dtype(dtype)?;
    let scores = scores
        .reshape((batch, kv_heads, groups, queries, keys))?
        .broadcast_add(&mask)?
        .reshape((batch, kv_heads, groups * queries, keys))?
        .to_dtype(DType::F32)?;
    // candle_nn's softmax_last_dim: max, exp of the differences, sum, division.
    let max = scores.max_keepdim(D::Minus1)?;
    let exp = scores.broadcast_sub(&max)?.exp()?;
    let probs = exp
        .broadcast_div(&exp.sum_keepdim(D::Minus1)?)?
        .to_dtype(dtype)?;
    Ok(matmul(&probs, v)?.reshape((batch, heads, queries, head_dim))?)
}

/// The attention in f64 from the (exact) f32 values of the inputs.
fn f64_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Vec<f64>> {
    let (batch, heads, queries, head_dim) = q.dims4()?;
    let (_, kv_heads, keys, _) = k.dims4()?;
    let groups = heads / kv_heads;
    let (q, k, v) = (f64_values(q)?, f64_values(k)?, f64_values(v)?);
    let mut out = Vec::with_capacity(q.len());
    for b in 0..batch {
        for h in 0..heads {
            let kv = (b * kv_heads + h / groups) * keys;
            for i in 0..queries {
                let query = &q[((b * heads + h) * queries + i) * head_dim..][..head_dim];
                let allowed = keys - queries + i + 1;
                let scores: Vec<f64> = (0..allowed)
                    .map(|j| {
                        let key = &k[(kv + j) * head_dim..][..head_dim];
                        scale * query.iter().zip(key).map(|(a, b)| a * b).sum::<f64>()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                for d in 0..head_dim {
                    out.push(
                        weights
                            .iter()
                            .enumerate()
                            .map(|(j, w)| w * v[(kv + j) * head_dim + d])
                            .sum::<f64>()
                            / total,
                    );
                }
            }
        }
    }
    Ok(out)
}

/// Shapes `[B, Hq, Hkv, T, L, D]`: one query, a prompt, a prompt after a
/// cached prefix, GQA groups of 1, 2 and 4.
const SHAPES: [[usize; 6]; 4] = [
    [2, 4, 2, 1, 1, 16],
    [1, 4, 1, 6, 6, 8],
    [2, 4, 2, 5, 9, 16],
    [1, 2, 2, 3, 11, 24],
];

#[test]
fn causal_attention_is_the_plugins_eager_attention() -> Result<()> {
    let scale = 0.3;
    for (seed, shape) in SHAPES.into_iter().enumerate() {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let (q, k, v) = inputs(seed as u64, shape, dtype)?;
            let y = causal_attention(&q, &k, &v, scale)?;
            let expected = plugin_attend(&q, &k, &v, scale)?;
            assert!(y.is_contiguous());
            assert_eq!(y.dims(), expected.dims());
            assert_eq!(y.dtype(), dtype);
            let (got, want) = (f32_values(&y)?, f32_values(&expected)?);
            // The same rounding points; only the order of the f32 sums of
            // the matmuls differs, which flips a rounding rarely: at most
            // one step of the dtype (4 at the magnitude 2 of the values).
            let step = match dtype {
                DType::BF16 => 2.0 / 128.0,
                DType::F16 => 2.0 / 1024.0,
                _ => 2e-6,
            };
            let mut differing = 0;
            for (index, (&g, &w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 4.0 * step,
                    "{shape:?} {dtype:?} element {index}: got {g}, expected {w}"
                );
                differing += usize::from(g != w);
            }
            if dtype != DType::F32 {
                assert!(
                    differing <= got.len() / 10 + 1,
                    "{shape:?} {dtype:?}: {differing} of {} values differ",
                    got.len()
                );
            }
        }
    }
    Ok(())
}

#[test]
fn causal_attention_f32_matches_f64_reference() -> Result<()> {
    let scale = 0.25;
    for (seed, shape) in SHAPES.into_iter().enumerate() {
        let (q, k, v) = inputs(10 + seed as u64, shape, DType::F32)?;
        let y = causal_attention(&q, &k, &v, scale)?;
        let expected = f64_attention(&q, &k, &v, f64::from(scale))?;
        assert_close(&f32_values(&y)?, &expected, 1e-5, 1e-5);
    }
    Ok(())
}

/// A single query at the end attends every key; the first query of a prompt
/// without prefix sees only the first key, so its output is that value.
#[test]
fn causal_attention_masks_the_future() -> Result<()> {
    let (q, k, v) = inputs(20, [1, 2, 1, 4, 4, 8], DType::F32)?;
    let y = causal_attention(&q, &k, &v, 0.5)?;
    for h in 0..2 {
        assert_eq!(
            f32_values(&y.get(0)?.get(h)?.get(0)?)?,
            f32_values(&v.get(0)?.get(0)?.get(0)?)?
        );
    }
    // The last query of the prompt is the one query of a decode step.
    let last = causal_attention(&q.narrow(2, 3, 1)?, &k, &v, 0.5)?;
    assert_eq!(f32_values(&last)?, f32_values(&y.narrow(2, 3, 1)?)?);
    // Keys past the causal limit do not matter.
    let later = causal_attention(
        &q.narrow(2, 0, 2)?,
        &k.narrow(2, 0, 2)?,
        &v.narrow(2, 0, 2)?,
        0.5,
    )?;
    assert_eq!(f32_values(&later)?, f32_values(&y.narrow(2, 0, 2)?)?);
    Ok(())
}

/// Keys and values as views of a larger cache narrowed along the positions,
/// and a transposed q, give the results of contiguous inputs.
#[test]
fn causal_attention_reads_views() -> Result<()> {
    let (q, k, v) = inputs(30, [2, 4, 2, 3, 12, 16], DType::BF16)?;
    let expected = causal_attention(&q, &k.narrow(2, 0, 7)?, &v.narrow(2, 0, 7)?, 0.25)?;
    let k_view = k.narrow(2, 0, 7)?;
    assert!(!k_view.is_contiguous());
    let q_t = q.transpose(1, 2)?.contiguous()?.transpose(1, 2)?;
    let y = causal_attention(&q_t, &k_view, &v.narrow(2, 0, 7)?, 0.25)?;
    assert_eq!(f32_values(&y)?, f32_values(&expected.contiguous()?)?);
    Ok(())
}

#[test]
fn causal_attention_rejects_bad_arguments() -> Result<()> {
    const OP: &str = "causal_attention";
    let zeros = |dims: &[usize], dtype: DType| Tensor::zeros(dims, dtype, &Device::Cpu);
    let q = zeros(&[1, 4, 3, 8], DType::BF16)?;
    let kv = zeros(&[1, 2, 5, 8], DType::BF16)?;
    let cases = [
        ("q", causal_attention(&q.flatten_to(1)?, &kv, &kv, 1.0)),
        (
            "q",
            causal_attention(&q.to_dtype(DType::U32)?, &kv, &kv, 1.0),
        ),
        (
            "q",
            causal_attention(&zeros(&[1, 4, 0, 8], DType::BF16)?, &kv, &kv, 1.0),
        ),
        ("k", causal_attention(&q, &kv.flatten_to(2)?, &kv, 1.0)),
        // 4 query heads over 3 key/value heads.
        (
            "k",
            causal_attention(&q, &zeros(&[1, 3, 5, 8], DType::BF16)?, &kv, 1.0),
        ),
        // Fewer keys than queries.
        (
            "k",
            causal_attention(&q, &kv.narrow(2, 0, 2)?, &kv.narrow(2, 0, 2)?, 1.0),
        ),
        (
            "k",
            causal_attention(&q, &zeros(&[2, 2, 5, 8], DType::BF16)?, &kv, 1.0),
        ),
        (
            "k",
            causal_attention(&q, &zeros(&[1, 2, 5, 4], DType::BF16)?, &kv, 1.0),
        ),
        (
            "k",
            causal_attention(&q, &kv.to_dtype(DType::F32)?, &kv, 1.0),
        ),
        ("v", causal_attention(&q, &kv, &kv.narrow(2, 0, 4)?, 1.0)),
        (
            "v",
            causal_attention(&q, &kv, &kv.to_dtype(DType::F16)?, 1.0),
        ),
        ("softmax_scale", causal_attention(&q, &kv, &kv, f32::NAN)),
    ];
    for (arg, result) in cases {
        assert_rejects(result, OP, arg);
    }
    Ok(())
}
