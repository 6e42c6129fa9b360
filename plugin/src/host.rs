//! Thin adapters from the host's model traits to [`BerryLm`].

use std::sync::{Arc, Mutex};

use candle_core::{Device, Result, Tensor};
use mistralrs_core::plugin_api::{
    chat_output_parser_named, AnyMoeBaseModelMixin, ChatOutputParser, ChatOutputRequest,
    DeviceMapper, EitherCache, FlashParams, HybridLayerCache, IsqModel, KvCacheLayout,
    ModelConfigLike, ModelConfigMetadata, NonGranularState, NormalModel,
    PagedAttentionInputMetadata,
};
use mistralrs_quant::QuantMethod;

use crate::model::{BerryLm, ForwardBatch, PagedKv};

pub struct BerryLmHostModel {
    model: BerryLm,
    cache: EitherCache,
    #[cfg(feature = "cuda")]
    decode_graphs: crate::decode_graph::DecodeGraphs,
    mapper: Box<dyn DeviceMapper + Send + Sync>,
    metadata: ModelConfigMetadata,
    /// Name of the registered chat output parser for this model's requests.
    output_parser: String,
}

impl BerryLmHostModel {
    pub fn new(
        model: BerryLm,
        mapper: Box<dyn DeviceMapper + Send + Sync>,
        output_parser: String,
    ) -> Result<Self> {
        let cache = EitherCache::Hybrid(Arc::new(Mutex::new(model.new_cache()?)));
        let metadata = model_metadata(model.config(), model.config().num_hidden_layers);
        Ok(BerryLmHostModel {
            model,
            cache,
            #[cfg(feature = "cuda")]
            decode_graphs: crate::decode_graph::DecodeGraphs::default(),
            mapper,
            metadata,
            output_parser,
        })
    }

    pub fn model(&self) -> &BerryLm {
        &self.model
    }
}

/// Host metadata for `num_layers` KV-cached layers.
pub fn model_metadata(
    cfg: &crate::config::BerryLmConfig,
    num_layers: usize,
) -> ModelConfigMetadata {
    ModelConfigMetadata {
        max_seq_len: cfg.max_position_embeddings,
        num_layers,
        hidden_size: cfg.hidden_size,
        num_kv_heads: cfg.num_key_value_heads,
        num_attn_heads: cfg.num_attention_heads,
        sliding_window: None,
        k_head_dim: cfg.head_dim,
        v_head_dim: cfg.head_dim,
        kv_cache_layout: KvCacheLayout::Standard,
    }
}

/// `in use/capacity` of the first recurrent layer's state pool (the host
/// allocates a sequence's slot in every recurrent layer at once), for the
/// forward's debug line.
fn recurrent_slots_in_use(cache: &EitherCache) -> String {
    let cache = cache.hybrid();
    cache
        .caches
        .iter()
        .find_map(HybridLayerCache::as_recurrent_pool)
        .map(|pool| {
            format!(
                "{}/{}",
                pool.capacity() - pool.num_free_slots(),
                pool.capacity()
            )
        })
        .unwrap_or_else(|| "none".to_string())
}

impl NormalModel for BerryLmHostModel {
    fn forward(
        &self,
        input_ids: &Tensor,
        seqlen_offsets: &[usize],
        context_lens: Vec<(usize, usize)>,
        position_ids: Vec<usize>,
        metadata: Option<(Vec<(Tensor, Tensor)>, &PagedAttentionInputMetadata)>,
        flash_params: &FlashParams,
    ) -> Result<Tensor> {
        let (rows, seq_len) = input_ids.dims2()?;
        // The host passes, per row, the position after its last real token;
        // rows shorter than the batch are right-padded.
        let token_counts: Vec<usize> = position_ids
            .iter()
            .zip(seqlen_offsets)
            .map(|(end, start)| end.saturating_sub(*start).clamp(1, seq_len))
            .collect();
        if token_counts.len() != rows {
            candle_core::bail!(
                "BerryLM forward: {rows} rows but {} position ids",
                token_counts.len()
            );
        }
        tracing::debug!(
            "berrylm forward: {rows} sequences x {seq_len} tokens at positions {seqlen_offsets:?}, recurrent slots in use {}",
            recurrent_slots_in_use(&self.cache)
        );
        let batch = ForwardBatch {
            input_ids,
            seqlen_offsets,
            token_counts: &token_counts,
        };
        let paged = metadata
            .as_ref()
            .map(|(blocks, metadata)| PagedKv { blocks, metadata });
        let mut cache = self.cache.hybrid();
        #[cfg(feature = "cuda")]
        if let Some(paged) = &paged {
            let replayed =
                self.decode_graphs
                    .forward(&self.model, &batch, &mut cache, paged, flash_params)?;
            if let Some(logits) = replayed {
                return Ok(logits);
            }
        }
        // Under `--no-kv-cache` the host gives no recurrent state slots.
        let step_slots = self.model.take_step_slots(&batch, &mut cache)?;
        let hidden = self
            .model
            .forward_hidden(&batch, &mut cache, paged, flash_params, None);
        if let Some(slots) = step_slots {
            BerryLm::free_step_slots(&mut cache, slots);
        }
        let hidden = hidden?;
        drop(cache);
        // A decode step's logits are every row's one token's.
        if seq_len == 1 {
            return self.model.logits(&hidden);
        }
        // Logits at the requested positions; a single last position means the
        // row's own last real token.
        let mut selected = Vec::with_capacity(rows);
        for (row, (start, len)) in context_lens.into_iter().enumerate() {
            let (start, len) = if len == 1 {
                (token_counts[row] - 1, 1)
            } else {
                (start, len)
            };
            selected.push(hidden.narrow(0, row, 1)?.narrow(1, start, len)?);
        }
        self.model.logits(&Tensor::cat(&selected, 0)?)
    }

    fn xlora_forward(
        &self,
        _input_ids: &Tensor,
        _input_ids_full: &Tensor,
        _seqlen_offsets: &[usize],
        _seqlen_offsets_full: &[usize],
        _no_kv_cache: bool,
        _non_granular_state: &Option<NonGranularState>,
        _context_lens: Vec<(usize, usize)>,
        _position_ids: Vec<usize>,
        _flash_params: &FlashParams,
        _flash_params_full: &FlashParams,
    ) -> Result<Tensor> {
        candle_core::bail!("BerryLM does not support X-LoRA")
    }

    fn is_xlora(&self) -> bool {
        false
    }

    fn device(&self) -> &Device {
        self.model.device()
    }

    fn cache(&self) -> &EitherCache {
        &self.cache
    }

    fn cache_mut(&mut self) -> &mut EitherCache {
        &mut self.cache
    }

    fn max_seq_len(&self) -> usize {
        self.model.config().max_position_embeddings
    }

    fn vocab_size(&self) -> Option<usize> {
        Some(self.model.config().vocab_size)
    }

    fn config(&self) -> &ModelConfigMetadata {
        &self.metadata
    }

    /// BerryLM's reasoning and tool-call parsers (`<think>`, Qwen3-Coder XML calls).
    fn chat_output_parser(
        &self,
        request: &ChatOutputRequest<'_>,
    ) -> Option<Box<dyn ChatOutputParser>> {
        tracing::debug!(prompt = ?request.prompt, "berrylm chat request");
        chat_output_parser_named(&self.output_parser, request)
    }

    /// Paged KV blocks are allocated for the full-attention layers only.
    fn model_config(&self) -> Arc<dyn ModelConfigLike + Send + Sync> {
        let cfg = self.model.config();
        Arc::new(model_metadata(cfg, cfg.num_full_attention_layers()))
    }
}

/// The host's in-situ quantization sees the projections it quantized while
/// loading or fills from a UQFF file (crate::layers::projection); the rest of
/// the model is its residual tensors.
impl IsqModel for BerryLmHostModel {
    /// The host may replace any layer it is handed (as `POST /re_isq` does,
    /// where BerryLM does not decline it), so the decode graphs, which read
    /// the weights where they were when captured, are dropped first.
    fn get_layers(
        &mut self,
    ) -> (
        Vec<(&mut Arc<dyn QuantMethod>, Option<usize>)>,
        &dyn DeviceMapper,
    ) {
        #[cfg(feature = "cuda")]
        self.decode_graphs.clear();
        let layers = self
            .model
            .host_layers_mut()
            .into_iter()
            .map(|(layer, index)| (layer.layer_mut(), index))
            .collect();
        (layers, &*self.mapper)
    }

    /// Collecting an imatrix needs the host's layers to see every
    /// projection's inputs in full precision; BerryLM's full-precision
    /// projections are its own.
    fn begin_track_stats(&mut self) -> anyhow::Result<()> {
        anyhow::bail!(CALIBRATION_UNSUPPORTED)
    }

    fn begin_track_stats_moe_experts_only(&mut self) -> anyhow::Result<()> {
        anyhow::bail!(CALIBRATION_UNSUPPORTED)
    }

    /// The tensors a UQFF file does not hold, under their checkpoint names.
    fn residual_tensors(&self) -> Vec<(String, Tensor)> {
        self.model.checkpoint_tensors().unwrap_or_else(|error| {
            panic!("BerryLM: collecting its full-precision tensors for the UQFF file: {error}")
        })
    }
}

const CALIBRATION_UNSUPPORTED: &str = "BerryLM cannot collect an imatrix from a calibration file \
     (`--calibration-file`): quantize it without one (`--isq TYPE`)";

impl AnyMoeBaseModelMixin for BerryLmHostModel {}
