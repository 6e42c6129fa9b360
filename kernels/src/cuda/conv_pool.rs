//! Binding of `berrylm_causal_conv1d_in_pool` (conv.cu): the causal
//! convolution whose carried states are rows of a conv state pool, read and
//! updated in place.

use std::ffi::{c_int, c_void};

use candle_core::cuda_backend::cudarc::driver::{sys::CUdeviceptr, DevicePtrMut};
use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::{CudaStorage, DType, InplaceOp1, Layout, Shape, Tensor};

use super::{
    c_size, check, cuda_device, dtype_code, input_ptr, into_tensor, output_ptr, storage_address,
    Input, Launch,
};
use crate::{invalid_argument, Result};

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

/// The launch of `berrylm_causal_conv1d_in_pool` once every other address is
/// known; run through [`Tensor::inplace_op1`] on the pool, which holds the
/// pool's write lock and hands out its storage mutably (so the write is
/// recorded as one).
struct ConvPoolLaunch<'a> {
    launch: &'a Launch,
    x_dtype: c_int,
    x: CUdeviceptr,
    weight: CUdeviceptr,
    slots: CUdeviceptr,
    pool_rows: c_int,
    outs: &'a [*mut c_void],
    widths: &'a [c_int],
    /// `[B, T, C, K]`.
    sizes: [c_int; 4],
}

impl InplaceOp1 for ConvPoolLaunch<'_> {
    fn name(&self) -> &'static str {
        "causal_conv1d_split_in_pool"
    }

    fn cpu_fwd(
        &self,
        _storage: &mut candle_core::CpuStorage,
        _layout: &Layout,
    ) -> candle_core::Result<()> {
        // `causal_conv1d_split_in_pool` dispatches CPU pools to the CPU
        // reference.
        candle_core::bail!("{OP}: the CUDA launch got a CPU pool")
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        let stream = &self.launch.stream;
        let (base, _guard, pool_dtype) = match &mut storage.slice {
            CudaStorageSlice::F32(slice) => {
                let (base, guard) = slice.device_ptr_mut(stream);
                (base, guard, DType::F32)
            }
            CudaStorageSlice::BF16(slice) => {
                let (base, guard) = slice.device_ptr_mut(stream);
                (base, guard, DType::BF16)
            }
            CudaStorageSlice::F16(slice) => {
                let (base, guard) = slice.device_ptr_mut(stream);
                (base, guard, DType::F16)
            }
            _ => candle_core::bail!("{OP}: the pool's dtype is not f32, bf16 or f16"),
        };
        let pool = base + (layout.start_offset() * pool_dtype.size_in_bytes()) as CUdeviceptr;
        let pool_dtype = dtype_code(OP, pool_dtype)?;
        let [batch, seq_len, channels, kernel_size] = self.sizes;
        // SAFETY: as in `kda_gate`; the pool is `pool_rows` contiguous rows
        // of `C * K` elements of its dtype from `pool`, and the kernels touch
        // only rows `slots[b] < pool_rows`; `outs` and `widths` live across
        // the call.
        let code = unsafe {
            berrylm_causal_conv1d_in_pool(
                self.x_dtype,
                pool_dtype,
                self.x as *const c_void,
                self.weight as *const f32,
                pool as *mut c_void,
                self.slots as *const u32,
                self.pool_rows,
                self.outs.as_ptr(),
                self.widths.as_ptr(),
                self.widths.len() as c_int,
                batch,
                seq_len,
                channels,
                kernel_size,
                self.launch.raw_stream(),
            )
        };
        check(OP, code).map_err(Into::into)
    }
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
    if batch > 65535 {
        return Err(invalid_argument(
            OP,
            "x",
            format!("batch size {batch} exceeds the CUDA kernel's 65535"),
        ));
    }
    let launch = Launch::new(cuda_device(OP, x)?)?;
    let x = Input::new(x, None)?;
    let weight = Input::new(weight, Some(DType::F32))?;
    let slots = Input::new(slots, None)?;
    // The pool's write lock is taken while the inputs' read locks are held;
    // an input sharing the pool's storage would deadlock there (and race
    // with the kernel's writes), so it is rejected.
    let pool_storage = storage_address(pool);
    for (arg, input) in [("x", &x), ("weight", &weight), ("slots", &slots)] {
        if storage_address(&input.tensor) == pool_storage {
            return Err(invalid_argument(
                OP,
                arg,
                "shares its storage with `pool`".to_string(),
            ));
        }
    }
    let out_shapes = widths
        .iter()
        .map(|&width| Shape::from_dims(&[batch, seq_len, width]))
        .collect::<Vec<_>>();
    let mut outs = out_shapes
        .iter()
        .map(|shape| launch.alloc(shape, x.dtype()))
        .collect::<Result<Vec<_>>>()?;
    let c_widths = widths
        .iter()
        .map(|&width| c_size(OP, "widths", width))
        .collect::<Result<Vec<_>>>()?;
    {
        input_ptrs!(OP, launch, x_p <- x, weight_p <- weight, slots_p <- slots);
        let out_ps = outs
            .iter_mut()
            .map(|out| output_ptr(out, &launch.stream))
            .collect::<Result<Vec<_>>>()?;
        let out_addresses = out_ps
            .iter()
            .map(|(address, _)| *address as *mut c_void)
            .collect::<Vec<_>>();
        pool.inplace_op1(&ConvPoolLaunch {
            launch: &launch,
            x_dtype: dtype_code(OP, x.dtype())?,
            x: x_p.0,
            weight: weight_p.0,
            slots: slots_p.0,
            pool_rows: c_size(OP, "pool", pool_rows)?,
            outs: &out_addresses,
            widths: &c_widths,
            sizes: [
                c_size(OP, "x", batch)?,
                c_size(OP, "x", seq_len)?,
                c_size(OP, "x", channels)?,
                c_size(OP, "weight", kernel_size)?,
            ],
        })?;
    }
    Ok(outs
        .into_iter()
        .zip(out_shapes)
        .map(|(out, shape)| into_tensor(out, shape))
        .collect())
}
