//! Binding of `attention.cu`: causal grouped-query attention over a prompt.
//!
//! `q`, `k` and `v` are read in place when their layout allows it (a
//! contiguous last dimension, 16-byte aligned rows: token-major views of the
//! projections, views of a larger key/value cache narrowed along the
//! positions), the kernel getting their batch, head and position strides;
//! other layouts are copied to fresh contiguous tensors first. The output is
//! written token-major (`[B, T, Hq, D]` in memory) and returned as its
//! `[B, Hq, T, D]` view, so that transposing it back to token order for the
//! output projection copies nothing.

use std::ffi::{c_int, c_void};

use candle_core::Tensor;

use super::{c_size, dtype_code, In, Launch};
use crate::attention::CausalAttentionArgs;
use crate::{invalid_argument, Result};

extern "C" {
    fn berrylm_causal_attention(
        dtype: c_int,
        q: *const c_void,
        k: *const c_void,
        v: *const c_void,
        out: *mut c_void,
        batch: c_int,
        heads: c_int,
        kv_heads: c_int,
        queries: c_int,
        keys: c_int,
        head_dim: c_int,
        q_strides: *const i64,
        k_strides: *const i64,
        v_strides: *const i64,
        out_strides: *const i64,
        softmax_scale: f32,
        stream: *mut c_void,
    ) -> c_int;
}

const OP: &str = "causal_attention";

/// Largest head dim of the kernels (the scalar kernel's 16 values per lane).
const MAX_HEAD_DIM: usize = 512;

/// Elements of 16 bytes in the narrowest dtype (`bf16`/`f16`): the alignment
/// of the kernels' `cp.async` row loads.
const ALIGN: usize = 8;

impl CausalAttentionArgs<'_> {
    /// CUDA `causal_attention`; arguments already validated by the caller.
    pub(crate) fn cuda(&self) -> Result<Tensor> {
        let head_dim = self.head_dim;
        if head_dim > MAX_HEAD_DIM {
            return Err(invalid_argument(
                OP,
                "q",
                format!("head dim {head_dim} exceeds the CUDA kernels' {MAX_HEAD_DIM}"),
            ));
        }
        let mut launch = Launch::new(OP, self.q)?;
        let (q, q_strides) = strided_input(&mut launch, "q", self.q)?;
        let (k, k_strides) = strided_input(&mut launch, "k", self.k)?;
        let (v, v_strides) = strided_input(&mut launch, "v", self.v)?;
        let dtype = launch.dtype(q);
        let (batch, heads, queries) = (self.batch, self.heads, self.queries);
        let out = launch.output((batch, queries, heads, head_dim), dtype)?;
        let out_strides =
            [queries * heads * head_dim, head_dim, heads * head_dim].map(|s| s as i64);
        let outputs = launch.run(|p| {
            // SAFETY: `q` spans `[batch, heads, queries, head_dim]`, `k` and
            // `v` `[batch, kv_heads, keys, head_dim]` at the strides given from
            // their first elements; `out` is freshly allocated
            // `[batch, queries, heads, head_dim]`, written at `out_strides`
            // (batch, head, query); all of one dtype, on candle's stream; the
            // stride arrays outlive the call.
            Ok(unsafe {
                berrylm_causal_attention(
                    dtype_code(OP, dtype)?,
                    p.input(q),
                    p.input(k),
                    p.input(v),
                    p.output(out),
                    c_size(OP, "q", self.batch)?,
                    c_size(OP, "q", self.heads)?,
                    c_size(OP, "k", self.kv_heads)?,
                    c_size(OP, "q", self.queries)?,
                    c_size(OP, "k", self.keys)?,
                    c_size(OP, "q", head_dim)?,
                    q_strides.as_ptr(),
                    k_strides.as_ptr(),
                    v_strides.as_ptr(),
                    out_strides.as_ptr(),
                    self.softmax_scale,
                    p.stream(),
                )
            })
        })?;
        Ok(outputs.tensor(out).transpose(1, 2)?)
    }
}

/// Declares the rank-4 `tensor` as an input read at its batch, head and row
/// strides (in elements, returned): in place when its last dimension is
/// contiguous and its offset and strides are multiples of [`ALIGN`], else a
/// fresh contiguous copy.
fn strided_input(
    launch: &mut Launch,
    name: &'static str,
    tensor: &Tensor,
) -> Result<(In, [i64; 3])> {
    let layout = tensor.layout();
    let stride = layout.stride();
    let dims = layout.dims();
    let in_place = (stride[3] == 1 || dims[3] == 1)
        && layout.start_offset().is_multiple_of(ALIGN)
        && stride[..3].iter().all(|s| s.is_multiple_of(ALIGN));
    let (tensor, stride) = if in_place {
        (tensor.clone(), [stride[0], stride[1], stride[2]])
    } else {
        let [_, heads, rows, width] = [dims[0], dims[1], dims[2], dims[3]];
        (
            tensor.force_contiguous()?,
            [heads * rows * width, rows * width, width],
        )
    };
    let input = launch.push_input(name, tensor)?;
    let stride = stride.map(|s| s as i64);
    Ok((input, stride))
}
