//! Binding of `conv.cu`: the split causal convolution, with the carried
//! states in and out as tensors or as rows of a conv state pool, read and
//! updated in place. The input is read in place when its time steps lie at a
//! stride (the conv's columns of the KDA in-projection's output).

use std::ffi::{c_int, c_void};

use candle_core::{DType, Tensor};

use super::{c_size, dtype_code, Args, In, Launch, Out};
use crate::conv::ConvDims;
use crate::{invalid_argument, Result, StatePool};

const OP: &str = "causal_conv1d";

extern "C" {
    fn berrylm_causal_conv1d(
        x_dtype: c_int,
        state_dtype: c_int,
        x: *const c_void,
        x_stride: i64,
        weight: *const f32,
        state: *const c_void,
        new_state: *mut c_void,
        slots: *const u32,
        state_rows: c_int,
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

/// CUDA `causal_conv1d_split`; arguments already validated by the caller.
pub(crate) fn causal_conv1d(
    x: &Tensor,
    weight: &Tensor,
    state: &Tensor,
    widths: &[usize],
    dims: &ConvDims,
) -> Result<(Vec<Tensor>, Tensor)> {
    let mut launch = Launch::new(OP, x)?;
    let call = ConvCall::declare(&mut launch, x, weight, widths, dims)?;
    let state = launch.input("state", state)?;
    let state_dtype = launch.dtype(state);
    let new_state = launch.output(&[dims.batch, dims.channels, dims.kernel_size], state_dtype)?;
    let state_dtype = dtype_code(OP, state_dtype)?;
    let outputs = launch.run(|p| {
        // SAFETY: as in `run_kernel!`; sequence `b` reads row `b` of `state`
        // and writes row `b` of `new_state` (no slots: `B` rows).
        Ok(unsafe {
            call.launch(
                p,
                state_dtype,
                p.input(state),
                p.output(new_state),
                std::ptr::null(),
                call.batch,
            )
        })
    })?;
    let groups = call.groups.iter().map(|&group| outputs.tensor(group));
    Ok((groups.collect(), outputs.tensor(new_state)))
}

/// CUDA `causal_conv1d_split_in_pool`; arguments already validated by the
/// caller (`x` `[B, T, C]`, `weight` `[C, K]`, `pool.states` contiguous
/// `[S, C, K]`, `pool.slots` u32 `[B]`, `widths` summing to `C`).
///
/// One call of the launcher: the convolution reads each sequence's state
/// from its pool row and the new state is written back into that row, after
/// every read of the old one (conv.cu's header says how).
pub(crate) fn causal_conv1d_in_pool(
    x: &Tensor,
    weight: &Tensor,
    pool: StatePool<'_>,
    widths: &[usize],
    dims: &ConvDims,
) -> Result<Vec<Tensor>> {
    let mut launch = Launch::new(OP, x)?;
    let call = ConvCall::declare(&mut launch, x, weight, widths, dims)?;
    let slots = launch.input("slots", pool.slots)?;
    launch.in_pool(pool.states)?;
    let pool_dtype = dtype_code(OP, pool.states.dtype())?;
    let pool_rows = c_size(OP, "pool", pool.states.dim(0)?)?;
    let outputs = launch.run(|p| {
        // SAFETY: as in `run_kernel!`; the pool is `pool_rows` contiguous rows
        // of `C * K` elements of its dtype from `p.pool()`, read and written
        // in place, and the kernels touch only rows `slots[b] < pool_rows`.
        Ok(unsafe { call.launch(p, pool_dtype, p.pool(), p.pool(), p.input(slots), pool_rows) })
    })?;
    Ok(call
        .groups
        .iter()
        .map(|&group| outputs.tensor(group))
        .collect())
}

/// What the two bindings pass `berrylm_causal_conv1d` alike: `x` and the
/// weights, one output per group of channels (`conv.cu`'s output groups),
/// and the sizes.
struct ConvCall {
    x_dtype: c_int,
    x: In,
    /// Elements between consecutive time steps (rows) of `x`.
    x_stride: i64,
    weight: In,
    groups: Vec<Out>,
    group_widths: Vec<c_int>,
    batch: c_int,
    seq_len: c_int,
    channels: c_int,
    kernel_size: c_int,
}

impl ConvCall {
    /// Checks the batch against the kernels' grid (`B` is its z dimension)
    /// and declares `x`, the weights (as f32) and one `[B, T, width]` output
    /// in the dtype of `x` per entry of `widths` on `launch`.
    fn declare(
        launch: &mut Launch,
        x: &Tensor,
        weight: &Tensor,
        widths: &[usize],
        dims: &ConvDims,
    ) -> Result<Self> {
        if dims.batch > 65535 {
            return Err(invalid_argument(
                OP,
                "x",
                format!("batch size {} exceeds the CUDA kernel's 65535", dims.batch),
            ));
        }
        let (x, x_stride) = launch.input_rows("x", x)?;
        let weight = launch.input_as("weight", weight, DType::F32)?;
        let x_dtype = launch.dtype(x);
        let groups = widths
            .iter()
            .map(|&width| launch.output(&[dims.batch, dims.seq_len, width], x_dtype))
            .collect::<Result<Vec<_>>>()?;
        let group_widths = widths
            .iter()
            .map(|&width| c_size(OP, "widths", width))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            x_dtype: dtype_code(OP, x_dtype)?,
            x,
            x_stride: x_stride as i64,
            weight,
            groups,
            group_widths,
            batch: c_size(OP, "x", dims.batch)?,
            seq_len: c_size(OP, "x", dims.seq_len)?,
            channels: c_size(OP, "x", dims.channels)?,
            kernel_size: c_size(OP, "weight", dims.kernel_size)?,
        })
    }

    /// Calls `berrylm_causal_conv1d` with the addresses of this call's
    /// inputs and outputs in `p` and the states (of dtype code
    /// `state_dtype`): sequence `b` reads row `slots[b]` (row `b` when
    /// `slots` is null) of the `state_rows` rows of `state` and writes its
    /// new state to that row of `new_state`.
    ///
    /// # Safety
    ///
    /// `p` is the launch's [`Args`], and the state pointers address
    /// `state_rows` rows of `C * K` elements of that dtype (`slots`, when not
    /// null, `B` u32 values).
    unsafe fn launch(
        &self,
        p: &Args,
        state_dtype: c_int,
        state: *const c_void,
        new_state: *mut c_void,
        slots: *const u32,
        state_rows: c_int,
    ) -> c_int {
        let outs = p.outputs(&self.groups);
        berrylm_causal_conv1d(
            self.x_dtype,
            state_dtype,
            p.input(self.x),
            self.x_stride,
            p.input(self.weight),
            state,
            new_state,
            slots,
            state_rows,
            outs.as_ptr(),
            self.group_widths.as_ptr(),
            self.group_widths.len() as c_int,
            self.batch,
            self.seq_len,
            self.channels,
            self.kernel_size,
            p.stream(),
        )
    }
}
