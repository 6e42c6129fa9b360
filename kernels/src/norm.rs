//! The RMSNorms of spec 3.1: the gated RMSNorm (norm before gate, SiLU
//! activation, `BerryLMRMSNormGated`) and the `(1 + w)` RMSNorm
//! (`BerryLMRMSNorm`).

use candle_core::{DType, Device, Tensor, D};

use crate::{
    expect_device, expect_dim, expect_float_dtype, expect_like, expect_on_device, expect_positive,
    expect_same_dtype, expect_shape, float_dims, invalid_argument, round_to_dtype, silu,
    tensor_from_f32, to_f32_vec, Result,
};

const OP: &str = "gated_rms_norm";
const OFFSET_OP: &str = "offset_rms_norm";

/// Normalises each row of `x`, scales it by `weight` and gates it with
/// `silu(z)`, rounding like the PyTorch reference:
///
/// ```text
/// x  = round(x)                              (the input in `dtype`)
/// n  = round(x / sqrt(mean(x^2) + eps))      (in f32)
/// wn = round(weight * n)
/// y  = round(wn * silu(z))                   (z in f32)
/// ```
///
/// where `round` rounds to `dtype`, the activations' dtype. The first
/// rounding is the reference's cast of the KDA recurrence's f32 output, done
/// here as the rows are read (nothing when `x` is already in `dtype`).
///
/// * `x`, `z`: `[N, D]` (for the KDA output norm, `D = dv`: one row per head).
/// * `weight`: `[D]`.
///
/// Returns `[N, D]` in `dtype`.
pub fn gated_rms_norm(
    x: &Tensor,
    z: &Tensor,
    weight: &Tensor,
    eps: f64,
    dtype: DType,
) -> Result<Tensor> {
    let args = GatedRmsNormArgs::validate(x, z, weight, eps, dtype)?;
    on_device!(OP, x.device(), args.cpu(), args.cuda())
}

/// The validated arguments of a [`gated_rms_norm`] call and its sizes: `x`
/// and `z` `[rows, width]`.
pub(crate) struct GatedRmsNormArgs<'a> {
    pub x: &'a Tensor,
    pub z: &'a Tensor,
    pub weight: &'a Tensor,
    pub eps: f64,
    pub dtype: DType,
    pub rows: usize,
    pub width: usize,
}

impl<'a> GatedRmsNormArgs<'a> {
    /// Checks the arguments of a [`gated_rms_norm`] call and reads its sizes.
    fn validate(
        x: &'a Tensor,
        z: &'a Tensor,
        weight: &'a Tensor,
        eps: f64,
        dtype: DType,
    ) -> Result<Self> {
        expect_float_dtype(OP, "dtype", dtype)?;
        let [rows, width] = float_dims::<2>(OP, "x", x)?;
        let z_dims = float_dims::<2>(OP, "z", z)?;
        let [weight_len] = float_dims::<1>(OP, "weight", weight)?;
        expect_positive(OP, "x", "row width (dim 1)", width)?;
        expect_shape(OP, "z", &z_dims, &[rows, width], "the shape of `x`")?;
        expect_dim(OP, "weight", "length", weight_len, width)?;
        expect_on_device(OP, x.device(), [("z", z), ("weight", weight)])?;
        Ok(Self {
            x,
            z,
            weight,
            eps,
            dtype,
            rows,
            width,
        })
    }

    /// The CPU reference.
    fn cpu(&self) -> Result<Tensor> {
        let (rows, width) = (self.rows, self.width);
        let dtype = self.dtype;
        let x = round_to_dtype(to_f32_vec(self.x)?, dtype)?;
        let z = to_f32_vec(self.z)?;
        let weight = to_f32_vec(self.weight)?;
        let eps = self.eps as f32;

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
}

/// Normalises `x` over its last dimension and scales it by `scale`, in `f32`
/// with one rounding at the end (spec 3.1, `BerryLMRMSNorm`):
///
/// ```text
/// y = round(x / sqrt(mean(x^2) + eps) * scale)      (x in f32)
/// ```
///
/// where `round` rounds to the dtype of `x`, and `scale` already holds
/// `1 + w` (the norm's weight `w` plus one, computed in `f32`).
///
/// * `x`: `[..., D]`, any rank from 1 (for the layer norms `D` is the hidden
///   size, for the q/k norms the head dim).
/// * `scale`: `[D]`, `f32`.
///
/// Returns a tensor of the shape and dtype of `x`. On the CPU this is the
/// candle op sequence `x.to(f32)`, `sqr`, `mean_keepdim`, `+ eps`, `sqrt`,
/// `broadcast_div`, `broadcast_mul(scale)`, `to(dtype)`, so results are those
/// of that sequence bit for bit.
pub fn offset_rms_norm(x: &Tensor, scale: &Tensor, eps: f64) -> Result<Tensor> {
    validate_offset_norm(x, scale)?;
    on_device!(
        OFFSET_OP,
        x.device(),
        cpu_offset_rms_norm(x, scale, eps),
        Ok(crate::cuda::offset_rms_norm(x, None, scale, eps)?.0),
    )
}

/// A residual add followed by [`offset_rms_norm`] of its result, in one
/// call: returns `(sum, offset_rms_norm(sum, scale, eps))` with
/// `sum = round(x + delta)` (in f32, rounded to the dtype of `x`, as
/// candle's and PyTorch's addition in that dtype).
///
/// * `x`, `delta`: the same shape and dtype (the residual stream and a
///   layer's output).
/// * `scale`: as for [`offset_rms_norm`].
pub fn add_offset_rms_norm(
    x: &Tensor,
    delta: &Tensor,
    scale: &Tensor,
    eps: f64,
) -> Result<(Tensor, Tensor)> {
    validate_offset_norm(x, scale)?;
    expect_like(OFFSET_OP, "delta", delta, x.dims(), ("x", x))?;
    on_device!(
        OFFSET_OP,
        x.device(),
        {
            let sum = (x + delta)?;
            let normed = cpu_offset_rms_norm(&sum, scale, eps)?;
            Ok((sum, normed))
        },
        {
            let (normed, sum) = crate::cuda::offset_rms_norm(x, Some(delta), scale, eps)?;
            let sum = sum.ok_or_else(|| {
                invalid_argument(OFFSET_OP, "delta", "the kernel returned no sum".to_string())
            })?;
            Ok((sum, normed))
        },
    )
}

const NORM_MATMUL_OP: &str = "add_offset_rms_norm_matmul";

/// [`add_offset_rms_norm`] followed by [`decode_matmul`](crate::decode_matmul)
/// of its normed rows, in one call: returns `(sum, normed, normed W^T)`, the
/// values of the two ops in turn.
///
/// * `x`, `delta`: `[N, D]` of one dtype (the residual stream and a layer's
///   output).
/// * `scale`: `1 + w`, `f32` `[D]`.
/// * `weight`: `[out, D]` in the dtype of `x`.
///
/// On CUDA one kernel does all three for a decode step (up to 8 rows, `D`
/// a multiple of 8 up to 2048, within 48 KiB of normed rows): each block
/// issues its first weight loads before it norms the rows, so the norm
/// costs no launch of its own; other sizes run the two ops.
pub fn add_offset_rms_norm_matmul(
    x: &Tensor,
    delta: &Tensor,
    scale: &Tensor,
    eps: f64,
    weight: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    let [_, width] = float_dims::<2>(NORM_MATMUL_OP, "x", x)?;
    let [_, weight_width] = float_dims::<2>(NORM_MATMUL_OP, "weight", weight)?;
    expect_dim(
        NORM_MATMUL_OP,
        "weight",
        "width (dim 1)",
        weight_width,
        width,
    )?;
    expect_same_dtype(
        NORM_MATMUL_OP,
        "weight",
        weight,
        x.dtype(),
        "the dtype of `x`",
    )?;
    expect_device(NORM_MATMUL_OP, "weight", weight, x.device())?;
    validate_offset_norm(x, scale)?;
    expect_like(OFFSET_OP, "delta", delta, x.dims(), ("x", x))?;
    let separate = || -> Result<(Tensor, Tensor, Tensor)> {
        let (sum, normed) = add_offset_rms_norm(x, delta, scale, eps)?;
        let y = crate::decode_matmul(&normed, weight)?;
        Ok((sum, normed, y))
    };
    on_device!(NORM_MATMUL_OP, x.device(), separate(), {
        match crate::cuda::add_offset_rms_norm_matmul(x, delta, scale, eps, weight)? {
            Some(outputs) => Ok(outputs),
            None => separate(),
        }
    })
}

/// Validates `offset_rms_norm`'s `x` (rank at least 1, a positive last
/// dimension) and `scale`.
fn validate_offset_norm(x: &Tensor, scale: &Tensor) -> Result<()> {
    expect_float_dtype(OFFSET_OP, "x", x.dtype())?;
    let Some(&width) = x.dims().last() else {
        return Err(invalid_argument(
            OFFSET_OP,
            "x",
            "expected at least one dimension, got a scalar".to_string(),
        ));
    };
    expect_positive(OFFSET_OP, "x", "the last dimension", width)?;
    validate_offset_scale(OFFSET_OP, scale, width, x.device())
}

/// Validates the `scale` of a `(1 + w)` RMSNorm of `op` over rows of
/// `width`: `f32` `[width]` on `device`.
pub(crate) fn validate_offset_scale(
    op: &'static str,
    scale: &Tensor,
    width: usize,
    device: &Device,
) -> Result<()> {
    let [scale_len] = float_dims::<1>(op, "scale", scale)?;
    if scale.dtype() != DType::F32 {
        return Err(invalid_argument(
            op,
            "scale",
            format!(
                "dtype {:?} is not supported (expected f32: `1 + w` is kept in f32)",
                scale.dtype()
            ),
        ));
    }
    expect_dim(op, "scale", "length", scale_len, width)?;
    expect_device(op, "scale", scale, device)
}

/// The CPU `offset_rms_norm` (candle's op sequence, for any layout of `x`),
/// also the first step of the CPU `offset_rms_norm_rope`.
pub(crate) fn cpu_offset_rms_norm(x: &Tensor, scale: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let mean_square = x.sqr()?.mean_keepdim(D::Minus1)?;
    let normed = x.broadcast_div(&(mean_square + eps)?.sqrt()?)?;
    Ok(normed.broadcast_mul(scale)?.to_dtype(dtype)?)
}
