//! Binding of `paged_attention.cu`: a decode step's attention over the
//! host's paged KV blocks, split over partitions of the context with a
//! combine launch when there is more than one.

use std::ffi::{c_int, c_void};

use candle_core::{DType, Tensor};

use super::{c_size, dtype_code, Launch};
use crate::paged_attention::{paged_decode_attention_takes, PagedDecodeArgs};
use crate::{invalid_argument, Result};

extern "C" {
    fn berrylm_paged_decode_partitions(max_blocks: c_int, block_size: c_int) -> c_int;

    fn berrylm_paged_decode_attention(
        dtype: c_int,
        q: *const c_void,
        key_cache: *const c_void,
        value_cache: *const c_void,
        block_tables: *const u32,
        context_lens: *const u32,
        out: *mut c_void,
        partial_out: *mut f32,
        partial_max: *mut f32,
        partial_sum: *mut f32,
        sequences: c_int,
        heads: c_int,
        kv_heads: c_int,
        head_dim: c_int,
        blocks: c_int,
        block_size: c_int,
        max_blocks: c_int,
        scale: f32,
        stream: *mut c_void,
    ) -> c_int;
}

const OP: &str = "paged_decode_attention";

/// CUDA `paged_decode_attention`; arguments validated by the caller.
pub(crate) fn paged_decode_attention(args: &PagedDecodeArgs<'_>) -> Result<Tensor> {
    let dtype = args.q.dtype();
    if !paged_decode_attention_takes(
        dtype,
        args.head_dim,
        args.heads,
        args.kv_heads,
        args.block_size,
    ) {
        return Err(invalid_argument(
            OP,
            "q",
            format!(
                "the CUDA kernel takes bf16/f16, head dim 64, 128 or 256, at most 8 query \
                 heads per key/value head and blocks of a multiple of 8 tokens; got {dtype:?}, \
                 head dim {}, {} / {} heads, blocks of {}",
                args.head_dim, args.heads, args.kv_heads, args.block_size
            ),
        ));
    }
    let [max_blocks, block_size] = [
        c_size(OP, "block_tables", args.max_blocks)?,
        c_size(OP, "key_cache", args.block_size)?,
    ];
    // SAFETY: a pure function of its arguments.
    let partitions = unsafe { berrylm_paged_decode_partitions(max_blocks, block_size) };
    let partitions = usize::try_from(partitions).map_err(|_| {
        invalid_argument(
            OP,
            "block_tables",
            format!("{} blocks of {} tokens", args.max_blocks, args.block_size),
        )
    })?;
    let kv = &args.kv;
    let mut launch = Launch::new(OP, args.q)?;
    let [q, key_cache, value_cache, block_tables, context_lens] = launch.inputs([
        ("q", args.q),
        ("key_cache", kv.key_cache),
        ("value_cache", kv.value_cache),
        ("block_tables", kv.block_tables),
        ("context_lens", kv.context_lens),
    ])?;
    let (sequences, heads, head_dim) = (args.sequences, args.heads, args.head_dim);
    let out = launch.output(&[sequences, heads, head_dim], dtype)?;
    // Scratch of the partitions' partial results (one element when unused).
    let partial = |per_head: usize| -> Vec<usize> {
        if partitions > 1 {
            vec![sequences, heads, partitions, per_head]
        } else {
            vec![1]
        }
    };
    let partial_out = launch.output(partial(head_dim), DType::F32)?;
    let partial_max = launch.output(partial(1), DType::F32)?;
    let partial_sum = launch.output(partial(1), DType::F32)?;
    let outputs = run_kernel!(launch => berrylm_paged_decode_attention(
        dtype(dtype), input(q), input(key_cache), input(value_cache), input(block_tables),
        input(context_lens), output(out), output(partial_out), output(partial_max),
        output(partial_sum), c_size(OP, "q", sequences)?, c_size(OP, "q", heads)?,
        c_size(OP, "key_cache", args.kv_heads)?, c_size(OP, "q", head_dim)?,
        c_size(OP, "key_cache", args.blocks)?, block_size, max_blocks, args.softmax_scale
    ))?;
    Ok(outputs.tensor(out))
}
