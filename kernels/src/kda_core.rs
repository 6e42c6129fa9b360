//! The KDA layer between its short conv and its output projection (spec 3.6
//! steps 3, 6 and 7): the forget gate and write strength from their
//! projections, the recurrence on the state pool, and the gated RMSNorm of
//! its output.

use candle_core::{DType, Tensor};

use crate::recurrence::{validate_pool, validate_qkv, RecurrenceDims};
use crate::{
    expect_float_dtype, expect_on_device, expect_shape, float_dims, gated_rms_norm, kda_beta,
    kda_gate, kda_recurrence_in_pool_with, KdaPrefillAlgorithm, Result, StatePool,
};

const OP: &str = "kda_core_in_pool";

/// The per-token inputs of [`kda_core_in_pool`]: the conv's outputs and the
/// layer's projections, each `[B, T, ...]` (a strided view is read in place
/// where the kernels can).
#[derive(Clone, Copy)]
pub struct KdaCoreInputs<'a> {
    /// `[B, T, Hk, dk]`.
    pub q: &'a Tensor,
    /// `[B, T, Hk, dk]`.
    pub k: &'a Tensor,
    /// `[B, T, Hv, dv]`.
    pub v: &'a Tensor,
    /// `[B, T, Hv * dk]`: `f_up(f_down(x))`, the forget gate's input.
    pub raw_gate: &'a Tensor,
    /// `[B, T, Hv]`: the write strength's logits (`in_proj_b`).
    pub b: &'a Tensor,
    /// `[B, T, Hv * dv]`: the output gate (`in_proj_z`).
    pub z: &'a Tensor,
}

/// The layer's parameters read by [`kda_core_in_pool`].
#[derive(Clone, Copy)]
pub struct KdaCoreParams<'a> {
    /// `[Hv]`.
    pub a_log: &'a Tensor,
    /// `[Hv * dk]`.
    pub dt_bias: &'a Tensor,
    /// The forget gate's optional lower bound (see [`kda_gate`]).
    pub gate_lower_bound: Option<f32>,
    /// `[dv]`: the output norm's weight.
    pub norm_weight: &'a Tensor,
    pub norm_eps: f64,
}

/// Runs the KDA layer from its conv's outputs to its normed, gated output,
/// for `B` sequences whose recurrent states are rows of `pool`:
///
/// ```text
/// g    = kda_gate(raw_gate, a_log, dt_bias, lower_bound)     [B, T, Hv, dk]
/// beta = kda_beta(b)                                         [B, T, Hv]
/// o    = kda_recurrence_in_pool_with(algorithm, q, k, v, g, beta, pool)
/// y    = gated_rms_norm(o, z, norm_weight, eps, dtype)       per head of dv
/// ```
///
/// and returns `y` as `[B, T, Hv * dv]` in `dtype`, the activations' dtype,
/// leaving the new states in the pool's rows (as
/// [`kda_recurrence_in_pool_with`] does). That composition is the CPU
/// reference and what CUDA runs for prompts; a CUDA decode step (`T = 1`,
/// `dv = 128`, `dk <= 128`, every input in `dtype`, the pool's rows 16-byte
/// aligned) runs it as one kernel with the same operations, whose result
/// equals the composition's bit for bit where the recurrence's own decode
/// kernel is the one-block-per-head kernel (`B * Hv >= 128`), and up to the
/// recurrence's summation order otherwise (`CUDA.md`).
pub fn kda_core_in_pool(
    algorithm: KdaPrefillAlgorithm,
    inputs: &KdaCoreInputs<'_>,
    params: &KdaCoreParams<'_>,
    pool: StatePool<'_>,
    dtype: DType,
) -> Result<Tensor> {
    let dims = validate(inputs, params, &pool, dtype)?;
    #[cfg(feature = "cuda")]
    if fused_decode_applies(inputs, &pool, &dims, dtype) {
        return crate::cuda::kda_decode_gated(inputs, params, pool, &dims, dtype);
    }
    composition(algorithm, inputs, params, pool, &dims, dtype)
}

/// Whether a call runs as the fused CUDA decode kernel: its shape, one dtype,
/// and the pool's rows at 16-byte boundaries (its float4 loads; a device
/// allocation is aligned, so the view's offset decides).
#[cfg(feature = "cuda")]
fn fused_decode_applies(
    inputs: &KdaCoreInputs<'_>,
    pool: &StatePool<'_>,
    dims: &RecurrenceDims,
    dtype: DType,
) -> bool {
    let KdaCoreInputs {
        q,
        k,
        v,
        raw_gate,
        b,
        z,
    } = *inputs;
    matches!(q.device(), candle_core::Device::Cuda(_))
        && dims.seq_len == 1
        && dims.value_dim == FUSED_VALUE_DIM
        && dims.key_dim <= FUSED_MAX_KEY_DIM
        && [q, k, v, raw_gate, b, z].iter().all(|t| t.dtype() == dtype)
        && pool.states.layout().start_offset().is_multiple_of(4)
}

/// The head sizes of the fused CUDA decode kernel (one block per head, a
/// float4 of value columns per lane, 16 key rows per warp).
#[cfg(feature = "cuda")]
const FUSED_VALUE_DIM: usize = 128;
#[cfg(feature = "cuda")]
const FUSED_MAX_KEY_DIM: usize = 128;

/// The operations one after another: the CPU reference, and CUDA prompts.
fn composition(
    algorithm: KdaPrefillAlgorithm,
    inputs: &KdaCoreInputs<'_>,
    params: &KdaCoreParams<'_>,
    pool: StatePool<'_>,
    dims: &RecurrenceDims,
    dtype: DType,
) -> Result<Tensor> {
    let (batch, seq_len, value_heads) = (dims.batch, dims.seq_len, dims.value_heads);
    let (key_dim, value_dim) = (dims.key_dim, dims.value_dim);
    let tokens = batch * seq_len;
    let gate = kda_gate(
        &inputs.raw_gate.reshape((tokens, value_heads * key_dim))?,
        params.a_log,
        params.dt_bias,
        value_heads,
        params.gate_lower_bound,
    )?
    .reshape((batch, seq_len, value_heads, key_dim))?;
    let beta = kda_beta(inputs.b)?;
    let out =
        kda_recurrence_in_pool_with(algorithm, inputs.q, inputs.k, inputs.v, &gate, &beta, pool)?;
    let rows = tokens * value_heads;
    // `z` read in place by the norm only when it is contiguous.
    let z = crate::contiguous(inputs.z)?;
    gated_rms_norm(
        &out.reshape((rows, value_dim))?,
        &z.reshape((rows, value_dim))?,
        params.norm_weight,
        params.norm_eps,
        dtype,
    )?
    .reshape((batch, seq_len, value_heads * value_dim))
    .map_err(Into::into)
}

/// Checks every argument of a call (both paths accept the same calls) and
/// returns its sizes.
fn validate(
    inputs: &KdaCoreInputs<'_>,
    params: &KdaCoreParams<'_>,
    pool: &StatePool<'_>,
    dtype: DType,
) -> Result<RecurrenceDims> {
    expect_float_dtype(OP, "dtype", dtype)?;
    let dims = validate_qkv(OP, inputs.q, inputs.k, inputs.v)?;
    let RecurrenceDims {
        batch,
        seq_len,
        value_heads,
        key_dim,
        value_dim,
        ..
    } = dims;
    for (arg, tensor, width, what) in [
        (
            "raw_gate",
            inputs.raw_gate,
            value_heads * key_dim,
            "[B, T, Hv * dk] =",
        ),
        ("b", inputs.b, value_heads, "[B, T, Hv] ="),
        ("z", inputs.z, value_heads * value_dim, "[B, T, Hv * dv] ="),
    ] {
        let tensor_dims = float_dims::<3>(OP, arg, tensor)?;
        expect_shape(OP, arg, &tensor_dims, &[batch, seq_len, width], what)?;
    }
    for (arg, tensor, len, what) in [
        ("a_log", params.a_log, value_heads, "[Hv] ="),
        (
            "dt_bias",
            params.dt_bias,
            value_heads * key_dim,
            "[Hv * dk] =",
        ),
        ("norm_weight", params.norm_weight, value_dim, "[dv] ="),
    ] {
        let tensor_dims = float_dims::<1>(OP, arg, tensor)?;
        expect_shape(OP, arg, &tensor_dims, &[len], what)?;
    }
    expect_on_device(
        OP,
        inputs.q.device(),
        [
            ("raw_gate", inputs.raw_gate),
            ("b", inputs.b),
            ("z", inputs.z),
            ("a_log", params.a_log),
            ("dt_bias", params.dt_bias),
            ("norm_weight", params.norm_weight),
        ],
    )?;
    let pool_rows = validate_pool(OP, pool.states, &dims)?;
    pool.validate(OP, pool_rows, batch, inputs.q.device())?;
    Ok(dims)
}
