//! Depthwise causal short convolution with SiLU (spec 3.6 step 4 and section 4).

use candle_core::Tensor;

use crate::{
    expect_device, expect_dim, expect_positive, float_dims, invalid_argument, round_to_dtype, silu,
    tensor_from_f32, to_f32_vec, Result, StatePool,
};

const OP: &str = "causal_conv1d";

/// The most output groups [`causal_conv1d_split`] takes (`kMaxGroups` in
/// conv.cu).
pub const MAX_CONV_OUTPUT_GROUPS: usize = 4;

/// Sizes of one `causal_conv1d` call.
pub(crate) struct ConvDims {
    pub batch: usize,
    pub seq_len: usize,
    pub channels: usize,
    pub kernel_size: usize,
}

/// Depthwise causal convolution without bias, followed by SiLU.
///
/// * `x`: `[B, T, C]` in the activation dtype.
/// * `weight`: `[C, K]`.
/// * `state`: `[B, C, K]`, the last `K` pre-convolution input columns of each
///   sequence (zeros for a fresh sequence).
///
/// With `xs[b, c, :] = concat(state[b, c, :], x[b, :, c])`, the
/// pre-activation is `pre[b, t, c] = sum_j weight[c, j] * xs[b, c, t + j + 1]`
/// (so the last `K - 1` state columns are the left context), accumulated in
/// `f32` and rounded to the dtype of `x`; the output is `silu(pre)` computed in
/// `f32` and rounded to the dtype of `x`.
///
/// Returns `(output [B, T, C] in the dtype of x, new_state [B, C, K] in the
/// dtype of state)`, where the new state is the last `K` columns of `xs`. Any
/// `T` works, including `T = 1` (a decode step) and `T < K`.
pub fn causal_conv1d(x: &Tensor, weight: &Tensor, state: &Tensor) -> Result<(Tensor, Tensor)> {
    let channels = float_dims::<3>(OP, "x", x)?[2];
    let (mut outputs, new_state) = causal_conv1d_split(x, weight, state, &[channels])?;
    Ok((outputs.remove(0), new_state))
}

/// [`causal_conv1d`] with its output channels split into consecutive groups
/// of `widths` channels (positive, summing to `C`, at most
/// [`MAX_CONV_OUTPUT_GROUPS`]), each returned as its own contiguous
/// `[B, T, width]` tensor: a KDA layer's packed `q | k | v` come out as the
/// three tensors its recurrence reads, without copies.
///
/// The plugin does not call it (it runs [`causal_conv1d_split_in_pool`] on
/// its conv state pool); it is kept as a test reference: the tests compare
/// the in-pool convolution with it on the gathered rows, and its CUDA split
/// outputs with the CPU's. [`causal_conv1d`] (used by the benchmarks) calls
/// it with one group.
pub fn causal_conv1d_split(
    x: &Tensor,
    weight: &Tensor,
    state: &Tensor,
    widths: &[usize],
) -> Result<(Vec<Tensor>, Tensor)> {
    let dims = validate(x, weight, widths)?;
    let state_batch = validate_state_rows("state", state, &dims)?;
    expect_dim(OP, "state", "batch size (dim 0)", state_batch, dims.batch)?;
    expect_device(OP, "state", state, x.device())?;
    on_device!(
        OP,
        x.device(),
        {
            let (output, new_state) = cpu_causal_conv1d(x, weight, state, &dims)?;
            Ok((split_channels(&output, widths)?, new_state))
        },
        crate::cuda::causal_conv1d(x, weight, state, widths, &dims),
    )
}

/// [`causal_conv1d_split`] for `B` sequences whose states are rows
/// `slots[b]` of a conv state pool, updated in place.
///
/// * `x`, `weight`, `widths`: as for [`causal_conv1d_split`] (same shapes,
///   validation, arithmetic, rounding and outputs).
/// * `pool`: the pool and the batch's rows in it ([`StatePool`]);
///   `pool.states` is `[S, C, K]` in any float dtype the convolution takes
///   for its state, contiguous (a view at an offset is fine).
///
/// Sequence `b` starts from row `slots[b]` of `pool.states`, exactly as
/// [`causal_conv1d_split`] starts from `state[b]`. Before returning, that row
/// holds the new state [`causal_conv1d_split`] returns for it (the last `K`
/// columns of `concat(old row, x[b, :, c])`, rounded to the pool's dtype:
/// copied values, exact when the pool's dtype holds those of `x`); no other
/// row is written. The write goes into the pool's storage, so every tensor
/// sharing it sees the new states. Returns the outputs, one `[B, T, width]`
/// tensor in the dtype of `x` per entry of `widths`, bit for bit those of
/// [`causal_conv1d_split`] on the gathered rows (on CUDA with the same
/// kernel code).
///
/// A row whose slot is [`crate::PAD_SLOT`] starts from a zero state and
/// writes none. The slots are validated as for
/// [`crate::kda_recurrence_in_pool_with`] (`host_slots`: `B` values `< S`
/// and distinct, or [`crate::PAD_SLOT`]; `slots`: `u32` `[B]`, on the CPU
/// equal to `host_slots`). On CUDA a sequence whose `slots` entry is `>= S`
/// is a pad row, so a disagreeing `slots` never writes outside the pool. No
/// input may share storage with `pool.states`.
pub fn causal_conv1d_split_in_pool(
    x: &Tensor,
    weight: &Tensor,
    pool: StatePool<'_>,
    widths: &[usize],
) -> Result<Vec<Tensor>> {
    let dims = validate(x, weight, widths)?;
    let pool_rows = validate_state_rows("pool", pool.states, &dims)?;
    pool.validate(OP, pool_rows, dims.batch, x.device())?;
    on_device!(
        OP,
        x.device(),
        split_channels(
            &pool.cpu_update(OP, |state| cpu_causal_conv1d(x, weight, state, &dims))?,
            widths,
        ),
        crate::cuda::causal_conv1d_in_pool(x, weight, pool, widths, &dims),
    )
}

/// Validates `x`, `weight` and `widths` of a convolution call and returns
/// its sizes.
fn validate(x: &Tensor, weight: &Tensor, widths: &[usize]) -> Result<ConvDims> {
    let [batch, seq_len, channels] = float_dims::<3>(OP, "x", x)?;
    if widths.is_empty()
        || widths.len() > MAX_CONV_OUTPUT_GROUPS
        || widths.contains(&0)
        || widths.iter().sum::<usize>() != channels
    {
        return Err(invalid_argument(
            OP,
            "widths",
            format!(
                "{widths:?} must be 1 to {MAX_CONV_OUTPUT_GROUPS} positive widths summing to the \
                 {channels} channels of `x`"
            ),
        ));
    }
    let [weight_channels, kernel_size] = float_dims::<2>(OP, "weight", weight)?;
    expect_positive(OP, "weight", "kernel size (dim 1)", kernel_size)?;
    expect_dim(
        OP,
        "weight",
        "channel count (dim 0)",
        weight_channels,
        channels,
    )?;
    expect_device(OP, "weight", weight, x.device())?;
    Ok(ConvDims {
        batch,
        seq_len,
        channels,
        kernel_size,
    })
}

/// Validates conv states `[rows, C, K]` of any float dtype (`arg`: `state`
/// or `pool`) for a call of sizes `dims` and returns their row count.
fn validate_state_rows(arg: &'static str, states: &Tensor, dims: &ConvDims) -> Result<usize> {
    let [rows, channels, columns] = float_dims::<3>(OP, arg, states)?;
    expect_dim(OP, arg, "channel count (dim 1)", channels, dims.channels)?;
    expect_dim(OP, arg, "column count (dim 2)", columns, dims.kernel_size)?;
    Ok(rows)
}

/// The CPU output `[B, T, C]` as one contiguous `[B, T, width]` tensor per
/// group of `widths` consecutive channels.
fn split_channels(output: &Tensor, widths: &[usize]) -> Result<Vec<Tensor>> {
    let mut start = 0;
    let mut outputs = Vec::with_capacity(widths.len());
    for &width in widths {
        outputs.push(output.narrow(2, start, width)?.contiguous()?);
        start += width;
    }
    Ok(outputs)
}

fn cpu_causal_conv1d(
    x: &Tensor,
    weight: &Tensor,
    state: &Tensor,
    dims: &ConvDims,
) -> Result<(Tensor, Tensor)> {
    let ConvDims {
        batch,
        seq_len,
        channels,
        kernel_size,
    } = *dims;
    let activation_dtype = x.dtype();
    let state_dtype = state.dtype();
    let x = to_f32_vec(x)?;
    let weight = to_f32_vec(weight)?;
    let state = to_f32_vec(state)?;

    let mut pre_activation = vec![0f32; batch * seq_len * channels];
    let mut new_state = vec![0f32; batch * channels * kernel_size];
    for b in 0..batch {
        for c in 0..channels {
            // Column `i` of the history `concat(state[b, c, :], x[b, :, c])`.
            let history = |i: usize| {
                if i < kernel_size {
                    state[(b * channels + c) * kernel_size + i]
                } else {
                    x[(b * seq_len + i - kernel_size) * channels + c]
                }
            };
            let taps = &weight[c * kernel_size..(c + 1) * kernel_size];
            for t in 0..seq_len {
                let mut sum = 0f32;
                for (j, &tap) in taps.iter().enumerate() {
                    sum += tap * history(t + j + 1);
                }
                pre_activation[(b * seq_len + t) * channels + c] = sum;
            }
            for i in 0..kernel_size {
                new_state[(b * channels + c) * kernel_size + i] = history(seq_len + i);
            }
        }
    }

    let activated = round_to_dtype(pre_activation, activation_dtype)?
        .into_iter()
        .map(silu)
        .collect();
    let output = tensor_from_f32(activated, &[batch, seq_len, channels], activation_dtype)?;
    let new_state = tensor_from_f32(new_state, &[batch, channels, kernel_size], state_dtype)?;
    Ok((output, new_state))
}
