//! Bindings of `conv.cu`: the split causal convolution, with the carried
//! states in and out as tensors or as rows of a conv state pool, read and
//! updated in place.

use std::ffi::{c_int, c_void};

use candle_core::{DType, Tensor};

use super::{c_size, dtype_code, Launch, Out, Outputs};
use crate::{invalid_argument, Result};

const OP: &str = "causal_conv1d";

extern "C" {
    fn berrylm_causal_conv1d(
        x_dtype: c_int,
        state_dtype: c_int,
        x: *const c_void,
        weight: *const f32,
        state: *const c_void,
        outs: *const *mut c_void,
        widths: *const c_int,
        num_groups: c_int,
        new_state: *mut c_void,
        batch: c_int,
        seq_len: c_int,
        channels: c_int,
        kernel_size: c_int,
        stream: *mut c_void,
    ) -> c_int;

    fn berrylm_causal_conv1d_in_pool(
        x_dtype: c_int,
        pool_dtype: c_int,
        x: *const c_void,
        weight: *const f32,
        pool: *mut c_void,
        slots: *const u32,
        pool_rows: c_int,
        outs: *const *mut c_void,
        widths: *const c_int,
        num_groups: c_int,
        batch: c_int,
        seq_len: c_int,
        channels: c_int,
        kernel_size: c_int,
        stream: *mut c_void,
    ) -> c_int;
}

/// The outputs of a split convolution (`conv.cu`'s output groups): checks
/// the batch against the kernels' grid (`B` is its z dimension), declares
/// one `[B, T, width]` output per group of channels, and returns them with
/// the widths as the launchers take them.
fn declare_outputs(
    launch: &mut Launch,
    batch: usize,
    seq_len: usize,
    widths: &[usize],
    dtype: DType,
) -> Result<(Vec<Out>, Vec<c_int>)> {
    if batch > 65535 {
        return Err(invalid_argument(
            OP,
            "x",
            format!("batch size {batch} exceeds the CUDA kernel's 65535"),
        ));
    }
    let outputs = widths
        .iter()
        .map(|&width| launch.output(&[batch, seq_len, width], dtype))
        .collect::<Result<Vec<_>>>()?;
    let widths = widths
        .iter()
        .map(|&width| c_size(OP, "widths", width))
        .collect::<Result<Vec<_>>>()?;
    Ok((outputs, widths))
}

/// The tensors of the output groups.
fn group_tensors(outputs: &Outputs, groups: &[Out]) -> Vec<Tensor> {
    groups.iter().map(|&group| outputs.tensor(group)).collect()
}

/// CUDA `causal_conv1d_split`; arguments already validated by the caller.
pub(crate) fn causal_conv1d(
    x: &Tensor,
    weight: &Tensor,
    state: &Tensor,
    widths: &[usize],
    batch: usize,
    seq_len: usize,
    kernel_size: usize,
) -> Result<(Vec<Tensor>, Tensor)> {
    let mut launch = Launch::new(OP, x)?;
    let x = launch.input("x", x)?;
    let weight = launch.input_as("weight", weight, DType::F32)?;
    let state = launch.input("state", state)?;
    let (x_dtype, state_dtype) = (launch.dtype(x), launch.dtype(state));
    let (groups, group_widths) = declare_outputs(&mut launch, batch, seq_len, widths, x_dtype)?;
    let channels = widths.iter().sum();
    let new_state = launch.output(&[batch, channels, kernel_size], state_dtype)?;
    let outputs = launch.run(|p| {
        let outs = groups
            .iter()
            .map(|&group| p.output(group))
            .collect::<Vec<_>>();
        // SAFETY: as in `kda_gate`; `outs` and `group_widths` live across
        // the call.
        Ok(unsafe {
            berrylm_causal_conv1d(
                dtype_code(OP, x_dtype)?,
                dtype_code(OP, state_dtype)?,
                p.input(x),
                p.input(weight),
                p.input(state),
                outs.as_ptr(),
                group_widths.as_ptr(),
                c_size(OP, "widths", group_widths.len())?,
                p.output(new_state),
                c_size(OP, "x", batch)?,
                c_size(OP, "x", seq_len)?,
                c_size(OP, "x", channels)?,
                c_size(OP, "weight", kernel_size)?,
                p.stream(),
            )
        })
    })?;
    Ok((group_tensors(&outputs, &groups), outputs.tensor(new_state)))
}

/// CUDA `causal_conv1d_split_in_pool`; arguments already validated by the
/// caller (`x` `[B, T, C]`, `weight` `[C, K]`, `pool` contiguous
/// `[S, C, K]`, `slots` u32 `[B]`, `widths` summing to `C`).
///
/// One call of the launcher: the convolution reads each sequence's state
/// from its pool row and the new state is written back into that row, after
/// every read of the old one (conv.cu's header says how).
pub(crate) fn causal_conv1d_in_pool(
    x: &Tensor,
    weight: &Tensor,
    pool: &Tensor,
    slots: &Tensor,
    widths: &[usize],
) -> Result<Vec<Tensor>> {
    let (batch, seq_len, channels) = x.dims3()?;
    let kernel_size = weight.dim(1)?;
    let pool_rows = pool.dim(0)?;
    let mut launch = Launch::new(OP, x)?;
    let x = launch.input("x", x)?;
    let weight = launch.input_as("weight", weight, DType::F32)?;
    let slots = launch.input("slots", slots)?;
    launch.in_pool(pool)?;
    let x_dtype = launch.dtype(x);
    let (groups, group_widths) = declare_outputs(&mut launch, batch, seq_len, widths, x_dtype)?;
    let x_dtype = dtype_code(OP, x_dtype)?;
    let pool_rows = c_size(OP, "pool", pool_rows)?;
    let [batch, seq_len, channels, kernel_size] = [
        c_size(OP, "x", batch)?,
        c_size(OP, "x", seq_len)?,
        c_size(OP, "x", channels)?,
        c_size(OP, "weight", kernel_size)?,
    ];
    let outputs = launch.run(|p| {
        let outs = groups
            .iter()
            .map(|&group| p.output(group))
            .collect::<Vec<_>>();
        // SAFETY: as in `kda_gate`; the pool is `pool_rows` contiguous rows
        // of `C * K` elements of its dtype from `p.pool()`, and the kernels
        // touch only rows `slots[b] < pool_rows`; `outs` and `group_widths`
        // live across the call.
        Ok(unsafe {
            berrylm_causal_conv1d_in_pool(
                x_dtype,
                dtype_code(OP, p.pool_dtype())?,
                p.input(x),
                p.input(weight),
                p.pool(),
                p.input(slots),
                pool_rows,
                outs.as_ptr(),
                group_widths.as_ptr(),
                group_widths.len() as c_int,
                batch,
                seq_len,
                channels,
                kernel_size,
                p.stream(),
            )
        })
    })?;
    Ok(group_tensors(&outputs, &groups))
}
