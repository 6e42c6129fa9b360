//! Partial NeoX rotary embedding: the first `rotary_dim` channels of each head
//! rotate (channel j pairs with j + rotary_dim/2), the rest pass through.
//! As in transformers, `base_dim = int(head_dim * partial_rotary_factor)` sets
//! the frequencies `theta^(-2j/base_dim)` for `j < ceil(base_dim / 2)`, and the
//! rotated width is twice their count (so an odd `base_dim` rotates one more).

use candle_core::{DType, Device, Result, Tensor, D};

#[derive(Debug, Clone)]
pub struct PartialRotaryEmbedding {
    /// `theta^(-2j/rotary_dim)` for j in 0..rotary_dim/2, f32.
    inv_freq: Vec<f32>,
    rotary_dim: usize,
}

impl PartialRotaryEmbedding {
    pub fn new(theta: f64, base_dim: usize) -> PartialRotaryEmbedding {
        let inv_freq: Vec<f32> = (0..base_dim.div_ceil(2))
            .map(|j| {
                let exponent = (2 * j) as f32 / base_dim as f32;
                1.0 / (theta as f32).powf(exponent)
            })
            .collect();
        PartialRotaryEmbedding {
            rotary_dim: 2 * inv_freq.len(),
            inv_freq,
        }
    }

    /// cos and sin `[T, rotary_dim]` for the given absolute positions, in `dtype`.
    pub fn cos_sin(
        &self,
        positions: &[usize],
        dtype: DType,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let half = self.rotary_dim / 2;
        let mut angles = Vec::with_capacity(positions.len() * self.rotary_dim);
        for &position in positions {
            let row: Vec<f32> = self.inv_freq.iter().map(|f| position as f32 * f).collect();
            angles.extend_from_slice(&row);
            angles.extend_from_slice(&row);
        }
        let angles = Tensor::from_vec(angles, (positions.len(), 2 * half), device)?;
        Ok((
            angles.cos()?.to_dtype(dtype)?,
            angles.sin()?.to_dtype(dtype)?,
        ))
    }

    /// Rotates `x` `[B, T, heads, head_dim]` with cos/sin `[B, T, rotary_dim]`.
    pub fn apply(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let head_dim = x.dim(D::Minus1)?;
        let half = self.rotary_dim / 2;
        let rotated = x.narrow(D::Minus1, 0, self.rotary_dim)?;
        let first = rotated.narrow(D::Minus1, 0, half)?;
        let second = rotated.narrow(D::Minus1, half, half)?;
        let rotate_half = Tensor::cat(&[&second.neg()?, &first], D::Minus1)?;
        let cos = cos.unsqueeze(2)?;
        let sin = sin.unsqueeze(2)?;
        let out = (rotated.broadcast_mul(&cos)? + rotate_half.broadcast_mul(&sin)?)?;
        if self.rotary_dim == head_dim {
            Ok(out)
        } else {
            let pass = x.narrow(D::Minus1, self.rotary_dim, head_dim - self.rotary_dim)?;
            Tensor::cat(&[&out, &pass], D::Minus1)
        }
    }
}
