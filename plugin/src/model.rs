//! The BerryLM decoder: embeddings, the hybrid layer stack with Gated Block
//! AttnRes on the residual stream, the final norm and the LM head.

use candle_core::{DType, Device, IndexOp, Module, Result, Tensor};
use mistralrs_core::layers::CausalMasker;
use mistralrs_core::plugin_api::{
    FlashParams, HybridCache, HybridCacheConfig, HybridLayerCache, HybridLayerType, PagedAttention,
    PagedAttentionInputMetadata, PastKvLenCache, RecurrentLayerConfig, RecurrentStatePool,
};

use crate::config::{BerryLmConfig, LayerKind};
use crate::layers::attention::{uses_tiled_attention, AttentionKv, GatedAttention};
use crate::layers::attn_res::AttnRes;
use crate::layers::kda::{Kda, KdaState};
use crate::layers::linear::Linear;
use crate::layers::moe::SparseMoe;
use crate::layers::norm::OffsetRmsNorm;
use crate::layers::projection::{HostLayer, Projection, ProjectionSpec};
use crate::layers::rope::PartialRotaryEmbedding;
use crate::weights::Weights;
use berrylm_kernels::StatePool;

enum Mixer {
    Kda(Kda),
    Attention(GatedAttention),
}

struct DecoderLayer {
    attn_res: Option<AttnRes>,
    input_layernorm: OffsetRmsNorm,
    post_attention_layernorm: OffsetRmsNorm,
    mixer: Mixer,
    moe: SparseMoe,
}

/// What a layer's token mixer reads and updates besides its input: a KDA
/// layer's recurrent pool and the batch's slots in it, an attention layer's
/// KV and the batch's positions.
enum MixerState<'a> {
    Kda {
        pool: &'a mut RecurrentStatePool,
        slots: &'a RecurrentSlots,
        /// The real tokens of each row.
        token_counts: &'a [usize],
    },
    Attention {
        kv: AttentionKv<'a>,
        cos: &'a Tensor,
        sin: &'a Tensor,
        mask: Option<&'a Tensor>,
        flash_params: &'a FlashParams,
    },
}

impl DecoderLayer {
    /// One layer on the residual stream `x` `[B * T, hidden]`, `committed`
    /// the AttnRes blocks committed so far:
    ///
    /// ```text
    /// x = attn_res(committed, x)                 (with AttnRes)
    /// h = x + mixer(input_layernorm(x))          (KDA or gated attention)
    /// y = h + moe(post_attention_layernorm(h))
    /// ```
    fn forward(
        &self,
        x: &Tensor,
        committed: &[Tensor],
        (rows, seq_len): (usize, usize),
        state: MixerState<'_>,
    ) -> Result<Tensor> {
        let hidden = x.dim(1)?;
        let (x, normed) = match &self.attn_res {
            Some(attn_res) => attn_res.forward_norm(committed, x, &self.input_layernorm)?,
            None => (x.clone(), self.input_layernorm.forward(x)?),
        };
        let mixed = self
            .mixer
            .forward(&normed.reshape((rows, seq_len, hidden))?, state)?;
        self.moe.forward_after_mixer(
            &x,
            &mixed.reshape((rows * seq_len, hidden))?,
            &self.post_attention_layernorm,
            (rows, seq_len),
        )
    }
}

impl DecoderLayer {
    fn host_layers_mut<'a>(&'a mut self, out: &mut Vec<&'a mut HostLayer>) {
        match &mut self.mixer {
            Mixer::Kda(kda) => kda.host_layers_mut(out),
            Mixer::Attention(attention) => attention.host_layers_mut(out),
        }
        self.moe.host_layers_mut(out);
    }

    fn checkpoint_tensors(&self, dtype: DType, out: &mut Vec<(String, Tensor)>) -> Result<()> {
        if let Some(attn_res) = &self.attn_res {
            attn_res.checkpoint_tensors(dtype, out)?;
        }
        out.push(self.input_layernorm.checkpoint_tensor());
        out.push(self.post_attention_layernorm.checkpoint_tensor());
        match &self.mixer {
            Mixer::Kda(kda) => kda.checkpoint_tensors(dtype, out)?,
            Mixer::Attention(attention) => attention.checkpoint_tensors(out)?,
        }
        self.moe.checkpoint_tensors(out)
    }
}

impl Mixer {
    fn forward(&self, normed: &Tensor, state: MixerState<'_>) -> Result<Tensor> {
        match (self, state) {
            (
                Mixer::Kda(kda),
                MixerState::Kda {
                    pool,
                    slots,
                    token_counts,
                },
            ) => run_kda(kda, normed, token_counts, slots, pool),
            (
                Mixer::Attention(attention),
                MixerState::Attention {
                    kv,
                    cos,
                    sin,
                    mask,
                    flash_params,
                },
            ) => attention.forward(normed, cos, sin, mask, kv, flash_params),
            _ => candle_core::bail!(
                "BerryLM forward: the host cache of a layer does not match its kind"
            ),
        }
    }
}

/// The sequences of one forward pass. Every row continues its sequence from
/// the state the cache holds for it; rows are right-padded to the same length.
pub struct ForwardBatch<'a> {
    /// `[B, T]` token ids.
    pub input_ids: &'a Tensor,
    /// Tokens each sequence has already processed (its position offset).
    pub seqlen_offsets: &'a [usize],
    /// Real (unpadded) tokens in each row, each in `1..=T`.
    pub token_counts: &'a [usize],
}

/// The recurrent state slots of a batch's sequences: on the device (the
/// kernels' index) and the same on the host.
#[derive(Clone)]
pub(crate) struct RecurrentSlots {
    pub indices: Tensor,
    pub host: Vec<u32>,
}

/// What the decoder layers read of a batch besides the caches.
pub(crate) struct StepInputs {
    /// The tokens' embeddings `[B * T, hidden]`.
    pub embedded: Tensor,
    /// Each token's rotary rows `[B, T, rotary_dim]`.
    pub cos: Tensor,
    pub sin: Tensor,
}

/// Paged KV blocks of the attention layers, indexed by attention-layer ordinal.
pub struct PagedKv<'a> {
    pub blocks: &'a [(Tensor, Tensor)],
    pub metadata: &'a PagedAttentionInputMetadata,
}

/// The LM head: the embedding when tied (full precision), else its own projection.
enum LmHead {
    Tied(Linear),
    Own(Projection),
}

pub struct BerryLm {
    cfg: BerryLmConfig,
    embed_tokens: Tensor,
    /// The embedding's checkpoint name.
    embed_tokens_name: String,
    layers: Vec<DecoderLayer>,
    norm: OffsetRmsNorm,
    lm_head: LmHead,
    rope: PartialRotaryEmbedding,
    device: Device,
    /// The device's freed memory stays pooled while the model lives.
    #[cfg(feature = "cuda")]
    _pooled_memory: crate::device_memory::PooledFreedMemory,
}

impl BerryLm {
    /// Loads every tensor the model uses (others, e.g. `mtp.*`, are never read).
    /// With `paged_attention`, attention layers run on the host's paged KV blocks.
    pub fn load(
        cfg: BerryLmConfig,
        weights: &Weights,
        paged_attention: bool,
    ) -> crate::error::Result<BerryLm> {
        let device = weights.device().clone();
        #[cfg(feature = "cuda")]
        let pooled_memory = crate::device_memory::PooledFreedMemory::keep(&device)?;
        let model = weights.pp("model");
        let embed_module = model.pp("embed_tokens");
        let embed_tokens = embed_module.get((cfg.vocab_size, cfg.hidden_size), "weight")?;
        let lm_head = if cfg.tie_word_embeddings {
            LmHead::Tied(Linear::new(embed_tokens.clone(), None))
        } else {
            LmHead::Own(Projection::load(
                weights,
                ProjectionSpec::quantizable("lm_head", cfg.hidden_size, cfg.vocab_size),
            )?)
        };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for (index, kind) in cfg.layer_types.iter().enumerate() {
            let layer = model.pp("layers").pp(index);
            let mixer = match kind {
                LayerKind::LinearAttention => Mixer::Kda(Kda::load(&layer, &cfg)?),
                LayerKind::FullAttention => {
                    let paged = if paged_attention {
                        Some(PagedAttention::new(cfg.head_dim, &device, None)?)
                    } else {
                        None
                    };
                    Mixer::Attention(GatedAttention::load(&layer, &cfg, paged)?)
                }
            };
            layers.push(DecoderLayer {
                attn_res: if cfg.attn_res_enabled() {
                    Some(AttnRes::load(&layer, &cfg)?)
                } else {
                    None
                },
                input_layernorm: OffsetRmsNorm::load(
                    &layer,
                    "input_layernorm",
                    cfg.hidden_size,
                    cfg.rms_norm_eps,
                )?,
                post_attention_layernorm: OffsetRmsNorm::load(
                    &layer,
                    "post_attention_layernorm",
                    cfg.hidden_size,
                    cfg.rms_norm_eps,
                )?,
                mixer,
                moe: SparseMoe::load(&layer, &cfg)?,
            });
        }
        let norm = OffsetRmsNorm::load(&model, "norm", cfg.hidden_size, cfg.rms_norm_eps)?;
        let rope = PartialRotaryEmbedding::new(
            cfg.rope.theta,
            cfg.rotary_dim(),
            cfg.max_position_embeddings,
            embed_tokens.dtype(),
            &device,
        )?;
        Ok(BerryLm {
            cfg,
            embed_tokens,
            embed_tokens_name: embed_module.full_name("weight"),
            layers,
            norm,
            lm_head,
            rope,
            device,
            #[cfg(feature = "cuda")]
            _pooled_memory: pooled_memory,
        })
    }

    pub fn config(&self) -> &BerryLmConfig {
        &self.cfg
    }

    /// The projections the host quantizes or fills (`IsqModel::get_layers`),
    /// each with its decoder layer (`None` for the LM head), in a fixed order.
    pub fn host_layers_mut(&mut self) -> Vec<(&mut HostLayer, Option<usize>)> {
        let mut listed = Vec::new();
        if let LmHead::Own(lm_head) = &mut self.lm_head {
            let mut head = Vec::new();
            lm_head.host_layers_mut(&mut head);
            listed.extend(head.into_iter().map(|layer| (layer, None)));
        }
        for (index, layer) in self.layers.iter_mut().enumerate() {
            let mut own = Vec::new();
            layer.host_layers_mut(&mut own);
            listed.extend(own.into_iter().map(|host_layer| (host_layer, Some(index))));
        }
        listed
    }

    /// Every tensor the model holds in full precision (all but the host's
    /// layers) under its checkpoint name, in the model's dtype: with a UQFF
    /// file's quantized layers, the whole checkpoint (`IsqModel::residual_tensors`).
    pub fn checkpoint_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let dtype = self.embed_tokens.dtype();
        let mut tensors = vec![(self.embed_tokens_name.clone(), self.embed_tokens.clone())];
        for layer in &self.layers {
            layer.checkpoint_tensors(dtype, &mut tensors)?;
        }
        tensors.push(self.norm.checkpoint_tensor());
        if let LmHead::Own(lm_head) = &self.lm_head {
            lm_head.full_precision_tensors(&mut tensors)?;
        }
        Ok(tensors)
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Whether the attention layers can run on the host's paged KV blocks.
    pub fn paged_attention(&self) -> bool {
        self.layers.iter().all(|layer| match &layer.mixer {
            Mixer::Attention(attention) => attention.is_paged(),
            Mixer::Kda(_) => true,
        })
    }

    /// Whether every layer's routed experts decode in BerryLM's kernels, as a
    /// CUDA graph can replay them
    /// ([`crate::layers::moe::SparseMoe::decodes_in_berrylm_kernels`]; the
    /// host's quantized matmul, which projections of more rows than
    /// BerryLM's GEMV takes run in, replays from graphs).
    pub fn decodes_in_berrylm_kernels(&self) -> bool {
        self.layers
            .iter()
            .all(|layer| layer.moe.decodes_in_berrylm_kernels())
    }

    /// The activations' dtype (the embedding's).
    pub fn dtype(&self) -> DType {
        self.embed_tokens.dtype()
    }

    /// The host cache layout: KV caches for attention layers, recurrent pools
    /// (packed q|k|v conv state of `Kc` columns, state `[Hv, dk, dv]`) for KDA.
    pub fn hybrid_cache_config(&self) -> HybridCacheConfig {
        HybridCacheConfig {
            layer_types: self
                .cfg
                .layer_types
                .iter()
                .map(|kind| match kind {
                    LayerKind::LinearAttention => HybridLayerType::Recurrent,
                    LayerKind::FullAttention => HybridLayerType::Attention,
                })
                .collect(),
            max_seq_len: self.cfg.max_position_embeddings,
            recurrent: RecurrentLayerConfig {
                conv_dim: self.cfg.linear_conv_dim(),
                conv_width: self.cfg.linear_conv_kernel_dim,
                state_dims: vec![
                    self.cfg.linear_num_value_heads,
                    self.cfg.linear_key_head_dim,
                    self.cfg.linear_value_head_dim,
                ],
            },
        }
    }

    /// A fresh host cache for this model. The pools are f32: the recurrent
    /// state must be (the reference keeps it in fp32), and the conv state holds
    /// activation-dtype values exactly.
    pub fn new_cache(&self) -> Result<HybridCache> {
        HybridCache::new(self.hybrid_cache_config(), DType::F32, &self.device)
            .map_err(|e| candle_core::Error::Msg(format!("creating the BerryLM cache: {e}")))
    }

    /// Runs the decoder and returns the final-normed hidden states `[B, T, hidden]`.
    /// If `layer_outputs` is given, each decoder layer's output is pushed to it.
    pub fn forward_hidden(
        &self,
        batch: &ForwardBatch<'_>,
        cache: &mut HybridCache,
        paged: Option<PagedKv<'_>>,
        flash_params: &FlashParams,
        layer_outputs: Option<&mut Vec<Tensor>>,
    ) -> Result<Tensor> {
        self.check_batch(batch, paged.is_some())?;
        let slots = self.recurrent_slots(cache, batch.seqlen_offsets.len())?;
        let inputs = self.step_inputs(batch)?;
        let mask = self.causal_mask(batch, inputs.embedded.dtype(), paged.as_ref())?;
        let hidden = self.run_layers(
            &inputs,
            batch.token_counts,
            slots.as_ref(),
            cache,
            paged,
            mask.as_ref(),
            flash_params,
            layer_outputs,
        )?;
        if let Some(slots) = &slots {
            advance_recurrent_offsets(cache, &slots.host, batch);
        }
        Ok(hidden)
    }

    /// Without the host's recurrent state slots (`--no-kv-cache`: the host
    /// keeps no state and every step recomputes each sequence from its first
    /// token), a batch that starts every row at position 0 runs on slots
    /// taken for this step and zeroed: returns them, for
    /// [`BerryLm::free_step_slots`] after the forward.
    pub(crate) fn take_step_slots(
        &self,
        batch: &ForwardBatch<'_>,
        cache: &mut HybridCache,
    ) -> Result<Option<Vec<usize>>> {
        if cache.state_indices().is_some()
            || !self.cfg.layer_types.contains(&LayerKind::LinearAttention)
            || batch.seqlen_offsets.iter().any(|offset| *offset != 0)
        {
            return Ok(None);
        }
        let mut slots = Vec::with_capacity(batch.seqlen_offsets.len());
        let mut take = || -> Result<Tensor> {
            for _ in batch.seqlen_offsets {
                let slot = cache.allocate_seq().ok_or_else(|| {
                    candle_core::Error::Msg(
                        "BerryLM forward: no recurrent state slot is free".into(),
                    )
                })?;
                slots.push(slot);
                cache.reset_seq(slot)?;
            }
            let indices: Vec<u32> = slots.iter().map(|slot| *slot as u32).collect();
            Tensor::new(indices.as_slice(), &self.device)
        };
        match take() {
            Ok(indices) => {
                cache.set_state_indices(Some(indices));
                Ok(Some(slots))
            }
            Err(error) => {
                for slot in slots {
                    cache.free_seq(slot);
                }
                Err(error)
            }
        }
    }

    /// Frees the slots of [`BerryLm::take_step_slots`].
    pub(crate) fn free_step_slots(cache: &mut HybridCache, slots: Vec<usize>) {
        for slot in slots {
            cache.free_seq(slot);
        }
        cache.set_state_indices(None);
    }

    /// Fails unless `batch`'s per-row lists match its rows and, without
    /// paged KV, its rows share one position offset.
    pub(crate) fn check_batch(&self, batch: &ForwardBatch<'_>, paged: bool) -> Result<()> {
        let (rows, _) = batch.input_ids.dims2()?;
        if batch.seqlen_offsets.len() != rows || batch.token_counts.len() != rows {
            candle_core::bail!(
                "BerryLM forward: {rows} rows but {} offsets and {} token counts",
                batch.seqlen_offsets.len(),
                batch.token_counts.len()
            );
        }
        if !paged
            && self.cfg.num_full_attention_layers() > 0
            && batch
                .seqlen_offsets
                .iter()
                .any(|o| *o != batch.seqlen_offsets[0])
        {
            candle_core::bail!(
                "BerryLM forward: a non-paged batch must share one position offset, got {:?}",
                batch.seqlen_offsets
            );
        }
        Ok(())
    }

    /// The recurrent state slots the host gave the batch's `rows` sequences
    /// (read back from the device), `None` for a model without KDA layers.
    pub(crate) fn recurrent_slots(
        &self,
        cache: &HybridCache,
        rows: usize,
    ) -> Result<Option<RecurrentSlots>> {
        if !self.cfg.layer_types.contains(&LayerKind::LinearAttention) {
            return Ok(None);
        }
        let Some(indices) = cache.state_indices() else {
            candle_core::bail!("BerryLM forward: the host gave no recurrent state slots")
        };
        let host: Vec<u32> = indices.to_vec1()?;
        if host.len() != rows {
            candle_core::bail!(
                "BerryLM forward: the host gave {} recurrent state slots for {rows} sequences",
                host.len()
            );
        }
        Ok(Some(RecurrentSlots {
            indices: indices.clone(),
            host,
        }))
    }

    /// What the layers read of the batch besides the caches: its tokens'
    /// embeddings and their rotary rows, computed and uploaded here.
    pub(crate) fn step_inputs(&self, batch: &ForwardBatch<'_>) -> Result<StepInputs> {
        let (_, seq_len) = batch.input_ids.dims2()?;
        let embedded = self
            .embed_tokens
            .index_select(&batch.input_ids.flatten_all()?, 0)?;
        let (cos, sin) = self.rotary_tables(batch, seq_len, embedded.dtype())?;
        Ok(StepInputs { embedded, cos, sin })
    }

    /// The decoder layers and the final norm over `inputs` (`token_counts`:
    /// the real tokens of each row): device work only, what a decode graph
    /// captures; returns `[B, T, hidden]`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run_layers(
        &self,
        inputs: &StepInputs,
        token_counts: &[usize],
        slots: Option<&RecurrentSlots>,
        cache: &mut HybridCache,
        paged: Option<PagedKv<'_>>,
        mask: Option<&Tensor>,
        flash_params: &FlashParams,
        mut layer_outputs: Option<&mut Vec<Tensor>>,
    ) -> Result<Tensor> {
        let (rows, seq_len, _) = inputs.cos.dims3()?;
        let hidden = self.cfg.hidden_size;
        let mut x = inputs.embedded.clone();
        let mut committed: Vec<Tensor> = Vec::new();
        if self.cfg.attn_res_enabled() {
            committed.push(x.clone());
        }
        let mut attention_ordinal = 0;
        for (index, layer) in self.layers.iter().enumerate() {
            let state = match cache.get_mut(index) {
                Some(HybridLayerCache::Recurrent(pool)) => {
                    let Some(slots) = slots else {
                        candle_core::bail!(
                            "BerryLM forward: the host gave no recurrent state slots"
                        )
                    };
                    MixerState::Kda {
                        pool,
                        slots,
                        token_counts,
                    }
                }
                Some(HybridLayerCache::Attention(kv)) => {
                    let kv = match &paged {
                        Some(paged) => AttentionKv::Paged {
                            key_value: paged.blocks[attention_ordinal].clone(),
                            metadata: paged.metadata,
                        },
                        None => AttentionKv::Contiguous(kv),
                    };
                    attention_ordinal += 1;
                    MixerState::Attention {
                        kv,
                        cos: &inputs.cos,
                        sin: &inputs.sin,
                        mask,
                        flash_params,
                    }
                }
                None => candle_core::bail!("BerryLM forward: the host cache has no layer {index}"),
            };
            x = layer.forward(&x, &committed, (rows, seq_len), state)?;
            if self.cfg.attn_res_enabled() && (index + 1) % self.cfg.attn_res_block_size == 0 {
                committed.push(x.clone());
            }
            if let Some(outputs) = layer_outputs.as_mut() {
                outputs.push(x.reshape((rows, seq_len, hidden))?);
            }
        }
        self.norm.forward(&x)?.reshape((rows, seq_len, hidden))
    }

    /// LM head over `[N, hidden]` (or `[B, T, hidden]`).
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        match &self.lm_head {
            LmHead::Tied(embedding) => embedding.forward(hidden),
            LmHead::Own(lm_head) => lm_head.forward(hidden),
        }
    }

    fn rotary_tables(
        &self,
        batch: &ForwardBatch<'_>,
        seq_len: usize,
        dtype: DType,
    ) -> Result<(Tensor, Tensor)> {
        // Every row's positions in one table: one upload per forward.
        let positions: Vec<usize> = batch
            .seqlen_offsets
            .iter()
            .flat_map(|&offset| offset..offset + seq_len)
            .collect();
        let (cos, sin) = self.rope.cos_sin(&positions, dtype, &self.device)?;
        let dims = (batch.seqlen_offsets.len(), seq_len, cos.dim(1)?);
        Ok((cos.reshape(dims)?, sin.reshape(dims)?))
    }

    fn causal_mask(
        &self,
        batch: &ForwardBatch<'_>,
        dtype: DType,
        paged: Option<&PagedKv<'_>>,
    ) -> Result<Option<Tensor>> {
        let (_, seq_len) = batch.input_ids.dims2()?;
        // The tiled attention is causal by itself; the matrix, `T x (past + T)`
        // elements built on the CPU, is only read by the eager attention and by
        // the host's paged prompt attention (in f32). Prefix hits
        // under paged attention get per-sequence masks from the host.
        let paged_key_cache = paged
            .and_then(|paged| paged.blocks.first())
            .map(|(key_cache, _)| key_cache.dtype());
        let mask = if seq_len == 1 {
            None
        } else if uses_tiled_attention(&self.device, dtype, paged_key_cache) {
            // Under paged attention the mask is what tells a prompt from a
            // decode step (without one, the host runs its decode kernel): a
            // one-element placeholder says "prompt".
            Some(Tensor::zeros((1, 1), dtype, &self.device)?)
        } else {
            let offsets: &[usize] = batch.seqlen_offsets;
            CausalMasker.make_causal_mask_matrix(
                batch.input_ids,
                &offsets as &dyn PastKvLenCache,
                dtype,
                self.cfg.num_attention_heads,
            )?
        };
        let Some(paged) = paged else {
            return Ok(mask);
        };
        // A prompt of one new token (a prefix hit that left only the last
        // token) still needs a mask, or the host's decode kernel reads the
        // prompt's metadata as a decode batch's.
        if !paged.metadata.is_first_prompt_chunk {
            return Ok(None);
        }
        match mask {
            Some(mask) => Ok(Some(mask)),
            None => Tensor::zeros((1, 1), dtype, &self.device).map(Some),
        }
    }
}

/// Runs a KDA layer on every row, reading and writing each sequence's slot.
fn run_kda(
    kda: &Kda,
    normed: &Tensor,
    token_counts: &[usize],
    slots: &RecurrentSlots,
    pool: &mut RecurrentStatePool,
) -> Result<Tensor> {
    let (rows, seq_len, _) = normed.dims3()?;
    let all_full = token_counts.iter().all(|count| *count == seq_len);
    if all_full {
        let state = KdaState {
            conv: StatePool {
                states: &pool.conv_state,
                slots: &slots.indices,
                host_slots: &slots.host,
            },
            recurrent: StatePool {
                states: &pool.recurrent_state,
                slots: &slots.indices,
                host_slots: &slots.host,
            },
        };
        return kda.forward(normed, &state);
    }
    // Padded rows: run each sequence on its real tokens only, so padding
    // never reaches its state; padded outputs are zeros.
    let mut outputs = Vec::with_capacity(rows);
    for (row, (&slot, &count)) in slots.host.iter().zip(token_counts).enumerate() {
        let index = Tensor::new(&[slot], pool.device())?;
        let state = KdaState {
            conv: StatePool {
                states: &pool.conv_state,
                slots: &index,
                host_slots: &[slot],
            },
            recurrent: StatePool {
                states: &pool.recurrent_state,
                slots: &index,
                host_slots: &[slot],
            },
        };
        let row_input = normed.i((row..row + 1, ..count))?;
        let row_out = kda.forward(&row_input, &state)?;
        outputs.push(if count < seq_len {
            row_out.pad_with_zeros(1, 0, seq_len - count)?
        } else {
            row_out
        });
    }
    Tensor::cat(&outputs, 0)
}

/// Records in every recurrent pool how many tokens each of the batch's
/// sequences (by its slot) has processed after the forward (host
/// bookkeeping, outside the device work a decode graph captures).
pub(crate) fn advance_recurrent_offsets(
    cache: &mut HybridCache,
    host_slots: &[u32],
    batch: &ForwardBatch<'_>,
) {
    for layer in cache.caches.iter_mut() {
        if let HybridLayerCache::Recurrent(pool) = layer {
            for ((&slot, &offset), &count) in host_slots
                .iter()
                .zip(batch.seqlen_offsets)
                .zip(batch.token_counts)
            {
                pool.set_seqlen_offset(slot as usize, offset + count);
            }
        }
    }
}
