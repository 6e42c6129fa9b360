//! The heavy operations of the BerryLM model, each with a CPU reference
//! implementation operating on candle tensors.
//!
//! | Function | Spec section | What it computes |
//! |---|---|---|
//! | [`kda_gate`] | 3.6 step 3 | KDA forget gate `-exp(A_log) * softplus(raw + dt_bias)`, optionally clamped |
//! | [`kda_beta`] | 3.6 step 3 | KDA write strength `sigmoid(b)` in f32 |
//! | [`causal_conv1d`] | 3.6 step 4, 4 | depthwise causal short convolution + SiLU, with a carried state of `K` columns |
//! | [`causal_conv1d_split`] | 3.6 step 4, 4 | the same, its output channels split into separate contiguous tensors (q, k, v); a test reference for the in-pool one |
//! | [`causal_conv1d_split_in_pool`] | 3.6 step 4, 4 | the same for sequences whose states are rows of a conv state pool, updated in place by slot |
//! | [`kda_recurrence`] | 3.6 step 6 | the KDA delta-rule recurrence with per-key-channel decay |
//! | [`kda_recurrence_with`] | 3.6 step 6 | the same, with an explicit [`KdaPrefillAlgorithm`] for CUDA prefill; a test reference |
//! | [`kda_recurrence_in_pool_with`] | 3.6 step 6 | the same for sequences whose states are rows of an `f32` state pool, updated in place by slot, with an explicit [`KdaPrefillAlgorithm`] |
//! | [`kda_core_in_pool`] | 3.6 steps 3, 6, 7 | the KDA layer from its conv's outputs to its gated output norm: gate, write strength, recurrence in the pool and gated RMSNorm (one kernel for a CUDA decode step) |
//! | [`attn_res_mix`] | 3.4 | gated block AttnRes: depth softmax over committed streams and the current stream |
//! | [`attn_res_mix_norm`] | 3.4, 3.1 | the AttnRes mix and the layer's input norm of it (one kernel on CUDA) |
//! | [`gated_rms_norm`] | 3.1 | RMSNorm before a SiLU gate (the KDA output norm) |
//! | [`offset_rms_norm`] | 3.1 | the `(1 + w)` RMSNorm of the layer, q/k and final norms |
//! | [`add_offset_rms_norm`] | 3.1, 3.3 | a residual add and the `(1 + w)` RMSNorm of its result, one launch |
//! | [`add_offset_rms_norm_matmul`] | 3.1, 3.3 | the same, then a decode step's projection of the normed rows, one launch |
//! | [`offset_rms_norm_rope`] | 3.5 step 2-3 | the q/k `(1 + w)` RMSNorm followed by the partial NeoX rotary embedding |
//! | [`causal_attention`] | 3.5 step 4 | causal GQA `softmax(q k^T * scale) v` over a prompt (FlashAttention-style tensor-core kernel on CUDA) |
//! | [`paged_decode_attention`] | 3.5 step 4 | a decode step's attention over the host's paged KV blocks (split-KV kernel on CUDA) |
//! | [`sigmoid_gate_mul`] | 3.5 step 5 | the attention output times the sigmoid of its gate |
//! | [`moe_route`] | 3.7 | MoE router: softmax, top-k with `torch.topk`'s order, optional renormalisation |
//! | [`moe_experts`] | 3.7 step 3 | the routed experts' weighted sum, accumulated in expert order (decode kernels; grouped GEMMs for prompts on CUDA) |
//! | [`moe_experts_with`] | 3.7 step 3 | the same, with an explicit [`MoeExpertsAlgorithm`] for CUDA; a test and benchmark reference |
//! | [`moe_block_decode`] | 3.7 steps 3-5 | a decode step's MoE block: the routed experts, the gated shared expert and the residual add (two launches on CUDA) |
//! | [`moe_experts_quantized`] | 3.7 step 3 | the same with experts quantized in GGUF blocks (q8_0, q4_K), for decode steps |
//! | [`quantized_matmul`] | - | `x W^T` with `W` quantized in GGUF blocks (q8_0, q4_K), for decode steps |
//! | [`quantized_matmul_with_dense`] | - | the same and `x D^T` with `D` in full precision, as one output (one launch on CUDA) |
//! | [`contiguous`] | - | a view's elements in contiguous memory (on CUDA without reading host memory, so decode graphs can capture it) |
//! | [`swiglu`] | 3.7 step 3-4 | an expert's `silu(gate) * up` from its packed gate-then-up projection |
//! | [`add_moe_output`] | 3.7 step 4-5 | the sigmoid-gated shared expert plus the routed output, added to the residual |
//!
//! Every function validates its arguments (rank, sizes, floating-point
//! dtypes, one device for all tensors) and then dispatches on the device of
//! its tensors. Most validate into a struct of the checked tensors and sizes
//! (`{Op}Args::validate`) whose `cpu` method is the CPU reference and whose
//! `cuda` method launches the kernels. The CPU is always implemented. With
//! the `cuda` feature, CUDA tensors run CUDA kernels (`src/cuda/*.cu`, see
//! `CUDA.md`) that compute the same results with the same rounding points,
//! launched on candle's stream of the device. Any other device yields
//! [`KernelError::UnsupportedDevice`] naming the operation.
//!
//! Inputs may be `f32`, `bf16` or `f16`. Arithmetic
//! and accumulation happen in `f32`; where the PyTorch reference rounds an
//! intermediate to the activation dtype, the CPU implementation rounds it the
//! same way (round-to-nearest-even through candle's dtype conversion).
//!
//! # Errors
//!
//! All functions return [`Result`], whose error type is [`KernelError`]. A
//! [`KernelError`] converts into a [`candle_core::Error`] (the wrapped candle
//! error is returned as is), so callers working with `candle_core::Result`
//! can use `?` directly.

use candle_core::{DType, Device, Tensor};

/// Runs an operation of this crate on `$device`, the device of its
/// (validated) tensors: `$cpu` computes the CPU reference, `$cuda` (compiled
/// with the `cuda` feature only) launches the CUDA kernels; any other device
/// is [`KernelError::UnsupportedDevice`] of `$op`.
macro_rules! on_device {
    ($op:expr, $device:expr, $cpu:expr, $cuda:expr $(,)?) => {
        match $device {
            candle_core::Device::Cpu => $cpu,
            #[cfg(feature = "cuda")]
            candle_core::Device::Cuda(_) => $cuda,
            other => Err($crate::unsupported_device($op, other)),
        }
    };
}

mod attention;
mod attn_res;
mod contiguous;
mod conv;
#[cfg(feature = "cuda")]
mod cuda;
mod gate;
mod gate_mul;
mod kda_core;
mod mlp;
mod moe;
mod norm;
mod paged_attention;
mod quantized;
mod recurrence;
mod rope;
mod route;

pub use attention::causal_attention;
pub use attn_res::{attn_res_mix, attn_res_mix_norm};
pub use contiguous::contiguous;
pub use conv::{
    causal_conv1d, causal_conv1d_split, causal_conv1d_split_in_pool, MAX_CONV_OUTPUT_GROUPS,
};
pub use gate::{kda_beta, kda_gate};
pub use gate_mul::sigmoid_gate_mul;
pub use kda_core::{kda_core_in_pool, KdaCoreInputs, KdaCoreParams};
pub use mlp::{add_moe_output, swiglu};
pub use moe::{
    moe_block_decode, moe_experts, moe_experts_quantized, moe_experts_with, MoeBlockInputs,
    MoeBlockWeights, MoeExpertsAlgorithm, MOE_BLOCK_DECODE_MAX_TOP_K,
};
pub use norm::{add_offset_rms_norm, add_offset_rms_norm_matmul, gated_rms_norm, offset_rms_norm};
pub use paged_attention::{paged_decode_attention, paged_decode_attention_takes, PagedKv};
pub use quantized::{
    decode_matmul, quantized_matmul, quantized_matmul_with_dense, takes_gguf_dtype,
};
pub use recurrence::{
    kda_recurrence, kda_recurrence_in_pool_with, kda_recurrence_with, repeated_slot,
    KdaPrefillAlgorithm, StatePool, PAD_SLOT,
};
pub use rope::offset_rms_norm_rope;
pub use route::moe_route;

/// Errors returned by the kernels of this crate.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// An argument has the wrong rank, size, dtype or device.
    #[error("{op}: invalid argument `{arg}`: {reason}")]
    InvalidArgument {
        /// The operation that rejected the argument.
        op: &'static str,
        /// The name of the offending argument.
        arg: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The operation has no implementation for the device of its tensors.
    #[error("{op}: not implemented for device {device}")]
    UnsupportedDevice {
        /// The operation that was called.
        op: &'static str,
        /// The device the tensors live on.
        device: String,
    },
    /// The linked CUDA library was built from other sources than this crate
    /// (a build-script output left from another build).
    #[error(
        "the CUDA kernel library was built from other sources than berrylm-kernels: \
         rebuild it (touch kernels/build.rs, then build again)"
    )]
    StaleLibrary,
    /// An error raised by candle while reading or building tensors.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl From<KernelError> for candle_core::Error {
    fn from(error: KernelError) -> Self {
        match error {
            KernelError::Candle(inner) => inner,
            other => candle_core::Error::wrap(other),
        }
    }
}

/// Result type of every function of this crate.
pub type Result<T> = std::result::Result<T, KernelError>;

fn invalid_argument(op: &'static str, arg: &'static str, reason: String) -> KernelError {
    KernelError::InvalidArgument { op, arg, reason }
}

fn unsupported_device(op: &'static str, device: &Device) -> KernelError {
    KernelError::UnsupportedDevice {
        op,
        device: format!("{:?}", device.location()),
    }
}

/// Fails unless `dtype` is a floating-point dtype that this crate supports
/// (`f32`, `bf16` or `f16`).
fn expect_float_dtype(op: &'static str, arg: &'static str, dtype: DType) -> Result<()> {
    match dtype {
        DType::F16 | DType::BF16 | DType::F32 => Ok(()),
        other => Err(invalid_argument(
            op,
            arg,
            format!("dtype {other:?} is not supported (expected f32, bf16 or f16)"),
        )),
    }
}

/// Returns the dimensions of `tensor`, which must have rank `RANK` and a
/// floating-point dtype that this crate supports.
fn float_dims<const RANK: usize>(
    op: &'static str,
    arg: &'static str,
    tensor: &Tensor,
) -> Result<[usize; RANK]> {
    expect_float_dtype(op, arg, tensor.dtype())?;
    <[usize; RANK]>::try_from(tensor.dims()).map_err(|_| {
        invalid_argument(
            op,
            arg,
            format!("expected rank {RANK}, got shape {:?}", tensor.dims()),
        )
    })
}

/// Fails with an invalid-argument error of `op` naming `arg` and giving
/// `reason()` unless `holds`.
fn ensure(
    holds: bool,
    op: &'static str,
    arg: &'static str,
    reason: impl FnOnce() -> String,
) -> Result<()> {
    if holds {
        Ok(())
    } else {
        Err(invalid_argument(op, arg, reason()))
    }
}

/// Fails unless `actual == expected`, describing the dimension by `what`.
fn expect_dim(
    op: &'static str,
    arg: &'static str,
    what: &str,
    actual: usize,
    expected: usize,
) -> Result<()> {
    ensure(actual == expected, op, arg, || {
        format!("{what} is {actual}, expected {expected}")
    })
}

/// Fails unless `size` is positive, describing the size by `what`.
fn expect_positive(op: &'static str, arg: &'static str, what: &str, size: usize) -> Result<()> {
    ensure(size > 0, op, arg, || format!("{what} must be positive"))
}

/// Fails unless `dims == expected`, naming the expected shape by `whose`
/// ("the expected", "the shape of `x`").
fn expect_shape(
    op: &'static str,
    arg: &'static str,
    dims: &[usize],
    expected: &[usize],
    whose: &str,
) -> Result<()> {
    ensure(dims == expected, op, arg, || {
        format!("shape {dims:?} differs from {whose} {expected:?}")
    })
}

/// Fails unless `tensor` has dtype `expected`, naming whose dtype that is by
/// `whose` ("the dtype of `x`", "the residual's").
fn expect_same_dtype(
    op: &'static str,
    arg: &'static str,
    tensor: &Tensor,
    expected: DType,
    whose: &str,
) -> Result<()> {
    ensure(tensor.dtype() == expected, op, arg, || {
        format!(
            "dtype {:?} differs from {whose} {expected:?}",
            tensor.dtype()
        )
    })
}

/// Fails unless `tensor` lives on `device`.
fn expect_device(
    op: &'static str,
    arg: &'static str,
    tensor: &Tensor,
    device: &Device,
) -> Result<()> {
    expect_same_device(op, arg, tensor.device(), device)
}

/// Fails unless `actual`, the device of argument `arg`, is `device`.
fn expect_same_device(
    op: &'static str,
    arg: &'static str,
    actual: &Device,
    device: &Device,
) -> Result<()> {
    ensure(actual.same_device(device), op, arg, || {
        format!(
            "is on device {:?}, expected {:?}",
            actual.location(),
            device.location()
        )
    })
}

/// Fails unless every tensor of `tensors`, each with its argument's name,
/// lives on `device`.
fn expect_on_device<const N: usize>(
    op: &'static str,
    device: &Device,
    tensors: [(&'static str, &Tensor); N],
) -> Result<()> {
    tensors
        .into_iter()
        .try_for_each(|(arg, tensor)| expect_device(op, arg, tensor, device))
}

/// Fails unless `tensor` has shape `dims` and the dtype and device of
/// `like`, the argument named `like_arg`.
fn expect_like(
    op: &'static str,
    arg: &'static str,
    tensor: &Tensor,
    dims: &[usize],
    (like_arg, like): (&str, &Tensor),
) -> Result<()> {
    expect_shape(op, arg, tensor.dims(), dims, "the expected")?;
    ensure(tensor.dtype() == like.dtype(), op, arg, || {
        format!(
            "dtype {:?} differs from the dtype of `{like_arg}` {:?}",
            tensor.dtype(),
            like.dtype()
        )
    })?;
    expect_device(op, arg, tensor, like.device())
}

/// Copies `tensor` into a row-major `Vec<f32>` (exact for every supported
/// dtype).
fn to_f32_vec(tensor: &Tensor) -> Result<Vec<f32>> {
    Ok(tensor
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?)
}

/// Rounds every value to the nearest value representable in `dtype`
/// (round-to-nearest-even), returning the results as `f32`.
fn round_to_dtype(values: Vec<f32>, dtype: DType) -> Result<Vec<f32>> {
    match dtype {
        DType::F32 => Ok(values),
        _ => {
            let len = values.len();
            let tensor = Tensor::from_vec(values, len, &Device::Cpu)?;
            to_f32_vec(&tensor.to_dtype(dtype)?)
        }
    }
}

/// Builds a CPU tensor of `dtype` from `f32` values in row-major order.
fn tensor_from_f32(values: Vec<f32>, dims: &[usize], dtype: DType) -> Result<Tensor> {
    Ok(Tensor::from_vec(values, dims, &Device::Cpu)?.to_dtype(dtype)?)
}

/// `x * sigmoid(x)` in `f32`, written as `x / (1 + exp(-x))` like PyTorch.
fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}
