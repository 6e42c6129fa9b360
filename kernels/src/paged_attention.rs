//! Attention of a decode step over the host's paged KV blocks (spec 3.5 step
//! 4): one new query token per sequence against the keys and values its
//! earlier tokens left in the host's paged cache.

use candle_core::{DType, IndexOp, Tensor};

use crate::{
    ensure, expect_dim, expect_on_device, expect_positive, expect_same_dtype, float_dims, Result,
};

const OP: &str = "paged_decode_attention";

/// One attention layer's paged KV cache, laid out as the host's paged
/// attention keeps it (vLLM's layout, `X` the elements of 16 bytes of the
/// dtype), and where a batch's tokens lie in it.
///
/// * `key_cache`: `[blocks, kv_heads, D / X, block_size, X]`.
/// * `value_cache`: `[blocks, kv_heads, D, block_size]`, the same dtype.
/// * `block_tables`: `[N, max_blocks]` `u32`: sequence `n`'s token `t` lies
///   in block `block_tables[n, t / block_size]`, slot `t % block_size`.
/// * `context_lens`: `[N]` `u32`: the tokens of each sequence, the new one
///   included (its key and value already written).
#[derive(Clone, Copy)]
pub struct PagedKv<'a> {
    pub key_cache: &'a Tensor,
    pub value_cache: &'a Tensor,
    pub block_tables: &'a Tensor,
    pub context_lens: &'a Tensor,
}

/// The attention of `q` `[N, Hq, D]`, one query token per sequence, over
/// each sequence's `context_lens[n]` tokens in `kv`: [`crate::causal_attention`]
/// of the last position (query head `h` reads KV head `h / (Hq / Hkv)`),
/// returning `[N, Hq, D]` in the dtype of `q`.
///
/// The CPU reference gathers each sequence's keys and values from its
/// blocks and runs [`crate::causal_attention`]'s reference, with its rounding
/// points; it fails on a context of no tokens, longer than its block table,
/// or a block id beyond the caches. On CUDA (`bf16`/`f16`, `D` of 64, 128
/// or 256, at most 8 query heads per KV head, blocks of a multiple of 8
/// tokens: [`paged_decode_attention_takes`]) a split-KV kernel computes the
/// scores and the softmax in f32 without rounding them, so it agrees with the
/// reference within the rounding of the output dtype; its grid depends on the
/// shapes alone, so a CUDA graph may capture it and replay it for other
/// context lengths. It cannot check the device's block tables: a context
/// of no tokens gives zeros, and it clamps longer contexts and block ids
/// beyond the caches instead of reading past them.
pub fn paged_decode_attention(q: &Tensor, kv: &PagedKv<'_>, softmax_scale: f32) -> Result<Tensor> {
    let args = PagedDecodeArgs::validate(q, kv, softmax_scale)?;
    on_device!(
        OP,
        q.device(),
        args.cpu(),
        crate::cuda::paged_decode_attention(&args)
    )
}

/// Whether the CUDA kernel of [`paged_decode_attention`] takes a layer of
/// these sizes in `dtype` (the other CUDA calls fail).
pub fn paged_decode_attention_takes(
    dtype: DType,
    head_dim: usize,
    heads: usize,
    kv_heads: usize,
    block_size: usize,
) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
        && matches!(head_dim, 64 | 128 | 256)
        && kv_heads > 0
        && heads.is_multiple_of(kv_heads)
        && heads / kv_heads <= PAGED_DECODE_MAX_GROUP
        && block_size > 0
        && block_size.is_multiple_of(8)
}

/// The most query heads per KV head the CUDA kernel takes (`kMaxGroup` in
/// paged_attention.cu).
pub(crate) const PAGED_DECODE_MAX_GROUP: usize = 8;

/// The validated arguments of a [`paged_decode_attention`] call and its
/// sizes.
pub(crate) struct PagedDecodeArgs<'a> {
    pub q: &'a Tensor,
    pub kv: PagedKv<'a>,
    pub softmax_scale: f32,
    pub sequences: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub blocks: usize,
    pub block_size: usize,
    pub max_blocks: usize,
}

impl<'a> PagedDecodeArgs<'a> {
    fn validate(q: &'a Tensor, kv: &PagedKv<'a>, softmax_scale: f32) -> Result<Self> {
        let [sequences, heads, head_dim] = float_dims::<3>(OP, "q", q)?;
        let [blocks, kv_heads, key_pieces, block_size, x] =
            float_dims::<5>(OP, "key_cache", kv.key_cache)?;
        expect_same_dtype(OP, "key_cache", kv.key_cache, q.dtype(), "the dtype of `q`")?;
        expect_same_dtype(
            OP,
            "value_cache",
            kv.value_cache,
            q.dtype(),
            "the dtype of `q`",
        )?;
        let element_bytes = q.dtype().size_in_bytes();
        ensure(
            x * element_bytes == 16 && key_pieces * x == head_dim,
            OP,
            "key_cache",
            || {
                format!(
                "shape {:?} is not [blocks, kv_heads, {head_dim} / X, block_size, X] with X = {}",
                kv.key_cache.dims(),
                16 / element_bytes
            )
            },
        )?;
        let value_dims = float_dims::<4>(OP, "value_cache", kv.value_cache)?;
        let expected = [blocks, kv_heads, head_dim, block_size];
        ensure(value_dims == expected, OP, "value_cache", || {
            format!("shape {value_dims:?}, expected {expected:?} (from `key_cache` and `q`)")
        })?;
        for (dim, what) in [
            (sequences, "the number of sequences"),
            (heads, "the number of query heads"),
            (kv_heads, "the number of key/value heads"),
            (block_size, "the block size"),
            (blocks, "the number of blocks"),
        ] {
            expect_positive(OP, "q", what, dim)?;
        }
        ensure(heads.is_multiple_of(kv_heads), OP, "key_cache", || {
            format!("the {heads} query heads are not a multiple of the {kv_heads} key/value heads")
        })?;
        ensure(
            kv.block_tables.dtype() == DType::U32 && kv.block_tables.rank() == 2,
            OP,
            "block_tables",
            || {
                format!(
                    "expected u32 [N, max_blocks], got {:?} {:?}",
                    kv.block_tables.dtype(),
                    kv.block_tables.dims()
                )
            },
        )?;
        let (table_rows, max_blocks) = kv.block_tables.dims2()?;
        expect_dim(
            OP,
            "block_tables",
            "the number of rows",
            table_rows,
            sequences,
        )?;
        expect_positive(OP, "block_tables", "the number of blocks a row", max_blocks)?;
        ensure(
            kv.context_lens.dtype() == DType::U32 && kv.context_lens.dims() == [sequences],
            OP,
            "context_lens",
            || {
                format!(
                    "expected u32 [{sequences}], got {:?} {:?}",
                    kv.context_lens.dtype(),
                    kv.context_lens.dims()
                )
            },
        )?;
        expect_on_device(
            OP,
            q.device(),
            [
                ("key_cache", kv.key_cache),
                ("value_cache", kv.value_cache),
                ("block_tables", kv.block_tables),
                ("context_lens", kv.context_lens),
            ],
        )?;
        ensure(softmax_scale.is_finite(), OP, "softmax_scale", || {
            format!("{softmax_scale} is not finite")
        })?;
        Ok(Self {
            q,
            kv: *kv,
            softmax_scale,
            sequences,
            heads,
            kv_heads,
            head_dim,
            blocks,
            block_size,
            max_blocks,
        })
    }

    /// The CPU reference: each sequence's keys and values gathered from its
    /// blocks, then [`crate::causal_attention`]'s reference of its token.
    fn cpu(&self) -> Result<Tensor> {
        let tables: Vec<Vec<u32>> = self.kv.block_tables.to_vec2()?;
        let context_lens: Vec<u32> = self.kv.context_lens.to_vec1()?;
        let (block_size, head_dim) = (self.block_size, self.head_dim);
        // [blocks, kv_heads, D / X, block_size, X] -> [blocks, block_size, kv_heads, D]
        let keys = self.kv.key_cache.permute((0, 3, 1, 2, 4))?.reshape((
            self.blocks,
            block_size,
            self.kv_heads,
            head_dim,
        ))?;
        // [blocks, kv_heads, D, block_size] -> [blocks, block_size, kv_heads, D]
        let values = self.kv.value_cache.permute((0, 3, 1, 2))?.contiguous()?;
        let mut outputs = Vec::with_capacity(self.sequences);
        for (n, (table, &context)) in tables.iter().zip(&context_lens).enumerate() {
            let context = context as usize;
            ensure(context > 0, OP, "context_lens", || {
                format!("sequence {n} has no tokens")
            })?;
            let capacity = self.max_blocks * block_size;
            ensure(context <= capacity, OP, "context_lens", || {
                format!("sequence {n} has {context} tokens, more than its blocks hold ({capacity})")
            })?;
            let used = &table[..context.div_ceil(block_size)];
            if let Some(&bad) = used.iter().find(|&&block| block as usize >= self.blocks) {
                return Err(crate::invalid_argument(
                    OP,
                    "block_tables",
                    format!("sequence {n} names block {bad} of {}", self.blocks),
                ));
            }
            let ids = Tensor::new(used, self.q.device())?;
            // [kv_heads, context, D] -> [1, kv_heads, context, D]
            let gather = |cache: &Tensor| -> Result<Tensor> {
                Ok(cache
                    .index_select(&ids, 0)?
                    .flatten(0, 1)?
                    .narrow(0, 0, context)?
                    .transpose(0, 1)?
                    .unsqueeze(0)?
                    .contiguous()?)
            };
            let query = self.q.i(n)?.reshape((1, self.heads, 1, head_dim))?;
            let attended = crate::causal_attention(
                &query,
                &gather(&keys)?,
                &gather(&values)?,
                self.softmax_scale,
            )?;
            outputs.push(attended.squeeze(2)?.squeeze(0)?);
        }
        Ok(Tensor::stack(&outputs, 0)?)
    }
}
