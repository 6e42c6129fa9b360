//! Binding of `attn_res.cu`: the block AttnRes mix.

use std::ffi::{c_int, c_void};

use candle_core::{DType, Tensor};

use super::{c_size, dtype_code, Launch};
use crate::{invalid_argument, Result};

/// The most sources `attn_res_mix` takes on CUDA (`kMaxSources` in attn_res.cu).
const MAX_ATTN_RES_SOURCES: usize = 32;

extern "C" {
    fn berrylm_attn_res_mix(
        src_dtype: c_int,
        out_dtype: c_int,
        sources: *const *const c_void,
        num_sources: c_int,
        query: *const f32,
        out: *mut c_void,
        tokens: i64,
        hidden: c_int,
        eps: f32,
        gated: c_int,
        strength: f32,
        norm_scale: *const f32,
        normed: *mut c_void,
        inv_width: f32,
        norm_eps: f32,
        stream: *mut c_void,
    ) -> c_int;
}

/// The `(1 + w)` RMSNorm `attn_res_mix_norm` applies to the mix: its
/// `scale` (`1 + w`, `[hidden]`) and `eps`.
pub(crate) struct InputNorm<'a> {
    pub scale: &'a Tensor,
    pub eps: f64,
}

/// CUDA `attn_res_mix` and `attn_res_mix_norm`; arguments already validated
/// by the caller. `strength` is `round_x(tanh(g))` for the gated variant.
/// Returns the mix and, with `norm`, its norm (one kernel for BerryLM's
/// widths).
pub(crate) fn attn_res_mix(
    sources: &[Tensor],
    pseudo_query: &Tensor,
    strength: Option<f32>,
    eps: f64,
    norm: Option<&InputNorm<'_>>,
    (tokens, hidden): (usize, usize),
) -> Result<(Tensor, Option<Tensor>)> {
    const OP: &str = "attn_res_mix";
    let current = &sources[sources.len() - 1];
    if sources.len() > MAX_ATTN_RES_SOURCES {
        return Err(invalid_argument(
            OP,
            "sources",
            format!(
                "{} sources exceed the CUDA kernel's maximum {MAX_ATTN_RES_SOURCES}",
                sources.len()
            ),
        ));
    }
    let mut launch = Launch::new(OP, current)?;
    let out_dtype = current.dtype();
    // Sources of mixed dtypes are all widened to f32 (exact).
    let src_dtype = if sources.iter().all(|s| s.dtype() == out_dtype) {
        out_dtype
    } else {
        DType::F32
    };
    let sources = sources
        .iter()
        .map(|source| launch.input_as("sources", source, src_dtype))
        .collect::<Result<Vec<_>>>()?;
    let query = launch.input_as("pseudo_query", pseudo_query, DType::F32)?;
    let norm_scale = norm
        .map(|norm| launch.input_as("scale", norm.scale, DType::F32))
        .transpose()?;
    let out = launch.output(&[tokens, hidden], out_dtype)?;
    let normed = norm
        .map(|_| launch.output(&[tokens, hidden], out_dtype))
        .transpose()?;
    // What candle's `mean_keepdim` multiplies the sum by, rounded to f32 as
    // candle rounds it (as `offset_rms_norm`).
    let inv_width = (1.0 / hidden as f64) as f32;
    let outputs = launch.run(|p| {
        let addresses = p.inputs(&sources);
        // SAFETY: as in `run_kernel!`; `addresses` lives across the call;
        // `norm_scale` and `normed` are null or `hidden` and `[tokens,
        // hidden]` long.
        Ok(unsafe {
            berrylm_attn_res_mix(
                dtype_code(OP, src_dtype)?,
                dtype_code(OP, out_dtype)?,
                addresses.as_ptr(),
                addresses.len() as c_int,
                p.input(query),
                p.output(out),
                tokens as i64,
                c_size(OP, "sources", hidden)?,
                eps as f32,
                c_int::from(strength.is_some()),
                strength.unwrap_or(0.0),
                norm_scale.map_or(std::ptr::null(), |scale| p.input(scale)),
                normed.map_or(std::ptr::null_mut(), |normed| p.output(normed)),
                inv_width,
                norm.map_or(0.0, |norm| norm.eps as f32),
                p.stream(),
            )
        })
    })?;
    Ok((
        outputs.tensor(out),
        normed.map(|normed| outputs.tensor(normed)),
    ))
}
