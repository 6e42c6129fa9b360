//! Gated Block AttnRes depth mixing (spec 3.4).

use candle_core::Tensor;

use crate::{
    expect_device, expect_dim, expect_positive, float_dims, invalid_argument, round_to_dtype,
    tensor_from_f32, to_f32_vec, Result,
};

const OP: &str = "attn_res_mix";

/// Mixes the residual streams over depth, per token.
///
/// * `sources`: each `[N, H]`; the committed block streams first and the
///   current stream `x` **last**. At least one source is required.
/// * `pseudo_query`: `[H]`, the layer's pseudo-query.
/// * `gate`: the raw gate parameter `g`, or `None` for the ungated variant.
/// * `eps`: the epsilon of the affine-free RMS norm of the keys.
///
/// In `f32`, per token: `key_s = s / sqrt(mean(s^2) + eps)`,
/// `logit_s = <key_s, pseudo_query>` (no scaling), `p = softmax_s(logit)`
/// (max-subtracted), `mix = sum_s p_s * s` over the raw sources, rounded to the
/// dtype of `x`. Ungated, the result is `mix`. Gated, `t = tanh(g)` is computed
/// in `f32` and rounded to the dtype of `x`, and `y = x + t * (mix - x)` is
/// evaluated op by op in the dtype of `x` (rounding after the subtraction, the
/// multiplication and the addition), so `g = 0` gives exactly `x`.
///
/// Returns `[N, H]` in the dtype of `x`.
pub fn attn_res_mix(
    sources: &[Tensor],
    pseudo_query: &Tensor,
    gate: Option<f32>,
    eps: f64,
) -> Result<Tensor> {
    let Some(current) = sources.last() else {
        return Err(invalid_argument(
            OP,
            "sources",
            "at least one source (the current stream) is required".to_string(),
        ));
    };
    let [tokens, hidden] = float_dims::<2>(OP, "sources", current)?;
    expect_positive(OP, "sources", "hidden size (dim 1)", hidden)?;
    let device = current.device();
    for (index, source) in sources.iter().enumerate() {
        let source_dims = float_dims::<2>(OP, "sources", source)?;
        if source_dims != [tokens, hidden] {
            return Err(invalid_argument(
                OP,
                "sources",
                format!(
                    "source {index} has shape {source_dims:?}, but the current stream (last source) has shape {:?}",
                    [tokens, hidden]
                ),
            ));
        }
        expect_device(OP, "sources", source, device)?;
    }
    let [query_len] = float_dims::<1>(OP, "pseudo_query", pseudo_query)?;
    expect_dim(OP, "pseudo_query", "length", query_len, hidden)?;
    expect_device(OP, "pseudo_query", pseudo_query, device)?;
    on_device!(
        OP,
        device,
        cpu_attn_res_mix(sources, pseudo_query, gate, eps, tokens, hidden),
        {
            // `t = tanh(g)` in f32, rounded to the dtype of x, as on the CPU.
            let strength = match gate {
                Some(gate) => Some(round_to_dtype(vec![gate.tanh()], current.dtype())?[0]),
                None => None,
            };
            crate::cuda::attn_res_mix(sources, pseudo_query, strength, eps, tokens, hidden)
        },
    )
}

fn cpu_attn_res_mix(
    sources: &[Tensor],
    pseudo_query: &Tensor,
    gate: Option<f32>,
    eps: f64,
    tokens: usize,
    hidden: usize,
) -> Result<Tensor> {
    let dtype = sources[sources.len() - 1].dtype();
    let sources = sources.iter().map(to_f32_vec).collect::<Result<Vec<_>>>()?;
    let query = to_f32_vec(pseudo_query)?;
    let eps = eps as f32;

    let mut mix = vec![0f32; tokens * hidden];
    let mut logits = vec![0f32; sources.len()];
    let mut probabilities = vec![0f32; sources.len()];
    for (token, mix_row) in mix.chunks_exact_mut(hidden).enumerate() {
        let span = token * hidden..(token + 1) * hidden;
        for (logit, source) in logits.iter_mut().zip(&sources) {
            let values = &source[span.clone()];
            let mean_square =
                values.iter().map(|&value| value * value).sum::<f32>() / hidden as f32;
            let inv_rms = 1.0 / (mean_square + eps).sqrt();
            *logit = values
                .iter()
                .zip(&query)
                .map(|(&value, &query_h)| value * inv_rms * query_h)
                .sum();
        }
        let max_logit = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        for (probability, &logit) in probabilities.iter_mut().zip(&logits) {
            *probability = (logit - max_logit).exp();
        }
        let denominator: f32 = probabilities.iter().sum();
        for probability in probabilities.iter_mut() {
            *probability /= denominator;
        }
        for (&probability, source) in probabilities.iter().zip(&sources) {
            for (mixed, &value) in mix_row.iter_mut().zip(&source[span.clone()]) {
                *mixed += probability * value;
            }
        }
    }
    let mix = round_to_dtype(mix, dtype)?;

    let result = match gate {
        None => mix,
        Some(gate) => {
            let current = &sources[sources.len() - 1];
            let strength = round_to_dtype(vec![gate.tanh()], dtype)?[0];
            let difference = mix.iter().zip(current).map(|(&m, &x)| m - x).collect();
            let step = round_to_dtype(difference, dtype)?
                .into_iter()
                .map(|difference| strength * difference)
                .collect();
            // The addition is rounded by the conversion to `dtype` below.
            round_to_dtype(step, dtype)?
                .into_iter()
                .zip(current)
                .map(|(step, &x)| x + step)
                .collect()
        }
    };
    tensor_from_f32(result, &[tokens, hidden], dtype)
}
