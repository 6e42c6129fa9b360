//! Bindings of `recurrence.cu` (and through it `chunked.cu`): the KDA
//! recurrence, with the states in and out as tensors or as rows of an `f32`
//! state pool, updated in place.

use std::ffi::{c_int, c_void};

use candle_core::{DType, Tensor};

use super::{c_size, dtype_code, In, Launch};
use crate::{invalid_argument, KdaPrefillAlgorithm, Result};

/// Values of `berrylm_kda_recurrence`'s `prefill_algorithm` argument
/// (`berrylm::recurrence::PrefillAlgorithm` in recurrence.cu).
const PREFILL_SEQUENTIAL: c_int = 0;
const PREFILL_CHUNKED: c_int = 1;

extern "C" {
    fn berrylm_kda_recurrence_max_key_dim() -> c_int;

    fn berrylm_kda_recurrence(
        qkv_dtype: c_int,
        q: *const c_void,
        k: *const c_void,
        v: *const c_void,
        g: *const f32,
        beta: *const f32,
        state_in: *const f32,
        out: *mut f32,
        state_out: *mut f32,
        batch: c_int,
        seq_len: c_int,
        key_heads: c_int,
        value_heads: c_int,
        key_dim: c_int,
        value_dim: c_int,
        prefill_algorithm: c_int,
        stream: *mut c_void,
    ) -> c_int;

    fn berrylm_kda_recurrence_in_pool(
        qkv_dtype: c_int,
        q: *const c_void,
        k: *const c_void,
        v: *const c_void,
        g: *const f32,
        beta: *const f32,
        pool: *mut f32,
        slots: *const u32,
        pool_rows: c_int,
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

/// Sizes and prefill algorithm of one `kda_recurrence_with` call.
pub(crate) struct RecurrenceParams {
    /// Applied by the kernel launcher to calls with `T > 1` (see
    /// `berrylm_kda_recurrence` in recurrence.cu).
    pub algorithm: KdaPrefillAlgorithm,
    pub batch: usize,
    pub seq_len: usize,
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
}

/// CUDA `kda_recurrence_with`; arguments already validated by the caller.
pub(crate) fn kda_recurrence(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    state: &Tensor,
    params: &RecurrenceParams,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "kda_recurrence";
    let prefill_algorithm = check_recurrence_limits(OP, params)?;
    let mut launch = Launch::new(OP, q)?;
    let (qkv_dtype, [q, k, v, g, beta]) = declare_inputs(&mut launch, q, k, v, g, beta)?;
    let state = launch.input_as("state", state, DType::F32)?;
    let RecurrenceParams {
        batch,
        seq_len,
        value_heads,
        key_dim,
        value_dim,
        ..
    } = *params;
    let out = launch.output(&[batch, seq_len, value_heads, value_dim], DType::F32)?;
    let new_state = launch.output(&[batch, value_heads, key_dim, value_dim], DType::F32)?;
    let outputs = launch.run(|p| {
        let qkv_dtype = dtype_code(OP, qkv_dtype)?;
        let [batch, seq_len, key_heads, value_heads, key_dim, value_dim] = c_sizes(OP, params)?;
        // SAFETY: as in `kda_gate`.
        Ok(unsafe {
            berrylm_kda_recurrence(
                qkv_dtype,
                p.input(q),
                p.input(k),
                p.input(v),
                p.input(g),
                p.input(beta),
                p.input(state),
                p.output(out),
                p.output(new_state),
                batch,
                seq_len,
                key_heads,
                value_heads,
                key_dim,
                value_dim,
                prefill_algorithm,
                p.stream(),
            )
        })
    })?;
    Ok((outputs.tensor(out), outputs.tensor(new_state)))
}

/// CUDA `kda_recurrence_in_pool_with`; arguments already validated by the
/// caller (`pool` f32, contiguous, `[pool_rows, Hv, dk, dv]`; `slots` u32
/// `[B]`).
#[allow(clippy::too_many_arguments)] // the public function's arguments
pub(crate) fn kda_recurrence_in_pool(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    pool: &Tensor,
    slots: &Tensor,
    pool_rows: usize,
    params: &RecurrenceParams,
) -> Result<Tensor> {
    const OP: &str = "kda_recurrence_in_pool";
    let prefill_algorithm = check_recurrence_limits(OP, params)?;
    let mut launch = Launch::new(OP, q)?;
    let (qkv_dtype, [q, k, v, g, beta]) = declare_inputs(&mut launch, q, k, v, g, beta)?;
    let slots = launch.input("slots", slots)?;
    launch.in_pool(pool)?;
    let RecurrenceParams {
        batch,
        seq_len,
        value_heads,
        value_dim,
        ..
    } = *params;
    let out = launch.output(&[batch, seq_len, value_heads, value_dim], DType::F32)?;
    let qkv_dtype = dtype_code(OP, qkv_dtype)?;
    let pool_rows = c_size(OP, "pool", pool_rows)?;
    let [batch, seq_len, key_heads, value_heads, key_dim, value_dim] = c_sizes(OP, params)?;
    let outputs = launch.run(|p| {
        if p.pool_dtype() != DType::F32 {
            return Err(invalid_argument(
                OP,
                "pool",
                format!("dtype {:?}, expected f32", p.pool_dtype()),
            ));
        }
        // SAFETY: as in `kda_gate`; the pool is `pool_rows` contiguous rows
        // of `Hv * dk * dv` f32 values from `p.pool()`, and the kernels
        // touch only rows `slots[b] < pool_rows`.
        Ok(unsafe {
            berrylm_kda_recurrence_in_pool(
                qkv_dtype,
                p.input(q),
                p.input(k),
                p.input(v),
                p.input(g),
                p.input(beta),
                p.pool(),
                p.input(slots),
                pool_rows,
                p.output(out),
                batch,
                seq_len,
                key_heads,
                value_heads,
                key_dim,
                value_dim,
                prefill_algorithm,
                p.stream(),
            )
        })
    })?;
    Ok(outputs.tensor(out))
}

/// Fails unless the sizes fit the recurrence kernels; returns the
/// `prefill_algorithm` argument of the launchers.
fn check_recurrence_limits(op: &'static str, params: &RecurrenceParams) -> Result<c_int> {
    let RecurrenceParams {
        algorithm,
        batch,
        value_heads,
        key_dim,
        ..
    } = *params;
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

/// The sizes as the launchers take them: `B`, `T`, `Hk`, `Hv`, `dk`, `dv`.
fn c_sizes(op: &'static str, params: &RecurrenceParams) -> Result<[c_int; 6]> {
    Ok([
        c_size(op, "q", params.batch)?,
        c_size(op, "q", params.seq_len)?,
        c_size(op, "q", params.key_heads)?,
        c_size(op, "v", params.value_heads)?,
        c_size(op, "q", params.key_dim)?,
        c_size(op, "v", params.value_dim)?,
    ])
}

/// Declares the token inputs of the recurrence as the kernels read them: q,
/// k and v in one dtype (mixed dtypes widened to f32, exact), g and beta in
/// f32. Returns that dtype and the inputs.
fn declare_inputs(
    launch: &mut Launch,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
) -> Result<(DType, [In; 5])> {
    let qkv_dtype = if q.dtype() == k.dtype() && q.dtype() == v.dtype() {
        q.dtype()
    } else {
        DType::F32
    };
    Ok((
        qkv_dtype,
        [
            launch.input_as("q", q, qkv_dtype)?,
            launch.input_as("k", k, qkv_dtype)?,
            launch.input_as("v", v, qkv_dtype)?,
            launch.input_as("g", g, DType::F32)?,
            launch.input_as("beta", beta, DType::F32)?,
        ],
    ))
}
