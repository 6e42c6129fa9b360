//! Partial NeoX rotary embedding: the first `rotary_dim` channels of each head
//! rotate (channel j pairs with j + rotary_dim/2), the rest pass through.
//! As in transformers, `base_dim = int(head_dim * partial_rotary_factor)` sets
//! the frequencies `theta^(-2j/base_dim)` for `j < ceil(base_dim / 2)`, and the
//! rotated width is twice their count (so an odd `base_dim` rotates one more).
//! This module builds the cos/sin tables; the rotation itself is fused with
//! the q/k norms (`OffsetRmsNorm::forward_rope`).

use candle_core::{DType, Device, Result, Tensor};
use rayon::prelude::*;

/// The most positions the tables hold (256 MiB in bf16 at a rotary width of
/// 64), so that a configuration's `max_position_embeddings` cannot make them
/// unbounded; later positions are computed per forward.
pub const MAX_TABLE_POSITIONS: usize = 1 << 20;

#[derive(Debug, Clone)]
pub struct PartialRotaryEmbedding {
    /// `theta^(-2j/rotary_dim)` for j in 0..rotary_dim/2, f32.
    inv_freq: Vec<f32>,
    /// cos and sin of every position below the model's
    /// `max_position_embeddings` (at most [`MAX_TABLE_POSITIONS`]),
    /// `[2, positions, rotary_dim]` on the model's
    /// device and in its dtype: a forward gathers its rows instead of
    /// computing them on the host (two million values for a 16384-token
    /// prompt) and uploading them.
    tables: Tensor,
}

impl PartialRotaryEmbedding {
    /// The embedding for `theta` and `base_dim`, its tables computed for
    /// positions `0..positions` (at most [`MAX_TABLE_POSITIONS`]) in `dtype`
    /// on `device`.
    pub fn new(
        theta: f64,
        base_dim: usize,
        positions: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<PartialRotaryEmbedding> {
        let inv_freq: Vec<f32> = (0..base_dim.div_ceil(2))
            .map(|j| {
                let exponent = (2 * j) as f32 / base_dim as f32;
                1.0 / (theta as f32).powf(exponent)
            })
            .collect();
        let all: Vec<usize> = (0..positions.min(MAX_TABLE_POSITIONS)).collect();
        let tables = host_tables(&inv_freq, &all, dtype, device)?;
        Ok(PartialRotaryEmbedding { inv_freq, tables })
    }

    /// Bytes of the tables [`PartialRotaryEmbedding::new`] keeps for
    /// `base_dim` and `positions` in `dtype`.
    pub fn table_bytes(base_dim: usize, positions: usize, dtype: DType) -> usize {
        2 * positions.min(MAX_TABLE_POSITIONS) * 2 * base_dim.div_ceil(2) * dtype.size_in_bytes()
    }

    /// cos and sin `[T, rotary_dim]` for the given absolute positions, in `dtype`.
    ///
    /// The angles `position * inv_freq` and their cos and sin are those candle's
    /// CPU `cos`/`sin` compute in f32, rounded once to `dtype`: rows of the
    /// tables, or computed on the host and uploaded for positions past them.
    pub fn cos_sin(
        &self,
        positions: &[usize],
        dtype: DType,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let table_positions = self.tables.dim(1)?;
        let in_tables = positions.iter().all(|&p| p < table_positions);
        let tables = if in_tables && dtype == self.tables.dtype() {
            let rows: Vec<u32> = positions.iter().map(|&p| p as u32).collect();
            let rows = Tensor::from_vec(rows, positions.len(), device)?;
            self.tables.index_select(&rows, 1)?
        } else {
            host_tables(&self.inv_freq, positions, dtype, device)?
        };
        Ok((tables.get(0)?, tables.get(1)?))
    }
}

/// `[2, positions, rotary_dim]`: cos then sin of `position * inv_freq`, each
/// frequency serving channel j and its partner j + rotary_dim/2; computed in
/// f32 on the host and converted to `dtype` on `device`.
fn host_tables(
    inv_freq: &[f32],
    positions: &[usize],
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let rotary_dim = 2 * inv_freq.len();
    let mut values = vec![0f32; 2 * positions.len() * rotary_dim];
    let (cos, sin) = values.split_at_mut(positions.len() * rotary_dim);
    for (out, function) in [(cos, f32::cos as fn(f32) -> f32), (sin, f32::sin)] {
        out.par_chunks_mut(rotary_dim)
            .zip(positions.par_iter())
            .for_each(|(row, &position)| {
                let (first, second) = row.split_at_mut(inv_freq.len());
                for ((a, b), f) in first.iter_mut().zip(second.iter_mut()).zip(inv_freq) {
                    *a = function(position as f32 * f);
                    *b = *a;
                }
            });
    }
    Tensor::from_vec(values, (2, positions.len(), rotary_dim), device)?.to_dtype(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bytes the loader reports for the tables are those they take, an
    /// odd base width rotating one more channel.
    #[test]
    fn table_bytes_are_the_tables_size() {
        for (base_dim, positions, dtype) in [(8, 6, DType::F32), (3, 5, DType::BF16)] {
            let rope =
                PartialRotaryEmbedding::new(10_000.0, base_dim, positions, dtype, &Device::Cpu)
                    .unwrap();
            assert_eq!(
                PartialRotaryEmbedding::table_bytes(base_dim, positions, dtype),
                rope.tables.elem_count() * dtype.size_in_bytes()
            );
        }
    }

    /// Rows gathered from the tables and rows computed past them are both
    /// std's f32 cos/sin of `position * inv_freq[j]`, with transformers'
    /// `inv_freq = 1 / theta^(2j / base_dim)`, each frequency on channel j and
    /// j + rotary_dim/2.
    #[test]
    fn rows_inside_and_past_the_tables_are_the_angles_cos_and_sin() {
        let rope = PartialRotaryEmbedding::new(10_000.0, 8, 6, DType::F32, &Device::Cpu).unwrap();
        let positions = [5, 0, 7, 2];
        let (cos, sin) = rope.cos_sin(&positions, DType::F32, &Device::Cpu).unwrap();
        let (cos, sin) = (cos.to_vec2::<f32>().unwrap(), sin.to_vec2::<f32>().unwrap());
        for (row, &position) in positions.iter().enumerate() {
            for j in 0..4 {
                let inv_freq = 1.0 / 10_000f32.powf(2.0 * j as f32 / 8.0);
                let angle = position as f32 * inv_freq;
                for channel in [j, j + 4] {
                    assert_eq!(cos[row][channel], angle.cos(), "cos {position} {channel}");
                    assert_eq!(sin[row][channel], angle.sin(), "sin {position} {channel}");
                }
            }
        }
    }
}
