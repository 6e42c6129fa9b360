use berrylm_kernels::{
    add_offset_rms_norm, add_offset_rms_norm_matmul, gated_rms_norm, offset_rms_norm, Result,
};
use candle_core::{DType, Tensor, D};

use crate::common::{
    assert_close, assert_identical, assert_rejects, f32_values, f64_values, silu, tensor, Rng,
};

const ROWS: usize = 6;
const WIDTH: usize = 24;
const EPS: f64 = 1e-6;

fn inputs(seed: u64) -> Result<(Tensor, Tensor, Tensor)> {
    let mut rng = Rng::new(seed);
    let x = tensor(rng.uniform_vec(ROWS * WIDTH, -3.0, 3.0), &[ROWS, WIDTH])?;
    let z = tensor(rng.uniform_vec(ROWS * WIDTH, -4.0, 4.0), &[ROWS, WIDTH])?;
    let weight = tensor(rng.uniform_vec(WIDTH, 0.5, 1.5), &[WIDTH])?;
    Ok((x, z, weight))
}

/// [`inputs`] of `seed`, converted to `dtype`.
fn inputs_in(seed: u64, dtype: DType) -> Result<(Tensor, Tensor, Tensor)> {
    let (x, z, weight) = inputs(seed)?;
    Ok((
        x.to_dtype(dtype)?,
        z.to_dtype(dtype)?,
        weight.to_dtype(dtype)?,
    ))
}

fn reference(x: &Tensor, z: &Tensor, weight: &Tensor) -> Result<Vec<f64>> {
    let x = f64_values(x)?;
    let z = f64_values(z)?;
    let weight = f64_values(weight)?;
    let mut result = Vec::new();
    for r in 0..ROWS {
        let row = &x[r * WIDTH..(r + 1) * WIDTH];
        let rms = (row.iter().map(|v| v * v).sum::<f64>() / WIDTH as f64 + EPS).sqrt();
        for c in 0..WIDTH {
            result.push(weight[c] * row[c] / rms * silu(z[r * WIDTH + c]));
        }
    }
    Ok(result)
}

/// `gated_rms_norm` of `(x, z, weight)`, compared with the f64 reference
/// ([`assert_close`] with `atol`, `rtol`).
fn reference_check(inputs: (Tensor, Tensor, Tensor), atol: f64, rtol: f64) -> Result<Tensor> {
    let (x, z, weight) = inputs;
    let y = gated_rms_norm(&x, &z, &weight, EPS, x.dtype())?;
    assert_close(&f32_values(&y)?, &reference(&x, &z, &weight)?, atol, rtol);
    Ok(y)
}

#[test]
fn f32_matches_f64_reference() -> Result<()> {
    let y = reference_check(inputs(1)?, 1e-6, 1e-5)?;
    assert_eq!(y.dims(), &[ROWS, WIDTH]);
    assert_eq!(y.dtype(), DType::F32);
    Ok(())
}

#[test]
fn half_precision_is_within_tolerance_of_f64_reference() -> Result<()> {
    for dtype in [DType::BF16, DType::F16] {
        let y = reference_check(inputs_in(2, dtype)?, 1e-2, 2e-2)?;
        assert_eq!(y.dtype(), dtype);
    }
    Ok(())
}

/// An f32 `x` is rounded to the output dtype before the norm: the same
/// result as candle's conversion of it first.
#[test]
fn an_f32_input_is_rounded_to_the_dtype_first() -> Result<()> {
    for dtype in [DType::BF16, DType::F16] {
        let (x, z, weight) = inputs_in(4, DType::F32)?;
        let (z, weight) = (z.to_dtype(dtype)?, weight.to_dtype(dtype)?);
        let expected = gated_rms_norm(&x.to_dtype(dtype)?, &z, &weight, EPS, dtype)?;
        let y = gated_rms_norm(&x, &z, &weight, EPS, dtype)?;
        assert_eq!(y.dtype(), dtype);
        assert_identical(&y, &expected)?;
    }
    Ok(())
}

/// The PyTorch chain, op by op with candle tensors:
/// `n = (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(dtype)`, `wn = w * n` in
/// `dtype`, `y = (wn_f32 * silu(z_f32)).to(dtype)`.
#[test]
fn half_precision_rounds_like_the_reference_chain() -> Result<()> {
    for dtype in [DType::BF16, DType::F16] {
        let (x, z, weight) = inputs_in(3, dtype)?;
        let x_f32 = x.to_dtype(DType::F32)?;
        let inv_rms = (x_f32.sqr()?.mean_keepdim(D::Minus1)? + EPS)?
            .sqrt()?
            .recip()?;
        let normalized = x_f32.broadcast_mul(&inv_rms)?.to_dtype(dtype)?;
        let scaled = normalized.broadcast_mul(&weight)?;
        let gate = z.to_dtype(DType::F32)?.silu()?;
        let expected = scaled.to_dtype(DType::F32)?.mul(&gate)?.to_dtype(dtype)?;
        assert_identical(&gated_rms_norm(&x, &z, &weight, EPS, dtype)?, &expected)?;
    }
    Ok(())
}

// --------------------------------------------------------- offset_rms_norm

/// `f32`'s unit roundoff, 2^-24.
const F32_U: f64 = 1.0 / 16_777_216.0;

/// Rows whose mean square has an exact root: `[3, 4, 0, 0]` (mean square
/// 25/4, root 5/2) and `[2, 2, 2, 2]` (mean square 4, root 2 without eps, 4
/// with eps = 12).
#[test]
fn offset_rms_norm_hand_computed_examples() -> Result<()> {
    let x = tensor(vec![3.0, 4.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0], &[2, 4])?;
    let scale = tensor(vec![1.0, 2.0, 0.5, 1.5], &[4])?;
    let y = offset_rms_norm(&x, &scale, 0.0)?;
    assert_eq!(y.dims(), &[2, 4]);
    assert_eq!(y.dtype(), DType::F32);
    let expected = [3.0 / 2.5, 4.0 / 2.5 * 2.0, 0.0, 0.0, 1.0, 2.0, 0.5, 1.5];
    // x / 2.5 and the product round once each: within one ulp (2u).
    assert_close(&f32_values(&y)?, &expected, 0.0, 2.0 * F32_U);
    let y = offset_rms_norm(&x.narrow(0, 1, 1)?, &scale, 12.0)?;
    assert_eq!(f32_values(&y)?, vec![0.5, 1.0, 0.25, 0.75]);
    Ok(())
}

/// `x[..., c] * scale[c] / sqrt(mean(x^2) + eps)` in `f64`, over the last
/// dimension of `x`.
fn offset_reference(x: &Tensor, scale: &Tensor, eps: f64) -> Result<Vec<f64>> {
    let width = x.dims()[x.rank() - 1];
    let scale = f64_values(scale)?;
    let mut result = Vec::new();
    for row in f64_values(x)?.chunks(width) {
        let rms = (row.iter().map(|v| v * v).sum::<f64>() / width as f64 + eps).sqrt();
        result.extend(row.iter().zip(&scale).map(|(v, s)| v / rms * s));
    }
    Ok(result)
}

#[test]
fn offset_rms_norm_matches_f64_reference() -> Result<()> {
    let mut rng = Rng::new(11);
    let x = tensor(rng.uniform_vec(2 * 3 * 40, -3.0, 3.0), &[2, 3, 40])?;
    let scale = tensor(rng.uniform_vec(40, 0.5, 1.5), &[40])?;
    let expected = offset_reference(&x, &scale, EPS)?;
    let y = offset_rms_norm(&x, &scale, EPS)?;
    assert_eq!(y.dims(), &[2, 3, 40]);
    // A sum of 40 squares, the root, a division and a product in f32.
    assert_close(&f32_values(&y)?, &expected, 0.0, 64.0 * F32_U);
    // Half precision: the f32 value rounded once, to within half a step
    // (2^-8 of the value for bf16's 8 significant bits, 2^-11 for f16's 11,
    // plus half of f16's smallest subnormal step 2^-24 near zero); inputs
    // rounded first.
    for (dtype, half_step) in [(DType::BF16, 1.0 / 256.0), (DType::F16, 1.0 / 2048.0)] {
        let x = x.to_dtype(dtype)?;
        let y = offset_rms_norm(&x, &scale, EPS)?;
        assert_eq!(y.dtype(), dtype);
        let expected = offset_reference(&x, &scale, EPS)?;
        assert_close(
            &f32_values(&y)?,
            &expected,
            F32_U / 2.0,
            half_step + 64.0 * F32_U,
        );
    }
    // Rank 1.
    let row = x.narrow(0, 0, 1)?.narrow(1, 0, 1)?.flatten_all()?;
    let y = offset_rms_norm(&row, &scale, EPS)?;
    assert_eq!(y.dims(), &[40]);
    assert_close(
        &f32_values(&y)?,
        &offset_reference(&row, &scale, EPS)?,
        0.0,
        64.0 * F32_U,
    );
    Ok(())
}

/// The plugin's `OffsetRmsNorm::forward`, op by op with candle tensors: the
/// CPU result must be this composition bit for bit, for every dtype and for
/// strided inputs.
#[test]
fn offset_rms_norm_is_the_candle_op_composition() -> Result<()> {
    let mut rng = Rng::new(12);
    let scale = tensor(rng.uniform_vec(40, 0.5, 1.5), &[40])?;
    // [3, 2, 40] transposed to a non-contiguous [2, 3, 40].
    let base = tensor(rng.uniform_vec(3 * 2 * 40, -3.0, 3.0), &[3, 2, 40])?;
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        for x in [
            base.to_dtype(dtype)?,
            base.to_dtype(dtype)?.transpose(0, 1)?,
        ] {
            let x_f32 = x.to_dtype(DType::F32)?;
            let mean_square = x_f32.sqr()?.mean_keepdim(D::Minus1)?;
            let normed = x_f32.broadcast_div(&(mean_square + 1e-6)?.sqrt()?)?;
            let expected = normed.broadcast_mul(&scale)?.to_dtype(dtype)?;
            assert_identical(&offset_rms_norm(&x, &scale, 1e-6)?, &expected)?;
        }
    }
    Ok(())
}

/// The sum is `x + delta` rounded once to the dtype (checked against f64
/// values rounded by candle's conversion), and the normed rows are the sum's
/// `(1 + w)` norm (f64 reference).
#[test]
fn add_offset_rms_norm_returns_the_sum_and_its_norm() -> Result<()> {
    let mut rng = Rng::new(21);
    let x = tensor(rng.uniform_vec(3 * 40, -3.0, 3.0), &[3, 40])?;
    let delta = tensor(rng.uniform_vec(3 * 40, -1.0, 1.0), &[3, 40])?;
    let scale = tensor(rng.uniform_vec(40, 0.5, 1.5), &[40])?;
    for dtype in [DType::F32, DType::BF16] {
        let (x, delta) = (x.to_dtype(dtype)?, delta.to_dtype(dtype)?);
        let (sum, normed) = add_offset_rms_norm(&x, &delta, &scale, EPS)?;
        let exact: Vec<f32> = f64_values(&x)?
            .iter()
            .zip(f64_values(&delta)?)
            .map(|(a, b)| (a + b) as f32)
            .collect();
        let rounded = tensor(exact, &[3, 40])?.to_dtype(dtype)?;
        assert_identical(&sum, &rounded)?;
        let tolerance = if dtype == DType::F32 {
            64.0 * F32_U
        } else {
            1.0 / 256.0
        };
        assert_close(
            &f32_values(&normed)?,
            &offset_reference(&sum, &scale, EPS)?,
            0.0,
            tolerance,
        );
    }
    assert_rejects(
        add_offset_rms_norm(&x, &delta.narrow(1, 0, 39)?, &scale, EPS),
        "offset_rms_norm",
        "delta",
    );
    Ok(())
}

/// The fused decode-step projection after the residual norm: the sum and
/// normed rows as above, and the projection of the normed rows (f64
/// products of the values returned, rounded once to the dtype).
#[test]
fn add_offset_rms_norm_matmul_projects_the_normed_rows() -> Result<()> {
    let mut rng = Rng::new(22);
    let x = tensor(rng.uniform_vec(3 * 40, -3.0, 3.0), &[3, 40])?;
    let delta = tensor(rng.uniform_vec(3 * 40, -1.0, 1.0), &[3, 40])?;
    let scale = tensor(rng.uniform_vec(40, 0.5, 1.5), &[40])?;
    let weight = tensor(rng.uniform_vec(5 * 40, -0.5, 0.5), &[5, 40])?;
    for (dtype, step) in [(DType::F32, 64.0 * F32_U), (DType::BF16, 1.0 / 256.0)] {
        let (x, delta, weight) = (
            x.to_dtype(dtype)?,
            delta.to_dtype(dtype)?,
            weight.to_dtype(dtype)?,
        );
        let (sum, normed, y) = add_offset_rms_norm_matmul(&x, &delta, &scale, EPS, &weight)?;
        let (expected_sum, _) = add_offset_rms_norm(&x, &delta, &scale, EPS)?;
        assert_identical(&sum, &expected_sum)?;
        assert_close(
            &f32_values(&normed)?,
            &offset_reference(&sum, &scale, EPS)?,
            0.0,
            step,
        );
        assert_eq!((y.dims(), y.dtype()), (&[3, 5][..], dtype));
        let (normed, weight) = (f64_values(&normed)?, f64_values(&weight)?);
        let expected: Vec<f64> = normed
            .chunks(40)
            .flat_map(|row| {
                weight
                    .chunks(40)
                    .map(|w| row.iter().zip(w).map(|(a, b)| a * b).sum::<f64>())
                    .collect::<Vec<_>>()
            })
            .collect();
        assert_close(&f32_values(&y)?, &expected, 1e-5, step);
    }
    Ok(())
}
