//! Binding of `moe.cu`: the routed experts for decode-sized batches.

use std::ffi::{c_int, c_void};

use candle_core::{DType, Shape, Tensor};

use super::{
    c_size, check, cuda_device, dtype_code, input_ptr, into_tensor, output_ptr, Input, Launch,
};
use crate::{invalid_argument, Result};

/// `kMaxRouted` in moe.cu: a block keeps the list of the rows sent to its
/// expert in shared memory.
const MAX_MOE_ROUTED_ROWS: usize = crate::MOE_EXPERTS_MAX_ROUTED_ROWS;

extern "C" {
    fn berrylm_moe_experts(
        dtype: c_int,
        x: *const c_void,
        weights: *const f32,
        ids: *const u32,
        gate_up: *const c_void,
        down: *const c_void,
        h: *mut c_void,
        expert_out: *mut c_void,
        y: *mut c_void,
        tokens: c_int,
        top_k: c_int,
        experts: c_int,
        hidden: c_int,
        inter: c_int,
        stream: *mut c_void,
    ) -> c_int;
}

/// Sizes of one `moe_experts` call.
pub(crate) struct MoeDims {
    pub tokens: usize,
    pub top_k: usize,
    pub experts: usize,
    pub hidden: usize,
    pub inter: usize,
}

/// CUDA `moe_experts`; arguments already validated by the caller.
pub(crate) fn moe_experts(
    x: &Tensor,
    weights: &Tensor,
    ids: &Tensor,
    gate_up: &Tensor,
    down: &Tensor,
    dims: &MoeDims,
) -> Result<Tensor> {
    const OP: &str = "moe_experts";
    let routed = dims.tokens * dims.top_k;
    if routed > MAX_MOE_ROUTED_ROWS {
        return Err(invalid_argument(
            OP,
            "ids",
            format!(
                "{routed} routed rows (tokens x top-k) exceed the CUDA kernel's maximum \
                 {MAX_MOE_ROUTED_ROWS}"
            ),
        ));
    }
    let launch = Launch::new(cuda_device(OP, x)?)?;
    let x = Input::new(x, None)?;
    let weights = Input::new(weights, Some(DType::F32))?;
    let ids = Input::new(ids, None)?;
    let gate_up = Input::new(gate_up, None)?;
    let down = Input::new(down, None)?;
    let dtype = x.dtype();
    let mut h = launch.alloc(&Shape::from_dims(&[routed, dims.inter]), dtype)?;
    let mut expert_out = launch.alloc(&Shape::from_dims(&[routed, dims.hidden]), dtype)?;
    let shape = Shape::from_dims(&[dims.tokens, dims.hidden]);
    let mut y = launch.alloc(&shape, dtype)?;
    {
        input_ptrs!(OP, launch, x_p <- x, weights_p <- weights, ids_p <- ids,
                           gate_up_p <- gate_up, down_p <- down);
        let h_p = output_ptr(&mut h, &launch.stream)?;
        let expert_out_p = output_ptr(&mut expert_out, &launch.stream)?;
        let y_p = output_ptr(&mut y, &launch.stream)?;
        // SAFETY: every pointer addresses a live contiguous device buffer of
        // the sizes the kernel derives from the dimensions passed; the launch
        // is queued on candle's stream of the device, after the work that
        // wrote the inputs.
        let code = unsafe {
            berrylm_moe_experts(
                dtype_code(OP, dtype)?,
                x_p.0 as *const c_void,
                weights_p.0 as *const f32,
                ids_p.0 as *const u32,
                gate_up_p.0 as *const c_void,
                down_p.0 as *const c_void,
                h_p.0 as *mut c_void,
                expert_out_p.0 as *mut c_void,
                y_p.0 as *mut c_void,
                c_size(OP, "x", dims.tokens)?,
                c_size(OP, "ids", dims.top_k)?,
                c_size(OP, "gate_up", dims.experts)?,
                c_size(OP, "x", dims.hidden)?,
                c_size(OP, "down", dims.inter)?,
                launch.raw_stream(),
            )
        };
        check(OP, code)?;
    }
    Ok(into_tensor(y, shape))
}
