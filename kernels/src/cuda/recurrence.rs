//! Binding of `recurrence.cu` (and through it `chunked.cu`): the KDA
//! recurrence, with the states in and out as tensors or as rows of an `f32`
//! state pool, updated in place; and the fused decode step of
//! `kda_core_in_pool` (gate, write strength, recurrence and gated norm).

use std::ffi::{c_int, c_void};

use candle_core::{DType, Tensor};

use super::{c_size, dtype_code, Args, In, Launch, Out};
use crate::recurrence::{KdaTokens, RecurrenceDims};
use crate::{
    invalid_argument, KdaCoreInputs, KdaCoreParams, KdaPrefillAlgorithm, Result, StatePool,
};

/// Values of `berrylm_kda_recurrence`'s `prefill_algorithm` argument
/// (`berrylm::recurrence::PrefillAlgorithm` in recurrence.cu).
const PREFILL_SEQUENTIAL: c_int = 0;
const PREFILL_CHUNKED: c_int = 1;

extern "C" {
    fn berrylm_kda_recurrence_max_key_dim() -> c_int;

    fn berrylm_kda_decode_gated(
        dtype: c_int,
        q: *const c_void,
        k: *const c_void,
        v: *const c_void,
        raw_gate: *const c_void,
        raw_gate_stride: i64,
        b: *const c_void,
        b_stride: i64,
        a_log: *const f32,
        dt_bias: *const f32,
        has_lower_bound: c_int,
        lower_bound: f32,
        z: *const c_void,
        z_stride: i64,
        norm_weight: *const f32,
        norm_eps: f32,
        states: *mut f32,
        slots: *const u32,
        state_rows: c_int,
        out: *mut c_void,
        batch: c_int,
        key_heads: c_int,
        value_heads: c_int,
        key_dim: c_int,
        value_dim: c_int,
        stream: *mut c_void,
    ) -> c_int;

    fn berrylm_kda_recurrence(
        qkv_dtype: c_int,
        q: *const c_void,
        k: *const c_void,
        v: *const c_void,
        g: *const f32,
        beta: *const f32,
        state_in: *const f32,
        state_out: *mut f32,
        slots: *const u32,
        state_rows: c_int,
        out: *mut f32,
        batch: c_int,
        seq_len: c_int,
        key_heads: c_int,
        value_heads: c_int,
        key_dim: c_int,
        value_dim: c_int,
        prefill_algorithm: c_int,
        stream: *mut c_void,
    ) -> c_int;
}

/// CUDA `kda_recurrence_with`; arguments already validated by the caller.
pub(crate) fn kda_recurrence(
    tokens: &KdaTokens<'_>,
    state: &Tensor,
    dims: &RecurrenceDims,
    algorithm: KdaPrefillAlgorithm,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "kda_recurrence";
    let mut launch = Launch::new(OP, tokens.q)?;
    let call = RecurrenceCall::declare(OP, &mut launch, tokens, dims, algorithm)?;
    let state = launch.input_as("state", state, DType::F32)?;
    let state_shape = [dims.batch, dims.value_heads, dims.key_dim, dims.value_dim];
    let new_state = launch.output(&state_shape, DType::F32)?;
    let state_rows = c_size(OP, "state", dims.batch)?;
    let outputs = launch.run(|p| {
        // SAFETY: as in `run_kernel!`; sequence `b` reads row `b` of `state`
        // and writes row `b` of `new_state` (no slots: `B` rows).
        Ok(unsafe {
            call.launch(
                p,
                p.input(state),
                p.output(new_state),
                std::ptr::null(),
                state_rows,
            )
        })
    })?;
    Ok((outputs.tensor(call.out), outputs.tensor(new_state)))
}

/// CUDA `kda_recurrence_in_pool_with`; arguments already validated by the
/// caller (`pool.states` f32, contiguous, `[pool_rows, Hv, dk, dv]`;
/// `pool.slots` u32 `[B]`).
pub(crate) fn kda_recurrence_in_pool(
    tokens: &KdaTokens<'_>,
    pool: StatePool<'_>,
    pool_rows: usize,
    dims: &RecurrenceDims,
    algorithm: KdaPrefillAlgorithm,
) -> Result<Tensor> {
    const OP: &str = "kda_recurrence_in_pool";
    let mut launch = Launch::new(OP, tokens.q)?;
    let call = RecurrenceCall::declare(OP, &mut launch, tokens, dims, algorithm)?;
    let slots = launch.input("slots", pool.slots)?;
    launch.in_pool(pool.states)?;
    let pool_rows = c_size(OP, "pool", pool_rows)?;
    let outputs = launch.run(|p| {
        // SAFETY: as in `run_kernel!`; the pool is `pool_rows` contiguous rows
        // of `Hv * dk * dv` f32 values from `p.pool()`, read and written in
        // place, and the kernels touch only rows `slots[b] < pool_rows`.
        Ok(unsafe { call.launch(p, p.pool(), p.pool(), p.input(slots), pool_rows) })
    })?;
    Ok(outputs.tensor(call.out))
}

/// CUDA `kda_core_in_pool` for a decode step in its fused kernel; arguments
/// validated by the caller, which checked that the kernel takes the shape
/// (`T = 1`, `dv = 128`, `dk <= 128`), that every token input has `dtype`
/// and that the pool's rows are 16-byte aligned.
pub(crate) fn kda_decode_gated(
    inputs: &KdaCoreInputs<'_>,
    params: &KdaCoreParams<'_>,
    pool: StatePool<'_>,
    dims: &RecurrenceDims,
    dtype: DType,
) -> Result<Tensor> {
    const OP: &str = "kda_core_in_pool";
    let mut launch = Launch::new(OP, inputs.q)?;
    let [q, k, v] = launch.inputs([("q", inputs.q), ("k", inputs.k), ("v", inputs.v)])?;
    let (raw_gate, raw_gate_stride) = launch.input_rows("raw_gate", inputs.raw_gate)?;
    let (b, b_stride) = launch.input_rows("b", inputs.b)?;
    let (z, z_stride) = launch.input_rows("z", inputs.z)?;
    let a_log = launch.input_as("a_log", params.a_log, DType::F32)?;
    let dt_bias = launch.input_as("dt_bias", params.dt_bias, DType::F32)?;
    let norm_weight = launch.input_as("norm_weight", params.norm_weight, DType::F32)?;
    let slots = launch.input("slots", pool.slots)?;
    launch.in_pool(pool.states)?;
    let out = launch.output(
        &[dims.batch, dims.seq_len, dims.value_heads * dims.value_dim],
        dtype,
    )?;
    let (has_lower_bound, lower_bound) = match params.gate_lower_bound {
        Some(bound) => (1, bound),
        None => (0, 0.0),
    };
    let dtype = dtype_code(OP, dtype)?;
    let pool_rows = c_size(OP, "pool", pool.states.dim(0)?)?;
    let sizes = [
        c_size(OP, "q", dims.batch)?,
        c_size(OP, "q", dims.key_heads)?,
        c_size(OP, "v", dims.value_heads)?,
        c_size(OP, "q", dims.key_dim)?,
        c_size(OP, "v", dims.value_dim)?,
    ];
    let outputs = launch.run(|p| {
        // SAFETY: as in `run_kernel!`; `raw_gate`, `b` and `z` are read as
        // `B` rows of their widths at the strides their layouts have; the
        // pool is `pool_rows` contiguous rows of `Hv * dk * dv` f32 values
        // from `p.pool()`, read and written in place in rows `slots[b] <
        // pool_rows` only.
        Ok(unsafe {
            berrylm_kda_decode_gated(
                dtype,
                p.input(q),
                p.input(k),
                p.input(v),
                p.input(raw_gate),
                raw_gate_stride as i64,
                p.input(b),
                b_stride as i64,
                p.input(a_log),
                p.input(dt_bias),
                has_lower_bound,
                lower_bound,
                p.input(z),
                z_stride as i64,
                p.input(norm_weight),
                params.norm_eps as f32,
                p.pool(),
                p.input(slots),
                pool_rows,
                p.output(out),
                sizes[0],
                sizes[1],
                sizes[2],
                sizes[3],
                sizes[4],
                p.stream(),
            )
        })
    })?;
    Ok(outputs.tensor(out))
}

/// What the two bindings pass `berrylm_kda_recurrence` alike: the token
/// inputs and the output declared on the launch, the sizes and the prefill
/// algorithm.
struct RecurrenceCall {
    qkv_dtype: c_int,
    /// q, k, v, g, beta.
    inputs: [In; 5],
    out: Out,
    /// The sizes as the launcher takes them.
    sizes: RecurrenceDims<c_int>,
    prefill_algorithm: c_int,
}

impl RecurrenceCall {
    /// Checks the sizes against the kernels' limits and declares the token
    /// inputs as the kernels read them (q, k and v in one dtype, mixed dtypes
    /// widened to f32, exact; g and beta in f32) and the output
    /// `[B, T, Hv, dv]` (f32) on `launch`.
    fn declare(
        op: &'static str,
        launch: &mut Launch,
        tokens: &KdaTokens<'_>,
        dims: &RecurrenceDims,
        algorithm: KdaPrefillAlgorithm,
    ) -> Result<Self> {
        let prefill_algorithm = check_recurrence_limits(op, dims, algorithm)?;
        let KdaTokens { q, k, v, g, beta } = *tokens;
        let qkv_dtype = if q.dtype() == k.dtype() && q.dtype() == v.dtype() {
            q.dtype()
        } else {
            DType::F32
        };
        let inputs = [
            launch.input_as("q", q, qkv_dtype)?,
            launch.input_as("k", k, qkv_dtype)?,
            launch.input_as("v", v, qkv_dtype)?,
            launch.input_as("g", g, DType::F32)?,
            launch.input_as("beta", beta, DType::F32)?,
        ];
        let out_shape = [dims.batch, dims.seq_len, dims.value_heads, dims.value_dim];
        Ok(Self {
            qkv_dtype: dtype_code(op, qkv_dtype)?,
            inputs,
            out: launch.output(&out_shape, DType::F32)?,
            sizes: RecurrenceDims {
                batch: c_size(op, "q", dims.batch)?,
                seq_len: c_size(op, "q", dims.seq_len)?,
                key_heads: c_size(op, "q", dims.key_heads)?,
                value_heads: c_size(op, "v", dims.value_heads)?,
                key_dim: c_size(op, "q", dims.key_dim)?,
                value_dim: c_size(op, "v", dims.value_dim)?,
            },
            prefill_algorithm,
        })
    }

    /// Calls `berrylm_kda_recurrence` with the addresses of this call's
    /// inputs and output in `p` and the states: sequence `b` reads row
    /// `slots[b]` (row `b` when `slots` is null) of the `state_rows` rows of
    /// `state_in` and writes its final state to that row of `state_out`.
    ///
    /// # Safety
    ///
    /// `p` is the launch's [`Args`], and the state pointers address
    /// `state_rows` rows of `Hv * dk * dv` f32 values (`slots`, when not
    /// null, `B` u32 values).
    unsafe fn launch(
        &self,
        p: &Args,
        state_in: *const f32,
        state_out: *mut f32,
        slots: *const u32,
        state_rows: c_int,
    ) -> c_int {
        let [q, k, v, g, beta] = self.inputs;
        let sizes = &self.sizes;
        berrylm_kda_recurrence(
            self.qkv_dtype,
            p.input(q),
            p.input(k),
            p.input(v),
            p.input(g),
            p.input(beta),
            state_in,
            state_out,
            slots,
            state_rows,
            p.output(self.out),
            sizes.batch,
            sizes.seq_len,
            sizes.key_heads,
            sizes.value_heads,
            sizes.key_dim,
            sizes.value_dim,
            self.prefill_algorithm,
            p.stream(),
        )
    }
}

/// Fails unless the sizes fit the recurrence kernels; returns the
/// `prefill_algorithm` argument of the launcher.
fn check_recurrence_limits(
    op: &'static str,
    dims: &RecurrenceDims,
    algorithm: KdaPrefillAlgorithm,
) -> Result<c_int> {
    let (batch, value_heads, key_dim) = (dims.batch, dims.value_heads, dims.key_dim);
    // SAFETY: a plain query of a constant.
    let max_key_dim = unsafe { berrylm_kda_recurrence_max_key_dim() } as usize;
    if key_dim > max_key_dim {
        return Err(invalid_argument(
            op,
            "q",
            format!("key dim {key_dim} exceeds the CUDA kernel's maximum {max_key_dim}"),
        ));
    }
    if batch > 65535 || value_heads > 65535 {
        return Err(invalid_argument(
            op,
            "v",
            format!("batch {batch} or value heads {value_heads} exceed the CUDA kernel's 65535"),
        ));
    }
    Ok(match algorithm {
        KdaPrefillAlgorithm::Sequential => PREFILL_SEQUENTIAL,
        KdaPrefillAlgorithm::Chunked => PREFILL_CHUNKED,
    })
}
