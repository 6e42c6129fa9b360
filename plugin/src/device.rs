//! Opening a CUDA device the way the host's loaders open theirs.

use candle_core::{Device, Result};

/// CUDA device `ordinal`, set up as the server sets up its own: the model
/// runs on one stream of the device's own (not the legacy NULL stream, on
/// which CUDA cannot capture the decode graphs), and cudarc's cross-stream
/// event tracking is off (with it, every allocation creates two events and
/// every kernel launch waits on and records them). Tools that run the model
/// outside the host (the benchmark, the alignment report) open their device
/// with this, so that they measure what the server runs.
pub fn open_cuda(ordinal: usize) -> Result<Device> {
    let device = Device::new_cuda_with_stream(ordinal)?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = &device {
        // SAFETY: nothing has been allocated on the device yet, and all its
        // work is queued on its one stream, which orders it without events.
        unsafe { cuda.disable_event_tracking() };
    }
    Ok(device)
}
