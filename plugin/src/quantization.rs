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

use std::borrow::Cow;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{Device, Result, Tensor};
use mistralrs_quant::{GgufMatMul, IsqType, QuantMethod, QuantMethodConfig};
use rayon::prelude::*;
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

/// Whether the host has indexed MoE kernels for stacked experts quantized to
/// `ty` (its GGUF types; in a CUDA build, those its CUDA kernels take).
pub fn stacked_experts_quantizable(ty: IsqType) -> bool {
    GgmlDType::try_from(ty).is_ok()
}

/// Every `[out, in]` weight of `weights` quantized to the GGUF type of `ty`,
/// each on its own thread (candle quantizes a tensor on one), their blocks
/// laid end to end as one `[E, out, in]` tensor on `device`: the layout of
/// the host's stacked experts, which its indexed MoE kernels read. Rows whose
/// width the type's blocks do not divide take the host's fallback type.
pub fn quantize_stacked(weights: &[Tensor], ty: IsqType, device: &Device) -> Result<GgufMatMul> {
    let (out_dim, in_dim) = weights
        .first()
        .ok_or_else(|| candle_core::Error::Msg("no expert weights to quantize".into()))?
        .dims2()?;
    let dtype = gguf_type_for_width(GgmlDType::try_from(ty)?, in_dim);
    let blocks = weights
        .par_iter()
        .map(|weight| {
            // A copy of its own: candle quantizes a tensor's storage from its
            // start, whatever the view's offset.
            let weight = weight.force_contiguous()?;
            Ok(QTensor::quantize(&weight, dtype)?.data()?.into_owned())
        })
        .collect::<Result<Vec<Vec<u8>>>>()?;
    // Borrowed: candle 0.10.2's `from_data` reads an owned buffer after
    // dropping it.
    let blocks = blocks.concat();
    let storage = QStorage::from_data(Cow::Borrowed(&blocks), device, dtype)?;
    let stacked = QTensor::new(storage, (weights.len(), out_dim, in_dim))?;
    GgufMatMul::new(QuantMethodConfig::Gguf {
        q_weight: Arc::new(stacked),
        b: None,
    })
}

/// `dtype` when its blocks divide rows of `width`, else the host's fallback
/// (mistralrs-quant's `utils/isq.rs`: the K-quants fall back to the plain
/// types, `q4k` to `q4_1` ...; a width nothing divides stays in f32).
fn gguf_type_for_width(dtype: GgmlDType, width: usize) -> GgmlDType {
    if width.is_multiple_of(dtype.block_size()) {
        return dtype;
    }
    match dtype {
        GgmlDType::Q2K | GgmlDType::Q3K => gguf_type_for_width(GgmlDType::Q4_0, width),
        GgmlDType::Q4K => gguf_type_for_width(GgmlDType::Q4_1, width),
        GgmlDType::Q5K => gguf_type_for_width(GgmlDType::Q5_0, width),
        GgmlDType::Q6K => gguf_type_for_width(GgmlDType::Q5_1, width),
        GgmlDType::Q8K => gguf_type_for_width(GgmlDType::Q8_1, width),
        _ => GgmlDType::F32,
    }
}

/// What the host's ISQ made of a loaded model's projections.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuantizationReport {
    /// The checkpoint projections the host holds (in its layers,
    /// `IsqModel::get_layers`; stacked experts count one per expert and
    /// projection).
    pub projections: usize,
    /// Of these, quantized.
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
            .map(|(layer, _)| {
                Ok((
                    layer.state()?,
                    layer.full_precision_bytes(),
                    layer.projections(),
                ))
            })
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
            projections: 0,
            quantized: 0,
            withheld: 0,
            full_precision_bytes: others,
            bytes: others,
        };
        for (state, full_precision_bytes, projections) in layers {
            report.projections += projections;
            report.full_precision_bytes += full_precision_bytes;
            report.bytes += match state {
                HostLayerState::Quantized { bytes } => {
                    report.quantized += projections;
                    bytes
                }
                HostLayerState::FullPrecision => full_precision_bytes,
                HostLayerState::Withheld => {
                    report.withheld += projections;
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
            self.projections,
            self.bytes,
            mebibytes(self.bytes),
            self.full_precision_bytes,
            mebibytes(self.full_precision_bytes)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    fn experts(count: usize, rows: usize, width: usize) -> Vec<Tensor> {
        (0..count)
            .map(|_| Tensor::randn(0f32, 1.0, (rows, width), &Device::Cpu).unwrap())
            .collect()
    }

    /// Stacked, each expert's blocks are what candle makes of that expert
    /// alone, in expert order.
    fn assert_stacks_each_expert(weights: &[Tensor], ty: IsqType, expected: GgmlDType) {
        let stacked = quantize_stacked(weights, ty, &Device::Cpu).unwrap();
        let (out_dim, in_dim) = weights[0].dims2().unwrap();
        let dequantized = stacked.dequantize_w().unwrap();
        assert_eq!(dequantized.dims(), &[weights.len(), out_dim, in_dim]);
        for (e, weight) in weights.iter().enumerate() {
            // `dequantize_w` gives the weights through f16, as the host's
            // GGUF layers do.
            // A tensor of its own, from the values (candle quantizes a
            // view's storage from its start).
            let values: Vec<f32> = weight.to_vec2::<f32>().unwrap().concat();
            let weight = Tensor::from_vec(values, (out_dim, in_dim), &Device::Cpu).unwrap();
            let alone = QTensor::quantize(&weight, expected)
                .unwrap()
                .dequantize(&Device::Cpu)
                .unwrap()
                .to_dtype(DType::F16)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            let ours = dequantized.get(e).unwrap().to_dtype(DType::F32).unwrap();
            let difference = (ours - alone)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert_eq!(difference, 0.0, "expert {e}");
        }
    }

    #[test]
    fn stacked_experts_are_each_expert_quantized_alone() {
        assert_stacks_each_expert(&experts(3, 4, 256), IsqType::Q4K, GgmlDType::Q4K);
        assert_stacks_each_expert(&experts(3, 2, 64), IsqType::Q8_0, GgmlDType::Q8_0);
    }

    #[test]
    fn rows_the_type_does_not_divide_take_the_hosts_fallback() {
        // 128 columns: not a multiple of the K-quants' 256.
        assert_stacks_each_expert(&experts(2, 4, 128), IsqType::Q4K, GgmlDType::Q4_1);
        assert_eq!(gguf_type_for_width(GgmlDType::Q6K, 64), GgmlDType::Q5_1);
        assert_eq!(gguf_type_for_width(GgmlDType::Q8_0, 16), GgmlDType::F32);
    }

    #[test]
    fn the_experts_of_a_stacked_view_are_quantized_from_their_own_rows() {
        let stacked = Tensor::randn(0f32, 1.0, (3, 4, 64), &Device::Cpu).unwrap();
        let views: Vec<Tensor> = (0..3).map(|e| stacked.get(e).unwrap()).collect();
        assert_stacks_each_expert(&views, IsqType::Q8_0, GgmlDType::Q8_0);
    }
}
