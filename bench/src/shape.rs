//! The benchmarked model: a BerryLM-OS-shaped `config.json` and random weights
//! under the checkpoint's HF names, generated directly on the device.

use std::collections::HashMap;

use anyhow::{Context, Result};
use berrylm::model::BerryLm;
use berrylm::weights::Weights;
use berrylm::BerryLmConfig;
use candle_core::{DType, Device, Tensor};
use mistralrs_quant::ShardedSafeTensors;
use serde_json::{json, Value};

/// Every size of the model (spec section 1's symbols).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelShape {
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    pub conv_kernel: usize,
    pub gate_rank: usize,
    pub experts: usize,
    pub top_k: usize,
    pub expert_intermediate: usize,
    pub shared_intermediate: usize,
    pub vocab: usize,
    pub block_size: usize,
}

impl ModelShape {
    /// BerryLM-OS at full width with `layers` layers.
    pub fn full(layers: usize) -> ModelShape {
        ModelShape {
            hidden: 2048,
            layers,
            heads: 16,
            kv_heads: 2,
            head_dim: 256,
            key_heads: 16,
            value_heads: 32,
            key_dim: 128,
            value_dim: 128,
            conv_kernel: 4,
            gate_rank: 128,
            experts: 128,
            top_k: 8,
            expert_intermediate: 512,
            shared_intermediate: 512,
            vocab: 180_224,
            block_size: 8,
        }
    }

    /// A scaled-down shape with the same structure, for quick CPU runs.
    pub fn tiny(layers: usize) -> ModelShape {
        ModelShape {
            hidden: 256,
            layers,
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            key_heads: 4,
            value_heads: 8,
            key_dim: 32,
            value_dim: 32,
            conv_kernel: 4,
            gate_rank: 32,
            experts: 8,
            top_k: 2,
            expert_intermediate: 128,
            shared_intermediate: 128,
            vocab: 2048,
            block_size: 8,
        }
    }

    /// Layer `i` is full attention when `(i + 1) % 4 == 0` (`full_attention_interval` 4).
    pub fn is_attention(&self, layer: usize) -> bool {
        (layer + 1).is_multiple_of(4)
    }

    pub fn kda_layers(&self) -> usize {
        (0..self.layers).filter(|&i| !self.is_attention(i)).count()
    }

    pub fn attention_layers(&self) -> usize {
        self.layers - self.kda_layers()
    }

    /// `Hk * dk`.
    pub fn key_width(&self) -> usize {
        self.key_heads * self.key_dim
    }

    /// `Hv * dv`.
    pub fn value_width(&self) -> usize {
        self.value_heads * self.value_dim
    }

    /// Channels of the packed q|k|v short convolution.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_width() + self.value_width()
    }

    /// `Hv * dk`: width of the forget gate.
    pub fn gate_dim(&self) -> usize {
        self.value_heads * self.key_dim
    }

    /// `[KDA,KDA,KDA,attn]x2` and the like.
    pub fn layout(&self) -> String {
        let kinds: Vec<&str> = (0..self.layers)
            .map(|i| if self.is_attention(i) { "attn" } else { "KDA" })
            .collect();
        if self.layers.is_multiple_of(4) {
            format!("[{}]x{}", kinds[..4].join(","), self.layers / 4)
        } else {
            format!("[{}]", kinds.join(","))
        }
    }

    /// The `config.json` of this shape, as transformers writes it.
    pub fn config_json(&self) -> Value {
        let layer_types: Vec<&str> = (0..self.layers)
            .map(|i| {
                if self.is_attention(i) {
                    "full_attention"
                } else {
                    "linear_attention"
                }
            })
            .collect();
        json!({
            "model_type": "berrylm",
            "architectures": ["BerryLMForCausalLM"],
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": 262_144,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": false,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10_000.0,
                "partial_rotary_factor": 0.25
            },
            "attention_bias": false,
            "attn_output_gate": true,
            "linear_conv_kernel_dim": self.conv_kernel,
            "linear_key_head_dim": self.key_dim,
            "linear_value_head_dim": self.value_dim,
            "linear_num_key_heads": self.key_heads,
            "linear_num_value_heads": self.value_heads,
            "moe_intermediate_size": self.expert_intermediate,
            "shared_expert_intermediate_size": self.shared_intermediate,
            "num_experts": self.experts,
            "num_experts_per_tok": self.top_k,
            "norm_topk_prob": true,
            "layer_types": layer_types,
            "attn_res_block_size": self.block_size,
            "attn_res_gated": true,
            "attn_res_eps": 1e-6,
            "kda_gate_bottleneck": self.gate_rank,
            "kda_safe_gate": false
        })
    }

    /// Every tensor of the checkpoint: its HF name, shape and initialisation.
    pub fn weight_specs(&self) -> Vec<WeightSpec> {
        let h = self.hidden;
        let mut specs = Vec::new();
        let mut add = |name: String, dims: Vec<usize>, init: Init| {
            specs.push(WeightSpec { name, dims, init });
        };
        add(
            "model.embed_tokens.weight".into(),
            vec![self.vocab, h],
            Init::PROJECTION,
        );
        add(
            "lm_head.weight".into(),
            vec![self.vocab, h],
            Init::PROJECTION,
        );
        add("model.norm.weight".into(), vec![h], Init::OFFSET_NORM);
        for i in 0..self.layers {
            let p = format!("model.layers.{i}");
            add(
                format!("{p}.input_layernorm.weight"),
                vec![h],
                Init::OFFSET_NORM,
            );
            add(
                format!("{p}.post_attention_layernorm.weight"),
                vec![h],
                Init::OFFSET_NORM,
            );
            add(
                format!("{p}.attn_res.pseudo_query"),
                vec![h],
                Init::Normal {
                    mean: 0.0,
                    std: 0.02,
                },
            );
            add(
                format!("{p}.attn_res.gate"),
                vec![],
                Init::Uniform { lo: 0.01, hi: 0.1 },
            );
            if self.is_attention(i) {
                let a = format!("{p}.self_attn");
                let (q, kv) = (self.heads * self.head_dim, self.kv_heads * self.head_dim);
                add(
                    format!("{a}.q_proj.weight"),
                    vec![2 * q, h],
                    Init::PROJECTION,
                );
                add(format!("{a}.k_proj.weight"), vec![kv, h], Init::PROJECTION);
                add(format!("{a}.v_proj.weight"), vec![kv, h], Init::PROJECTION);
                add(format!("{a}.o_proj.weight"), vec![h, q], Init::PROJECTION);
                add(
                    format!("{a}.q_norm.weight"),
                    vec![self.head_dim],
                    Init::OFFSET_NORM,
                );
                add(
                    format!("{a}.k_norm.weight"),
                    vec![self.head_dim],
                    Init::OFFSET_NORM,
                );
            } else {
                let k = format!("{p}.linear_attn");
                let bound = 1.0 / (self.conv_kernel as f64).sqrt();
                add(
                    format!("{k}.in_proj_qkv.weight"),
                    vec![self.conv_dim(), h],
                    Init::PROJECTION,
                );
                add(
                    format!("{k}.in_proj_z.weight"),
                    vec![self.value_width(), h],
                    Init::PROJECTION,
                );
                add(
                    format!("{k}.in_proj_b.weight"),
                    vec![self.value_heads, h],
                    Init::PROJECTION,
                );
                add(
                    format!("{k}.conv1d.weight"),
                    vec![self.conv_dim(), 1, self.conv_kernel],
                    Init::Uniform {
                        lo: -bound,
                        hi: bound,
                    },
                );
                add(
                    format!("{k}.f_down_proj.weight"),
                    vec![self.gate_rank, h],
                    Init::PROJECTION,
                );
                add(
                    format!("{k}.f_up_proj.weight"),
                    vec![self.gate_dim(), self.gate_rank],
                    Init::PROJECTION,
                );
                add(format!("{k}.dt_bias"), vec![self.gate_dim()], Init::DtBias);
                add(format!("{k}.A_log"), vec![self.value_heads], Init::ALog);
                add(
                    format!("{k}.norm.weight"),
                    vec![self.value_dim],
                    Init::Normal {
                        mean: 1.0,
                        std: 0.02,
                    },
                );
                add(
                    format!("{k}.out_proj.weight"),
                    vec![h, self.value_width()],
                    Init::PROJECTION,
                );
            }
            let m = format!("{p}.mlp");
            let (e, i_e, i_s) = (
                self.experts,
                self.expert_intermediate,
                self.shared_intermediate,
            );
            add(format!("{m}.gate.weight"), vec![e, h], Init::PROJECTION);
            add(
                format!("{m}.experts.gate_up_proj"),
                vec![e, 2 * i_e, h],
                Init::PROJECTION,
            );
            add(
                format!("{m}.experts.down_proj"),
                vec![e, h, i_e],
                Init::PROJECTION,
            );
            add(
                format!("{m}.shared_expert.gate_proj.weight"),
                vec![i_s, h],
                Init::PROJECTION,
            );
            add(
                format!("{m}.shared_expert.up_proj.weight"),
                vec![i_s, h],
                Init::PROJECTION,
            );
            add(
                format!("{m}.shared_expert.down_proj.weight"),
                vec![h, i_s],
                Init::PROJECTION,
            );
            add(
                format!("{m}.shared_expert_gate.weight"),
                vec![1, h],
                Init::PROJECTION,
            );
        }
        specs
    }

    /// Parameters by what a decode step reads of them.
    pub fn parameter_counts(&self) -> ParameterCounts {
        let mut counts = ParameterCounts::default();
        for spec in self.weight_specs() {
            let elements: usize = spec.dims.iter().product();
            match spec.role() {
                Role::Embedding => counts.embedding += elements,
                Role::Experts => counts.experts += elements,
                Role::Dense => counts.dense += elements,
            }
        }
        counts
    }

    /// Expected number of distinct routed experts per layer in a step of
    /// `tokens` tokens, each choosing `top_k` of `experts` uniformly at random.
    pub fn expected_experts(&self, tokens: usize) -> f64 {
        let miss = 1.0 - self.top_k as f64 / self.experts as f64;
        self.experts as f64 * (1.0 - miss.powi(tokens as i32))
    }
}

/// How a tensor is initialised.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    Normal {
        mean: f64,
        std: f64,
    },
    Uniform {
        lo: f64,
        hi: f64,
    },
    /// `log U(1, 16)` (spec 3.8).
    ALog,
    /// Inverse softplus of `dt = exp(U(log 1e-3, log 0.1))` (spec 3.8).
    DtBias,
}

impl Init {
    /// Projections, router and experts: `N(0, 0.02)` (`initializer_range`).
    const PROJECTION: Init = Init::Normal {
        mean: 0.0,
        std: 0.02,
    };
    /// (1+w) RMSNorm weights: near 0, i.e. near the identity.
    const OFFSET_NORM: Init = Init::Normal {
        mean: 0.0,
        std: 0.02,
    };
}

/// One tensor of the checkpoint.
#[derive(Clone, Debug)]
pub struct WeightSpec {
    pub name: String,
    pub dims: Vec<usize>,
    pub init: Init,
}

/// What a decode step reads of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// One row per distinct token.
    Embedding,
    /// The chosen experts' slices.
    Experts,
    /// All of it.
    Dense,
}

impl WeightSpec {
    pub fn role(&self) -> Role {
        if self.name == "model.embed_tokens.weight" {
            Role::Embedding
        } else if self.name.contains(".mlp.experts.") {
            Role::Experts
        } else {
            Role::Dense
        }
    }

    /// The tensor, generated on `device` in f32 and cast to `dtype`.
    pub(crate) fn generate(&self, dtype: DType, device: &Device) -> Result<Tensor> {
        let dims = self.dims.as_slice();
        let values = match self.init {
            Init::Normal { mean, std } => Tensor::randn(mean as f32, std as f32, dims, device)?,
            Init::Uniform { lo, hi } => Tensor::rand(lo as f32, hi as f32, dims, device)?,
            Init::ALog => Tensor::rand(1f32, 16f32, dims, device)?.log()?,
            Init::DtBias => {
                let (lo, hi) = (1e-3f64.ln(), 0.1f64.ln());
                let dt = Tensor::rand(lo as f32, hi as f32, dims, device)?.exp()?;
                // dt + log(-expm1(-dt)) = dt + log(1 - exp(-dt)); dt >= 1e-3 keeps it accurate in f32.
                let one_minus = dt.neg()?.exp()?.affine(-1.0, 1.0)?;
                (dt + one_minus.log()?)?
            }
        };
        Ok(values.to_dtype(dtype)?)
    }
}

/// Parameter counts of a shape, by what a decode step reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ParameterCounts {
    /// `embed_tokens` (a step reads one row per token).
    pub embedding: usize,
    /// The routed experts of every layer (a step reads the chosen ones).
    pub experts: usize,
    /// Everything else, the LM head included (read in full every step).
    pub dense: usize,
}

impl ParameterCounts {
    pub fn total(&self) -> usize {
        self.embedding + self.experts + self.dense
    }
}

/// Generates every weight on `device` and loads the model from them.
pub fn build_model(shape: &ModelShape, dtype: DType, device: &Device) -> Result<BerryLm> {
    let cfg = BerryLmConfig::from_json(&shape.config_json().to_string())
        .context("the generated config.json is invalid")?;
    let mut tensors = HashMap::new();
    for spec in shape.weight_specs() {
        let tensor = spec
            .generate(dtype, device)
            .with_context(|| format!("generating {} {:?}", spec.name, spec.dims))?;
        tensors.insert(spec.name, tensor);
    }
    let vb = ShardedSafeTensors::wrap(Box::new(tensors), dtype, device.clone());
    // Paged on CUDA: the decode runs of `--decode-kv paged` and `graphs` give it blocks.
    let model = BerryLm::load(cfg, &Weights::new(vb), device.is_cuda())
        .context("loading the random model")?;
    Ok(model)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Spec section 1: the default config's parameter count and active
    /// parameters per token (both embedding matrices counted in full).
    #[test]
    fn full_shape_matches_the_spec_counts() {
        let counts = ModelShape::full(40).parameter_counts();
        assert_eq!(counts.total(), 18_286_907_112);
        let active = counts.dense + counts.embedding + counts.experts * 8 / 128;
        assert_eq!(active, 3_187_412_712);
        assert_eq!(counts.experts, 16_106_127_360);
    }

    #[test]
    fn layouts_and_config() {
        let shape = ModelShape::full(8);
        assert_eq!(shape.layout(), "[KDA,KDA,KDA,attn]x2");
        assert_eq!((shape.kda_layers(), shape.attention_layers()), (6, 2));
        assert_eq!(ModelShape::tiny(2).layout(), "[KDA,KDA]");
        assert_eq!(ModelShape::tiny(6).layout(), "[KDA,KDA,KDA,attn,KDA,KDA]");
        assert_eq!(ModelShape::tiny(4).layout(), "[KDA,KDA,KDA,attn]x1");
        let cfg = BerryLmConfig::from_json(&shape.config_json().to_string()).unwrap();
        assert_eq!(cfg.linear_conv_dim(), 8192);
        assert_eq!(cfg.num_full_attention_layers(), 2);
        assert_eq!(cfg.rotary_dim(), 64);
        assert!((shape.expected_experts(1) - 8.0).abs() < 1e-9);
        assert!(shape.expected_experts(64) < 128.0);
    }

    #[test]
    fn tiny_model_loads_with_sane_weights() {
        let shape = ModelShape::tiny(4);
        let model = build_model(&shape, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(model.config().num_hidden_layers, 4);
        let spec = |suffix: &str| {
            shape
                .weight_specs()
                .into_iter()
                .find(|s| s.name.ends_with(suffix))
                .unwrap()
        };
        let a_log: Vec<f32> = spec("A_log")
            .generate(DType::F32, &Device::Cpu)
            .unwrap()
            .to_vec1()
            .unwrap();
        assert!(a_log.iter().all(|v| (0.0..=16f32.ln()).contains(v)));
        let dt_bias: Vec<f32> = spec("dt_bias")
            .generate(DType::F32, &Device::Cpu)
            .unwrap()
            .to_vec1()
            .unwrap();
        // softplus(dt_bias) = dt in [1e-3, 0.1].
        for v in dt_bias {
            let dt = (1.0 + v.exp()).ln();
            assert!((0.99e-3..=0.101).contains(&dt), "softplus(dt_bias) = {dt}");
        }
    }
}
