//! The q/k path of the gated full attention (spec 3.5 steps 2-3): the
//! `(1 + w)` RMSNorm of each head followed by the partial NeoX rotary
//! embedding, in one operation.

use candle_core::{Tensor, D};

use crate::norm::{cpu_offset_rms_norm, validate_offset_scale};
use crate::{ensure, expect_like, expect_positive, float_dims, Result};

const OP: &str = "offset_rms_norm_rope";

/// [`offset_rms_norm`](crate::offset_rms_norm) over the head dim of `x`,
/// then the partial NeoX rotation of the first `R` channels of each head by
/// its token's `cos`/`sin` (channel `i` pairs with `i + R/2`), the other
/// channels passing through:
///
/// ```text
/// n    = round(x / sqrt(mean(x^2) + eps) * scale)                 (x in f32)
/// y[i] = round(round(n[i] * cos[i]) + round(-n[i + R/2] * sin[i]))   i < R/2
/// y[i] = round(round(n[i] * cos[i]) + round(n[i - R/2] * sin[i]))    R/2 <= i < R
/// y[i] = n[i]                                                        i >= R
/// ```
///
/// where `round` rounds to the dtype of `x` and every product and sum is an
/// `f32` operation on the rounded operands: the rounding points of
/// PyTorch's `q_norm(q)` followed by `q * cos + rotate_half(q) * sin` in
/// that dtype.
///
/// * `x`: `[B, T, H, D]`, any layout; a view whose last dimension is
///   contiguous and whose rows of `D` lie at one stride (the query half of
///   the per-head interleaved `q_proj` output, `[B, T, H, 2D]` narrowed to
///   its first `D` channels) is read in place on CUDA, others are made
///   contiguous first.
/// * `scale`: `[D]`, `f32`, holding `1 + w` as for `offset_rms_norm`.
/// * `cos`, `sin`: `[B, T, R]` in the dtype of `x`, one row per token;
///   `R` is positive, even and at most `D`.
///
/// Returns a contiguous `[B, T, H, D]` in the dtype of `x`. On the CPU this
/// is the candle op sequence of `offset_rms_norm`, then `narrow`s, `neg`,
/// `cat`, two `broadcast_mul`s, the sum and the `cat` of the pass-through
/// channels, so results are those of that sequence bit for bit.
pub fn offset_rms_norm_rope(
    x: &Tensor,
    scale: &Tensor,
    eps: f64,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<Tensor> {
    let args = NormRopeArgs::validate(x, scale, eps, cos, sin)?;
    on_device!(OP, x.device(), args.cpu(), args.cuda())
}

/// The validated arguments of an [`offset_rms_norm_rope`] call: `x`
/// `[B, T, H, D]`, `scale` `f32` `[D]`, `cos` and `sin` `[B, T, rotary]` in
/// the dtype of `x`.
pub(crate) struct NormRopeArgs<'a> {
    pub x: &'a Tensor,
    pub scale: &'a Tensor,
    pub eps: f64,
    pub cos: &'a Tensor,
    pub sin: &'a Tensor,
    pub rotary: usize,
}

impl<'a> NormRopeArgs<'a> {
    /// Checks the arguments of an [`offset_rms_norm_rope`] call and reads its
    /// rotary width.
    fn validate(
        x: &'a Tensor,
        scale: &'a Tensor,
        eps: f64,
        cos: &'a Tensor,
        sin: &'a Tensor,
    ) -> Result<Self> {
        let [batch, seq_len, _, width] = float_dims::<4>(OP, "x", x)?;
        expect_positive(OP, "x", "the head dim (dim 3)", width)?;
        validate_offset_scale(OP, scale, width, x.device())?;
        let [_, _, rotary] = float_dims::<3>(OP, "cos", cos)?;
        ensure(
            rotary > 0 && rotary % 2 == 0 && rotary <= width,
            OP,
            "cos",
            || {
                format!(
                    "the rotary width (dim 2) is {rotary}; it must be positive, even and at most \
                 the head dim {width}"
                )
            },
        )?;
        for (arg, table) in [("cos", cos), ("sin", sin)] {
            expect_like(OP, arg, table, &[batch, seq_len, rotary], ("x", x))?;
        }
        Ok(Self {
            x,
            scale,
            eps,
            cos,
            sin,
            rotary,
        })
    }

    /// The CPU reference.
    fn cpu(&self) -> Result<Tensor> {
        let NormRopeArgs {
            cos, sin, rotary, ..
        } = *self;
        let normed = cpu_offset_rms_norm(self.x, self.scale, self.eps)?;
        let width = normed.dim(D::Minus1)?;
        let half = rotary / 2;
        let rotated = normed.narrow(D::Minus1, 0, rotary)?;
        let first = rotated.narrow(D::Minus1, 0, half)?;
        let second = rotated.narrow(D::Minus1, half, half)?;
        let rotate_half = Tensor::cat(&[&second.neg()?, &first], D::Minus1)?;
        let cos_term = rotated.broadcast_mul(&cos.unsqueeze(2)?)?;
        let sin_term = rotate_half.broadcast_mul(&sin.unsqueeze(2)?)?;
        let out = (cos_term + sin_term)?;
        if rotary == width {
            return Ok(out);
        }
        let pass = normed.narrow(D::Minus1, rotary, width - rotary)?;
        // candle concatenates non-contiguous views along the last dimension into
        // a transposed layout.
        Ok(Tensor::cat(&[&out, &pass], D::Minus1)?.contiguous()?)
    }
}
