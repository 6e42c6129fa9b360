use berrylm_kernels::{gated_rms_norm, Result};
use candle_core::{DType, Tensor, D};

use crate::common::{assert_close, assert_identical, f32_values, f64_values, silu, tensor, Rng};

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

#[test]
fn f32_matches_f64_reference() -> Result<()> {
    let (x, z, weight) = inputs(1)?;
    let y = gated_rms_norm(&x, &z, &weight, EPS)?;
    assert_eq!(y.dims(), &[ROWS, WIDTH]);
    assert_eq!(y.dtype(), DType::F32);
    assert_close(&f32_values(&y)?, &reference(&x, &z, &weight)?, 1e-6, 1e-5);
    Ok(())
}

#[test]
fn half_precision_is_within_tolerance_of_f64_reference() -> Result<()> {
    let (x, z, weight) = inputs(2)?;
    for dtype in [DType::BF16, DType::F16] {
        let (x, z, weight) = (
            x.to_dtype(dtype)?,
            z.to_dtype(dtype)?,
            weight.to_dtype(dtype)?,
        );
        let y = gated_rms_norm(&x, &z, &weight, EPS)?;
        assert_eq!(y.dtype(), dtype);
        assert_close(&f32_values(&y)?, &reference(&x, &z, &weight)?, 1e-2, 2e-2);
    }
    Ok(())
}

/// The PyTorch chain, op by op with candle tensors:
/// `n = (x_f32 * rsqrt(mean(x_f32^2) + eps)).to(dtype)`, `wn = w * n` in
/// `dtype`, `y = (wn_f32 * silu(z_f32)).to(dtype)`.
#[test]
fn half_precision_rounds_like_the_reference_chain() -> Result<()> {
    let (x, z, weight) = inputs(3)?;
    for dtype in [DType::BF16, DType::F16] {
        let (x, z, weight) = (
            x.to_dtype(dtype)?,
            z.to_dtype(dtype)?,
            weight.to_dtype(dtype)?,
        );
        let x_f32 = x.to_dtype(DType::F32)?;
        let inv_rms = (x_f32.sqr()?.mean_keepdim(D::Minus1)? + EPS)?
            .sqrt()?
            .recip()?;
        let normalized = x_f32.broadcast_mul(&inv_rms)?.to_dtype(dtype)?;
        let scaled = normalized.broadcast_mul(&weight)?;
        let gate = z.to_dtype(DType::F32)?.silu()?;
        let expected = scaled.to_dtype(DType::F32)?.mul(&gate)?.to_dtype(dtype)?;
        assert_identical(&gated_rms_norm(&x, &z, &weight, EPS)?, &expected)?;
    }
    Ok(())
}
