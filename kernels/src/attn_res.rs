//! Gated Block AttnRes depth mixing (spec 3.4).

use candle_core::Tensor;

use crate::norm::{cpu_offset_rms_norm, validate_offset_scale};
use crate::{
    expect_device, expect_dim, expect_positive, float_dims, invalid_argument, round_to_dtype,
    tensor_from_f32, to_f32_vec, Result,
};

const OP: &str = "attn_res_mix";
const NORM_OP: &str = "attn_res_mix_norm";

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
    let sizes = validate(OP, sources, pseudo_query)?;
    on_device!(
        OP,
        sources[0].device(),
        cpu_attn_res_mix(sources, pseudo_query, gate, eps, sizes),
        Ok(crate::cuda::attn_res_mix(
            sources,
            pseudo_query,
            cuda_strength(sources, gate)?,
            eps,
            None,
            sizes
        )?
        .0),
    )
}

/// [`attn_res_mix`] followed by the layer's input norm,
/// [`offset_rms_norm`](crate::offset_rms_norm) of the mix with `scale`
/// (`1 + w`, `f32` `[H]`) and `norm_eps`, in one call: returns `(mix,
/// normed)`, the same values as the two ops in turn. On CUDA one kernel does
/// both for hidden sizes that are a multiple of 8 up to 4096.
pub fn attn_res_mix_norm(
    sources: &[Tensor],
    pseudo_query: &Tensor,
    gate: Option<f32>,
    eps: f64,
    scale: &Tensor,
    norm_eps: f64,
) -> Result<(Tensor, Tensor)> {
    let sizes = validate(NORM_OP, sources, pseudo_query)?;
    let device = sources[0].device();
    validate_offset_scale(NORM_OP, scale, sizes.1, device)?;
    on_device!(
        NORM_OP,
        device,
        {
            let mix = cpu_attn_res_mix(sources, pseudo_query, gate, eps, sizes)?;
            let normed = cpu_offset_rms_norm(&mix, scale, norm_eps)?;
            Ok((mix, normed))
        },
        {
            let norm = crate::cuda::InputNorm {
                scale,
                eps: norm_eps,
            };
            let strength = cuda_strength(sources, gate)?;
            match crate::cuda::attn_res_mix(
                sources,
                pseudo_query,
                strength,
                eps,
                Some(&norm),
                sizes,
            )? {
                (mix, Some(normed)) => Ok((mix, normed)),
                (_, None) => Err(invalid_argument(
                    NORM_OP,
                    "scale",
                    "the kernel returned no norm".to_string(),
                )),
            }
        },
    )
}

/// The gated blend's `t = tanh(g)` in f32, rounded to the dtype of x, as on
/// the CPU.
#[cfg(feature = "cuda")]
fn cuda_strength(sources: &[Tensor], gate: Option<f32>) -> Result<Option<f32>> {
    let dtype = sources[sources.len() - 1].dtype();
    gate.map(|gate| Ok(round_to_dtype(vec![gate.tanh()], dtype)?[0]))
        .transpose()
}

/// Checks the sources (at least one, all `[N, H]` on one device) and the
/// pseudo-query of an AttnRes call of `op`; returns `(N, H)`.
fn validate(op: &'static str, sources: &[Tensor], pseudo_query: &Tensor) -> Result<(usize, usize)> {
    let Some(current) = sources.last() else {
        return Err(invalid_argument(
            op,
            "sources",
            "at least one source (the current stream) is required".to_string(),
        ));
    };
    let [tokens, hidden] = float_dims::<2>(op, "sources", current)?;
    expect_positive(op, "sources", "hidden size (dim 1)", hidden)?;
    let device = current.device();
    for (index, source) in sources.iter().enumerate() {
        let source_dims = float_dims::<2>(op, "sources", source)?;
        if source_dims != [tokens, hidden] {
            return Err(invalid_argument(
                op,
                "sources",
                format!(
                    "source {index} has shape {source_dims:?}, but the current stream (last source) has shape {:?}",
                    [tokens, hidden]
                ),
            ));
        }
        expect_device(op, "sources", source, device)?;
    }
    let [query_len] = float_dims::<1>(op, "pseudo_query", pseudo_query)?;
    expect_dim(op, "pseudo_query", "length", query_len, hidden)?;
    expect_device(op, "pseudo_query", pseudo_query, device)?;
    Ok((tokens, hidden))
}

fn cpu_attn_res_mix(
    sources: &[Tensor],
    pseudo_query: &Tensor,
    gate: Option<f32>,
    eps: f64,
    (tokens, hidden): (usize, usize),
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
