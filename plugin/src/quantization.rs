//! BerryLM under the host's in-situ quantization (ISQ): which checkpoint
//! tensors the host may quantize, and what it did to a loaded model.
//!
//! The host quantizes the projections of attention (`q_proj`, `k_proj`,
//! `v_proj`, `o_proj`) and KDA (`in_proj_qkv`, `in_proj_z`, `out_proj`), the
//! routed and shared experts and the LM head (when it is not the embedding).
//! Everything else stays in full precision, as in the reference
//! implementations: the router and the shared expert's gate, KDA's β
//! (`in_proj_b`) and forget-gate projections (`f_down_proj`, `f_up_proj`),
//! the conv, `A_log`, `dt_bias`, the norms, AttnRes and the embedding.

use candle_core::Result;
use regex::Regex;

use crate::layers::projection::HostLayerState;
use crate::model::BerryLm;

/// The checkpoint tensors the host quantizes by default (`--isq TYPE`), as
/// its ISQ regexes: a name matches when it ends with one of these.
const QUANTIZABLE: [&str; 6] = [
    r"lm_head\.(weight|bias)$",
    r"layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.(weight|bias)$",
    r"layers\.(\d+)\.(linear_attn|kda)\.(in_proj_qkv|in_proj_z|out_proj)\.(weight|bias)$",
    EXPERTS,
    STACKED_EXPERTS,
    SHARED_EXPERT,
];

/// The routed experts, one by one.
const EXPERTS: &str =
    r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|bias)$";
/// The routed experts stacked (`gate_up_proj` `[E, 2I, H]`, `down_proj` `[E, H, I]`).
const STACKED_EXPERTS: &str = r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$";
const SHARED_EXPERT: &str =
    r"layers\.(\d+)\.mlp\.shared_expert\.(gate_proj|up_proj|down_proj)\.(weight|bias)$";

/// What MoQE (`--isq-organization moqe`) quantizes: the experts and the LM
/// head, as the host's MoE models do.
const QUANTIZABLE_MOQE: [&str; 4] = [
    r"lm_head\.(weight|bias)$",
    EXPERTS,
    STACKED_EXPERTS,
    SHARED_EXPERT,
];

fn compile(patterns: &[&str]) -> std::result::Result<Vec<Regex>, regex::Error> {
    patterns.iter().map(|pattern| Regex::new(pattern)).collect()
}

/// The host's ISQ regexes for BerryLM (`IsqModelLoader::isq_layer_regexes`).
pub fn quantizable_tensors() -> std::result::Result<Vec<Regex>, regex::Error> {
    compile(&QUANTIZABLE)
}

/// The same under MoQE (`IsqModelLoader::isq_layer_regexes_moqe`).
pub fn quantizable_tensors_moqe() -> std::result::Result<Vec<Regex>, regex::Error> {
    compile(&QUANTIZABLE_MOQE)
}

/// What the host's ISQ made of a loaded model's projections.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuantizationReport {
    /// The projections the host holds (`IsqModel::get_layers`).
    pub host_layers: usize,
    pub quantized: usize,
    /// Withheld by the checkpoint, for the host to load from a UQFF file.
    pub withheld: usize,
    /// The model's weights in full precision (its dtype), in bytes.
    pub full_precision_bytes: usize,
    /// The model's weights as held now, in bytes (a quantized projection
    /// counts its UQFF serialization: its data and a header of a few bytes).
    pub bytes: usize,
}

impl QuantizationReport {
    /// The report of `model` (waits for quantizations still running); `None`
    /// when the host holds none of its projections.
    pub fn of(model: &mut BerryLm) -> Result<Option<QuantizationReport>> {
        let layers = model
            .host_layers_mut()
            .into_iter()
            .map(|(layer, _)| Ok((layer.state()?, layer.full_precision_bytes())))
            .collect::<Result<Vec<_>>>()?;
        if layers.is_empty() {
            return Ok(None);
        }
        let others: usize = model
            .checkpoint_tensors()?
            .iter()
            .map(|(_, tensor)| tensor.elem_count() * tensor.dtype().size_in_bytes())
            .sum();
        let mut report = QuantizationReport {
            host_layers: layers.len(),
            quantized: 0,
            withheld: 0,
            full_precision_bytes: others,
            bytes: others,
        };
        for (state, full_precision_bytes) in layers {
            report.full_precision_bytes += full_precision_bytes;
            report.bytes += match state {
                HostLayerState::Quantized { bytes } => {
                    report.quantized += 1;
                    bytes
                }
                HostLayerState::FullPrecision => full_precision_bytes,
                HostLayerState::Withheld => {
                    report.withheld += 1;
                    0
                }
            };
        }
        Ok(Some(report))
    }
}

/// `quantized Q of P projections; the weights take B bytes (M MiB), F bytes
/// (N MiB) in full precision`.
impl std::fmt::Display for QuantizationReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mebibytes = |bytes: usize| bytes as f64 / (1024.0 * 1024.0);
        write!(
            f,
            "quantized {} of {} projections; the weights take {} bytes ({:.1} MiB), {} bytes \
             ({:.1} MiB) in full precision",
            self.quantized,
            self.host_layers,
            self.bytes,
            mebibytes(self.bytes),
            self.full_precision_bytes,
            mebibytes(self.full_precision_bytes)
        )
    }
}
