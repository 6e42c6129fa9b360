use berrylm_kernels::{attn_res_mix, attn_res_mix_norm, Result};
use candle_core::{DType, Tensor};

use crate::common::{assert_close, assert_identical, f32_values, f64_values, tensor, Rng};

const TOKENS: usize = 4;
const HIDDEN: usize = 16;
const EPS: f64 = 1e-6;

/// `count` random streams `[TOKENS, HIDDEN]` with different scales, and a
/// random pseudo-query.
fn inputs(seed: u64, count: usize) -> Result<(Vec<Tensor>, Tensor)> {
    let mut rng = Rng::new(seed);
    let sources = (0..count)
        .map(|index| {
            let scale = 1.0 + index as f32;
            tensor(
                rng.uniform_vec(TOKENS * HIDDEN, -scale, scale),
                &[TOKENS, HIDDEN],
            )
        })
        .collect::<Result<Vec<_>>>()?;
    let pseudo_query = tensor(rng.uniform_vec(HIDDEN, -0.5, 0.5), &[HIDDEN])?;
    Ok((sources, pseudo_query))
}

/// The mix in `f64`, blended with `tanh(gate)` when a gate is given.
fn reference(sources: &[Tensor], pseudo_query: &Tensor, gate: Option<f64>) -> Result<Vec<f64>> {
    let streams = sources.iter().map(f64_values).collect::<Result<Vec<_>>>()?;
    let query = f64_values(pseudo_query)?;
    let current = &streams[streams.len() - 1];
    let mut result = Vec::new();
    for n in 0..TOKENS {
        let row = |stream: &Vec<f64>| stream[n * HIDDEN..(n + 1) * HIDDEN].to_vec();
        let logits: Vec<f64> = streams
            .iter()
            .map(|stream| {
                let values = row(stream);
                let rms = (values.iter().map(|v| v * v).sum::<f64>() / HIDDEN as f64 + EPS).sqrt();
                values.iter().zip(&query).map(|(v, q)| v / rms * q).sum()
            })
            .collect();
        let exponentials: Vec<f64> = logits.iter().map(|logit| logit.exp()).collect();
        let total: f64 = exponentials.iter().sum();
        for h in 0..HIDDEN {
            let mix: f64 = streams
                .iter()
                .zip(&exponentials)
                .map(|(stream, weight)| weight / total * stream[n * HIDDEN + h])
                .sum();
            let x = row(current)[h];
            result.push(gate.map_or(mix, |g| x + g.tanh() * (mix - x)));
        }
    }
    Ok(result)
}

#[test]
fn ungated_matches_f64_reference() -> Result<()> {
    for count in [1, 2, 3, 6] {
        let (sources, pseudo_query) = inputs(count as u64, count)?;
        let mix = attn_res_mix(&sources, &pseudo_query, None, EPS)?;
        assert_eq!(mix.dims(), &[TOKENS, HIDDEN]);
        assert_eq!(mix.dtype(), DType::F32);
        let expected = reference(&sources, &pseudo_query, None)?;
        assert_close(&f32_values(&mix)?, &expected, 1e-5, 1e-5);
    }
    Ok(())
}

#[test]
fn gated_matches_f64_reference() -> Result<()> {
    let (sources, pseudo_query) = inputs(10, 4)?;
    for gate in [0.7f32, -0.3, 2.5] {
        let mixed = attn_res_mix(&sources, &pseudo_query, Some(gate), EPS)?;
        let expected = reference(&sources, &pseudo_query, Some(f64::from(gate)))?;
        assert_close(&f32_values(&mixed)?, &expected, 1e-5, 1e-5);
    }
    Ok(())
}

#[test]
fn zero_gate_is_exact_identity() -> Result<()> {
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let (sources, pseudo_query) = inputs(11, 3)?;
        let sources = sources
            .iter()
            .map(|source| source.to_dtype(dtype))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let mixed = attn_res_mix(&sources, &pseudo_query, Some(0.0), EPS)?;
        assert_identical(&mixed, &sources[2])?;
    }
    Ok(())
}

#[test]
fn equal_sources_return_the_source() -> Result<()> {
    let (sources, pseudo_query) = inputs(12, 1)?;
    let x = &sources[0];
    for dtype in [DType::F32, DType::BF16] {
        let x = x.to_dtype(dtype)?;
        let pair = [x.clone(), x.clone()];
        assert_identical(&attn_res_mix(&pair, &pseudo_query, None, EPS)?, &x)?;
        assert_identical(&attn_res_mix(&pair, &pseudo_query, Some(0.8), EPS)?, &x)?;
    }
    let triple = [x.clone(), x.clone(), x.clone()];
    let mix = attn_res_mix(&triple, &pseudo_query, None, EPS)?;
    assert_close(&f32_values(&mix)?, &f64_values(x)?, 0.0, 1e-6);
    Ok(())
}

#[test]
fn zero_pseudo_query_gives_uniform_mean() -> Result<()> {
    let (sources, _) = inputs(13, 3)?;
    let zero_query = tensor(vec![0.0; HIDDEN], &[HIDDEN])?;
    let mix = attn_res_mix(&sources, &zero_query, None, EPS)?;
    let streams = sources.iter().map(f64_values).collect::<Result<Vec<_>>>()?;
    let mean: Vec<f64> = (0..TOKENS * HIDDEN)
        .map(|index| streams.iter().map(|stream| stream[index]).sum::<f64>() / 3.0)
        .collect();
    assert_close(&f32_values(&mix)?, &mean, 1e-6, 1e-6);
    Ok(())
}

#[test]
fn bf16_is_within_bf16_tolerance_of_f32() -> Result<()> {
    let (sources, pseudo_query) = inputs(14, 4)?;
    let half_sources = sources
        .iter()
        .map(|source| source.to_dtype(DType::BF16))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let half_query = pseudo_query.to_dtype(DType::BF16)?;
    for gate in [None, Some(0.6)] {
        let full = attn_res_mix(&sources, &pseudo_query, gate, EPS)?;
        let half = attn_res_mix(&half_sources, &half_query, gate, EPS)?;
        assert_eq!(half.dtype(), DType::BF16);
        assert_close(&f32_values(&half)?, &f64_values(&full)?, 3e-2, 2e-2);
    }
    Ok(())
}

#[test]
fn gated_blend_rounds_op_by_op_in_the_stream_dtype() -> Result<()> {
    let (sources, pseudo_query) = inputs(15, 3)?;
    let gate = 0.45f32;
    for dtype in [DType::BF16, DType::F16] {
        let sources = sources
            .iter()
            .map(|source| source.to_dtype(dtype))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let x = &sources[2];
        let mix = attn_res_mix(&sources, &pseudo_query, None, EPS)?;
        let strength = Tensor::new(&[gate.tanh()], x.device())?.to_dtype(dtype)?;
        // candle's half-precision element-wise ops round after each op, like PyTorch.
        let expected = x.add(&(mix.sub(x)?).broadcast_mul(&strength)?)?;
        let blended = attn_res_mix(&sources, &pseudo_query, Some(gate), EPS)?;
        assert_identical(&blended, &expected)?;
    }
    Ok(())
}

/// The (1 + w) RMSNorm of each `HIDDEN`-wide row of `rows`, in `f64`.
fn reference_norm(rows: &[f64], scale: &[f64], eps: f64) -> Vec<f64> {
    rows.chunks_exact(HIDDEN)
        .flat_map(|row| {
            let rms = (row.iter().map(|v| v * v).sum::<f64>() / HIDDEN as f64 + eps).sqrt();
            row.iter()
                .zip(scale)
                .map(move |(v, s)| v / rms * s)
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn mix_then_input_norm_matches_f64_reference() -> Result<()> {
    let mut rng = Rng::new(16);
    let scale = rng.uniform_vec(HIDDEN, 0.5, 1.5);
    let scale_f64: Vec<f64> = scale.iter().map(|&s| f64::from(s)).collect();
    let scale = tensor(scale, &[HIDDEN])?;
    let norm_eps = 1e-5;
    for (count, gate) in [(1, None), (3, Some(0.7f32)), (6, Some(-1.2))] {
        let (sources, pseudo_query) = inputs(20 + count as u64, count)?;
        let (mix, normed) =
            attn_res_mix_norm(&sources, &pseudo_query, gate, EPS, &scale, norm_eps)?;
        let expected_mix = reference(&sources, &pseudo_query, gate.map(f64::from))?;
        assert_close(&f32_values(&mix)?, &expected_mix, 1e-5, 1e-5);
        assert_eq!(
            (normed.dims(), normed.dtype()),
            (&[TOKENS, HIDDEN][..], DType::F32)
        );
        let expected = reference_norm(&expected_mix, &scale_f64, norm_eps);
        assert_close(&f32_values(&normed)?, &expected, 1e-5, 1e-5);
    }
    Ok(())
}
