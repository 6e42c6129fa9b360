//! The output gate of the gated full attention (spec 3.5 step 5).

use candle_core::Tensor;

use crate::{
    expect_device, expect_same_dtype, expect_shape, float_dims, round_to_dtype, tensor_from_f32,
    to_f32_vec, Result,
};

const OP: &str = "sigmoid_gate_mul";

/// The attention output gated by the sigmoid of the gate half of `q_proj`:
///
/// ```text
/// s = round(1 / (exp(-gate) + 1))      (gate in f32)
/// y = round(x * s)                     (in f32)
/// ```
///
/// where `round` rounds to the dtype of `x`: PyTorch's `o * sigmoid(gate)`
/// in that dtype (the sigmoid computed in f32 and rounded once, then the
/// product).
///
/// * `x`: `[B, T, H, D]`, any layout (made contiguous first).
/// * `gate`: `[B, T, H, D]` in the dtype of `x`, any layout; a view whose
///   last dimension is contiguous and whose rows of `D` lie at one stride
///   (the gate half of the per-head interleaved `q_proj` output,
///   `[B, T, H, 2D]` narrowed to its last `D` channels) is read in place on
///   CUDA, others are made contiguous first.
///
/// Returns a contiguous `[B, T, H, D]` in the dtype of `x`.
pub fn sigmoid_gate_mul(x: &Tensor, gate: &Tensor) -> Result<Tensor> {
    let dims = float_dims::<4>(OP, "x", x)?;
    let gate_dims = float_dims::<4>(OP, "gate", gate)?;
    expect_shape(OP, "gate", &gate_dims, &dims, "the shape of `x`")?;
    expect_same_dtype(OP, "gate", gate, x.dtype(), "the dtype of `x`")?;
    let device = x.device();
    expect_device(OP, "gate", gate, device)?;
    on_device!(
        OP,
        device,
        cpu_sigmoid_gate_mul(x, gate, &dims),
        crate::cuda::sigmoid_gate_mul(x, gate, &dims),
    )
}

fn cpu_sigmoid_gate_mul(x: &Tensor, gate: &Tensor, dims: &[usize]) -> Result<Tensor> {
    let dtype = x.dtype();
    let gates = round_to_dtype(
        to_f32_vec(gate)?
            .into_iter()
            .map(|gate| 1.0 / ((-gate).exp() + 1.0))
            .collect(),
        dtype,
    )?;
    let product = to_f32_vec(x)?
        .into_iter()
        .zip(gates)
        .map(|(value, gate)| value * gate)
        .collect();
    tensor_from_f32(product, dims, dtype)
}
