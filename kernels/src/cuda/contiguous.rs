//! Binding of `contiguous.cu`: a strided view copied into contiguous memory
//! with its layout passed as kernel arguments (no host memory read on the
//! stream, so a CUDA graph capture can record it).

use std::ffi::{c_int, c_void};

use candle_core::Tensor;

use super::Launch;
use crate::Result;

extern "C" {
    fn berrylm_copy_strided(
        element_bytes: c_int,
        src: *const c_void,
        dst: *mut c_void,
        rank: c_int,
        dims: *const i64,
        strides: *const i64,
        total: i64,
        stream: *mut c_void,
    ) -> c_int;
}

/// CUDA `contiguous` of a tensor that is not contiguous, of at most
/// [`crate::contiguous::MAX_RANK`] dimensions, in a dtype [`Launch`] takes.
pub(crate) fn contiguous(tensor: &Tensor) -> Result<Tensor> {
    const OP: &str = "contiguous";
    let layout = tensor.layout();
    let rank = layout.dims().len();
    let dims: Vec<i64> = layout.dims().iter().map(|&d| d as i64).collect();
    let strides: Vec<i64> = layout.stride().iter().map(|&s| s as i64).collect();
    let element_bytes = tensor.dtype().size_in_bytes() as c_int;
    let mut launch = Launch::new(OP, tensor)?;
    let src = launch.push_input("tensor", tensor.clone())?;
    let out = launch.output(tensor.shape().clone(), tensor.dtype())?;
    // SAFETY (with `run_kernel!`'s): the kernel reads the elements the view's
    // dims and strides address from its first element, all within its storage.
    let outputs = run_kernel!(launch => berrylm_copy_strided(
        element_bytes, input(src), output(out), rank as c_int, dims.as_ptr(), strides.as_ptr(),
        tensor.elem_count() as i64
    ))?;
    Ok(outputs.tensor(out))
}
