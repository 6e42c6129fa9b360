//! KDA delta-rule recurrence (spec 3.6 step 6).

use candle_core::{DType, Device, Tensor};

use crate::{
    ensure, expect_device, expect_dim, expect_on_device, expect_positive, expect_shape, float_dims,
    invalid_argument, tensor_from_f32, to_f32_vec, Result,
};

const OP: &str = "kda_recurrence";

/// Epsilon of the q/k L2 normalisation (a fixed constant, not `rms_norm_eps`).
const L2_NORM_EPS: f32 = 1e-6;

/// How [`kda_recurrence_with`] computes a prefill (a call with `T > 1`).
///
/// The choice only matters for CUDA tensors; on the CPU both variants run the
/// same token-by-token reference and give identical results. On CUDA both
/// compute the same recurrence: `Sequential` in f32 throughout (agreeing with
/// the CPU reference up to summation order), `Chunked` with TF32 tensor-core
/// products (relative errors of order 1e-4, see `CUDA.md`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KdaPrefillAlgorithm {
    /// Token by token, the state held in registers for the whole call, all
    /// f32. [`kda_recurrence`] uses it for calls of fewer than 64 tokens.
    #[default]
    Sequential,
    /// Chunks of 64 tokens in the WY/UT form with TF32 tensor-core matmuls
    /// and f32 accumulation (one kernel prepares all chunks in parallel, a
    /// second one walks them in order). [`kda_recurrence`] uses it from 64
    /// tokens on. Used on CUDA when `dk <= 128` and `dv <= 128`; larger
    /// heads fall back to [`KdaPrefillAlgorithm::Sequential`].
    Chunked,
}

/// The sequence length from which [`kda_recurrence`] computes a CUDA
/// prefill with [`KdaPrefillAlgorithm::Chunked`] (shorter calls, decode
/// included, run [`KdaPrefillAlgorithm::Sequential`]). On an H200 at
/// BerryLM-OS shapes the chunked kernels measured faster from this length
/// on (`CUDA.md`).
const CHUNKED_PREFILL_MIN_LEN: usize = 64;

impl KdaPrefillAlgorithm {
    /// The algorithm [`kda_recurrence`] picks for a call of `seq_len` tokens.
    pub fn for_len(seq_len: usize) -> KdaPrefillAlgorithm {
        if seq_len >= CHUNKED_PREFILL_MIN_LEN {
            KdaPrefillAlgorithm::Chunked
        } else {
            KdaPrefillAlgorithm::Sequential
        }
    }
}

/// The per-token inputs of a recurrence call (see [`kda_recurrence`]).
pub(crate) struct KdaTokens<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub g: &'a Tensor,
    pub beta: &'a Tensor,
}

/// Sizes of one recurrence call (as `usize`, or as the CUDA launcher's
/// `c_int`).
pub(crate) struct RecurrenceDims<T = usize> {
    pub batch: T,
    pub seq_len: T,
    pub key_heads: T,
    pub value_heads: T,
    pub key_dim: T,
    pub value_dim: T,
}

/// Runs the KDA recurrence token by token, in `f32`.
///
/// * `q`, `k`: `[B, T, Hk, dk]`.
/// * `v`: `[B, T, Hv, dv]`; `Hv` must be a multiple of `Hk`, and value head
///   `j` uses key head `j / (Hv / Hk)` (grouped, like `repeat_interleave`).
/// * `g`: `[B, T, Hv, dk]`, the log-decay per key channel (`f32`).
/// * `beta`: `[B, T, Hv]`, the write strength (`f32`).
/// * `state`: `[B, Hv, dk, dv]`, the state before the first token (`f32`).
///
/// Inputs of other float dtypes are cast to `f32`. For each value head and
/// token, with `S` the `dk x dv` state:
///
/// ```text
/// q̂ = l2norm(q) * dk^-0.5,  k̂ = l2norm(k),   l2norm(x) = x / sqrt(sum(x^2) + 1e-6)
/// S[c, :] *= exp(g[c])                 for every key channel c
/// u = Sᵀ k̂;  δ = beta * (v - u);  S += k̂ δᵀ
/// o = Sᵀ q̂                            (read after the write)
/// ```
///
/// Returns `(output [B, T, Hv, dv], final_state [B, Hv, dk, dv])`, both `f32`.
///
/// A CUDA prefill of `T >= 64` tokens uses
/// [`KdaPrefillAlgorithm::Chunked`], a shorter one
/// [`KdaPrefillAlgorithm::Sequential`]; use [`kda_recurrence_with`] to choose
/// the algorithm.
pub fn kda_recurrence(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    state: &Tensor,
) -> Result<(Tensor, Tensor)> {
    kda_recurrence_with(default_algorithm(q), q, k, v, g, beta, state)
}

/// The prefill algorithm [`kda_recurrence`] uses for queries `q`.
fn default_algorithm(q: &Tensor) -> KdaPrefillAlgorithm {
    KdaPrefillAlgorithm::for_len(q.dims().get(1).copied().unwrap_or(0))
}

/// [`kda_recurrence`] with an explicit prefill algorithm.
///
/// Arguments, validation, shapes and the computed recurrence are those of
/// [`kda_recurrence`]. `algorithm` only matters for CUDA tensors, and there
/// only for calls with `T > 1`: decode (`T = 1`) always runs the decode
/// kernel chosen by batch size and state alignment. On the CPU both
/// algorithms run the CPU reference, so the results do not depend on
/// `algorithm`.
///
/// The plugin does not call it (it runs [`kda_recurrence_in_pool_with`] on
/// its state pool); it is kept as a test reference: the CUDA tests
/// (`tests/cuda.rs`) run every recurrence case through it once per
/// algorithm against the CPU reference, and `examples/kernel_bench.rs` times
/// it. [`kda_recurrence`] (used by the benchmarks) calls it.
pub fn kda_recurrence_with(
    algorithm: KdaPrefillAlgorithm,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    state: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let tokens = KdaTokens { q, k, v, g, beta };
    let dims = validate(&tokens, state)?;
    on_device!(
        OP,
        q.device(),
        {
            // One reference for both algorithms (the choice is CUDA-only).
            let _ = algorithm;
            cpu_kda_recurrence(&tokens, state, &dims)
        },
        crate::cuda::kda_recurrence(&tokens, state, &dims, algorithm),
    )
}

const POOL_OP: &str = "kda_recurrence_in_pool";

/// The slot of a batch row that belongs to no sequence (a decode batch
/// padded to the size of a captured CUDA graph): the row starts from a zero
/// state and its final state is written nowhere. Any number of rows may
/// take it.
pub const PAD_SLOT: u32 = u32::MAX;

/// The rows of a state pool that a batch's sequences own: a pool of `S`
/// per-sequence states, read and updated in place by the functions taking
/// it, which touch only the batch's rows.
///
/// Used for the recurrent states of [`kda_recurrence_in_pool_with`] and the conv
/// states of [`crate::causal_conv1d_split_in_pool`]; each function documents
/// the shape and dtype its pool must have.
#[derive(Clone, Copy)]
pub struct StatePool<'a> {
    /// `[S, ...]`, contiguous (a view at an offset is fine); row `s` is the
    /// state of whichever sequence owns slot `s`: `[S, Hv, dk, dv]` `f32`
    /// recurrent states, or `[S, C, K]` conv states.
    pub states: &'a Tensor,
    /// `[B]`, `u32`, on the device of the other tensors: the pool row of each
    /// sequence. The kernels read it on the device.
    pub slots: &'a Tensor,
    /// The same `B` slots on the host, where they are validated: each `< S`
    /// or [`PAD_SLOT`], the ones `< S` distinct. Taking them from the caller
    /// (who chose the slots on the host anyway) validates them without
    /// copying `slots` back from the GPU, which would stall candle's stream.
    pub host_slots: &'a [u32],
}

/// The recurrence of [`kda_recurrence`] for `B` sequences whose states are
/// rows `slots[b]` of `pool.states`, updated in place.
///
/// * `algorithm`: as for [`kda_recurrence_with`];
///   [`KdaPrefillAlgorithm::for_len`] of `T` picks what [`kda_recurrence`]
///   would.
/// * `q`, `k`, `v`, `g`, `beta`: as for [`kda_recurrence`] (same shapes,
///   dtypes, validation and arithmetic).
/// * `pool`: the state pool and the batch's rows in it ([`StatePool`]);
///   `pool.states` is `[S, Hv, dk, dv]`, `f32`, contiguous.
///
/// Before returning, row `slots[b]` of `pool.states` holds the final state that
/// [`kda_recurrence_with`] returns with the same `algorithm` for sequence `b`
/// started from that row (bit for bit on the CPU and with the same CUDA
/// kernels); no other row is
/// written. The write goes into the pool's storage, so every tensor sharing
/// it sees the new states. Returns the output `[B, T, Hv, dv]` (`f32`).
/// A row whose slot is [`PAD_SLOT`] gives the output of a zero initial state
/// and writes no state.
///
/// On the CPU, `slots` must equal `host_slots` (checked). On CUDA they are
/// not compared (that would need the copy back); the kernels treat a
/// sequence whose `slots` entry is `>= S` as a [`PAD_SLOT`] row, so a
/// disagreeing `slots` can give wrong outputs but never writes outside the
/// pool. No input may share storage with `pool.states`.
pub fn kda_recurrence_in_pool_with(
    algorithm: KdaPrefillAlgorithm,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    pool: StatePool<'_>,
) -> Result<Tensor> {
    let tokens = KdaTokens { q, k, v, g, beta };
    let dims = validate_tokens(POOL_OP, &tokens)?;
    let pool_rows = validate_pool(POOL_OP, pool.states, &dims)?;
    pool.validate(POOL_OP, pool_rows, dims.batch, q.device())?;
    on_device!(
        POOL_OP,
        q.device(),
        {
            // One reference for both algorithms (the choice is CUDA-only).
            let _ = algorithm;
            pool.cpu_update(POOL_OP, |state| cpu_kda_recurrence(&tokens, state, &dims))
        },
        crate::cuda::kda_recurrence_in_pool(&tokens, pool, pool_rows, &dims, algorithm),
    )
}

impl StatePool<'_> {
    /// Validates the pool of a call of `op` for `batch` sequences on
    /// `device`, whose `states` (already checked for shape and dtype) has
    /// `pool_rows` rows: contiguous, valid slots ([`validate_slots`]), and
    /// both tensors on `device`.
    pub(crate) fn validate(
        &self,
        op: &'static str,
        pool_rows: usize,
        batch: usize,
        device: &Device,
    ) -> Result<()> {
        if !self.states.is_contiguous() {
            return Err(invalid_argument(
                op,
                "pool",
                "must be contiguous (it is updated in place)".to_string(),
            ));
        }
        validate_slots(op, self.slots, self.host_slots, pool_rows, batch)?;
        for (arg, tensor) in [("pool", self.states), ("slots", self.slots)] {
            expect_device(op, arg, tensor, device)?;
        }
        Ok(())
    }

    /// The CPU path of a call of `op` on the pool: `reference` gets the
    /// batch's rows `[B, ...]` (zeros for a [`PAD_SLOT`]) and returns its
    /// output and their new values, which are written back into those rows
    /// (not a [`PAD_SLOT`]'s). Fails unless `slots` holds the values of
    /// `host_slots` (a check only the CPU path makes: on CUDA it would copy
    /// `slots` back).
    pub(crate) fn cpu_update<T>(
        &self,
        op: &'static str,
        reference: impl FnOnce(&Tensor) -> Result<(T, Tensor)>,
    ) -> Result<T> {
        let cpu_slots = self.slots.to_vec1::<u32>()?;
        if cpu_slots != self.host_slots {
            return Err(invalid_argument(
                op,
                "slots",
                format!(
                    "values {cpu_slots:?} differ from `host_slots` {:?}",
                    self.host_slots
                ),
            ));
        }
        let rows = if self.host_slots.contains(&PAD_SLOT) {
            let zero_row = self.states.narrow(0, 0, 1)?.zeros_like()?;
            let rows = self
                .host_slots
                .iter()
                .map(|&slot| match slot {
                    PAD_SLOT => Ok(zero_row.clone()),
                    slot => self.states.narrow(0, slot as usize, 1),
                })
                .collect::<candle_core::Result<Vec<_>>>()?;
            Tensor::cat(&rows, 0)?
        } else {
            self.states.index_select(self.slots, 0)?
        };
        let (output, new_rows) = reference(&rows)?;
        for (row, &slot) in self.host_slots.iter().enumerate() {
            if slot != PAD_SLOT {
                self.states
                    .slice_set(&new_rows.narrow(0, row, 1)?, 0, slot as usize)?;
            }
        }
        Ok(output)
    }
}

/// Validates the state pool of [`kda_recurrence_in_pool_with`] and returns its
/// row count `S`.
pub(crate) fn validate_pool(
    op: &'static str,
    pool: &Tensor,
    dims: &RecurrenceDims,
) -> Result<usize> {
    if pool.dtype() != DType::F32 {
        return Err(invalid_argument(
            op,
            "pool",
            format!("dtype {:?}, expected f32", pool.dtype()),
        ));
    }
    let [rows, value_heads, key_dim, value_dim] = float_dims::<4>(op, "pool", pool)?;
    let expected = [dims.value_heads, dims.key_dim, dims.value_dim];
    if [value_heads, key_dim, value_dim] != expected {
        return Err(invalid_argument(
            op,
            "pool",
            format!(
                "shape {:?}, expected [S, Hv, dk, dv] with [Hv, dk, dv] = {expected:?}",
                pool.dims()
            ),
        ));
    }
    Ok(rows)
}

/// Validates the slots of a [`StatePool`] call of `op` for `batch`
/// sequences: `slots` a `u32` tensor `[B]`, `host_slots` `B` values, each
/// below `pool_rows` or [`PAD_SLOT`], the ones below distinct.
fn validate_slots(
    op: &'static str,
    slots: &Tensor,
    host_slots: &[u32],
    pool_rows: usize,
    batch: usize,
) -> Result<()> {
    if slots.dtype() != DType::U32 {
        return Err(invalid_argument(
            op,
            "slots",
            format!("dtype {:?}, expected u32", slots.dtype()),
        ));
    }
    if slots.dims() != [batch] {
        return Err(invalid_argument(
            op,
            "slots",
            format!("shape {:?}, expected [B] = [{batch}]", slots.dims()),
        ));
    }
    expect_dim(op, "host_slots", "length", host_slots.len(), batch)?;
    if let Some(&slot) = host_slots
        .iter()
        .find(|&&slot| slot != PAD_SLOT && slot as usize >= pool_rows)
    {
        return Err(invalid_argument(
            op,
            "host_slots",
            format!("slot {slot} is out of range for a pool of {pool_rows} rows"),
        ));
    }
    if let Some(slot) = repeated_slot(host_slots) {
        return Err(invalid_argument(
            op,
            "host_slots",
            format!("slot {slot} appears more than once"),
        ));
    }
    Ok(())
}

/// A slot that `host_slots` gives more than one sequence, if any (the
/// in-pool kernels take each sequence's state row once); [`PAD_SLOT`] is no
/// sequence's.
pub fn repeated_slot(host_slots: &[u32]) -> Option<u32> {
    let mut sorted: Vec<u32> = host_slots
        .iter()
        .copied()
        .filter(|&slot| slot != PAD_SLOT)
        .collect();
    sorted.sort_unstable();
    sorted
        .windows(2)
        .find(|pair| pair[0] == pair[1])
        .map(|pair| pair[0])
}

fn validate(tokens: &KdaTokens<'_>, state: &Tensor) -> Result<RecurrenceDims> {
    let dims = validate_tokens(OP, tokens)?;
    let state_dims = float_dims::<4>(OP, "state", state)?;
    let expected_state = [dims.batch, dims.value_heads, dims.key_dim, dims.value_dim];
    expect_shape(
        OP,
        "state",
        &state_dims,
        &expected_state,
        "[B, Hv, dk, dv] =",
    )?;
    expect_device(OP, "state", state, tokens.q.device())?;
    Ok(dims)
}

/// Validates the per-token inputs of a recurrence call of `op` and returns
/// its sizes.
fn validate_tokens(op: &'static str, tokens: &KdaTokens<'_>) -> Result<RecurrenceDims> {
    let KdaTokens { q, k, v, g, beta } = *tokens;
    let dims = validate_qkv(op, q, k, v)?;
    let g_dims = float_dims::<4>(op, "g", g)?;
    let beta_dims = float_dims::<3>(op, "beta", beta)?;
    let RecurrenceDims {
        batch,
        seq_len,
        value_heads,
        key_dim,
        ..
    } = dims;
    let expected_g = [batch, seq_len, value_heads, key_dim];
    expect_shape(op, "g", &g_dims, &expected_g, "[B, T, Hv, dk] =")?;
    let expected_beta = [batch, seq_len, value_heads];
    expect_shape(op, "beta", &beta_dims, &expected_beta, "[B, T, Hv] =")?;
    expect_on_device(op, q.device(), [("g", g), ("beta", beta)])?;
    Ok(dims)
}

/// Validates the q, k and v of a recurrence call of `op` (shapes as for
/// [`kda_recurrence`], one device) and returns the call's sizes.
pub(crate) fn validate_qkv(
    op: &'static str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Result<RecurrenceDims> {
    let [batch, seq_len, key_heads, key_dim] = float_dims::<4>(op, "q", q)?;
    let k_dims = float_dims::<4>(op, "k", k)?;
    let [v_batch, v_seq_len, value_heads, value_dim] = float_dims::<4>(op, "v", v)?;

    expect_shape(op, "k", &k_dims, q.dims(), "the shape of `q`")?;
    for (arg, what, size) in [
        ("q", "key head count (dim 2)", key_heads),
        ("q", "key dim (dim 3)", key_dim),
        ("v", "value dim (dim 3)", value_dim),
    ] {
        expect_positive(op, arg, what, size)?;
    }
    ensure(
        value_heads > 0 && value_heads % key_heads == 0,
        op,
        "v",
        || {
            format!(
            "value head count (dim 2) {value_heads} must be a positive multiple of the key head count {key_heads}"
        )
        },
    )?;
    expect_dim(op, "v", "batch size (dim 0)", v_batch, batch)?;
    expect_dim(op, "v", "sequence length (dim 1)", v_seq_len, seq_len)?;
    expect_on_device(op, q.device(), [("k", k), ("v", v)])?;
    Ok(RecurrenceDims {
        batch,
        seq_len,
        key_heads,
        value_heads,
        key_dim,
        value_dim,
    })
}

fn cpu_kda_recurrence(
    tokens: &KdaTokens<'_>,
    state: &Tensor,
    dims: &RecurrenceDims,
) -> Result<(Tensor, Tensor)> {
    let &RecurrenceDims {
        batch,
        seq_len,
        key_heads,
        value_heads,
        key_dim,
        value_dim,
    } = dims;
    let q = to_f32_vec(tokens.q)?;
    let k = to_f32_vec(tokens.k)?;
    let v = to_f32_vec(tokens.v)?;
    let g = to_f32_vec(tokens.g)?;
    let beta = to_f32_vec(tokens.beta)?;
    let mut state = to_f32_vec(state)?;

    let group_size = value_heads / key_heads;
    let query_scale = (key_dim as f64).powf(-0.5) as f32;
    let mut output = vec![0f32; batch * seq_len * value_heads * value_dim];
    let mut query = vec![0f32; key_dim];
    let mut key = vec![0f32; key_dim];
    let mut delta = vec![0f32; value_dim];

    for b in 0..batch {
        for head in 0..value_heads {
            let key_head = head / group_size;
            let state_start = (b * value_heads + head) * key_dim * value_dim;
            let s = &mut state[state_start..state_start + key_dim * value_dim];
            for t in 0..seq_len {
                let key_start = ((b * seq_len + t) * key_heads + key_head) * key_dim;
                l2_normalize(&q[key_start..key_start + key_dim], &mut query);
                for value in query.iter_mut() {
                    *value *= query_scale;
                }
                l2_normalize(&k[key_start..key_start + key_dim], &mut key);

                let token_head = (b * seq_len + t) * value_heads + head;
                let decay = &g[token_head * key_dim..(token_head + 1) * key_dim];
                let value_t = &v[token_head * value_dim..(token_head + 1) * value_dim];
                let beta_t = beta[token_head];

                for (row, &log_decay) in s.chunks_exact_mut(value_dim).zip(decay) {
                    let factor = log_decay.exp();
                    for entry in row.iter_mut() {
                        *entry *= factor;
                    }
                }
                for (e, delta_e) in delta.iter_mut().enumerate() {
                    let mut prediction = 0f32;
                    for (c, &key_c) in key.iter().enumerate() {
                        prediction += s[c * value_dim + e] * key_c;
                    }
                    *delta_e = beta_t * (value_t[e] - prediction);
                }
                for (row, &key_c) in s.chunks_exact_mut(value_dim).zip(&key) {
                    for (entry, &delta_e) in row.iter_mut().zip(&delta) {
                        *entry += key_c * delta_e;
                    }
                }
                let out = &mut output[token_head * value_dim..(token_head + 1) * value_dim];
                for (e, out_e) in out.iter_mut().enumerate() {
                    let mut read = 0f32;
                    for (c, &query_c) in query.iter().enumerate() {
                        read += s[c * value_dim + e] * query_c;
                    }
                    *out_e = read;
                }
            }
        }
    }

    let output = tensor_from_f32(
        output,
        &[batch, seq_len, value_heads, value_dim],
        DType::F32,
    )?;
    let state = tensor_from_f32(state, &[batch, value_heads, key_dim, value_dim], DType::F32)?;
    Ok((output, state))
}

/// Writes `input / sqrt(sum(input^2) + eps)` into `output`.
fn l2_normalize(input: &[f32], output: &mut [f32]) {
    let sum_of_squares: f32 = input.iter().map(|&value| value * value).sum();
    let inv_norm = 1.0 / (sum_of_squares + L2_NORM_EPS).sqrt();
    for (out, &value) in output.iter_mut().zip(input) {
        *out = value * inv_norm;
    }
}
