//! Binding of `berrylm_causal_conv1d_in_pool` (conv.cu): the causal
//! convolution whose carried states are rows of a conv state pool, read and
//! updated in place.

use std::ffi::{c_int, c_void};

use candle_core::{DType, Tensor};

use super::{
    c_size, check, cuda_device, dtype_code, input_ptr, launch_in_pool, reject_inputs_in_pool,
    ConvOutputs, Input, Launch,
};
use crate::Result;

const OP: &str = "causal_conv1d";

extern "C" {
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
    let launch = Launch::new(cuda_device(OP, x)?)?;
    let x = Input::new(x, None)?;
    let weight = Input::new(weight, Some(DType::F32))?;
    let slots = Input::new(slots, None)?;
    reject_inputs_in_pool(
        OP,
        pool,
        &[("x", &x), ("weight", &weight), ("slots", &slots)],
    )?;
    let mut outs = ConvOutputs::new(OP, &launch, batch, seq_len, widths, x.dtype())?;
    let x_dtype = dtype_code(OP, x.dtype())?;
    let pool_rows = c_size(OP, "pool", pool_rows)?;
    let sizes = [
        c_size(OP, "x", batch)?,
        c_size(OP, "x", seq_len)?,
        c_size(OP, "x", channels)?,
        c_size(OP, "weight", kernel_size)?,
    ];
    {
        input_ptrs!(OP, launch, x_p <- x, weight_p <- weight, slots_p <- slots);
        let (out_addresses, _out_guards, out_widths) = outs.launch_args(&launch.stream)?;
        launch_in_pool(OP, pool, &launch.stream, |pool, pool_dtype| {
            let [batch, seq_len, channels, kernel_size] = sizes;
            // SAFETY: as in `kda_gate`; the pool is `pool_rows` contiguous
            // rows of `C * K` elements of its dtype from `pool`, and the
            // kernels touch only rows `slots[b] < pool_rows`; `out_addresses`
            // and `out_widths` live across the call.
            let code = unsafe {
                berrylm_causal_conv1d_in_pool(
                    x_dtype,
                    dtype_code(OP, pool_dtype)?,
                    x_p.0 as *const c_void,
                    weight_p.0 as *const f32,
                    pool as *mut c_void,
                    slots_p.0 as *const u32,
                    pool_rows,
                    out_addresses.as_ptr(),
                    out_widths.as_ptr(),
                    out_widths.len() as c_int,
                    batch,
                    seq_len,
                    channels,
                    kernel_size,
                    launch.raw_stream(),
                )
            };
            check(OP, code)
        })?;
    }
    Ok(outs.into_tensors())
}
