//! Depthwise causal short convolution with SiLU (spec 3.6 step 4 and section 4).

use candle_core::{Device, Tensor};

use crate::{
    expect_device, expect_dim, float_dims, invalid_argument, round_to_dtype, silu, tensor_from_f32,
    to_f32_vec, unsupported_device, Result,
};

const OP: &str = "causal_conv1d";

/// Sizes of one `causal_conv1d` call.
struct ConvDims {
    batch: usize,
    seq_len: usize,
    channels: usize,
    kernel_size: usize,
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
    let [batch, seq_len, channels] = float_dims::<3>(OP, "x", x)?;
    let [weight_channels, kernel_size] = float_dims::<2>(OP, "weight", weight)?;
    let [state_batch, state_channels, state_columns] = float_dims::<3>(OP, "state", state)?;
    if kernel_size == 0 {
        return Err(invalid_argument(
            OP,
            "weight",
            "kernel size (dim 1) must be positive".to_string(),
        ));
    }
    expect_dim(
        OP,
        "weight",
        "channel count (dim 0)",
        weight_channels,
        channels,
    )?;
    expect_dim(OP, "state", "batch size (dim 0)", state_batch, batch)?;
    expect_dim(
        OP,
        "state",
        "channel count (dim 1)",
        state_channels,
        channels,
    )?;
    expect_dim(
        OP,
        "state",
        "column count (dim 2)",
        state_columns,
        kernel_size,
    )?;
    let device = x.device();
    expect_device(OP, "weight", weight, device)?;
    expect_device(OP, "state", state, device)?;
    let dims = ConvDims {
        batch,
        seq_len,
        channels,
        kernel_size,
    };
    match device {
        Device::Cpu => cpu_causal_conv1d(x, weight, state, &dims),
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => crate::cuda::causal_conv1d(
            x,
            weight,
            state,
            dims.batch,
            dims.seq_len,
            dims.channels,
            dims.kernel_size,
        ),
        other => Err(unsupported_device(OP, other)),
    }
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
