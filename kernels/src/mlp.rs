//! The elementwise tails of the MoE block (spec 3.7): the SwiGLU activation of
//! an expert and the gated shared expert added to the routed output and to
//! the residual stream, each with the reference's rounding points.

use candle_core::Tensor;

use crate::{
    expect_float_dtype, expect_like, float_dims, invalid_argument, round_to_dtype, silu,
    tensor_from_f32, to_f32_vec, Result,
};

const SWIGLU_OP: &str = "swiglu";
const ADD_MOE_OP: &str = "add_moe_output";

/// The SwiGLU activation of an expert's packed `gate | up` projection:
///
/// ```text
/// y = round(round(silu(gate)) * up)      (in f32)
/// ```
///
/// where `round` rounds to the dtype of `gate_up`, as PyTorch's
/// `act_fn(gate) * up` rounds in that dtype.
///
/// * `gate_up`: `[..., 2I]`: the gate projection in the first `I` columns of
///   the last dimension, the up projection in the other `I`.
///
/// Returns `[..., I]` in the dtype of `gate_up`.
pub fn swiglu(gate_up: &Tensor) -> Result<Tensor> {
    expect_float_dtype(SWIGLU_OP, "gate_up", gate_up.dtype())?;
    let width = match gate_up.dims().last() {
        Some(&width) if width > 0 && width % 2 == 0 => width,
        _ => {
            return Err(invalid_argument(
                SWIGLU_OP,
                "gate_up",
                format!(
                    "the last dimension must be positive and even (gate | up), got shape {:?}",
                    gate_up.dims()
                ),
            ))
        }
    };
    let mut out_dims = gate_up.dims().to_vec();
    let intermediate = width / 2;
    *out_dims.last_mut().expect("rank checked above") = intermediate;
    on_device!(
        SWIGLU_OP,
        gate_up.device(),
        cpu_swiglu(gate_up, intermediate, &out_dims),
        crate::cuda::swiglu(gate_up, intermediate, &out_dims),
    )
}

fn cpu_swiglu(gate_up: &Tensor, intermediate: usize, out_dims: &[usize]) -> Result<Tensor> {
    let dtype = gate_up.dtype();
    let values = to_f32_vec(gate_up)?;
    let rows = values.chunks_exact(2 * intermediate);
    let activated = round_to_dtype(
        rows.clone()
            .flat_map(|row| row[..intermediate].iter().map(|&gate| silu(gate)))
            .collect(),
        dtype,
    )?;
    let up = rows.flat_map(|row| row[intermediate..].iter().copied());
    let product = activated
        .into_iter()
        .zip(up)
        .map(|(activated, up)| activated * up)
        .collect();
    tensor_from_f32(product, out_dims, dtype)
}

/// The residual stream after an MoE block whose shared expert is gated:
///
/// ```text
/// gate   = round(sigmoid(gate_logit))
/// shared = round(gate * shared)
/// moe    = round(routed + shared)
/// y      = round(residual + moe)             (each step in f32)
/// ```
///
/// where `round` rounds to the dtype of the inputs, as the reference rounds
/// each of these steps in the activation dtype.
///
/// * `residual`, `routed`, `shared`: `[N, H]`, one dtype.
/// * `gate_logit`: `[N, 1]` (the shared expert gate's projection), the same
///   dtype.
///
/// Returns `[N, H]` in that dtype.
pub fn add_moe_output(
    residual: &Tensor,
    routed: &Tensor,
    shared: &Tensor,
    gate_logit: &Tensor,
) -> Result<Tensor> {
    let args = AddMoeOutputArgs::validate(residual, routed, shared, gate_logit)?;
    on_device!(ADD_MOE_OP, residual.device(), args.cpu(), args.cuda())
}

/// The validated arguments of an [`add_moe_output`] call: all four of one
/// dtype, `[N, hidden]` and `[N, 1]`.
pub(crate) struct AddMoeOutputArgs<'a> {
    pub residual: &'a Tensor,
    pub routed: &'a Tensor,
    pub shared: &'a Tensor,
    pub gate_logit: &'a Tensor,
    pub hidden: usize,
}

impl<'a> AddMoeOutputArgs<'a> {
    /// Checks the arguments of an [`add_moe_output`] call and reads its
    /// hidden size.
    fn validate(
        residual: &'a Tensor,
        routed: &'a Tensor,
        shared: &'a Tensor,
        gate_logit: &'a Tensor,
    ) -> Result<Self> {
        let [rows, hidden] = float_dims::<2>(ADD_MOE_OP, "residual", residual)?;
        for (arg, tensor, dims) in [
            ("routed", routed, [rows, hidden]),
            ("shared", shared, [rows, hidden]),
            ("gate_logit", gate_logit, [rows, 1]),
        ] {
            expect_like(ADD_MOE_OP, arg, tensor, &dims, ("residual", residual))?;
        }
        Ok(Self {
            residual,
            routed,
            shared,
            gate_logit,
            hidden,
        })
    }

    /// The CPU reference.
    fn cpu(&self) -> Result<Tensor> {
        let dtype = self.residual.dtype();
        let gates = round_to_dtype(
            to_f32_vec(self.gate_logit)?
                .into_iter()
                .map(|logit| 1.0 / (1.0 + (-logit).exp()))
                .collect(),
            dtype,
        )?;
        let gated = round_to_dtype(
            to_f32_vec(self.shared)?
                .chunks_exact(self.hidden)
                .zip(&gates)
                .flat_map(|(row, &gate)| row.iter().map(move |&value| gate * value))
                .collect(),
            dtype,
        )?;
        let moe = round_to_dtype(
            to_f32_vec(self.routed)?
                .into_iter()
                .zip(gated)
                .map(|(routed, shared)| routed + shared)
                .collect(),
            dtype,
        )?;
        let out = to_f32_vec(self.residual)?
            .into_iter()
            .zip(moe)
            .map(|(residual, moe)| residual + moe)
            .collect();
        tensor_from_f32(out, self.residual.dims(), dtype)
    }
}
