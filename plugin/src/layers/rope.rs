//! Partial NeoX rotary embedding: the first `rotary_dim` channels of each head
//! rotate (channel j pairs with j + rotary_dim/2), the rest pass through.
//! As in transformers, `base_dim = int(head_dim * partial_rotary_factor)` sets
//! the frequencies `theta^(-2j/base_dim)` for `j < ceil(base_dim / 2)`, and the
//! rotated width is twice their count (so an odd `base_dim` rotates one more).
//! This module builds the cos/sin tables; the rotation itself is fused with
//! the q/k norms (`OffsetRmsNorm::forward_rope`).

use candle_core::{DType, Device, Result, Tensor};

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
    ///
    /// The angles `position * inv_freq` and their cos and sin are computed on
    /// the host in f32 (what candle's CPU `cos`/`sin` compute), and both tables
    /// reach the device in one upload and one dtype conversion.
    pub fn cos_sin(
        &self,
        positions: &[usize],
        dtype: DType,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let mut values = Vec::with_capacity(2 * positions.len() * self.rotary_dim);
        for table in [f32::cos, f32::sin] {
            for &position in positions {
                // Each frequency serves channel j and its partner j + half.
                for _ in 0..2 {
                    values.extend(self.inv_freq.iter().map(|f| table(position as f32 * f)));
                }
            }
        }
        let tables = Tensor::from_vec(values, (2, positions.len(), self.rotary_dim), device)?
            .to_dtype(dtype)?;
        Ok((tables.get(0)?, tables.get(1)?))
    }
}
