//! Gated full attention: q/k (1+w) norms before partial NeoX RoPE, GQA, and a
//! sigmoid output gate taken from the doubled, per-head interleaved `q_proj`.
//! The norm and rotation of q and of k, and the output gate, are one kernel
//! each (`berrylm_kernels`), reading the query and gate halves of `q_proj`'s
//! output in place.
//!
//! On CUDA in bf16/f16 a prompt's attention is `berrylm_kernels::causal_attention`
//! (tiled, no score matrix in memory) over the contiguous cache, and under
//! paged attention over the prompt's own keys and values or, after a
//! prefix-cache hit, over each sequence's cached and new ones gathered from
//! its blocks; a decode step's attention over the paged blocks is
//! `berrylm_kernels::paged_decode_attention` (split-KV). The CPU and f32 keep
//! the reference's eager attention.

use std::collections::HashMap;

use candle_core::{DType, Device, DeviceLocation, Module, Result, Tensor};
use candle_nn::ops::softmax_last_dim;
use mistralrs_core::plugin_api::{
    FlashParams, KvCache, PagedAttention, PagedAttentionInputMetadata, SdpaParams,
};

use crate::config::BerryLmConfig;
use crate::layers::norm::OffsetRmsNorm;
use crate::layers::ops::{matmul, scale};
use crate::layers::projection::{HostLayer, Projection, ProjectionSpec, Projections};
use crate::weights::Weights;

/// Queries per block of the eager attention over long prompts.
const QUERY_CHUNK: usize = 1024;

/// Where this layer's keys and values live for one forward pass.
pub enum AttentionKv<'a> {
    /// The host's contiguous per-batch cache (CPU and non-paged CUDA).
    Contiguous(&'a mut KvCache),
    /// The host's paged blocks for this layer.
    Paged {
        key_value: (Tensor, Tensor),
        metadata: &'a PagedAttentionInputMetadata,
    },
}

pub struct GatedAttention {
    /// `q_proj`, `k_proj` and `v_proj` (q with the interleaved output gate),
    /// stacked into one projection (one launch per step instead of three)
    /// when the host quantizes none of them.
    qkv_proj: Projections,
    o_proj: Projection,
    q_norm: OffsetRmsNorm,
    k_norm: OffsetRmsNorm,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    output_gate: bool,
    sdpa_params: SdpaParams,
    paged: Option<PagedAttention>,
}

impl GatedAttention {
    pub fn load(
        weights: &Weights,
        cfg: &BerryLmConfig,
        paged: Option<PagedAttention>,
    ) -> crate::error::Result<GatedAttention> {
        let attn = weights.pp("self_attn");
        let hidden = cfg.hidden_size;
        let head_dim = cfg.head_dim;
        let q_rows = cfg.num_attention_heads * head_dim * if cfg.attn_output_gate { 2 } else { 1 };
        let kv_rows = cfg.num_key_value_heads * head_dim;
        let bias = cfg.attention_bias;
        let qkv_proj = Projections::load(
            &attn,
            &[
                ProjectionSpec::quantizable("q_proj", hidden, q_rows).with_bias(bias),
                ProjectionSpec::quantizable("k_proj", hidden, kv_rows).with_bias(bias),
                ProjectionSpec::quantizable("v_proj", hidden, kv_rows).with_bias(bias),
            ],
        )?;
        Ok(GatedAttention {
            qkv_proj,
            o_proj: Projection::load(
                &attn,
                ProjectionSpec::quantizable("o_proj", cfg.num_attention_heads * head_dim, hidden)
                    .with_bias(bias),
            )?,
            q_norm: OffsetRmsNorm::load(&attn, "q_norm", head_dim, cfg.rms_norm_eps)?,
            k_norm: OffsetRmsNorm::load(&attn, "k_norm", head_dim, cfg.rms_norm_eps)?,
            num_heads: cfg.num_attention_heads,
            num_kv_heads: cfg.num_key_value_heads,
            head_dim,
            output_gate: cfg.attn_output_gate,
            sdpa_params: SdpaParams {
                n_kv_groups: cfg.num_attention_heads / cfg.num_key_value_heads,
                softcap: None,
                softmax_scale: 1.0 / (head_dim as f32).sqrt(),
                sliding_window: None,
                sinks: None,
            },
            paged,
        })
    }

    /// Its projections the host quantizes or fills, in order.
    pub fn host_layers_mut<'a>(&'a mut self, out: &mut Vec<&'a mut HostLayer>) {
        self.qkv_proj.host_layers_mut(out);
        self.o_proj.host_layers_mut(out);
    }

    /// Whether it was built for the host's paged KV blocks.
    pub fn is_paged(&self) -> bool {
        self.paged.is_some()
    }

    /// Its full-precision tensors under their checkpoint names.
    pub fn checkpoint_tensors(&self, out: &mut Vec<(String, Tensor)>) -> Result<()> {
        self.qkv_proj.full_precision_tensors(out)?;
        self.o_proj.full_precision_tensors(out)?;
        out.push(self.q_norm.checkpoint_tensor());
        out.push(self.k_norm.checkpoint_tensor());
        Ok(())
    }

    /// `x` `[B, T, hidden]`; `cos`/`sin` `[B, T, rotary_dim]` for each token's position.
    pub fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: Option<&Tensor>,
        kv: AttentionKv<'_>,
        flash_params: &FlashParams,
    ) -> Result<Tensor> {
        let (batch, seq_len, _) = x.dims3()?;
        // The stacked projection's columns: views, contiguous for one token
        // and copied for several (by a kernel a decode graph can capture).
        let projected = self.qkv_proj.forward(x)?;
        let q_all = berrylm_kernels::contiguous(&projected.part(0)?)?;
        let k = berrylm_kernels::contiguous(&projected.part(1)?)?;
        let v = berrylm_kernels::contiguous(&projected.part(2)?)?;
        let (q, gate) = if self.output_gate {
            let q2 = q_all.reshape((batch, seq_len, self.num_heads, 2 * self.head_dim))?;
            // Views whose heads lie 2 * head_dim apart, read in place by the
            // kernels below.
            let q = q2.narrow(3, 0, self.head_dim)?;
            let gate = q2.narrow(3, self.head_dim, self.head_dim)?;
            (q, Some(gate))
        } else {
            let q = q_all.reshape((batch, seq_len, self.num_heads, self.head_dim))?;
            (q, None)
        };
        let v_tokens = v.reshape((batch, seq_len, self.num_kv_heads, self.head_dim))?;
        let q_tokens = self.q_norm.forward_rope(&q, cos, sin)?;
        let k_tokens = self.k_norm.forward_rope(
            &k.reshape((batch, seq_len, self.num_kv_heads, self.head_dim))?,
            cos,
            sin,
        )?;

        // Head-major views of the token-major rows: the tiled attention reads
        // them in place, the other paths take contiguous copies.
        let q = q_tokens.transpose(1, 2)?;
        let k = k_tokens.transpose(1, 2)?;
        let v = v_tokens.transpose(1, 2)?;
        let attended = match (kv, &self.paged) {
            (
                AttentionKv::Paged {
                    key_value,
                    metadata,
                },
                Some(paged),
            ) => {
                let tiled = uses_tiled_attention(q.device(), q.dtype(), Some(key_value.0.dtype()));
                let write_cache =
                    || write_paged_cache(paged, &k_tokens, &v_tokens, &key_value, metadata);
                if tiled && is_uncached_prompt(mask, metadata) {
                    write_cache()?;
                    self.causal_attention(&q, &k, &v)?
                } else if tiled && mask.is_some() {
                    // A prompt after a prefix-cache hit.
                    write_cache()?;
                    self.prefix_hit_attention(paged, &q, &key_value, metadata)?
                } else if tiled && seq_len == 1 && self.decodes_paged(&key_value.0, metadata)? {
                    write_cache()?;
                    self.paged_decode_attention(&q_tokens, &key_value, metadata)?
                } else {
                    paged.forward(
                        &berrylm_kernels::contiguous(&q)?,
                        &berrylm_kernels::contiguous(&k)?,
                        &berrylm_kernels::contiguous(&v)?,
                        mask,
                        Some(key_value.0),
                        Some(key_value.1),
                        metadata,
                        &self.sdpa_params,
                        Some(flash_params),
                    )?
                }
            }
            (AttentionKv::Paged { .. }, None) => {
                candle_core::bail!(
                    "paged KV blocks were given to a layer built without paged attention"
                )
            }
            (AttentionKv::Contiguous(cache), _) => {
                let (k, v) = cache.append(&k.contiguous()?, &v.contiguous()?)?;
                if uses_tiled_attention(q.device(), q.dtype(), None) {
                    self.causal_attention(&q, &k, &v)?
                } else {
                    self.eager_attention(&q.contiguous()?, &k, &v, mask)?
                }
            }
        };
        // Attention over a prompt is `[B, heads, T, hd]` (the tiled kernel's
        // a view of token-major rows); the paged decode kernel answers
        // `[B, heads, hd]`, already in token-major order.
        let token_major = if attended.rank() == 3 {
            attended
        } else {
            attended.transpose(1, 2)?
        };
        let out = token_major.reshape((batch, seq_len, self.num_heads, self.head_dim))?;
        let out = match gate {
            Some(gate) => berrylm_kernels::sigmoid_gate_mul(&out, &gate)?,
            None => out,
        };
        self.o_proj
            .forward(&out.reshape((batch, seq_len, self.num_heads * self.head_dim))?)
    }

    /// Whether a decode step (one token a sequence, after the prompt) runs
    /// `berrylm_kernels::paged_decode_attention` over `key_cache`'s blocks:
    /// when its CUDA kernel takes this layer's sizes.
    fn decodes_paged(
        &self,
        key_cache: &Tensor,
        metadata: &PagedAttentionInputMetadata,
    ) -> Result<bool> {
        Ok(!metadata.is_first_prompt_chunk
            && metadata.num_cached_tokens.is_none()
            && berrylm_kernels::paged_decode_attention_takes(
                key_cache.dtype(),
                self.head_dim,
                self.num_heads,
                self.num_kv_heads,
                key_cache.dim(3)?,
            ))
    }

    /// The attention of each sequence's one new token (`q_tokens`
    /// `[B, 1, heads, hd]`, its key and value already in the blocks) over
    /// its paged KV, `[B, heads, hd]`: the block tables and context lengths
    /// of the whole context (the full tables where the host keeps windowed
    /// ones too), on the layer's device.
    fn paged_decode_attention(
        &self,
        q_tokens: &Tensor,
        (key_cache, value_cache): &(Tensor, Tensor),
        metadata: &PagedAttentionInputMetadata,
    ) -> Result<Tensor> {
        let location = q_tokens.device().location();
        let block_tables = full_block_tables(metadata, &location)?;
        let context_lens = on_device(
            metadata
                .full_context_lens
                .as_ref()
                .or(metadata.context_lens.as_ref()),
            &location,
            "context lengths",
        )?;
        let (batch, _, heads, head_dim) = q_tokens.dims4()?;
        Ok(berrylm_kernels::paged_decode_attention(
            &q_tokens.reshape((batch, heads, head_dim))?,
            &berrylm_kernels::PagedKv {
                key_cache,
                value_cache,
                block_tables,
                context_lens,
            },
            self.sdpa_params.softmax_scale,
        )?)
    }

    /// The attention of prompts whose first positions the prefix cache
    /// supplied (`q` `[B, heads, T, hd]`; their new keys and values already
    /// in the blocks): each sequence's cached and new keys and values
    /// gathered from its blocks in `q`'s dtype (an FP8 cache's dequantized
    /// with its scales), then [`attend_each_sequence`] with the tiled kernel.
    fn prefix_hit_attention(
        &self,
        paged: &PagedAttention,
        q: &Tensor,
        (key_cache, value_cache): &(Tensor, Tensor),
        metadata: &PagedAttentionInputMetadata,
    ) -> Result<Tensor> {
        let (Some(cached), Some(new)) = (&metadata.num_cached_tokens, &metadata.query_lens) else {
            candle_core::bail!("a prompt after a prefix-cache hit without its token counts")
        };
        let location = q.device().location();
        let (keys, values) = paged.gather_cache(
            key_cache,
            value_cache,
            full_block_tables(metadata, &location)?,
            on_device(
                metadata.cu_seqlens_kv.as_ref(),
                &location,
                "cumulative KV lengths",
            )?,
            q.dtype(),
        )?;
        attend_each_sequence(q, (&keys, &values), (cached, new), |q, k, v| {
            self.causal_attention(q, k, v)
        })
    }

    /// Causal attention of the last `T` of `L` positions (queries `[B, heads,
    /// T, hd]`, keys and values `[B, kv_heads, L, hd]`), tiled: what the causal
    /// mask of a prompt, or no mask for one decoded token, asks for.
    fn causal_attention(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        Ok(berrylm_kernels::causal_attention(
            q,
            k,
            v,
            self.sdpa_params.softmax_scale,
        )?)
    }

    /// The reference's eager attention: `softmax(q k^T * scale + mask)` in f32,
    /// times `v`, each query head reading KV head `h / groups`. `q` is
    /// `[B, heads, T, hd]` (contiguous), `k`/`v` `[B, kv_heads, L, hd]` (any
    /// strides, e.g. views of the cache), the mask `[T, L]`.
    ///
    /// The query heads that share a KV head are consecutive, so `q` is read as
    /// `[B, kv_heads, groups * T, hd]` and multiplied with the keys and values
    /// as they are: nothing is repeated or copied per query head.
    fn eager_attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let queries = q.dim(2)?;
        if queries <= QUERY_CHUNK {
            return self.attend(q, k, v, mask);
        }
        // Long prompts in chunks of queries: the scores of a whole 16k-token
        // prompt would hold 2^32 elements per 16 heads, past what one kernel
        // launch indexes.
        let mut outputs = Vec::with_capacity(queries.div_ceil(QUERY_CHUNK));
        for start in (0..queries).step_by(QUERY_CHUNK) {
            let len = QUERY_CHUNK.min(queries - start);
            let rows = mask.map(|mask| mask.narrow(0, start, len)).transpose()?;
            outputs.push(self.attend(
                &q.narrow(2, start, len)?.contiguous()?,
                k,
                v,
                rows.as_ref(),
            )?);
        }
        Tensor::cat(&outputs, 2)
    }

    /// `softmax(q k^T * scale + mask) v` for `q` `[B, heads, T, hd]`
    /// (contiguous) against `k`/`v` `[B, kv_heads, L, hd]`.
    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>) -> Result<Tensor> {
        let (batch, heads, queries, head_dim) = q.dims4()?;
        let (_, kv_heads, keys, _) = k.dims4()?;
        let groups = heads / kv_heads;
        let grouped = q.reshape((batch, kv_heads, groups * queries, head_dim))?;
        let scores = scale(
            &matmul(&grouped, &k.t()?)?,
            f64::from(self.sdpa_params.softmax_scale),
        )?;
        let scores = match mask {
            Some(mask) => scores
                .reshape((batch, kv_heads, groups, queries, keys))?
                .broadcast_add(&mask.to_dtype(scores.dtype())?)?
                .reshape((batch, kv_heads, groups * queries, keys))?,
            None => scores,
        };
        let probs = softmax_last_dim(&scores.to_dtype(DType::F32)?)?.to_dtype(q.dtype())?;
        matmul(&probs, v)?.reshape((batch, heads, queries, head_dim))
    }
}

/// The attention of prompts after prefix-cache hits, sequence by sequence:
/// `q` `[B, heads, T, hd]` holds sequence `b`'s `new[b]` tokens first, then
/// padding; `keys` and `values` `[tokens, kv_heads, hd]` hold each
/// sequence's `cached[b] + new[b]` positions, one sequence after another.
/// `attend` (causal attention of the last `T` of `L` positions, as
/// [`berrylm_kernels::causal_attention`]) runs on each sequence's new
/// queries and its positions' keys and values (`[1, kv_heads, L, hd]`
/// views). Returns `[B, heads, T, hd]`, the padding rows zeros.
fn attend_each_sequence(
    q: &Tensor,
    (keys, values): (&Tensor, &Tensor),
    (cached, new): (&[usize], &[usize]),
    attend: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let (batch, heads, padded, head_dim) = q.dims4()?;
    if cached.len() != batch || new.len() != batch {
        candle_core::bail!(
            "prefix-cache token counts for {} and {} sequences in a batch of {batch}",
            cached.len(),
            new.len()
        )
    }
    let mut rows = Vec::with_capacity(batch);
    let mut start = 0;
    for (row, (&cached, &new)) in cached.iter().zip(new).enumerate() {
        let (first, len) = (start, cached + new);
        start += len;
        let sequence = |gathered: &Tensor| -> Result<Tensor> {
            gathered
                .narrow(0, first, len)?
                .unsqueeze(0)?
                .transpose(1, 2)
        };
        let mut attended = Vec::with_capacity(2);
        if new > 0 {
            let queries = q.narrow(0, row, 1)?.narrow(2, 0, new)?;
            attended.push(attend(&queries, &sequence(keys)?, &sequence(values)?)?.transpose(1, 2)?);
        }
        if new < padded {
            attended.push(Tensor::zeros(
                (1, padded - new, heads, head_dim),
                q.dtype(),
                q.device(),
            )?);
        }
        rows.push(Tensor::cat(&attended, 1)?);
    }
    Tensor::cat(&rows, 0)?.transpose(1, 2)
}

/// The tensor of a per-device map of the paged metadata (`what` names it in
/// the error) for `location`.
fn on_device<'a>(
    tensors: Option<&'a HashMap<DeviceLocation, Tensor>>,
    location: &DeviceLocation,
    what: &str,
) -> Result<&'a Tensor> {
    tensors
        .and_then(|tensors| tensors.get(location))
        .ok_or_else(|| candle_core::Error::Msg(format!("no paged {what} for this device")))
}

/// The block tables of the whole context on `location` (the full tables
/// where the host keeps windowed ones too).
fn full_block_tables<'a>(
    metadata: &'a PagedAttentionInputMetadata,
    location: &DeviceLocation,
) -> Result<&'a Tensor> {
    on_device(
        metadata
            .full_block_tables
            .as_ref()
            .or(metadata.block_tables.as_ref()),
        location,
        "block tables",
    )
}

/// Whether a prompt's attention runs tiled (`berrylm_kernels::causal_attention`):
/// on CUDA in half precision, over the contiguous cache (`paged_key_cache`
/// `None`) or paged blocks of the activations' dtype or of FP8 (whose keys
/// and values the host's paged attention quantizes as they are written and
/// dequantizes as a prefix hit gathers them). The CPU, the oracle, and f32
/// keep the eager path.
pub fn uses_tiled_attention(device: &Device, dtype: DType, paged_key_cache: Option<DType>) -> bool {
    device.is_cuda()
        && matches!(dtype, DType::BF16 | DType::F16)
        && paged_key_cache.is_none_or(|cache| cache == dtype || cache == DType::F8E4M3)
}

/// Whether a paged step is a prompt (it has a mask) without a cached prefix:
/// attention then needs the prompt's own keys and values only.
fn is_uncached_prompt(mask: Option<&Tensor>, metadata: &PagedAttentionInputMetadata) -> bool {
    mask.is_some() && metadata.num_cached_tokens.is_none()
}

/// Writes a step's keys and values (`[B, T, kv_heads, hd]`) into its paged
/// blocks at the slots the host assigned (padding has none), through the
/// host's paged attention, which quantizes them for an FP8 cache.
fn write_paged_cache(
    paged: &PagedAttention,
    k_tokens: &Tensor,
    v_tokens: &Tensor,
    (key_cache, value_cache): &(Tensor, Tensor),
    metadata: &PagedAttentionInputMetadata,
) -> Result<()> {
    let (_, _, kv_heads, head_dim) = k_tokens.dims4()?;
    let rows = ((), kv_heads, head_dim);
    paged.write_cache(
        &k_tokens.reshape(rows)?,
        &v_tokens.reshape(rows)?,
        key_cache,
        value_cache,
        metadata,
    )
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, IndexOp, Result, Tensor};

    use super::attend_each_sequence;

    /// Two sequences in one batch of 3 query rows: the first with 5 cached
    /// and 3 new positions, the second with none cached and 2 new (then a
    /// padding row). Each sequence's rows equal the causal attention of its
    /// own queries over its own positions, computed from tensors built
    /// apart; the padding row is zeros.
    #[test]
    fn each_sequence_attends_over_its_own_cached_and_new_positions() -> Result<()> {
        let device = Device::Cpu;
        let (heads, kv_heads, head_dim) = (4, 2, 8);
        let random = |dims: &[usize]| Tensor::randn(0f32, 1.0, dims, &device);
        // Token-major queries `[B, T, heads, hd]`, read head-major.
        let q = random(&[2, 3, heads, head_dim])?;
        let (first_keys, first_values) = (
            random(&[8, kv_heads, head_dim])?,
            random(&[8, kv_heads, head_dim])?,
        );
        let (second_keys, second_values) = (
            random(&[2, kv_heads, head_dim])?,
            random(&[2, kv_heads, head_dim])?,
        );
        let keys = Tensor::cat(&[&first_keys, &second_keys], 0)?;
        let values = Tensor::cat(&[&first_values, &second_values], 0)?;
        let attend = |q: &Tensor, k: &Tensor, v: &Tensor| -> Result<Tensor> {
            berrylm_kernels::causal_attention(q, k, v, 0.25).map_err(candle_core::Error::wrap)
        };
        let out = attend_each_sequence(
            &q.transpose(1, 2)?,
            (&keys, &values),
            (&[5, 0], &[3, 2]),
            attend,
        )?;
        assert_eq!(out.dims(), [2, heads, 3, head_dim]);
        let head_major = |positions: &Tensor| -> Result<Tensor> {
            positions.transpose(0, 1)?.unsqueeze(0)?.contiguous()
        };
        let first = attend(
            &q.i(0)?.transpose(0, 1)?.unsqueeze(0)?.contiguous()?,
            &head_major(&first_keys)?,
            &head_major(&first_values)?,
        )?;
        let second = attend(
            &q.i(1)?
                .narrow(0, 0, 2)?
                .transpose(0, 1)?
                .unsqueeze(0)?
                .contiguous()?,
            &head_major(&second_keys)?,
            &head_major(&second_values)?,
        )?;
        let difference = |a: &Tensor, b: &Tensor| -> Result<f32> {
            (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
        };
        assert_eq!(difference(&out.i(0)?, &first.i(0)?)?, 0.0);
        assert_eq!(difference(&out.i(1)?.narrow(1, 0, 2)?, &second.i(0)?)?, 0.0);
        let padding = out.i(1)?.narrow(1, 2, 1)?.to_dtype(DType::F32)?;
        assert_eq!(
            padding.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?,
            0.0
        );
        Ok(())
    }
}
