//! The host loader for BerryLM checkpoints.

use std::collections::HashMap;
use std::fmt::Debug;

use anyhow::Result;
use candle_core::{DType, Device};
use mistralrs_core::matformer::MatformerSliceConfig;
use mistralrs_core::plugin_api::{
    AttentionImplementation, AutoDeviceMapParams, DeviceMappedModelLoader, DeviceMapper,
    IsqModelLoader, LoraConfig, ModelConfigLike, NormalLoadingMetadata, NormalModel,
    NormalModelLoader, XLoraConfig, ATTENTION_CHUNK_SIZE,
};
use mistralrs_core::Ordering;
use mistralrs_quant::ShardedVarBuilder;
use regex::Regex;

use crate::config::{BerryLmConfig, LayerKind};
use crate::host::{model_metadata, BerryLmHostModel};
use crate::layers::rope::PartialRotaryEmbedding;
use crate::model::BerryLm;
use crate::quantization::{self, QuantizationReport};
use crate::weights::Weights;

/// Head sizes of the host's paged attention decode kernels.
const PAGED_HEAD_SIZES: [usize; 8] = [64, 80, 96, 112, 128, 192, 256, 512];

/// Loads BerryLM checkpoints for the host.
pub struct BerryLmLoader {
    /// The registered chat output parser the model's requests use.
    pub output_parser: String,
}

/// Logs how many projections the host's LoRA adapters (`--lora`) were merged
/// into; fails when adapters were given and none of them applies to a
/// BerryLM projection, rather than serving the model without them.
fn report_lora_adapters(weights: &Weights) -> Result<()> {
    let adapters = mistralrs_quant::get_applied_loras().len();
    if adapters == 0 {
        return Ok(());
    }
    let merged = weights.lora_merges();
    if merged == 0 {
        anyhow::bail!(
            "BerryLM: none of the {adapters} LoRA adapter(s) given (--lora) holds weights for a \
             projection its target_modules name (e.g. `model.layers.0.linear_attn.in_proj_qkv`); \
             BerryLM merges adapters into its projections only, not into the stacked routed experts"
        );
    }
    tracing::info!("BerryLM: LoRA adapters (--lora) merged into {merged} projections");
    Ok(())
}

impl NormalModelLoader for BerryLmLoader {
    fn load(
        &self,
        config: &str,
        vb: ShardedVarBuilder,
        normal_loading_metadata: NormalLoadingMetadata,
        attention_mechanism: AttentionImplementation,
    ) -> Result<Box<dyn NormalModel + Send + Sync>> {
        let cfg = BerryLmConfig::from_json(config)?;
        let device = normal_loading_metadata.real_device.clone();
        ensure_one_device(&*normal_loading_metadata.mapper, &device)?;
        // With `loading_isq` the host fills or quantizes layers after loading:
        // the projections a UQFF file holds are withheld from the checkpoint.
        let loading_isq = normal_loading_metadata.loading_isq;
        let weights = Weights::new(vb.set_device(device)).with_host_filling_withheld(loading_isq);
        let paged = matches!(attention_mechanism, AttentionImplementation::PagedAttention);
        let mut model = BerryLm::load(cfg, &weights, paged)?;
        report_lora_adapters(&weights)?;
        log_quantization(&mut model, loading_isq)?;
        let cfg = model.config();
        let kda_layers = cfg.num_hidden_layers - cfg.num_full_attention_layers();
        tracing::info!(
            "BerryLM: {} layers ({kda_layers} KDA, {} full attention), {} experts top-{}",
            cfg.num_hidden_layers,
            cfg.num_full_attention_layers(),
            cfg.num_experts,
            cfg.num_experts_per_tok
        );
        // What a sequence holds besides its KV cache (under paged attention
        // the host reserves it for `--max-seqs` sequences before it sizes the
        // KV pool from the memory left).
        let recurrent_bytes = kda_layers * cfg.recurrent_values_per_kda_layer() * 4;
        tracing::info!(
            "BerryLM: each sequence holds {recurrent_bytes} bytes ({:.1} MiB) of recurrent state \
             (f32, {kda_layers} KDA layers) besides its KV cache",
            recurrent_bytes as f64 / (1024.0 * 1024.0)
        );
        Ok(Box::new(BerryLmHostModel::new(
            model,
            normal_loading_metadata.mapper,
            self.output_parser.clone(),
        )?))
    }

    fn load_xlora(
        &self,
        _config: &str,
        _vb: ShardedVarBuilder,
        _lora_config: &[((String, String), LoraConfig)],
        _xlora_config: Option<XLoraConfig>,
        _xlora_ordering: Ordering,
        _normal_loading_metadata: NormalLoadingMetadata,
        _preload_adapters: &Option<HashMap<String, (ShardedVarBuilder, LoraConfig)>>,
    ) -> Result<Box<dyn NormalModel + Send + Sync>> {
        anyhow::bail!("BerryLM does not support X-LoRA")
    }

    fn is_gptx(&self, _config: &str) -> Result<bool> {
        Ok(true)
    }

    fn get_config_repr(&self, config: &str) -> Result<Box<dyn Debug>> {
        Ok(Box::new(BerryLmConfig::from_json(config)?))
    }

    /// The host's paged decode kernels take head sizes 64, 80, 96, 112, 128,
    /// 192, 256 and 512; other checkpoints keep the contiguous KV cache, and
    /// so does a checkpoint without full-attention layers (the host's paged
    /// KV pool divides its memory among them).
    fn supports_paged_attention(&self, config: &str) -> Result<bool> {
        let cfg = BerryLmConfig::from_json(config)?;
        let reason = paged_attention_unsupported(&cfg);
        if let Some(reason) = &reason {
            tracing::info!("BerryLM: {reason}; using the contiguous KV cache");
        }
        Ok(reason.is_none())
    }
}

/// BerryLM loads every layer, its KV cache and its recurrent state on the
/// pipeline's device: a device map that spreads the layers over several
/// devices (`--device-layers`, a `--topology` with devices, or an automatic
/// map of a model larger than the device) is refused at load, naming them.
fn ensure_one_device(mapper: &dyn DeviceMapper, device: &Device) -> Result<()> {
    let mapped = mapper.get_unique_devices();
    if mapped
        .iter()
        .all(|mapped| mapped.location() == device.location())
    {
        return Ok(());
    }
    let names: Vec<String> = mapped
        .iter()
        .map(|mapped| format!("{:?}", mapped.location()))
        .collect();
    anyhow::bail!(
        "BerryLM runs every layer on one device ({:?}), but the device map places its layers \
         on {}: serve it without `--device-layers` (or a `--topology` naming devices), on a \
         device with room for the whole model",
        device.location(),
        names.join(", ")
    )
}

/// Why the host's paged attention cannot hold this model's KV cache, if so.
fn paged_attention_unsupported(cfg: &BerryLmConfig) -> Option<String> {
    if cfg.num_full_attention_layers() == 0 {
        Some("no full-attention layer, so no KV cache to page".into())
    } else if !PAGED_HEAD_SIZES.contains(&cfg.head_dim) {
        Some(format!(
            "head_dim {} has no paged attention kernel",
            cfg.head_dim
        ))
    } else {
        None
    }
}

/// Logs what the host's ISQ made of the model's projections. A load the host
/// would quantize after loading the whole checkpoint (an imatrix, per-layer
/// ISQ types of a topology) is refused: BerryLM's projections are the host's
/// layers only when it quantizes them while loading (`--isq`) or fills them
/// from a UQFF file. What tells is whether the checkpoint withheld layers for
/// the host to fill, not whether the host holds any: on CUDA the stacked
/// experts are the host's layers whenever it quantizes, in full precision
/// until then.
fn log_quantization(model: &mut BerryLm, loading_isq: bool) -> Result<()> {
    let report = QuantizationReport::of(model)?;
    let filled_from_uqff = report.as_ref().is_some_and(|report| report.withheld > 0);
    anyhow::ensure!(
        !loading_isq || filled_from_uqff,
        "BerryLM cannot be quantized after loading (an imatrix file, `--imatrix`, or \
         per-layer ISQ types in a `--topology`): quantize it while loading (`--isq TYPE`) \
         or load a UQFF file (`--from-uqff`)"
    );
    let Some(report) = report else {
        return Ok(());
    };
    if filled_from_uqff {
        tracing::info!(
            "BerryLM: {} of its {} quantizable projections come from the UQFF file",
            report.withheld,
            report.projections
        );
    } else {
        tracing::info!("BerryLM: in-situ quantization {report}");
    }
    Ok(())
}

/// The tensors the host may quantize (`crate::quantization`).
impl IsqModelLoader for BerryLmLoader {
    fn isq_layer_regexes(&self, _config: &str) -> Result<Vec<Regex>> {
        Ok(quantization::quantizable_tensors()?)
    }

    fn immediate_isq_predicates(&self, config: &str) -> Result<Vec<Regex>> {
        self.isq_layer_regexes(config)
    }

    fn isq_layer_regexes_moqe(&self, _config: &str) -> Result<Vec<Regex>> {
        Ok(quantization::quantizable_tensors_moqe()?)
    }

    fn immediate_isq_predicates_moqe(&self, config: &str) -> Result<Vec<Regex>> {
        self.isq_layer_regexes_moqe(config)
    }
}

impl DeviceMappedModelLoader for BerryLmLoader {
    fn mapped_max_act_size_elems(
        &self,
        config: &str,
        params: &AutoDeviceMapParams,
    ) -> Result<usize> {
        let AutoDeviceMapParams::Text {
            max_seq_len,
            max_batch_size,
        } = params
        else {
            anyhow::bail!("BerryLM is a text model")
        };
        let cfg = BerryLmConfig::from_json(config)?;
        Ok(
            max_batch_size
                * cfg.num_attention_heads
                * max_seq_len.min(&ATTENTION_CHUNK_SIZE).pow(2),
        )
    }

    fn non_mapped_max_act_size_elems(
        &self,
        _config: &str,
        _params: &AutoDeviceMapParams,
    ) -> Result<usize> {
        Ok(0)
    }

    fn non_mapped_size_in_bytes(
        &self,
        config: &str,
        dtype: DType,
        weight_pack_factor: usize,
        _matformer_config: Option<&MatformerSliceConfig>,
    ) -> Result<usize> {
        let cfg = BerryLmConfig::from_json(config)?;
        let embedding = cfg.vocab_size * cfg.hidden_size;
        let lm_head = if cfg.tie_word_embeddings {
            0
        } else {
            embedding / weight_pack_factor
        };
        let rotary_tables = PartialRotaryEmbedding::table_bytes(
            cfg.rotary_dim(),
            cfg.max_position_embeddings,
            dtype,
        );
        Ok((embedding + lm_head + cfg.hidden_size) * dtype.size_in_bytes() + rotary_tables)
    }

    fn layer_sizes_in_bytes(
        &self,
        config: &str,
        dtype: DType,
        weight_pack_factor: usize,
        _matformer_config: Option<&MatformerSliceConfig>,
    ) -> Result<Vec<usize>> {
        let cfg = BerryLmConfig::from_json(config)?;
        // The projections the host may quantize take 1 / weight_pack_factor
        // (crate::quantization lists them).
        let hidden = cfg.hidden_size;
        let moe = hidden * cfg.num_experts
            + cfg.num_experts * 3 * hidden * cfg.moe_intermediate_size / weight_pack_factor
            + 3 * hidden * cfg.shared_expert_intermediate_size / weight_pack_factor
            + hidden;
        let norms_and_attn_res = 2 * hidden
            + if cfg.attn_res_enabled() {
                hidden + 1
            } else {
                0
            };
        let sizes = cfg
            .layer_types
            .iter()
            .map(|kind| {
                let mixer = match kind {
                    LayerKind::FullAttention => {
                        let q_rows = cfg.num_attention_heads
                            * cfg.head_dim
                            * if cfg.attn_output_gate { 2 } else { 1 };
                        let kv_rows = cfg.num_key_value_heads * cfg.head_dim;
                        ((q_rows + 2 * kv_rows) * hidden
                            + cfg.num_attention_heads * cfg.head_dim * hidden)
                            / weight_pack_factor
                            + 2 * cfg.head_dim
                    }
                    LayerKind::LinearAttention => {
                        let gate_dim = cfg.linear_num_value_heads * cfg.linear_key_head_dim;
                        (cfg.linear_conv_dim() + 2 * cfg.linear_value_dim()) * hidden
                            / weight_pack_factor
                            + cfg.linear_num_value_heads * hidden
                            + cfg.kda_gate_bottleneck * (hidden + gate_dim)
                            + cfg.linear_conv_dim() * cfg.linear_conv_kernel_dim
                            + gate_dim
                            + cfg.linear_num_value_heads
                            + cfg.linear_value_head_dim
                    }
                };
                (mixer + moe + norms_and_attn_res) * dtype.size_in_bytes()
            })
            .collect();
        Ok(sizes)
    }

    fn num_layers(&self, config: &str) -> Result<usize> {
        Ok(BerryLmConfig::from_json(config)?.num_hidden_layers)
    }

    fn model_config(&self, config: &str) -> Result<Box<dyn ModelConfigLike>> {
        let cfg = BerryLmConfig::from_json(config)?;
        Ok(Box::new(model_metadata(&cfg, cfg.num_hidden_layers)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(json: &str) -> BerryLmConfig {
        BerryLmConfig::from_json(json).unwrap()
    }

    #[test]
    fn paged_attention_needs_a_kernel_head_size_and_an_attention_layer() {
        assert_eq!(paged_attention_unsupported(&config("{}")), None);
        let odd_head = paged_attention_unsupported(&config(r#"{"head_dim": 12}"#)).unwrap();
        assert!(odd_head.contains("head_dim 12"), "{odd_head}");
        let kda_only = config(
            r#"{"num_hidden_layers": 2, "layer_types": ["linear_attention", "linear_attention"]}"#,
        );
        assert_eq!(kda_only.num_full_attention_layers(), 0);
        let reason = paged_attention_unsupported(&kda_only).unwrap();
        assert!(reason.contains("no full-attention layer"), "{reason}");
    }
}
