//! Bindings of `mlp.cu`: an expert's SwiGLU and the gated shared expert
//! added to the residual.
//!
//! The packed gate | up rows and the gate logits are read in place when their
//! rows lie at a stride (the shared expert's columns of the MoE's stacked
//! input projection, at more than one token).

use std::ffi::{c_int, c_void};

use candle_core::Tensor;

use super::{c_size, dtype_code, Launch};
use crate::mlp::AddMoeOutputArgs;
use crate::Result;

extern "C" {
    fn berrylm_swiglu(
        dtype: c_int,
        gate_up: *const c_void,
        gate_up_stride: i64,
        out: *mut c_void,
        rows: i64,
        intermediate: c_int,
        stream: *mut c_void,
    ) -> c_int;

    fn berrylm_add_moe_output(
        dtype: c_int,
        residual: *const c_void,
        routed: *const c_void,
        shared: *const c_void,
        gate_logit: *const c_void,
        gate_logit_stride: i64,
        out: *mut c_void,
        rows: i64,
        hidden: c_int,
        stream: *mut c_void,
    ) -> c_int;
}

/// CUDA `swiglu`; arguments already validated by the caller (`out_dims` is
/// the shape of `gate_up` with its last dimension `intermediate`).
pub(crate) fn swiglu(gate_up: &Tensor, intermediate: usize, out_dims: &[usize]) -> Result<Tensor> {
    const OP: &str = "swiglu";
    let mut launch = Launch::new(OP, gate_up)?;
    let (gate_up, gate_up_stride) = launch.input_rows("gate_up", gate_up)?;
    let dtype = launch.dtype(gate_up);
    let out = launch.output(out_dims, dtype)?;
    let rows = out_dims.iter().product::<usize>() / intermediate;
    // SAFETY (with `run_kernel!`'s): `gate_up` is read as `rows` rows of `2 * intermediate`
    // elements, `gate_up_stride` elements apart from its first element, which its layout spans.
    let outputs = run_kernel!(launch => berrylm_swiglu(
        dtype(dtype), input(gate_up), gate_up_stride as i64, output(out),
        rows as i64, c_size(OP, "gate_up", intermediate)?
    ))?;
    Ok(outputs.tensor(out))
}

impl AddMoeOutputArgs<'_> {
    /// CUDA `add_moe_output`; arguments already validated by the caller.
    pub(crate) fn cuda(&self) -> Result<Tensor> {
        const OP: &str = "add_moe_output";
        let hidden = self.hidden;
        let mut launch = Launch::new(OP, self.residual)?;
        let [residual, routed, shared] = launch.inputs([
            ("residual", self.residual),
            ("routed", self.routed),
            ("shared", self.shared),
        ])?;
        let (gate_logit, gate_logit_stride) = launch.input_rows("gate_logit", self.gate_logit)?;
        let dtype = launch.dtype(residual);
        let shape = launch.shape(residual).clone();
        let rows = shape.elem_count() / hidden.max(1);
        let out = launch.output(shape, dtype)?;
        // SAFETY (with `run_kernel!`'s): `gate_logit` is read as `rows` elements,
        // `gate_logit_stride` elements apart from its first element, which its layout spans.
        let outputs = run_kernel!(launch => berrylm_add_moe_output(
            dtype(dtype), input(residual), input(routed), input(shared), input(gate_logit),
            gate_logit_stride as i64, output(out), rows as i64, c_size(OP, "residual", hidden)?
        ))?;
        Ok(outputs.tensor(out))
    }
}
