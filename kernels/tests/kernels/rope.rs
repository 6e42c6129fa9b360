use berrylm_kernels::{offset_rms_norm, offset_rms_norm_rope, Result};
use candle_core::{DType, Device, Tensor, D};

use crate::common::{assert_identical, assert_rejects, f64_values, tensor, Rng};

const BATCH: usize = 2;
const SEQ_LEN: usize = 3;
const HEADS: usize = 3;
const HEAD_DIM: usize = 32;
const EPS: f64 = 1e-6;
/// One position per token of the `[BATCH, SEQ_LEN]` batch: the first
/// (cos 1, sin 0), small and large ones.
const POSITIONS: [usize; BATCH * SEQ_LEN] = [0, 1, 5, 77, 1000, 16383];

/// `f32`'s unit roundoff, 2^-24.
const F32_U: f64 = 1.0 / 16_777_216.0;

/// cos and sin `[BATCH, SEQ_LEN, rotary]` of [`POSITIONS`] as the model builds
/// them: angles `position * theta^(-2j/rotary)` in f32, each frequency
/// twice, cos and sin in f32 rounded to `dtype`.
fn tables(rotary: usize, dtype: DType) -> Result<(Tensor, Tensor)> {
    let half = rotary / 2;
    let inv_freq: Vec<f32> = (0..half)
        .map(|j| 1.0 / 10_000f32.powf((2 * j) as f32 / rotary as f32))
        .collect();
    let mut angles = Vec::with_capacity(POSITIONS.len() * rotary);
    for position in POSITIONS {
        let row: Vec<f32> = inv_freq.iter().map(|f| position as f32 * f).collect();
        angles.extend_from_slice(&row);
        angles.extend_from_slice(&row);
    }
    let angles = tensor(angles, &[BATCH, SEQ_LEN, rotary])?;
    Ok((
        angles.cos()?.to_dtype(dtype)?,
        angles.sin()?.to_dtype(dtype)?,
    ))
}

/// `x` `[BATCH, SEQ_LEN, HEADS, HEAD_DIM]` in `dtype`, contiguous, and a view
/// of the same shape whose rows lie `2 * HEAD_DIM` apart (the query half of
/// an interleaved `[.., HEADS, 2 * HEAD_DIM]` projection); and the scale.
fn inputs(seed: u64, dtype: DType) -> Result<(Tensor, Tensor, Tensor)> {
    let mut rng = Rng::new(seed);
    let dims = [BATCH, SEQ_LEN, HEADS, HEAD_DIM];
    let x = tensor(rng.uniform_vec(dims.iter().product(), -3.0, 3.0), &dims)?;
    let interleaved = tensor(
        rng.uniform_vec(2 * dims.iter().product::<usize>(), -3.0, 3.0),
        &[BATCH, SEQ_LEN, HEADS, 2 * HEAD_DIM],
    )?;
    let view = interleaved.to_dtype(dtype)?.narrow(3, 0, HEAD_DIM)?;
    let scale = tensor(rng.uniform_vec(HEAD_DIM, 0.5, 1.5), &[HEAD_DIM])?;
    Ok((x.to_dtype(dtype)?, view, scale))
}

/// The plugin's former `rope.apply(&q_norm.forward(&q)?, cos, sin)`, op by
/// op with candle tensors: the `(1 + w)` norm (`x.to(f32)`, `sqr`, mean,
/// `+ eps`, `sqrt`, division, product, `to(dtype)`), then each half of the
/// rotated channels as two products and a sum (or difference) in the dtype,
/// and the pass-through channels appended.
fn candle_chain(x: &Tensor, scale: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let x_f32 = x.to_dtype(DType::F32)?;
    let mean_square = x_f32.sqr()?.mean_keepdim(D::Minus1)?;
    let normed = x_f32
        .broadcast_div(&(mean_square + EPS)?.sqrt()?)?
        .broadcast_mul(scale)?
        .to_dtype(x.dtype())?;
    let rotary = cos.dim(D::Minus1)?;
    let half = rotary / 2;
    let first = normed.narrow(D::Minus1, 0, half)?;
    let second = normed.narrow(D::Minus1, half, half)?;
    let table = |t: &Tensor, start: usize| t.narrow(D::Minus1, start, half)?.unsqueeze(2);
    let (cos_first, cos_second) = (table(cos, 0)?, table(cos, half)?);
    let (sin_first, sin_second) = (table(sin, 0)?, table(sin, half)?);
    let new_first = (first.broadcast_mul(&cos_first)? - second.broadcast_mul(&sin_first)?)?;
    let new_second = (second.broadcast_mul(&cos_second)? + first.broadcast_mul(&sin_second)?)?;
    let mut parts = vec![new_first, new_second];
    if rotary < HEAD_DIM {
        parts.push(normed.narrow(D::Minus1, rotary, HEAD_DIM - rotary)?);
    }
    Ok(Tensor::cat(&parts, D::Minus1)?)
}

#[test]
fn offset_rms_norm_rope_is_the_candle_op_composition() -> Result<()> {
    let mut seed = 20;
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        seed += 1;
        let (x, view, scale) = inputs(seed, dtype)?;
        assert!(!view.is_contiguous());
        // Every channel rotated, the model's quarter, and one pair.
        for rotary in [HEAD_DIM, HEAD_DIM / 4, 2] {
            let (cos, sin) = tables(rotary, dtype)?;
            for x in [&x, &view] {
                let y = offset_rms_norm_rope(x, &scale, EPS, &cos, &sin)?;
                assert!(y.is_contiguous());
                assert_identical(&y, &candle_chain(x, &scale, &cos, &sin)?)?;
            }
        }
    }
    Ok(())
}

/// At position 0 (cos 1, sin 0) the rotation leaves the norm's result as is.
#[test]
fn offset_rms_norm_rope_at_position_zero_is_the_norm() -> Result<()> {
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let (_, view, scale) = inputs(30, dtype)?;
        let (cos, sin) = tables(HEAD_DIM / 4, dtype)?;
        let first_token = |t: &Tensor| t.narrow(0, 0, 1)?.narrow(1, 0, 1);
        let x = first_token(&view)?;
        assert_identical(
            &offset_rms_norm_rope(&x, &scale, EPS, &first_token(&cos)?, &first_token(&sin)?)?,
            &offset_rms_norm(&x, &scale, EPS)?,
        )?;
    }
    Ok(())
}

/// In `f32`, against the norm and rotation in `f64` of the same inputs and
/// tables: each `n` is within `64u` of its exact value (a sum of 32 squares,
/// the root, a division and a product, as in the norm's own test), the two
/// products and the sum add a rounding each, so an output is within
/// `(64 + 3)u` of `|n[i] cos[i]| + |n[j] sin[i]|`, the magnitudes it is made
/// of (relative to the output itself it can be larger, where they cancel).
#[test]
fn offset_rms_norm_rope_f32_matches_f64_reference() -> Result<()> {
    let (x, view, scale) = inputs(40, DType::F32)?;
    let rotary = HEAD_DIM / 4;
    let half = rotary / 2;
    let (cos, sin) = tables(rotary, DType::F32)?;
    let (cos_values, sin_values) = (f64_values(&cos)?, f64_values(&sin)?);
    let scale_values = f64_values(&scale)?;
    for x in [&x, &view] {
        let got = f64_values(&offset_rms_norm_rope(x, &scale, EPS, &cos, &sin)?)?;
        let values = f64_values(x)?;
        for (row, input) in values.chunks_exact(HEAD_DIM).enumerate() {
            let rms = (input.iter().map(|v| v * v).sum::<f64>() / HEAD_DIM as f64 + EPS).sqrt();
            let n: Vec<f64> = input
                .iter()
                .zip(&scale_values)
                .map(|(v, s)| v / rms * s)
                .collect();
            let table = (row / HEADS) * rotary;
            for i in 0..HEAD_DIM {
                let (expected, magnitude) = if i < rotary {
                    let (c, s) = (cos_values[table + i], sin_values[table + i]);
                    let partner = if i < half { -n[i + half] } else { n[i - half] };
                    (
                        n[i] * c + partner * s,
                        (n[i] * c).abs() + (partner * s).abs(),
                    )
                } else {
                    (n[i], n[i].abs())
                };
                let actual = got[row * HEAD_DIM + i];
                let error = (actual - expected).abs();
                assert!(
                    error <= 67.0 * F32_U * magnitude,
                    "row {row}, channel {i}: got {actual}, expected {expected} (error {error:e})"
                );
            }
        }
    }
    Ok(())
}

#[test]
fn offset_rms_norm_rope_rejects_bad_arguments() -> Result<()> {
    let zeros = |dims: &[usize], dtype: DType| Tensor::zeros(dims, dtype, &Device::Cpu);
    let x = zeros(&[1, 2, 3, 8], DType::BF16)?;
    let scale = zeros(&[8], DType::F32)?;
    let cos = zeros(&[1, 2, 4], DType::BF16)?;
    let sin = cos.clone();
    let rope = |x: &Tensor, scale: &Tensor, cos: &Tensor, sin: &Tensor| {
        offset_rms_norm_rope(x, scale, EPS, cos, sin)
    };
    rope(&x, &scale, &cos, &sin)?;
    assert_rejects(
        rope(&x.flatten_to(1)?, &scale, &cos, &sin),
        "offset_rms_norm_rope",
        "x",
    );
    assert_rejects(
        rope(&zeros(&[1, 2, 3, 8], DType::U32)?, &scale, &cos, &sin),
        "offset_rms_norm_rope",
        "x",
    );
    assert_rejects(
        rope(
            &zeros(&[1, 2, 3, 0], DType::BF16)?,
            &zeros(&[0], DType::F32)?,
            &cos,
            &sin,
        ),
        "offset_rms_norm_rope",
        "x",
    );
    assert_rejects(
        rope(&x, &zeros(&[7], DType::F32)?, &cos, &sin),
        "offset_rms_norm_rope",
        "scale",
    );
    assert_rejects(
        rope(&x, &scale.to_dtype(DType::BF16)?, &cos, &sin),
        "offset_rms_norm_rope",
        "scale",
    );
    assert_rejects(
        rope(&x, &scale, &cos.flatten_to(1)?, &sin),
        "offset_rms_norm_rope",
        "cos",
    );
    for rotary in [0, 3, 10] {
        let table = zeros(&[1, 2, rotary], DType::BF16)?;
        assert_rejects(
            rope(&x, &scale, &table, &table),
            "offset_rms_norm_rope",
            "cos",
        );
    }
    assert_rejects(
        rope(&x, &scale, &zeros(&[1, 3, 4], DType::BF16)?, &sin),
        "offset_rms_norm_rope",
        "cos",
    );
    assert_rejects(
        rope(&x, &scale, &cos.to_dtype(DType::F32)?, &sin),
        "offset_rms_norm_rope",
        "cos",
    );
    assert_rejects(
        rope(&x, &scale, &cos, &zeros(&[1, 2, 6], DType::BF16)?),
        "offset_rms_norm_rope",
        "sin",
    );
    assert_rejects(
        rope(&x, &scale, &cos, &sin.to_dtype(DType::F16)?),
        "offset_rms_norm_rope",
        "sin",
    );
    Ok(())
}
