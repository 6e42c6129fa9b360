//! CUDA implementations of the crate's operations (feature `cuda`).
//!
//! The kernels live in `src/cuda/*.cu`; `build.rs` compiles them with nvcc
//! into the static library `libberrylmkernels.a`, whose C symbols are all
//! prefixed `berrylm_`. This module binds them and moves candle tensors in and
//! out: inputs are made contiguous, the small parameter tensors are widened to
//! `f32` (exact), outputs are allocated uninitialised on the same device, and
//! every kernel is launched on candle's stream of that device, so the order
//! with candle's own work is preserved without synchronisation.

use std::ffi::{c_char, c_int, c_void, CStr};

use candle_core::backend::BackendDevice;
use candle_core::cuda_backend::cudarc::driver::{
    sys::CUdeviceptr, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop,
};
use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, InplaceOp1, Layout, Shape, Storage, Tensor};

use crate::{invalid_argument, KdaPrefillAlgorithm, KernelError, Result};

/// Dtype codes understood by the kernels (`berrylm::DTypeCode` in common.cuh).
const DTYPE_F32: c_int = 0;
const DTYPE_BF16: c_int = 1;
const DTYPE_F16: c_int = 2;

/// Values of `berrylm_kda_recurrence`'s `prefill_algorithm` argument
/// (`berrylm::recurrence::PrefillAlgorithm` in recurrence.cu).
const PREFILL_SEQUENTIAL: c_int = 0;
const PREFILL_CHUNKED: c_int = 1;

/// The most sources `attn_res_mix` takes on CUDA (`kMaxSources` in attn_res.cu).
pub(crate) const MAX_ATTN_RES_SOURCES: usize = 32;

/// The most experts `moe_route` takes on CUDA (`kMaxExperts` in route.cu: one
/// thread per expert in a block).
const MAX_MOE_EXPERTS: usize = 512;

#[allow(improper_ctypes)]
extern "C" {
    fn berrylm_cuda_error_string(code: c_int) -> *const c_char;

    fn berrylm_kda_gate(
        raw_dtype: c_int,
        raw: *const c_void,
        a_log: *const f32,
        dt_bias: *const f32,
        out: *mut f32,
        tokens: i64,
        width: c_int,
        head_dim: c_int,
        has_lower_bound: c_int,
        lower_bound: f32,
        stream: *mut c_void,
    ) -> c_int;

    fn berrylm_kda_beta(
        b_dtype: c_int,
        b: *const c_void,
        out: *mut f32,
        total: i64,
        stream: *mut c_void,
    ) -> c_int;

    fn berrylm_causal_conv1d(
        x_dtype: c_int,
        state_dtype: c_int,
        x: *const c_void,
        weight: *const f32,
        state: *const c_void,
        outs: *const *mut c_void,
        widths: *const c_int,
        num_groups: c_int,
        new_state: *mut c_void,
        batch: c_int,
        seq_len: c_int,
        channels: c_int,
        kernel_size: c_int,
        stream: *mut c_void,
    ) -> c_int;

    fn berrylm_kda_recurrence_max_key_dim() -> c_int;

    fn berrylm_kda_recurrence(
        qkv_dtype: c_int,
        q: *const c_void,
        k: *const c_void,
        v: *const c_void,
        g: *const f32,
        beta: *const f32,
        state_in: *const f32,
        out: *mut f32,
        state_out: *mut f32,
        batch: c_int,
        seq_len: c_int,
        key_heads: c_int,
        value_heads: c_int,
        key_dim: c_int,
        value_dim: c_int,
        prefill_algorithm: c_int,
        stream: *mut c_void,
    ) -> c_int;

    fn berrylm_kda_recurrence_in_pool(
        qkv_dtype: c_int,
        q: *const c_void,
        k: *const c_void,
        v: *const c_void,
        g: *const f32,
        beta: *const f32,
        pool: *mut f32,
        slots: *const u32,
        pool_rows: c_int,
        out: *mut f32,
        batch: c_int,
        seq_len: c_int,
        key_heads: c_int,
        value_heads: c_int,
        key_dim: c_int,
        value_dim: c_int,
        prefill_algorithm: c_int,
        stream: *mut c_void,
    ) -> c_int;

    fn berrylm_attn_res_mix(
        src_dtype: c_int,
        out_dtype: c_int,
        sources: *const *const c_void,
        num_sources: c_int,
        query: *const f32,
        out: *mut c_void,
        tokens: i64,
        hidden: c_int,
        eps: f32,
        gated: c_int,
        strength: f32,
        stream: *mut c_void,
    ) -> c_int;

    fn berrylm_gated_rms_norm(
        x_dtype: c_int,
        z_dtype: c_int,
        x: *const c_void,
        z: *const c_void,
        weight: *const f32,
        out: *mut c_void,
        rows: i64,
        width: c_int,
        eps: f32,
        stream: *mut c_void,
    ) -> c_int;

    fn berrylm_offset_rms_norm(
        x_dtype: c_int,
        x: *const c_void,
        delta: *const c_void,
        scale: *const f32,
        sum_out: *mut c_void,
        out: *mut c_void,
        rows: i64,
        width: c_int,
        inv_width: f32,
        eps: f32,
        stream: *mut c_void,
    ) -> c_int;

    fn berrylm_swiglu(
        dtype: c_int,
        gate_up: *const c_void,
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
        out: *mut c_void,
        rows: i64,
        hidden: c_int,
        stream: *mut c_void,
    ) -> c_int;

    fn berrylm_moe_route(
        logits_dtype: c_int,
        logits: *const c_void,
        weights: *mut f32,
        ids: *mut u32,
        rows: i64,
        experts: c_int,
        top_k: c_int,
        renormalize: c_int,
        weight_dtype: c_int,
        stream: *mut c_void,
    ) -> c_int;
}

fn dtype_code(op: &'static str, dtype: DType) -> Result<c_int> {
    match dtype {
        DType::F32 => Ok(DTYPE_F32),
        DType::BF16 => Ok(DTYPE_BF16),
        DType::F16 => Ok(DTYPE_F16),
        other => Err(invalid_argument(
            op,
            "dtype",
            format!("dtype {other:?} is not supported"),
        )),
    }
}

/// Turns a kernel launcher's status into a `Result`.
fn check(op: &'static str, code: c_int) -> Result<()> {
    if code == 0 {
        return Ok(());
    }
    // SAFETY: cudaGetErrorString returns a static NUL-terminated string.
    let name = unsafe { CStr::from_ptr(berrylm_cuda_error_string(code)) };
    Err(KernelError::Candle(candle_core::Error::Msg(format!(
        "{op}: CUDA kernel launch failed with error {code} ({})",
        name.to_string_lossy()
    ))))
}

/// Fails unless `size` fits the kernels' 32-bit size arguments.
fn c_size(op: &'static str, arg: &'static str, size: usize) -> Result<c_int> {
    c_int::try_from(size).map_err(|_| {
        invalid_argument(
            op,
            arg,
            format!("size {size} is too large for the CUDA kernel"),
        )
    })
}

/// The CUDA device and its (candle) stream, with the device's context bound
/// to the calling thread for the runtime-API launches.
struct Launch {
    device: CudaDevice,
    stream: std::sync::Arc<CudaStream>,
}

impl Launch {
    fn new(device: &CudaDevice) -> Result<Self> {
        let stream = device.cuda_stream();
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| KernelError::Candle(candle_core::Error::Msg(format!("{e:?}"))))?;
        Ok(Self {
            device: device.clone(),
            stream,
        })
    }

    fn raw_stream(&self) -> *mut c_void {
        self.stream.cu_stream() as *mut c_void
    }

    /// Uninitialised device storage for `shape` elements of `dtype`.
    fn alloc(&self, shape: &Shape, dtype: DType) -> Result<CudaStorage> {
        // SAFETY: every element is written by the kernel before the tensor is
        // read.
        Ok(unsafe { self.device.alloc_uninit(shape, dtype)? })
    }
}

/// Wraps freshly written device storage into a tensor of `shape`.
fn into_tensor(storage: CudaStorage, shape: Shape) -> Tensor {
    Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false)
}

/// A read lock on a contiguous CUDA tensor's storage.
struct Input {
    tensor: Tensor,
}

impl Input {
    /// `tensor`, made contiguous (and converted to `dtype` when given).
    fn new(tensor: &Tensor, dtype: Option<DType>) -> Result<Self> {
        let tensor = match dtype {
            Some(dtype) if dtype != tensor.dtype() => tensor.to_dtype(dtype)?,
            _ => tensor.clone(),
        };
        Ok(Self {
            tensor: tensor.contiguous()?,
        })
    }

    fn dtype(&self) -> DType {
        self.tensor.dtype()
    }
}

/// The device address of a contiguous tensor's first element; the returned
/// guard records the read on `stream` when dropped (after the launch).
fn input_ptr<'a>(
    op: &'static str,
    storage: &'a Storage,
    layout: &Layout,
    stream: &'a CudaStream,
) -> Result<(CUdeviceptr, SyncOnDrop<'a>)> {
    let Storage::Cuda(storage) = storage else {
        return Err(invalid_argument(
            op,
            "tensor",
            "expected a CUDA tensor".to_string(),
        ));
    };
    let (base, guard, elem) = match &storage.slice {
        CudaStorageSlice::F32(s) => {
            let (p, g) = s.device_ptr(stream);
            (p, g, 4)
        }
        CudaStorageSlice::BF16(s) => {
            let (p, g) = s.device_ptr(stream);
            (p, g, 2)
        }
        CudaStorageSlice::F16(s) => {
            let (p, g) = s.device_ptr(stream);
            (p, g, 2)
        }
        CudaStorageSlice::U32(s) => {
            let (p, g) = s.device_ptr(stream);
            (p, g, 4)
        }
        _ => {
            return Err(invalid_argument(
                op,
                "tensor",
                "unsupported dtype".to_string(),
            ))
        }
    };
    Ok((base + (layout.start_offset() * elem) as CUdeviceptr, guard))
}

/// The device address of freshly allocated output storage; the guard records
/// the write on `stream` when dropped.
fn output_ptr<'a>(
    storage: &'a mut CudaStorage,
    stream: &'a CudaStream,
) -> Result<(CUdeviceptr, SyncOnDrop<'a>)> {
    Ok(match &mut storage.slice {
        CudaStorageSlice::F32(s) => s.device_ptr_mut(stream),
        CudaStorageSlice::BF16(s) => s.device_ptr_mut(stream),
        CudaStorageSlice::F16(s) => s.device_ptr_mut(stream),
        CudaStorageSlice::U32(s) => s.device_ptr_mut(stream),
        _ => {
            return Err(KernelError::Candle(candle_core::Error::Msg(
                "unsupported output dtype".to_string(),
            )))
        }
    })
}

macro_rules! input_ptrs {
    ($op:expr, $launch:expr, $( $ptr:ident <- $input:expr ),+ $(,)?) => {
        $(
            let (storage, layout) = $input.tensor.storage_and_layout();
            let $ptr = input_ptr($op, &storage, layout, &$launch.stream)?;
        )+
    };
}

mod rope;
pub(crate) use rope::{offset_rms_norm_rope, sigmoid_gate_mul};
mod moe;
pub(crate) use moe::{moe_experts, MoeDims};
mod conv_pool;
pub(crate) use conv_pool::causal_conv1d_in_pool;

fn cuda_device<'a>(op: &'static str, tensor: &'a Tensor) -> Result<&'a CudaDevice> {
    match tensor.device() {
        candle_core::Device::Cuda(device) => Ok(device),
        other => Err(crate::unsupported_device(op, other)),
    }
}

/// CUDA `kda_gate`; arguments already validated by the caller.
pub(crate) fn kda_gate(
    raw: &Tensor,
    a_log: &Tensor,
    dt_bias: &Tensor,
    tokens: usize,
    num_heads: usize,
    head_dim: usize,
    lower_bound: Option<f32>,
) -> Result<Tensor> {
    const OP: &str = "kda_gate";
    let launch = Launch::new(cuda_device(OP, raw)?)?;
    let raw = Input::new(raw, None)?;
    let a_log = Input::new(a_log, Some(DType::F32))?;
    let dt_bias = Input::new(dt_bias, Some(DType::F32))?;
    let width = num_heads * head_dim;
    let shape = Shape::from_dims(&[tokens, num_heads, head_dim]);
    let mut out = launch.alloc(&shape, DType::F32)?;
    {
        input_ptrs!(OP, launch, raw_p <- raw, a_log_p <- a_log, dt_bias_p <- dt_bias);
        let out_p = output_ptr(&mut out, &launch.stream)?;
        let (has_lb, lb) = match lower_bound {
            Some(bound) => (1, bound),
            None => (0, 0.0),
        };
        // SAFETY: the pointers address contiguous device buffers of the sizes
        // the kernel reads/writes, on the stream passed.
        let code = unsafe {
            berrylm_kda_gate(
                dtype_code(OP, raw.dtype())?,
                raw_p.0 as *const c_void,
                a_log_p.0 as *const f32,
                dt_bias_p.0 as *const f32,
                out_p.0 as *mut f32,
                tokens as i64,
                c_size(OP, "raw", width)?,
                c_size(OP, "raw", head_dim)?,
                has_lb,
                lb,
                launch.raw_stream(),
            )
        };
        check(OP, code)?;
    }
    Ok(into_tensor(out, shape))
}

/// The outputs of a split causal convolution (`conv.cu`'s output groups):
/// one uninitialised `[B, T, width]` buffer per group of channels, and the
/// widths as the launchers take them.
struct ConvOutputs {
    shapes: Vec<Shape>,
    buffers: Vec<CudaStorage>,
    widths: Vec<c_int>,
}

impl ConvOutputs {
    /// Checks the batch against the kernels' grid (`B` is its z dimension)
    /// and allocates the buffers.
    fn new(
        op: &'static str,
        launch: &Launch,
        batch: usize,
        seq_len: usize,
        widths: &[usize],
        dtype: DType,
    ) -> Result<Self> {
        if batch > 65535 {
            return Err(invalid_argument(
                op,
                "x",
                format!("batch size {batch} exceeds the CUDA kernel's 65535"),
            ));
        }
        let shapes = widths
            .iter()
            .map(|&width| Shape::from_dims(&[batch, seq_len, width]))
            .collect::<Vec<_>>();
        let buffers = shapes
            .iter()
            .map(|shape| launch.alloc(shape, dtype))
            .collect::<Result<Vec<_>>>()?;
        let widths = widths
            .iter()
            .map(|&width| c_size(op, "widths", width))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            shapes,
            buffers,
            widths,
        })
    }

    /// What a launch takes: the buffers' device addresses, the guards that
    /// record the writes on `stream` when dropped (after the launch), and
    /// the widths.
    fn launch_args<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> Result<(Vec<*mut c_void>, Vec<SyncOnDrop<'a>>, &'a [c_int])> {
        let mut addresses = Vec::with_capacity(self.buffers.len());
        let mut guards = Vec::with_capacity(self.buffers.len());
        for buffer in &mut self.buffers {
            let (address, guard) = output_ptr(buffer, stream)?;
            addresses.push(address as *mut c_void);
            guards.push(guard);
        }
        Ok((addresses, guards, &self.widths))
    }

    fn into_tensors(self) -> Vec<Tensor> {
        self.buffers
            .into_iter()
            .zip(self.shapes)
            .map(|(buffer, shape)| into_tensor(buffer, shape))
            .collect()
    }
}

/// CUDA `causal_conv1d`; arguments already validated by the caller.
pub(crate) fn causal_conv1d(
    x: &Tensor,
    weight: &Tensor,
    state: &Tensor,
    widths: &[usize],
    batch: usize,
    seq_len: usize,
    kernel_size: usize,
) -> Result<(Vec<Tensor>, Tensor)> {
    const OP: &str = "causal_conv1d";
    let launch = Launch::new(cuda_device(OP, x)?)?;
    let x = Input::new(x, None)?;
    let weight = Input::new(weight, Some(DType::F32))?;
    let state = Input::new(state, None)?;
    let mut outs = ConvOutputs::new(OP, &launch, batch, seq_len, widths, x.dtype())?;
    let channels = widths.iter().sum();
    let state_shape = Shape::from_dims(&[batch, channels, kernel_size]);
    let mut new_state = launch.alloc(&state_shape, state.dtype())?;
    {
        input_ptrs!(OP, launch, x_p <- x, weight_p <- weight, state_p <- state);
        let (out_addresses, _out_guards, out_widths) = outs.launch_args(&launch.stream)?;
        let new_state_p = output_ptr(&mut new_state, &launch.stream)?;
        // SAFETY: as in `kda_gate`.
        let code = unsafe {
            berrylm_causal_conv1d(
                dtype_code(OP, x.dtype())?,
                dtype_code(OP, state.dtype())?,
                x_p.0 as *const c_void,
                weight_p.0 as *const f32,
                state_p.0 as *const c_void,
                out_addresses.as_ptr(),
                out_widths.as_ptr(),
                c_size(OP, "widths", out_widths.len())?,
                new_state_p.0 as *mut c_void,
                c_size(OP, "x", batch)?,
                c_size(OP, "x", seq_len)?,
                c_size(OP, "x", channels)?,
                c_size(OP, "weight", kernel_size)?,
                launch.raw_stream(),
            )
        };
        check(OP, code)?;
    }
    Ok((outs.into_tensors(), into_tensor(new_state, state_shape)))
}

/// CUDA `kda_beta`; the dtype already validated by the caller.
pub(crate) fn kda_beta(b: &Tensor) -> Result<Tensor> {
    const OP: &str = "kda_beta";
    let launch = Launch::new(cuda_device(OP, b)?)?;
    let b = Input::new(b, None)?;
    let shape = b.tensor.shape().clone();
    let mut out = launch.alloc(&shape, DType::F32)?;
    {
        input_ptrs!(OP, launch, b_p <- b);
        let out_p = output_ptr(&mut out, &launch.stream)?;
        // SAFETY: as in `kda_gate`.
        let code = unsafe {
            berrylm_kda_beta(
                dtype_code(OP, b.dtype())?,
                b_p.0 as *const c_void,
                out_p.0 as *mut f32,
                shape.elem_count() as i64,
                launch.raw_stream(),
            )
        };
        check(OP, code)?;
    }
    Ok(into_tensor(out, shape))
}

/// Sizes and prefill algorithm of one `kda_recurrence_with` call.
pub(crate) struct RecurrenceParams {
    /// Applied by the kernel launcher to calls with `T > 1` (see
    /// `berrylm_kda_recurrence` in recurrence.cu).
    pub algorithm: KdaPrefillAlgorithm,
    pub batch: usize,
    pub seq_len: usize,
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
}

/// CUDA `kda_recurrence_with`; arguments already validated by the caller.
pub(crate) fn kda_recurrence(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    state: &Tensor,
    params: &RecurrenceParams,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "kda_recurrence";
    let RecurrenceParams {
        batch,
        seq_len,
        key_heads,
        value_heads,
        key_dim,
        value_dim,
        ..
    } = *params;
    let prefill_algorithm = check_recurrence_limits(OP, params)?;
    let launch = Launch::new(cuda_device(OP, q)?)?;
    let (qkv_dtype, [q, k, v, g, beta]) = recurrence_inputs(q, k, v, g, beta)?;
    let state = Input::new(state, Some(DType::F32))?;
    let out_shape = Shape::from_dims(&[batch, seq_len, value_heads, value_dim]);
    let state_shape = Shape::from_dims(&[batch, value_heads, key_dim, value_dim]);
    let mut out = launch.alloc(&out_shape, DType::F32)?;
    let mut new_state = launch.alloc(&state_shape, DType::F32)?;
    {
        input_ptrs!(OP, launch,
            q_p <- q, k_p <- k, v_p <- v, g_p <- g, beta_p <- beta, state_p <- state);
        let out_p = output_ptr(&mut out, &launch.stream)?;
        let new_state_p = output_ptr(&mut new_state, &launch.stream)?;
        // SAFETY: as in `kda_gate`.
        let code = unsafe {
            berrylm_kda_recurrence(
                dtype_code(OP, qkv_dtype)?,
                q_p.0 as *const c_void,
                k_p.0 as *const c_void,
                v_p.0 as *const c_void,
                g_p.0 as *const f32,
                beta_p.0 as *const f32,
                state_p.0 as *const f32,
                out_p.0 as *mut f32,
                new_state_p.0 as *mut f32,
                c_size(OP, "q", batch)?,
                c_size(OP, "q", seq_len)?,
                c_size(OP, "q", key_heads)?,
                c_size(OP, "v", value_heads)?,
                c_size(OP, "q", key_dim)?,
                c_size(OP, "v", value_dim)?,
                prefill_algorithm,
                launch.raw_stream(),
            )
        };
        check(OP, code)?;
    }
    Ok((
        into_tensor(out, out_shape),
        into_tensor(new_state, state_shape),
    ))
}

/// Fails unless the sizes fit the recurrence kernels; returns the
/// `prefill_algorithm` argument of the launchers.
fn check_recurrence_limits(op: &'static str, params: &RecurrenceParams) -> Result<c_int> {
    let RecurrenceParams {
        algorithm,
        batch,
        value_heads,
        key_dim,
        ..
    } = *params;
    // SAFETY: a plain query of a constant.
    let max_key_dim = unsafe { berrylm_kda_recurrence_max_key_dim() } as usize;
    if key_dim > max_key_dim {
        return Err(invalid_argument(
            op,
            "q",
            format!("key dim {key_dim} exceeds the CUDA kernel's maximum {max_key_dim}"),
        ));
    }
    if batch > 65535 || value_heads > 65535 {
        return Err(invalid_argument(
            op,
            "v",
            format!("batch {batch} or value heads {value_heads} exceed the CUDA kernel's 65535"),
        ));
    }
    Ok(match algorithm {
        KdaPrefillAlgorithm::Sequential => PREFILL_SEQUENTIAL,
        KdaPrefillAlgorithm::Chunked => PREFILL_CHUNKED,
    })
}

/// The token inputs of the recurrence as the kernels read them: q, k and v
/// in one dtype (mixed dtypes widened to f32, exact), g and beta in f32.
fn recurrence_inputs(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
) -> Result<(DType, [Input; 5])> {
    let qkv_dtype = if q.dtype() == k.dtype() && q.dtype() == v.dtype() {
        q.dtype()
    } else {
        DType::F32
    };
    Ok((
        qkv_dtype,
        [
            Input::new(q, Some(qkv_dtype))?,
            Input::new(k, Some(qkv_dtype))?,
            Input::new(v, Some(qkv_dtype))?,
            Input::new(g, Some(DType::F32))?,
            Input::new(beta, Some(DType::F32))?,
        ],
    ))
}

/// The storage behind `tensor` (its address identifies the storage, which
/// tensors share through an `Arc`).
fn storage_address(tensor: &Tensor) -> *const Storage {
    let (storage, _) = tensor.storage_and_layout();
    &*storage as *const Storage
}

/// Fails, naming the argument, if one of `inputs` shares its storage with
/// `pool`: the in-place launches take the pool's write lock while they hold
/// the inputs' read locks, which such an input would deadlock (and the
/// kernel's writes would race with its reads). Call before taking the
/// inputs' locks.
fn reject_inputs_in_pool(
    op: &'static str,
    pool: &Tensor,
    inputs: &[(&'static str, &Input)],
) -> Result<()> {
    let pool_storage = storage_address(pool);
    match inputs
        .iter()
        .find(|(_, input)| storage_address(&input.tensor) == pool_storage)
    {
        Some((arg, _)) => Err(invalid_argument(
            op,
            arg,
            "shares its storage with `pool`".to_string(),
        )),
        None => Ok(()),
    }
}

/// Runs `launch` with the device address of `pool`'s first element and the
/// pool's dtype, through [`Tensor::inplace_op1`]: it holds the pool's write
/// lock and hands out its storage mutably, so the kernel's write is recorded
/// as one. How the in-place kernels reach a pool the host owns.
fn launch_in_pool(
    op: &'static str,
    pool: &Tensor,
    stream: &CudaStream,
    launch: impl Fn(CUdeviceptr, DType) -> Result<()>,
) -> Result<()> {
    pool.inplace_op1(&PoolWrite { op, stream, launch })?;
    Ok(())
}

/// [`launch_in_pool`]'s in-place operation.
struct PoolWrite<'a, F> {
    op: &'static str,
    stream: &'a CudaStream,
    launch: F,
}

impl<F: Fn(CUdeviceptr, DType) -> Result<()>> InplaceOp1 for PoolWrite<'_, F> {
    fn name(&self) -> &'static str {
        self.op
    }

    fn cpu_fwd(
        &self,
        _storage: &mut candle_core::CpuStorage,
        _layout: &Layout,
    ) -> candle_core::Result<()> {
        // The public functions dispatch CPU pools to the CPU reference.
        candle_core::bail!("{}: the CUDA launch got a CPU pool", self.op)
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        let (base, _guard, dtype) = match &mut storage.slice {
            CudaStorageSlice::F32(slice) => {
                let (base, guard) = slice.device_ptr_mut(self.stream);
                (base, guard, DType::F32)
            }
            CudaStorageSlice::BF16(slice) => {
                let (base, guard) = slice.device_ptr_mut(self.stream);
                (base, guard, DType::BF16)
            }
            CudaStorageSlice::F16(slice) => {
                let (base, guard) = slice.device_ptr_mut(self.stream);
                (base, guard, DType::F16)
            }
            _ => candle_core::bail!("{}: the pool's dtype is not f32, bf16 or f16", self.op),
        };
        let address = base + (layout.start_offset() * dtype.size_in_bytes()) as CUdeviceptr;
        (self.launch)(address, dtype).map_err(Into::into)
    }
}

/// CUDA `kda_recurrence_in_pool`; arguments already validated by the caller
/// (`pool` f32, contiguous, `[pool_rows, Hv, dk, dv]`; `slots` u32 `[B]`).
#[allow(clippy::too_many_arguments)] // the public function's arguments
pub(crate) fn kda_recurrence_in_pool(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    pool: &Tensor,
    slots: &Tensor,
    pool_rows: usize,
    params: &RecurrenceParams,
) -> Result<Tensor> {
    const OP: &str = "kda_recurrence_in_pool";
    let RecurrenceParams {
        batch,
        seq_len,
        key_heads,
        value_heads,
        key_dim,
        value_dim,
        ..
    } = *params;
    let prefill_algorithm = check_recurrence_limits(OP, params)?;
    let launch = Launch::new(cuda_device(OP, q)?)?;
    let (qkv_dtype, [q, k, v, g, beta]) = recurrence_inputs(q, k, v, g, beta)?;
    let slots = Input::new(slots, None)?;
    reject_inputs_in_pool(
        OP,
        pool,
        &[
            ("q", &q),
            ("k", &k),
            ("v", &v),
            ("g", &g),
            ("beta", &beta),
            ("slots", &slots),
        ],
    )?;
    let out_shape = Shape::from_dims(&[batch, seq_len, value_heads, value_dim]);
    let mut out = launch.alloc(&out_shape, DType::F32)?;
    let qkv_dtype = dtype_code(OP, qkv_dtype)?;
    let pool_rows = c_size(OP, "pool", pool_rows)?;
    let sizes = [
        c_size(OP, "q", batch)?,
        c_size(OP, "q", seq_len)?,
        c_size(OP, "q", key_heads)?,
        c_size(OP, "v", value_heads)?,
        c_size(OP, "q", key_dim)?,
        c_size(OP, "v", value_dim)?,
    ];
    {
        input_ptrs!(OP, launch,
            q_p <- q, k_p <- k, v_p <- v, g_p <- g, beta_p <- beta, slots_p <- slots);
        let out_p = output_ptr(&mut out, &launch.stream)?;
        launch_in_pool(OP, pool, &launch.stream, |pool, pool_dtype| {
            if pool_dtype != DType::F32 {
                return Err(invalid_argument(
                    OP,
                    "pool",
                    format!("dtype {pool_dtype:?}, expected f32"),
                ));
            }
            let [batch, seq_len, key_heads, value_heads, key_dim, value_dim] = sizes;
            // SAFETY: as in `kda_gate`; the pool is `pool_rows` contiguous rows
            // of `Hv * dk * dv` f32 values from `pool`, and the kernels touch
            // only rows `slots[b] < pool_rows`.
            let code = unsafe {
                berrylm_kda_recurrence_in_pool(
                    qkv_dtype,
                    q_p.0 as *const c_void,
                    k_p.0 as *const c_void,
                    v_p.0 as *const c_void,
                    g_p.0 as *const f32,
                    beta_p.0 as *const f32,
                    pool as *mut f32,
                    slots_p.0 as *const u32,
                    pool_rows,
                    out_p.0 as *mut f32,
                    batch,
                    seq_len,
                    key_heads,
                    value_heads,
                    key_dim,
                    value_dim,
                    prefill_algorithm,
                    launch.raw_stream(),
                )
            };
            check(OP, code)
        })?;
    }
    Ok(into_tensor(out, out_shape))
}

/// CUDA `attn_res_mix`; arguments already validated by the caller.
/// `strength` is `round_x(tanh(g))` for the gated variant.
pub(crate) fn attn_res_mix(
    sources: &[Tensor],
    pseudo_query: &Tensor,
    strength: Option<f32>,
    eps: f64,
    tokens: usize,
    hidden: usize,
) -> Result<Tensor> {
    const OP: &str = "attn_res_mix";
    let current = &sources[sources.len() - 1];
    if sources.len() > MAX_ATTN_RES_SOURCES {
        return Err(invalid_argument(
            OP,
            "sources",
            format!(
                "{} sources exceed the CUDA kernel's maximum {MAX_ATTN_RES_SOURCES}",
                sources.len()
            ),
        ));
    }
    let launch = Launch::new(cuda_device(OP, current)?)?;
    let out_dtype = current.dtype();
    // Sources of mixed dtypes are all widened to f32 (exact).
    let src_dtype = if sources.iter().all(|s| s.dtype() == out_dtype) {
        out_dtype
    } else {
        DType::F32
    };
    let inputs = sources
        .iter()
        .map(|s| Input::new(s, Some(src_dtype)))
        .collect::<Result<Vec<_>>>()?;
    let query = Input::new(pseudo_query, Some(DType::F32))?;
    let shape = Shape::from_dims(&[tokens, hidden]);
    let mut out = launch.alloc(&shape, out_dtype)?;
    {
        let locks = inputs
            .iter()
            .map(|input| input.tensor.storage_and_layout())
            .collect::<Vec<_>>();
        let source_ptrs = locks
            .iter()
            .map(|(storage, layout)| input_ptr(OP, storage, layout, &launch.stream))
            .collect::<Result<Vec<_>>>()?;
        let addresses = source_ptrs
            .iter()
            .map(|(address, _)| *address as *const c_void)
            .collect::<Vec<_>>();
        input_ptrs!(OP, launch, query_p <- query);
        let out_p = output_ptr(&mut out, &launch.stream)?;
        // SAFETY: as in `kda_gate`; `addresses` lives across the call.
        let code = unsafe {
            berrylm_attn_res_mix(
                dtype_code(OP, src_dtype)?,
                dtype_code(OP, out_dtype)?,
                addresses.as_ptr(),
                addresses.len() as c_int,
                query_p.0 as *const f32,
                out_p.0 as *mut c_void,
                tokens as i64,
                c_size(OP, "sources", hidden)?,
                eps as f32,
                c_int::from(strength.is_some()),
                strength.unwrap_or(0.0),
                launch.raw_stream(),
            )
        };
        check(OP, code)?;
    }
    Ok(into_tensor(out, shape))
}

/// CUDA `gated_rms_norm`; arguments already validated by the caller.
pub(crate) fn gated_rms_norm(
    x: &Tensor,
    z: &Tensor,
    weight: &Tensor,
    eps: f64,
    rows: usize,
    width: usize,
) -> Result<Tensor> {
    const OP: &str = "gated_rms_norm";
    let launch = Launch::new(cuda_device(OP, x)?)?;
    let x = Input::new(x, None)?;
    // z is read in its own dtype when it matches x, else widened to f32.
    let z_dtype = if z.dtype() == x.dtype() {
        x.dtype()
    } else {
        DType::F32
    };
    let z = Input::new(z, Some(z_dtype))?;
    let weight = Input::new(weight, Some(DType::F32))?;
    let shape = Shape::from_dims(&[rows, width]);
    let mut out = launch.alloc(&shape, x.dtype())?;
    {
        input_ptrs!(OP, launch, x_p <- x, z_p <- z, weight_p <- weight);
        let out_p = output_ptr(&mut out, &launch.stream)?;
        // SAFETY: as in `kda_gate`.
        let code = unsafe {
            berrylm_gated_rms_norm(
                dtype_code(OP, x.dtype())?,
                dtype_code(OP, z_dtype)?,
                x_p.0 as *const c_void,
                z_p.0 as *const c_void,
                weight_p.0 as *const f32,
                out_p.0 as *mut c_void,
                rows as i64,
                c_size(OP, "x", width)?,
                eps as f32,
                launch.raw_stream(),
            )
        };
        check(OP, code)?;
    }
    Ok(into_tensor(out, shape))
}

/// CUDA `offset_rms_norm` and `add_offset_rms_norm`; arguments already
/// validated by the caller (`x` has a positive last dimension, `scale` is
/// `f32`, `delta` has the shape and dtype of `x`). Returns the normed rows
/// and, with `delta`, the sums `x + delta` they were computed from.
pub(crate) fn offset_rms_norm(
    x: &Tensor,
    delta: Option<&Tensor>,
    scale: &Tensor,
    eps: f64,
) -> Result<(Tensor, Option<Tensor>)> {
    const OP: &str = "offset_rms_norm";
    let width = x.dim(candle_core::D::Minus1)?;
    let launch = Launch::new(cuda_device(OP, x)?)?;
    let x = Input::new(x, None)?;
    let delta = delta.map(|delta| Input::new(delta, None)).transpose()?;
    let scale = Input::new(scale, Some(DType::F32))?;
    let shape = x.tensor.shape().clone();
    let rows = shape.elem_count() / width;
    // What candle's `mean_keepdim` multiplies the sum by, and the `eps` its
    // `+ eps` adds, both rounded to f32 as candle rounds them.
    let inv_width = (1.0 / width as f64) as f32;
    let mut out = launch.alloc(&shape, x.dtype())?;
    let mut sum = delta
        .as_ref()
        .map(|_| launch.alloc(&shape, x.dtype()))
        .transpose()?;
    {
        input_ptrs!(OP, launch, x_p <- x, scale_p <- scale);
        let delta_lock = delta
            .as_ref()
            .map(|delta| delta.tensor.storage_and_layout());
        let delta_p = delta_lock
            .as_ref()
            .map(|(storage, layout)| input_ptr(OP, storage, layout, &launch.stream))
            .transpose()?;
        let out_p = output_ptr(&mut out, &launch.stream)?;
        let sum_p = sum
            .as_mut()
            .map(|sum| output_ptr(sum, &launch.stream))
            .transpose()?;
        // SAFETY: as in `kda_gate`; `delta` and `sum_out` are null or
        // buffers of the size of `x`.
        let code = unsafe {
            berrylm_offset_rms_norm(
                dtype_code(OP, x.dtype())?,
                x_p.0 as *const c_void,
                delta_p
                    .as_ref()
                    .map_or(std::ptr::null(), |p| p.0 as *const c_void),
                scale_p.0 as *const f32,
                sum_p
                    .as_ref()
                    .map_or(std::ptr::null_mut(), |p| p.0 as *mut c_void),
                out_p.0 as *mut c_void,
                rows as i64,
                c_size(OP, "x", width)?,
                inv_width,
                eps as f32,
                launch.raw_stream(),
            )
        };
        check(OP, code)?;
    }
    Ok((
        into_tensor(out, shape.clone()),
        sum.map(|sum| into_tensor(sum, shape)),
    ))
}

/// CUDA `moe_route`; arguments already validated by the caller.
pub(crate) fn moe_route(
    router_logits: &Tensor,
    rows: usize,
    experts: usize,
    top_k: usize,
    renormalize: bool,
    weight_dtype: DType,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "moe_route";
    if experts > MAX_MOE_EXPERTS {
        return Err(invalid_argument(
            OP,
            "router_logits",
            format!("{experts} experts exceed the CUDA kernel's maximum {MAX_MOE_EXPERTS}"),
        ));
    }
    if rows > i32::MAX as usize {
        return Err(invalid_argument(
            OP,
            "router_logits",
            format!("{rows} rows exceed the CUDA kernel's maximum {}", i32::MAX),
        ));
    }
    let launch = Launch::new(cuda_device(OP, router_logits)?)?;
    let logits = Input::new(router_logits, None)?;
    let shape = Shape::from_dims(&[rows, top_k]);
    let mut weights = launch.alloc(&shape, DType::F32)?;
    let mut ids = launch.alloc(&shape, DType::U32)?;
    {
        input_ptrs!(OP, launch, logits_p <- logits);
        let weights_p = output_ptr(&mut weights, &launch.stream)?;
        let ids_p = output_ptr(&mut ids, &launch.stream)?;
        // SAFETY: as in `kda_gate`.
        let code = unsafe {
            berrylm_moe_route(
                dtype_code(OP, logits.dtype())?,
                logits_p.0 as *const c_void,
                weights_p.0 as *mut f32,
                ids_p.0 as *mut u32,
                rows as i64,
                c_size(OP, "router_logits", experts)?,
                c_size(OP, "top_k", top_k)?,
                c_int::from(renormalize),
                dtype_code(OP, weight_dtype)?,
                launch.raw_stream(),
            )
        };
        check(OP, code)?;
    }
    Ok((into_tensor(weights, shape.clone()), into_tensor(ids, shape)))
}

/// CUDA `swiglu`; arguments already validated by the caller (`out_dims` is
/// the shape of `gate_up` with its last dimension `intermediate`).
pub(crate) fn swiglu(gate_up: &Tensor, intermediate: usize, out_dims: &[usize]) -> Result<Tensor> {
    const OP: &str = "swiglu";
    let launch = Launch::new(cuda_device(OP, gate_up)?)?;
    let gate_up = Input::new(gate_up, None)?;
    let shape = Shape::from_dims(out_dims);
    let rows = shape.elem_count() / intermediate;
    let mut out = launch.alloc(&shape, gate_up.dtype())?;
    {
        input_ptrs!(OP, launch, gate_up_p <- gate_up);
        let out_p = output_ptr(&mut out, &launch.stream)?;
        // SAFETY: as in `kda_gate`.
        let code = unsafe {
            berrylm_swiglu(
                dtype_code(OP, gate_up.dtype())?,
                gate_up_p.0 as *const c_void,
                out_p.0 as *mut c_void,
                rows as i64,
                c_size(OP, "gate_up", intermediate)?,
                launch.raw_stream(),
            )
        };
        check(OP, code)?;
    }
    Ok(into_tensor(out, shape))
}

/// CUDA `add_moe_output`; arguments already validated by the caller (all
/// four of one dtype, `[N, hidden]` and `[N, 1]`).
pub(crate) fn add_moe_output(
    residual: &Tensor,
    routed: &Tensor,
    shared: &Tensor,
    gate_logit: &Tensor,
    hidden: usize,
) -> Result<Tensor> {
    const OP: &str = "add_moe_output";
    let launch = Launch::new(cuda_device(OP, residual)?)?;
    let residual = Input::new(residual, None)?;
    let routed = Input::new(routed, None)?;
    let shared = Input::new(shared, None)?;
    let gate_logit = Input::new(gate_logit, None)?;
    let shape = residual.tensor.shape().clone();
    let rows = shape.elem_count() / hidden.max(1);
    let mut out = launch.alloc(&shape, residual.dtype())?;
    {
        input_ptrs!(OP, launch, residual_p <- residual, routed_p <- routed,
                    shared_p <- shared, gate_logit_p <- gate_logit);
        let out_p = output_ptr(&mut out, &launch.stream)?;
        // SAFETY: as in `kda_gate`.
        let code = unsafe {
            berrylm_add_moe_output(
                dtype_code(OP, residual.dtype())?,
                residual_p.0 as *const c_void,
                routed_p.0 as *const c_void,
                shared_p.0 as *const c_void,
                gate_logit_p.0 as *const c_void,
                out_p.0 as *mut c_void,
                rows as i64,
                c_size(OP, "residual", hidden)?,
                launch.raw_stream(),
            )
        };
        check(OP, code)?;
    }
    Ok(into_tensor(out, shape))
}
