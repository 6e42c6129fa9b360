//! How the CUDA driver keeps the memory the model frees.
//!
//! candle allocates every tensor with `cuMemAllocAsync` from the device's
//! default memory pool and frees it back there. That pool's release
//! threshold is 0 by default, so at every synchronisation (the engine reads
//! the logits back each step) the driver returns the pool's unused memory to
//! the system, and the next step's hundreds of allocations reserve it again.
//! Raising the threshold keeps the freed memory pooled for reuse, as
//! PyTorch's caching allocator does.
//!
//! Memory kept in the pool counts as used in the device's free-memory
//! figure, from which the host sizes a paged KV cache. So the threshold is
//! raised only while a model on the device needs it: when the last one is
//! dropped (an unload), the threshold returns to the driver's default and
//! the pool is trimmed, and the unload's synchronisation returns what the
//! model and its cache free to the system, for the next load to find.

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};

use candle_core::cuda_backend::cudarc::driver::sys;
use candle_core::{Device, Result};

/// Models alive per CUDA device (by ordinal) that keep its freed memory pooled.
static HOLDERS: Mutex<BTreeMap<usize, usize>> = Mutex::new(BTreeMap::new());

/// Keeps a CUDA device's freed memory pooled while it lives (nothing on other
/// devices).
pub struct PooledFreedMemory {
    pool: Option<(usize, sys::CUmemoryPool)>,
}

// SAFETY: a memory pool handle is a driver object usable from any thread of
// the process; the guard only passes it to the driver.
unsafe impl Send for PooledFreedMemory {}
// SAFETY: as for Send; the guard has no interior mutability.
unsafe impl Sync for PooledFreedMemory {}

impl PooledFreedMemory {
    /// Sets the release threshold of `device`'s default memory pool to the
    /// maximum until the last guard of the device is dropped.
    pub fn keep(device: &Device) -> Result<Self> {
        let Device::Cuda(cuda) = device else {
            return Ok(Self { pool: None });
        };
        let context = cuda.cuda_stream().context().clone();
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: `pool` outlives the call, which writes it.
        unsafe {
            sys::cuDeviceGetDefaultMemPool(&mut pool, context.cu_device())
                .result()
                .map_err(candle_core::Error::wrap)?;
        }
        set_release_threshold(pool, u64::MAX)?;
        let ordinal = context.ordinal();
        let mut holders = HOLDERS.lock().unwrap_or_else(PoisonError::into_inner);
        *holders.entry(ordinal).or_default() += 1;
        Ok(Self {
            pool: Some((ordinal, pool)),
        })
    }
}

impl Drop for PooledFreedMemory {
    fn drop(&mut self) {
        let Some((ordinal, pool)) = self.pool else {
            return;
        };
        let mut holders = HOLDERS.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(count) = holders.get_mut(&ordinal) else {
            return;
        };
        *count -= 1;
        if *count > 0 {
            return;
        }
        let released = set_release_threshold(pool, 0).and_then(|()| {
            // SAFETY: `pool` is the device's default pool, alive as long as
            // the process.
            unsafe { sys::cuMemPoolTrimTo(pool, 0) }
                .result()
                .map_err(candle_core::Error::wrap)
        });
        if let Err(e) = released {
            tracing::warn!(
                "BerryLM: CUDA device {ordinal}'s memory pool still keeps what the model freed: {e}"
            );
        }
    }
}

fn set_release_threshold(pool: sys::CUmemoryPool, mut threshold: u64) -> Result<()> {
    // SAFETY: `threshold` outlives the call, which reads it.
    unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
        .result()
        .map_err(candle_core::Error::wrap)
    }
}
