//! `config.json` of a BerryLM checkpoint: every `BerryLMConfig` field with the
//! reference's defaults, the legacy forms real checkpoints use, and validation.

use serde::Deserialize;

use crate::error::{BerryLmError, Result};

/// What each decoder layer mixes tokens with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// KDA linear attention with a recurrent state.
    LinearAttention,
    /// Gated full attention with a KV cache.
    FullAttention,
}

/// RoPE parameters after standardisation (`rope_type: default` only).
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub theta: f64,
    pub partial_rotary_factor: f64,
}

/// The validated configuration the model is built from.
#[derive(Debug, Clone)]
pub struct BerryLmConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub tie_word_embeddings: bool,
    pub rope: RopeConfig,
    pub attention_bias: bool,
    pub attn_output_gate: bool,
    pub linear_conv_kernel_dim: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub moe_intermediate_size: usize,
    pub shared_expert_intermediate_size: usize,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub norm_topk_prob: bool,
    pub layer_types: Vec<LayerKind>,
    /// Commit period of Gated Block AttnRes; 0 disables AttnRes.
    pub attn_res_block_size: usize,
    pub attn_res_gated: bool,
    pub attn_res_eps: f64,
    pub kda_gate_bottleneck: usize,
    /// Lower bound of the KDA log-decay when `kda_safe_gate` is set.
    pub kda_gate_lower_bound: Option<f64>,
}

/// The JSON as written by transformers (and older exports), before validation.
#[derive(Debug, Deserialize)]
struct RawConfig {
    #[serde(default = "defaults::vocab_size")]
    vocab_size: i64,
    #[serde(default = "defaults::hidden_size")]
    hidden_size: i64,
    #[serde(default = "defaults::num_hidden_layers")]
    num_hidden_layers: i64,
    #[serde(default = "defaults::num_attention_heads")]
    num_attention_heads: i64,
    #[serde(default = "defaults::num_key_value_heads")]
    num_key_value_heads: i64,
    #[serde(default = "defaults::head_dim")]
    head_dim: i64,
    #[serde(default = "defaults::hidden_act")]
    hidden_act: String,
    #[serde(default = "defaults::max_position_embeddings")]
    max_position_embeddings: i64,
    #[serde(default = "defaults::rms_norm_eps")]
    rms_norm_eps: f64,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default)]
    rope_parameters: Option<RawRopeParameters>,
    /// Legacy top-level RoPE fields.
    #[serde(default)]
    rope_theta: Option<f64>,
    #[serde(default)]
    partial_rotary_factor: Option<f64>,
    #[serde(default)]
    rope_scaling: Option<serde_json::Value>,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default = "defaults::yes")]
    attn_output_gate: bool,
    #[serde(default = "defaults::linear_conv_kernel_dim")]
    linear_conv_kernel_dim: i64,
    #[serde(default = "defaults::linear_head_dim")]
    linear_key_head_dim: i64,
    #[serde(default = "defaults::linear_head_dim")]
    linear_value_head_dim: i64,
    #[serde(default = "defaults::linear_num_key_heads")]
    linear_num_key_heads: i64,
    #[serde(default = "defaults::linear_num_value_heads")]
    linear_num_value_heads: i64,
    #[serde(default = "defaults::expert_intermediate_size")]
    moe_intermediate_size: i64,
    #[serde(default = "defaults::expert_intermediate_size")]
    shared_expert_intermediate_size: i64,
    #[serde(default = "defaults::num_experts")]
    num_experts: i64,
    #[serde(default = "defaults::num_experts_per_tok")]
    num_experts_per_tok: i64,
    #[serde(default = "defaults::yes")]
    norm_topk_prob: bool,
    #[serde(default)]
    layer_types: Option<Vec<String>>,
    /// Legacy: seeds `layer_types` when they are absent.
    #[serde(default)]
    full_attention_interval: Option<i64>,
    #[serde(default = "defaults::attn_res_block_size")]
    attn_res_block_size: i64,
    #[serde(default = "defaults::yes")]
    attn_res_gated: bool,
    #[serde(default = "defaults::rms_norm_eps")]
    attn_res_eps: f64,
    #[serde(default = "defaults::kda_gate_bottleneck")]
    kda_gate_bottleneck: i64,
    #[serde(default)]
    kda_safe_gate: bool,
    #[serde(default)]
    kda_gate_lower_bound: Option<f64>,
}

#[derive(Debug, Deserialize)]
struct RawRopeParameters {
    #[serde(default)]
    rope_type: Option<String>,
    #[serde(default)]
    rope_theta: Option<f64>,
    #[serde(default)]
    partial_rotary_factor: Option<f64>,
}

mod defaults {
    pub fn vocab_size() -> i64 {
        180_224
    }
    pub fn hidden_size() -> i64 {
        2048
    }
    pub fn num_hidden_layers() -> i64 {
        40
    }
    pub fn num_attention_heads() -> i64 {
        16
    }
    pub fn num_key_value_heads() -> i64 {
        2
    }
    pub fn head_dim() -> i64 {
        256
    }
    pub fn hidden_act() -> String {
        "silu".into()
    }
    pub fn max_position_embeddings() -> i64 {
        262_144
    }
    pub fn rms_norm_eps() -> f64 {
        1e-6
    }
    pub fn yes() -> bool {
        true
    }
    pub fn linear_conv_kernel_dim() -> i64 {
        4
    }
    pub fn linear_head_dim() -> i64 {
        128
    }
    pub fn linear_num_key_heads() -> i64 {
        16
    }
    pub fn linear_num_value_heads() -> i64 {
        32
    }
    pub fn expert_intermediate_size() -> i64 {
        512
    }
    pub fn num_experts() -> i64 {
        128
    }
    pub fn num_experts_per_tok() -> i64 {
        8
    }
    pub fn attn_res_block_size() -> i64 {
        8
    }
    pub fn kda_gate_bottleneck() -> i64 {
        128
    }
}

/// transformers' `RotaryEmbeddingConfigMixin.default_theta` (BerryLM does not override it).
const DEFAULT_ROPE_THETA: f64 = 10_000.0;
const DEFAULT_PARTIAL_ROTARY_FACTOR: f64 = 0.25;
const DEFAULT_FULL_ATTENTION_INTERVAL: i64 = 4;

fn invalid(field: &str, message: impl Into<String>) -> BerryLmError {
    BerryLmError::InvalidConfig {
        field: field.to_string(),
        message: message.into(),
    }
}

fn positive(field: &str, value: i64) -> Result<usize> {
    usize::try_from(value)
        .ok()
        .filter(|v| *v > 0)
        .ok_or_else(|| invalid(field, format!("must be a positive integer, got {value}")))
}

fn positive_float(field: &str, value: f64) -> Result<f64> {
    if value.is_finite() && value > 0.0 {
        Ok(value)
    } else {
        Err(invalid(
            field,
            format!("must be a positive number, got {value}"),
        ))
    }
}

impl BerryLmConfig {
    /// Parses and validates `config.json`.
    pub fn from_json(json: &str) -> Result<BerryLmConfig> {
        let raw: RawConfig = serde_json::from_str(json).map_err(|e| BerryLmError::ConfigJson {
            message: e.to_string(),
        })?;
        Self::validate(raw)
    }

    fn validate(raw: RawConfig) -> Result<BerryLmConfig> {
        let num_hidden_layers = positive("num_hidden_layers", raw.num_hidden_layers)?;
        if raw.hidden_act != "silu" && raw.hidden_act != "swish" {
            return Err(invalid(
                "hidden_act",
                format!("only \"silu\" is supported, got {:?}", raw.hidden_act),
            ));
        }
        let layer_types = match (&raw.layer_types, raw.full_attention_interval) {
            (Some(names), _) => {
                if names.len() != num_hidden_layers {
                    return Err(invalid(
                        "layer_types",
                        format!(
                            "has {} entries but num_hidden_layers is {num_hidden_layers}",
                            names.len()
                        ),
                    ));
                }
                names
                    .iter()
                    .map(|name| match name.as_str() {
                        "linear_attention" => Ok(LayerKind::LinearAttention),
                        "full_attention" => Ok(LayerKind::FullAttention),
                        other => Err(invalid(
                            "layer_types",
                            format!(
                                "entry {other:?} is neither \"linear_attention\" nor \"full_attention\""
                            ),
                        )),
                    })
                    .collect::<Result<Vec<_>>>()?
            }
            (None, interval) => {
                let interval = positive(
                    "full_attention_interval",
                    interval.unwrap_or(DEFAULT_FULL_ATTENTION_INTERVAL),
                )?;
                (0..num_hidden_layers)
                    .map(|i| {
                        if (i + 1) % interval == 0 {
                            LayerKind::FullAttention
                        } else {
                            LayerKind::LinearAttention
                        }
                    })
                    .collect()
            }
        };

        let rope = Self::rope(&raw)?;
        let head_dim = positive("head_dim", raw.head_dim)?;
        let rotary_dim = (head_dim as f64 * rope.partial_rotary_factor) as usize;
        if rotary_dim == 0 || 2 * rotary_dim.div_ceil(2) > head_dim {
            return Err(invalid(
                "partial_rotary_factor",
                format!(
                    "gives a rotary dimension of {rotary_dim} for head_dim {head_dim}; it must be \
                     positive and (rounded up to even) at most head_dim"
                ),
            ));
        }

        let num_attention_heads = positive("num_attention_heads", raw.num_attention_heads)?;
        let num_key_value_heads = positive("num_key_value_heads", raw.num_key_value_heads)?;
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(invalid(
                "num_key_value_heads",
                format!(
                    "{num_key_value_heads} does not divide num_attention_heads {num_attention_heads}"
                ),
            ));
        }
        let linear_num_key_heads = positive("linear_num_key_heads", raw.linear_num_key_heads)?;
        let linear_num_value_heads =
            positive("linear_num_value_heads", raw.linear_num_value_heads)?;
        if linear_num_value_heads % linear_num_key_heads != 0 {
            return Err(invalid(
                "linear_num_value_heads",
                format!(
                    "{linear_num_value_heads} is not a multiple of linear_num_key_heads \
                     {linear_num_key_heads}"
                ),
            ));
        }
        let num_experts = positive("num_experts", raw.num_experts)?;
        let num_experts_per_tok = positive("num_experts_per_tok", raw.num_experts_per_tok)?;
        if num_experts_per_tok > num_experts {
            return Err(invalid(
                "num_experts_per_tok",
                format!("{num_experts_per_tok} exceeds num_experts {num_experts}"),
            ));
        }
        let attn_res_block_size = usize::try_from(raw.attn_res_block_size).map_err(|_| {
            invalid(
                "attn_res_block_size",
                format!("must be >= 0, got {}", raw.attn_res_block_size),
            )
        })?;
        let kda_gate_lower_bound = match (raw.kda_safe_gate, raw.kda_gate_lower_bound) {
            (true, None) => {
                return Err(invalid(
                    "kda_gate_lower_bound",
                    "is required when kda_safe_gate is true",
                ))
            }
            (true, Some(bound)) if !bound.is_finite() => {
                return Err(invalid("kda_gate_lower_bound", "must be a finite number"))
            }
            (true, Some(bound)) => Some(bound),
            (false, _) => None,
        };

        Ok(BerryLmConfig {
            vocab_size: positive("vocab_size", raw.vocab_size)?,
            hidden_size: positive("hidden_size", raw.hidden_size)?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            max_position_embeddings: positive(
                "max_position_embeddings",
                raw.max_position_embeddings,
            )?,
            rms_norm_eps: positive_float("rms_norm_eps", raw.rms_norm_eps)?,
            tie_word_embeddings: raw.tie_word_embeddings,
            rope,
            attention_bias: raw.attention_bias,
            attn_output_gate: raw.attn_output_gate,
            linear_conv_kernel_dim: positive("linear_conv_kernel_dim", raw.linear_conv_kernel_dim)?,
            linear_key_head_dim: positive("linear_key_head_dim", raw.linear_key_head_dim)?,
            linear_value_head_dim: positive("linear_value_head_dim", raw.linear_value_head_dim)?,
            linear_num_key_heads,
            linear_num_value_heads,
            moe_intermediate_size: positive("moe_intermediate_size", raw.moe_intermediate_size)?,
            shared_expert_intermediate_size: positive(
                "shared_expert_intermediate_size",
                raw.shared_expert_intermediate_size,
            )?,
            num_experts,
            num_experts_per_tok,
            norm_topk_prob: raw.norm_topk_prob,
            layer_types,
            attn_res_block_size,
            attn_res_gated: raw.attn_res_gated,
            attn_res_eps: positive_float("attn_res_eps", raw.attn_res_eps)?,
            kda_gate_bottleneck: positive("kda_gate_bottleneck", raw.kda_gate_bottleneck)?,
            kda_gate_lower_bound,
        })
    }

    fn rope(raw: &RawConfig) -> Result<RopeConfig> {
        if raw.rope_scaling.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(invalid(
                "rope_scaling",
                "RoPE scaling is not supported (BerryLM uses default RoPE)",
            ));
        }
        let parameters = raw.rope_parameters.as_ref();
        if let Some(rope_type) = parameters.and_then(|p| p.rope_type.as_deref()) {
            if rope_type != "default" {
                return Err(invalid(
                    "rope_parameters.rope_type",
                    format!("only \"default\" is supported, got {rope_type:?}"),
                ));
            }
        }
        let theta = parameters
            .and_then(|p| p.rope_theta)
            .or(raw.rope_theta)
            .unwrap_or(DEFAULT_ROPE_THETA);
        let partial_rotary_factor = parameters
            .and_then(|p| p.partial_rotary_factor)
            .or(raw.partial_rotary_factor)
            .unwrap_or(DEFAULT_PARTIAL_ROTARY_FACTOR);
        Ok(RopeConfig {
            theta: positive_float("rope_theta", theta)?,
            partial_rotary_factor: positive_float("partial_rotary_factor", partial_rotary_factor)?,
        })
    }

    /// `Hk * dk`: width of the q and k parts of the packed KDA projection.
    pub fn linear_key_dim(&self) -> usize {
        self.linear_num_key_heads * self.linear_key_head_dim
    }

    /// `Hv * dv`: width of the v part and of the KDA output.
    pub fn linear_value_dim(&self) -> usize {
        self.linear_num_value_heads * self.linear_value_head_dim
    }

    /// The f32 values of one sequence's recurrent state in one KDA layer:
    /// its conv state (`linear_conv_dim x linear_conv_kernel_dim`) and its
    /// recurrent state (`Hv x dk x dv`), as the host's pools hold them.
    pub fn recurrent_values_per_kda_layer(&self) -> usize {
        self.linear_conv_dim() * self.linear_conv_kernel_dim
            + self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
    }

    /// Channels of the packed q|k|v short convolution.
    pub fn linear_conv_dim(&self) -> usize {
        2 * self.linear_key_dim() + self.linear_value_dim()
    }

    /// `int(head_dim * partial_rotary_factor)`: sets the RoPE frequencies (the
    /// rotated width is this rounded up to even).
    pub fn rotary_dim(&self) -> usize {
        (self.head_dim as f64 * self.rope.partial_rotary_factor) as usize
    }

    pub fn attn_res_enabled(&self) -> bool {
        self.attn_res_block_size > 0
    }

    pub fn num_full_attention_layers(&self) -> usize {
        self.layer_types
            .iter()
            .filter(|kind| **kind == LayerKind::FullAttention)
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<BerryLmConfig> {
        BerryLmConfig::from_json(json)
    }

    #[test]
    fn defaults_are_the_released_shape() {
        let cfg = parse(r#"{"model_type":"berrylm"}"#).unwrap();
        assert_eq!(cfg.hidden_size, 2048);
        assert_eq!(cfg.num_hidden_layers, 40);
        assert_eq!(cfg.num_full_attention_layers(), 10);
        assert_eq!(cfg.layer_types[3], LayerKind::FullAttention);
        assert_eq!(cfg.layer_types[0], LayerKind::LinearAttention);
        assert_eq!(cfg.linear_conv_dim(), 8192);
        assert_eq!(cfg.rotary_dim(), 64);
        assert_eq!(cfg.rope.theta, 10_000.0);
        assert_eq!(cfg.attn_res_block_size, 8);
    }

    #[test]
    fn legacy_fields_seed_layer_types_and_rope() {
        let cfg = parse(
            r#"{"num_hidden_layers": 6, "full_attention_interval": 3,
                "rope_theta": 1e6, "partial_rotary_factor": 0.5}"#,
        )
        .unwrap();
        let full: Vec<usize> = cfg
            .layer_types
            .iter()
            .enumerate()
            .filter(|(_, k)| **k == LayerKind::FullAttention)
            .map(|(i, _)| i)
            .collect();
        assert_eq!(full, vec![2, 5]);
        assert_eq!(cfg.rope.theta, 1e6);
        assert_eq!(cfg.rotary_dim(), 128);
    }

    #[test]
    fn invalid_values_name_the_field() {
        let cases = [
            (
                r#"{"num_hidden_layers": 2, "layer_types": ["linear_attention"]}"#,
                "layer_types",
            ),
            (
                r#"{"num_hidden_layers": 1, "layer_types": ["mamba"]}"#,
                "layer_types",
            ),
            (
                r#"{"linear_num_key_heads": 3, "linear_num_value_heads": 4}"#,
                "linear_num_value_heads",
            ),
            (r#"{"attn_res_block_size": -1}"#, "attn_res_block_size"),
            (r#"{"kda_safe_gate": true}"#, "kda_gate_lower_bound"),
            (r#"{"hidden_size": 0}"#, "hidden_size"),
            (
                r#"{"num_experts": 4, "num_experts_per_tok": 5}"#,
                "num_experts_per_tok",
            ),
            (r#"{"hidden_act": "gelu"}"#, "hidden_act"),
            (
                r#"{"rope_parameters": {"rope_type": "yarn"}}"#,
                "rope_parameters.rope_type",
            ),
        ];
        for (json, field) in cases {
            let error = parse(json).unwrap_err().to_string();
            assert!(error.contains(field), "{json}: {error}");
        }
    }
}
