//! Binding of `moe.cu`: the routed experts for decode-sized batches.

use std::ffi::{c_int, c_void};

use candle_core::{DType, Tensor};

use super::{c_size, dtype_code, Launch};
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
    let mut launch = Launch::new(OP, x)?;
    let x = launch.input("x", x)?;
    let weights = launch.input_as("weights", weights, DType::F32)?;
    let ids = launch.input("ids", ids)?;
    let gate_up = launch.input("gate_up", gate_up)?;
    let down = launch.input("down", down)?;
    let dtype = launch.dtype(x);
    // Scratch: each routed row's `h` and expert output.
    let h = launch.output(&[routed, dims.inter], dtype)?;
    let expert_out = launch.output(&[routed, dims.hidden], dtype)?;
    let y = launch.output(&[dims.tokens, dims.hidden], dtype)?;
    let outputs = launch.run(|p| {
        // SAFETY: as in `kda_gate`.
        Ok(unsafe {
            berrylm_moe_experts(
                dtype_code(OP, dtype)?,
                p.input(x),
                p.input(weights),
                p.input(ids),
                p.input(gate_up),
                p.input(down),
                p.output(h),
                p.output(expert_out),
                p.output(y),
                c_size(OP, "x", dims.tokens)?,
                c_size(OP, "ids", dims.top_k)?,
                c_size(OP, "gate_up", dims.experts)?,
                c_size(OP, "x", dims.hidden)?,
                c_size(OP, "down", dims.inter)?,
                p.stream(),
            )
        })
    })?;
    Ok(outputs.tensor(y))
}
