//! How the CUDA driver keeps the memory the model frees.
//!
//! candle allocates every tensor with `cuMemAllocAsync` from the device's
//! default memory pool and frees it back there. That pool's release
//! threshold is 0 by default, so at every synchronisation (the engine reads
//! the logits back each step) the driver returns the pool's unused memory to
//! the system, and the next step's hundreds of allocations reserve it again.
//! Raising the threshold keeps the freed memory pooled for reuse, as
//! PyTorch's caching allocator does.

use candle_core::cuda_backend::cudarc::driver::sys;
use candle_core::{Device, Result};

/// Sets the release threshold of `device`'s default memory pool to the
/// maximum, so that freed memory stays pooled. Other devices are left alone.
pub fn keep_freed_memory_pooled(device: &Device) -> Result<()> {
    let Device::Cuda(cuda) = device else {
        return Ok(());
    };
    let stream = cuda.cuda_stream();
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold = u64::MAX;
    // SAFETY: `pool` and `threshold` outlive the calls, which only read the
    // device handle and write `pool` / read `threshold`.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, stream.context().cu_device())
            .result()
            .map_err(candle_core::Error::wrap)?;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
        .result()
        .map_err(candle_core::Error::wrap)?;
    }
    Ok(())
}
