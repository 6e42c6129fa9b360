//! Gated full attention: q/k (1+w) norms before partial NeoX RoPE, GQA, and a
//! sigmoid output gate taken from the doubled, per-head interleaved `q_proj`.

use candle_core::{DType, Module, Result, Tensor};
use candle_nn::ops::softmax_last_dim;
use mistralrs_core::plugin_api::{
    FlashParams, KvCache, PagedAttention, PagedAttentionInputMetadata, SdpaParams,
};

use crate::config::BerryLmConfig;
use crate::layers::linear::Linear;
use crate::layers::norm::OffsetRmsNorm;
use crate::layers::ops::{matmul, scale, sigmoid};
use crate::layers::rope::PartialRotaryEmbedding;
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
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
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
        Ok(GatedAttention {
            q_proj: Linear::load(&attn, "q_proj", hidden, q_rows, bias)?,
            k_proj: Linear::load(&attn, "k_proj", hidden, kv_rows, bias)?,
            v_proj: Linear::load(&attn, "v_proj", hidden, kv_rows, bias)?,
            o_proj: Linear::load(
                &attn,
                "o_proj",
                cfg.num_attention_heads * head_dim,
                hidden,
                bias,
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

    /// `x` `[B, T, hidden]`; `cos`/`sin` `[B, T, rotary_dim]` for each token's position.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        x: &Tensor,
        rope: &PartialRotaryEmbedding,
        cos: &Tensor,
        sin: &Tensor,
        mask: Option<&Tensor>,
        kv: AttentionKv<'_>,
        flash_params: &FlashParams,
    ) -> Result<Tensor> {
        let (batch, seq_len, _) = x.dims3()?;
        let (q, gate) = if self.output_gate {
            let q2 = self.q_proj.forward(x)?.reshape((
                batch,
                seq_len,
                self.num_heads,
                2 * self.head_dim,
            ))?;
            let q = q2.narrow(3, 0, self.head_dim)?;
            let gate = q2.narrow(3, self.head_dim, self.head_dim)?.reshape((
                batch,
                seq_len,
                self.num_heads * self.head_dim,
            ))?;
            (q, Some(gate))
        } else {
            let q =
                self.q_proj
                    .forward(x)?
                    .reshape((batch, seq_len, self.num_heads, self.head_dim))?;
            (q, None)
        };
        let k =
            self.k_proj
                .forward(x)?
                .reshape((batch, seq_len, self.num_kv_heads, self.head_dim))?;
        let v =
            self.v_proj
                .forward(x)?
                .reshape((batch, seq_len, self.num_kv_heads, self.head_dim))?;
        let q = rope.apply(&self.q_norm.forward(&q)?, cos, sin)?;
        let k = rope.apply(&self.k_norm.forward(&k)?, cos, sin)?;

        let q = q.transpose(1, 2)?.contiguous()?;
        let k = k.transpose(1, 2)?.contiguous()?;
        let v = v.transpose(1, 2)?.contiguous()?;
        let attended = match (kv, &self.paged) {
            (
                AttentionKv::Paged {
                    key_value,
                    metadata,
                },
                Some(paged),
            ) => paged.forward(
                &q,
                &k,
                &v,
                mask,
                Some(key_value.0),
                Some(key_value.1),
                metadata,
                &self.sdpa_params,
                Some(flash_params),
            )?,
            (AttentionKv::Paged { .. }, None) => {
                candle_core::bail!(
                    "paged KV blocks were given to a layer built without paged attention"
                )
            }
            (AttentionKv::Contiguous(cache), _) => {
                let (k, v) = cache.append(&k, &v)?;
                self.eager_attention(&q, &k, &v, mask)?
            }
        };
        // Attention over a prompt is `[B, heads, T, hd]`; the paged decode
        // kernel answers `[B, heads, hd]`, already in token-major order.
        let token_major = if attended.rank() == 3 {
            attended
        } else {
            attended.transpose(1, 2)?
        };
        let mut out = token_major.reshape((batch, seq_len, self.num_heads * self.head_dim))?;
        if let Some(gate) = gate {
            out = (out * sigmoid(&gate)?)?;
        }
        self.o_proj.forward(&out)
    }

    /// The reference's eager attention: `softmax(q k^T * scale + mask)` in f32,
    /// times `v`, each query head reading KV head `h / groups`. `q` is
    /// `[B, heads, T, hd]`, `k`/`v` `[B, kv_heads, L, hd]`, the mask `[T, L]`.
    fn eager_attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let groups = self.sdpa_params.n_kv_groups;
        let repeat = |t: &Tensor| -> Result<Tensor> {
            if groups == 1 {
                return t.contiguous();
            }
            let (b, kv_heads, len, dim) = t.dims4()?;
            t.unsqueeze(2)?
                .broadcast_as((b, kv_heads, groups, len, dim))?
                .contiguous()?
                .reshape((b, kv_heads * groups, len, dim))
        };
        // The keys transposed once for every block of queries.
        let (k_t, v) = (repeat(k)?.t()?.contiguous()?, repeat(v)?);
        let queries = q.dim(2)?;
        if queries <= QUERY_CHUNK {
            return self.attend(q, &k_t, &v, mask);
        }
        // Long prompts in chunks of queries: the scores of a whole 16k-token
        // prompt would hold 2^32 elements per 16 heads, past what one kernel
        // launch indexes.
        let mut outputs = Vec::with_capacity(queries.div_ceil(QUERY_CHUNK));
        for start in (0..queries).step_by(QUERY_CHUNK) {
            let len = QUERY_CHUNK.min(queries - start);
            let rows = mask
                .map(|mask| mask.narrow(mask.rank() - 2, start, len))
                .transpose()?;
            outputs.push(self.attend(&q.narrow(2, start, len)?, &k_t, &v, rows.as_ref())?);
        }
        Tensor::cat(&outputs, 2)
    }

    /// `softmax(q k_t * scale + mask) v` with the keys `k_t` (transposed,
    /// `[B, heads, hd, L]`) and `v` already repeated to the query heads.
    fn attend(
        &self,
        q: &Tensor,
        k_t: &Tensor,
        v: &Tensor,
        mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let scores = scale(
            &matmul(&q.contiguous()?, k_t)?,
            f64::from(self.sdpa_params.softmax_scale),
        )?;
        let scores = match mask {
            Some(mask) => scores.broadcast_add(&mask.to_dtype(scores.dtype())?)?,
            None => scores,
        };
        let probs = softmax_last_dim(&scores.to_dtype(DType::F32)?)?.to_dtype(q.dtype())?;
        matmul(&probs, v)
    }
}
