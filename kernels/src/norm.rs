//! Gated RMSNorm, norm before gate, SiLU activation (spec 3.1,
//! `BerryLMRMSNormGated`).

use candle_core::{Device, Tensor};

use crate::{
    expect_device, expect_dim, float_dims, invalid_argument, round_to_dtype, silu, tensor_from_f32,
    to_f32_vec, unsupported_device, Result,
};

const OP: &str = "gated_rms_norm";

/// Normalises each row of `x`, scales it by `weight` and gates it with
/// `silu(z)`, rounding like the PyTorch reference:
///
/// ```text
/// n  = round(x / sqrt(mean(x^2) + eps))      (in f32)
/// wn = round(weight * n)
/// y  = round(wn * silu(z))                   (z in f32)
/// ```
///
/// where `round` rounds to the dtype of `x`.
///
/// * `x`, `z`: `[N, D]` (for the KDA output norm, `D = dv`: one row per head).
/// * `weight`: `[D]`.
///
/// Returns `[N, D]` in the dtype of `x`.
pub fn gated_rms_norm(x: &Tensor, z: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let [rows, width] = float_dims::<2>(OP, "x", x)?;
    let z_dims = float_dims::<2>(OP, "z", z)?;
    let [weight_len] = float_dims::<1>(OP, "weight", weight)?;
    if width == 0 {
        return Err(invalid_argument(
            OP,
            "x",
            "row width (dim 1) must be positive".to_string(),
        ));
    }
    if z_dims != [rows, width] {
        return Err(invalid_argument(
            OP,
            "z",
            format!(
                "shape {z_dims:?} differs from the shape of `x` {:?}",
                [rows, width]
            ),
        ));
    }
    expect_dim(OP, "weight", "length", weight_len, width)?;
    let device = x.device();
    expect_device(OP, "z", z, device)?;
    expect_device(OP, "weight", weight, device)?;
    match device {
        Device::Cpu => cpu_gated_rms_norm(x, z, weight, eps, rows, width),
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => crate::cuda::gated_rms_norm(x, z, weight, eps, rows, width),
        other => Err(unsupported_device(OP, other)),
    }
}

fn cpu_gated_rms_norm(
    x: &Tensor,
    z: &Tensor,
    weight: &Tensor,
    eps: f64,
    rows: usize,
    width: usize,
) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = to_f32_vec(x)?;
    let z = to_f32_vec(z)?;
    let weight = to_f32_vec(weight)?;
    let eps = eps as f32;

    let mut normalized = Vec::with_capacity(x.len());
    for row in x.chunks_exact(width) {
        let mean_square = row.iter().map(|&value| value * value).sum::<f32>() / width as f32;
        let inv_rms = 1.0 / (mean_square + eps).sqrt();
        normalized.extend(row.iter().map(|&value| value * inv_rms));
    }
    let scaled = round_to_dtype(normalized, dtype)?
        .into_iter()
        .zip(weight.iter().cycle())
        .map(|(normalized, &weight)| weight * normalized)
        .collect();
    let gated = round_to_dtype(scaled, dtype)?
        .into_iter()
        .zip(&z)
        .map(|(scaled, &gate)| scaled * silu(gate))
        .collect();
    tensor_from_f32(gated, &[rows, width], dtype)
}
