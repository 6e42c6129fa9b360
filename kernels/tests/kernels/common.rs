//! Helpers shared by the kernel tests.

use berrylm_kernels::{KernelError, Result, PAD_SLOT};
use candle_core::{DType, Device, Tensor};

/// A small deterministic PRNG (SplitMix64).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut mixed = self.0;
        mixed = (mixed ^ (mixed >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        mixed = (mixed ^ (mixed >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        mixed ^ (mixed >> 31)
    }

    /// A value drawn uniformly from `[low, high)`.
    pub fn uniform(&mut self, low: f32, high: f32) -> f32 {
        let unit = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        low + (high - low) * unit
    }

    /// `len` values drawn uniformly from `[low, high)`.
    pub fn uniform_vec(&mut self, len: usize, low: f32, high: f32) -> Vec<f32> {
        (0..len).map(|_| self.uniform(low, high)).collect()
    }
}

/// A CPU `f32` tensor of the given shape.
pub fn tensor(values: Vec<f32>, dims: &[usize]) -> Result<Tensor> {
    Ok(Tensor::from_vec(values, dims, &Device::Cpu)?)
}

/// The values of `tensor` as `f32`, in row-major order.
pub fn f32_values(tensor: &Tensor) -> Result<Vec<f32>> {
    Ok(tensor
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?)
}

/// The values of `tensor` as `f64`, in row-major order.
pub fn f64_values(tensor: &Tensor) -> Result<Vec<f64>> {
    Ok(f32_values(tensor)?.into_iter().map(f64::from).collect())
}

/// Asserts `|actual - expected| <= atol + rtol * |expected|` element-wise.
pub fn assert_close(actual: &[f32], expected: &[f64], atol: f64, rtol: f64) {
    assert_eq!(actual.len(), expected.len(), "element counts differ");
    for (index, (&got, &want)) in actual.iter().zip(expected).enumerate() {
        let error = (f64::from(got) - want).abs();
        assert!(
            error <= atol + rtol * want.abs(),
            "element {index}: got {got}, expected {want} (error {error:e})"
        );
    }
}

/// Asserts that two tensors have the same shape, dtype and values.
pub fn assert_identical(actual: &Tensor, expected: &Tensor) -> Result<()> {
    assert_eq!(actual.dims(), expected.dims(), "shapes differ");
    assert_eq!(actual.dtype(), expected.dtype(), "dtypes differ");
    assert_eq!(f32_values(actual)?, f32_values(expected)?, "values differ");
    Ok(())
}

/// Asserts that `result` is an invalid-argument error of `op` naming `arg`.
pub fn assert_rejects<T: std::fmt::Debug>(result: Result<T>, op: &str, arg: &str) {
    match result {
        Err(KernelError::InvalidArgument {
            op: error_op,
            arg: error_arg,
            reason,
        }) => {
            assert_eq!((error_op, error_arg), (op, arg), "reason: {reason}");
        }
        other => panic!("expected {op} to reject `{arg}`, got {other:?}"),
    }
}

/// `x * sigmoid(x)` in `f64`.
pub fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// Rows `slots` of a state pool, in that order, on the pool's device; a zero
/// row for a [`PAD_SLOT`] (the state a pad row starts from).
pub fn pool_rows(pool: &Tensor, slots: &[u32]) -> Result<Tensor> {
    if !slots.contains(&PAD_SLOT) {
        return Ok(pool.index_select(&Tensor::new(slots, pool.device())?, 0)?);
    }
    let zero = pool.narrow(0, 0, 1)?.zeros_like()?;
    let rows = slots
        .iter()
        .map(|&slot| match slot {
            PAD_SLOT => Ok(zero.clone()),
            slot => pool.narrow(0, slot as usize, 1),
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(Tensor::cat(&rows, 0)?)
}

/// A CPU tensor of `dtype` with uniform values in `[low, high)`.
pub fn random(rng: &mut Rng, dims: &[usize], low: f32, high: f32, dtype: DType) -> Result<Tensor> {
    let len: usize = dims.iter().product();
    Ok(tensor(rng.uniform_vec(len, low, high), dims)?.to_dtype(dtype)?)
}

/// A paged KV cache holding the keys and values of a batch of sequences, in
/// the host's layout (`berrylm_kernels::PagedKv`), built element by element
/// from that layout's definition.
pub struct PagedCache {
    /// `[blocks, kv_heads, D / X, block_size, X]`.
    pub key_cache: Tensor,
    /// `[blocks, kv_heads, D, block_size]`.
    pub value_cache: Tensor,
    /// `[N, max_blocks]` `u32`.
    pub block_tables: Tensor,
    /// `[N]` `u32`.
    pub context_lens: Tensor,
}

/// Scatters `keys[n]` and `values[n]` (`[kv_heads, L_n, D]` CPU tensors of
/// one dtype) into a paged cache of `blocks` blocks of `block_size` tokens,
/// the blocks of every sequence drawn from `rng` without repetition, each
/// table row `max_blocks` wide (unused entries name block 0); every slot no
/// sequence uses holds a random value, so that a read of the wrong slot shows.
pub fn paged_cache(
    rng: &mut Rng,
    keys: &[Tensor],
    values: &[Tensor],
    block_size: usize,
    blocks: usize,
    max_blocks: usize,
) -> Result<PagedCache> {
    let dtype = keys[0].dtype();
    let (kv_heads, _, head_dim) = keys[0].dims3()?;
    let x = 16 / dtype.size_in_bytes();
    let mut key_cache = rng.uniform_vec(blocks * kv_heads * head_dim * block_size, -9.0, 9.0);
    let mut value_cache = rng.uniform_vec(key_cache.len(), -9.0, 9.0);
    let mut free: Vec<u32> = (0..blocks as u32).collect();
    let mut tables = Vec::new();
    let mut context_lens = Vec::new();
    for (k, v) in keys.iter().zip(values) {
        let len = k.dim(1)?;
        let (k, v) = (f32_values(k)?, f32_values(v)?);
        let mut table = vec![0u32; max_blocks];
        for entry in table.iter_mut().take(len.div_ceil(block_size)) {
            let pick = (rng.uniform(0.0, free.len() as f32) as usize).min(free.len() - 1);
            *entry = free.swap_remove(pick);
        }
        for h in 0..kv_heads {
            for t in 0..len {
                let (block, slot) = (table[t / block_size] as usize, t % block_size);
                for d in 0..head_dim {
                    let source = (h * len + t) * head_dim + d;
                    let key_index =
                        (((block * kv_heads + h) * (head_dim / x) + d / x) * block_size + slot) * x
                            + d % x;
                    key_cache[key_index] = k[source];
                    let value_index = ((block * kv_heads + h) * head_dim + d) * block_size + slot;
                    value_cache[value_index] = v[source];
                }
            }
        }
        tables.extend(table);
        context_lens.push(len as u32);
    }
    let sequences = keys.len();
    Ok(PagedCache {
        key_cache: tensor(key_cache, &[blocks, kv_heads, head_dim / x, block_size, x])?
            .to_dtype(dtype)?,
        value_cache: tensor(value_cache, &[blocks, kv_heads, head_dim, block_size])?
            .to_dtype(dtype)?,
        block_tables: Tensor::from_vec(tables, (sequences, max_blocks), &Device::Cpu)?,
        context_lens: Tensor::from_vec(context_lens, sequences, &Device::Cpu)?,
    })
}
