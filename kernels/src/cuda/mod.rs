//! CUDA implementations of the crate's operations (feature `cuda`).
//!
//! The kernels live in `src/cuda/*.cu`; `build.rs` compiles them with nvcc
//! into the static library `libberrylmkernels.a`, whose C symbols are all
//! prefixed `berrylm_`. The bindings live one file per operation, mirroring
//! `src/{op}.rs` (an operation that validates its arguments into a struct
//! `{Op}Args` has its binding as that struct's `cuda` method); this module
//! holds what they share, [`Launch`]: inputs are
//! made contiguous, the small parameter tensors are widened to `f32`
//! (exact), outputs are allocated uninitialised on the same device, and
//! every kernel is launched on candle's stream of that device, so the order
//! with candle's own work is preserved without synchronisation.
//!
//! A binding reads: check the CUDA-only limits, declare the inputs and
//! outputs on a [`Launch`], and [`Launch::run`] a closure that makes the FFI
//! call with the typed device addresses [`Args`] hands it (`run_kernel!`
//! writes that closure for the usual call).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::{Arc, OnceLock};

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cuda_backend::cudarc::driver::{
    sys::CUdeviceptr, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop,
};
use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::op::BackpropOp;
use candle_core::{
    CudaDevice, CudaStorage, DType, Device, InplaceOp1, Layout, Shape, Storage, Tensor,
};

use crate::{invalid_argument, unsupported_device, KernelError, Result};

/// [`Launch::run`]s `$launch` with the FFI call `$launcher(args.., stream)`,
/// the usual call of a binding: each argument is
/// - `dtype(d)`: the kernels' code of the dtype `d` ([`dtype_code`]),
/// - `input(i)` or `output(o)`: the device address of the input `i` or the
///   output `o` declared on `$launch` ([`Args::input`], [`Args::output`]),
/// - any other expression, passed as it is (it may use `?`);
///
/// and candle's stream ([`Args::stream`]) is passed last. Returns what
/// [`Launch::run`] returns. A binding whose call needs more (an array of
/// addresses, a pool, an optional buffer) calls [`Launch::run`] itself.
macro_rules! run_kernel {
    ($launch:ident => $launcher:ident($($args:tt)*)) => {{
        // Read by `dtype(..)` arguments only.
        #[allow(unused_variables)]
        let op = $launch.op;
        $launch.run(|p| {
            // SAFETY (every binding's): `p` addresses contiguous device
            // buffers of the sizes the kernel reads and writes (derived from
            // the sizes passed), live until the launch is queued on the
            // stream passed.
            Ok(unsafe { run_kernel!(@call p, op, $launcher, [] $($args)*) })
        })
    }};
    (@call $p:ident, $op:ident, $launcher:ident, [$($done:expr),*]
        dtype($dtype:expr) $(, $($rest:tt)*)?) => {
        run_kernel!(@call $p, $op, $launcher, [$($done,)* dtype_code($op, $dtype)?]
            $($($rest)*)?)
    };
    (@call $p:ident, $op:ident, $launcher:ident, [$($done:expr),*]
        input($input:expr) $(, $($rest:tt)*)?) => {
        run_kernel!(@call $p, $op, $launcher, [$($done,)* $p.input($input)] $($($rest)*)?)
    };
    (@call $p:ident, $op:ident, $launcher:ident, [$($done:expr),*]
        output($output:expr) $(, $($rest:tt)*)?) => {
        run_kernel!(@call $p, $op, $launcher, [$($done,)* $p.output($output)] $($($rest)*)?)
    };
    (@call $p:ident, $op:ident, $launcher:ident, [$($done:expr),*]
        $value:expr $(, $($rest:tt)*)?) => {
        run_kernel!(@call $p, $op, $launcher, [$($done,)* $value] $($($rest)*)?)
    };
    (@call $p:ident, $op:ident, $launcher:ident, [$($done:expr),*]) => {
        $launcher($($done,)* $p.stream())
    };
}

mod attention;
mod attn_res;
mod contiguous;
mod conv;
mod gate;
mod gate_mul;
mod mlp;
mod moe;
mod norm;
mod paged_attention;
mod quantized;
mod recurrence;
mod rope;
mod route;
mod sources_digest;

pub(crate) use attn_res::{attn_res_mix, InputNorm};
pub(crate) use contiguous::contiguous;
pub(crate) use conv::{causal_conv1d, causal_conv1d_in_pool};
pub(crate) use gate::kda_beta;
pub(crate) use gate_mul::sigmoid_gate_mul;
pub(crate) use mlp::swiglu;
pub(crate) use moe::{moe_block_decode, moe_experts, moe_experts_quantized};
pub(crate) use norm::{add_offset_rms_norm_matmul, offset_rms_norm};
pub(crate) use paged_attention::paged_decode_attention;
pub(crate) use quantized::{dense_matmul, quantized_matmul};
pub(crate) use recurrence::{kda_decode_gated, kda_recurrence, kda_recurrence_in_pool};

/// Dtype codes understood by the kernels (`berrylm::DTypeCode` in common.cuh).
const DTYPE_F32: c_int = 0;
const DTYPE_BF16: c_int = 1;
const DTYPE_F16: c_int = 2;

extern "C" {
    fn berrylm_cuda_error_string(code: c_int) -> *const c_char;
    fn berrylm_sources_digest() -> u64;
}

include!(concat!(env!("OUT_DIR"), "/cuda_sources.rs"));

/// Fails unless the linked CUDA library was built from the sources this
/// crate was compiled with (checked once): a library left from another
/// build would run kernels whose arguments no longer match their bindings.
fn library_matches_sources() -> Result<()> {
    static MATCHES: OnceLock<bool> = OnceLock::new();
    let matches = *MATCHES.get_or_init(|| {
        let compiled = sources_digest::sources_digest(
            CUDA_SOURCES
                .iter()
                .map(|(name, contents)| (*name, *contents)),
        );
        // SAFETY: returns a constant.
        compiled == unsafe { berrylm_sources_digest() }
    });
    if matches {
        Ok(())
    } else {
        Err(KernelError::StaleLibrary)
    }
}

/// The kernels' dtype code of `dtype`.
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

/// An input declared on a [`Launch`].
#[derive(Clone, Copy)]
struct In(usize);

/// An output declared on a [`Launch`].
#[derive(Clone, Copy)]
struct Out(usize);

/// An input of a launch: a CUDA tensor the kernel reads, and the argument
/// name that an error about it gives.
struct Input {
    name: &'static str,
    tensor: Tensor,
}

/// One kernel launch of `op`: the CUDA device and its (candle) stream, with
/// the device's context bound to the calling thread for the runtime-API
/// launches; the inputs and the outputs declared so far; and, for the
/// launches that update a state pool, the pool.
struct Launch {
    op: &'static str,
    device: CudaDevice,
    stream: Arc<CudaStream>,
    inputs: Vec<Input>,
    outputs: Vec<(Shape, CudaStorage)>,
    pool: Option<Tensor>,
}

impl Launch {
    /// A launch of `op` on the device of `tensor`, which must be a CUDA
    /// device.
    fn new(op: &'static str, tensor: &Tensor) -> Result<Self> {
        library_matches_sources()?;
        let device = match tensor.device() {
            Device::Cuda(device) => device,
            other => return Err(unsupported_device(op, other)),
        };
        let stream = device.cuda_stream();
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| KernelError::Candle(candle_core::Error::Msg(format!("{e:?}"))))?;
        Ok(Self {
            op,
            device: device.clone(),
            stream,
            inputs: Vec::new(),
            outputs: Vec::new(),
            pool: None,
        })
    }

    /// Declares `tensor` as an input read in its own dtype, made contiguous
    /// ([`crate::contiguous`]).
    fn input(&mut self, name: &'static str, tensor: &Tensor) -> Result<In> {
        self.push_input(name, crate::contiguous(tensor)?)
    }

    /// Declares each of `tensors` (with its name) as an [`Launch::input`],
    /// in order.
    fn inputs<const N: usize>(&mut self, tensors: [(&'static str, &Tensor); N]) -> Result<[In; N]> {
        let mut inputs = [In(0); N];
        for (input, (name, tensor)) in inputs.iter_mut().zip(tensors) {
            *input = self.input(name, tensor)?;
        }
        Ok(inputs)
    }

    /// Declares `tensor` as an input read in `dtype` (converted when it has
    /// another one), made contiguous.
    fn input_as(&mut self, name: &'static str, tensor: &Tensor, dtype: DType) -> Result<In> {
        if tensor.dtype() == dtype {
            return self.input(name, tensor);
        }
        self.push_input(name, crate::contiguous(&tensor.to_dtype(dtype)?)?)
    }

    /// Declares `tensor` as an input read as rows of its last dimension at
    /// one stride, and returns that stride in elements: the tensor itself
    /// when its layout has one (see [`row_stride`]), else a contiguous copy
    /// (whose stride is the row width).
    fn input_rows(&mut self, name: &'static str, tensor: &Tensor) -> Result<(In, usize)> {
        if let Some(stride) = row_stride(tensor.layout()) {
            return Ok((self.push_input(name, tensor.clone())?, stride));
        }
        let input = self.input(name, tensor)?;
        let stride = self.shape(input).dims().last().copied().unwrap_or(1);
        Ok((input, stride))
    }

    fn push_input(&mut self, name: &'static str, tensor: Tensor) -> Result<In> {
        let input = Input { name, tensor };
        self.reject_in_pool(&input)?;
        self.inputs.push(input);
        Ok(In(self.inputs.len() - 1))
    }

    /// The dtype in which the kernel reads `input`.
    fn dtype(&self, input: In) -> DType {
        self.inputs[input.0].tensor.dtype()
    }

    /// The shape of `input`.
    fn shape(&self, input: In) -> &Shape {
        self.inputs[input.0].tensor.shape()
    }

    /// Declares an output: uninitialised device storage for `shape` elements
    /// of `dtype`, allocated now.
    fn output(&mut self, shape: impl Into<Shape>, dtype: DType) -> Result<Out> {
        let shape = shape.into();
        // SAFETY: every element is written by the kernel before the tensor is
        // read.
        let storage = unsafe { self.device.alloc_uninit(&shape, dtype)? };
        self.outputs.push((shape, storage));
        Ok(Out(self.outputs.len() - 1))
    }

    /// Declares `pool` as the tensor the kernel updates in place (see
    /// [`Launch::run`]; [`Args::pool`] is its address). Fails, naming the
    /// argument, if an input shares its storage with `pool`: the launch
    /// takes the pool's write lock while it holds the inputs' read locks,
    /// which such an input would deadlock (and the kernel's writes would
    /// race with its reads).
    fn in_pool(&mut self, pool: &Tensor) -> Result<()> {
        self.pool = Some(pool.clone());
        self.inputs
            .iter()
            .try_for_each(|input| self.reject_in_pool(input))
    }

    fn reject_in_pool(&self, input: &Input) -> Result<()> {
        match &self.pool {
            Some(pool) if storage_address(pool) == storage_address(&input.tensor) => {
                Err(invalid_argument(
                    self.op,
                    input.name,
                    "shares its storage with `pool`".to_string(),
                ))
            }
            _ => Ok(()),
        }
    }

    /// Launches the kernel: takes the inputs' read locks and device
    /// addresses and the outputs' addresses, calls `call` with them (the FFI
    /// call, returning the launcher's status) and checks the status. With a
    /// pool, `call` runs inside the pool's in-place operation (see
    /// [`launch_in_pool`]). Returns the outputs as tensors.
    fn run(self, call: impl Fn(&Args) -> Result<c_int>) -> Result<Outputs> {
        let Self {
            op,
            stream,
            inputs,
            mut outputs,
            pool,
            ..
        } = self;
        {
            let locks = inputs
                .iter()
                .map(|input| input.tensor.storage_and_layout())
                .collect::<Vec<_>>();
            // Each guard records its read or write on the stream when
            // dropped, after the call.
            let mut guards = Vec::with_capacity(inputs.len() + outputs.len());
            let mut input_addresses = Vec::with_capacity(inputs.len());
            for ((storage, layout), input) in locks.iter().zip(&inputs) {
                let (address, guard) = input_ptr(op, storage, layout, &stream)?;
                input_addresses.push((address, input.tensor.dtype()));
                guards.push(guard);
            }
            let mut output_addresses = Vec::with_capacity(outputs.len());
            for (_, storage) in &mut outputs {
                let dtype = storage.dtype();
                let (address, guard) = output_ptr(storage, &stream)?;
                output_addresses.push((address, dtype));
                guards.push(guard);
            }
            let args = Args {
                inputs: &input_addresses,
                outputs: &output_addresses,
                pool: None,
                stream: stream.cu_stream() as *mut c_void,
            };
            match &pool {
                None => check(op, call(&args)?)?,
                Some(pool) => launch_in_pool(op, pool, &stream, |address, dtype| {
                    let pool = Some((address, dtype));
                    check(op, call(&Args { pool, ..args })?)
                })?,
            }
        }
        Ok(Outputs(
            outputs
                .into_iter()
                .map(|(shape, storage)| {
                    Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false)
                })
                .collect(),
        ))
    }
}

/// What a launcher's pointer argument may address: `c_void` (data in the
/// dtype whose code the launcher also takes) or one dtype (`f32`, `u32`).
trait DeviceElem {
    fn takes(dtype: DType) -> bool;
}

impl DeviceElem for c_void {
    fn takes(_: DType) -> bool {
        true
    }
}

impl DeviceElem for f32 {
    fn takes(dtype: DType) -> bool {
        dtype == DType::F32
    }
}

impl DeviceElem for u32 {
    fn takes(dtype: DType) -> bool {
        dtype == DType::U32
    }
}

/// What [`Launch::run`] hands the FFI call: the device addresses of the
/// inputs, outputs and pool, typed as the launcher's arguments, and the
/// stream.
#[derive(Clone, Copy)]
struct Args<'a> {
    inputs: &'a [(CUdeviceptr, DType)],
    outputs: &'a [(CUdeviceptr, DType)],
    pool: Option<(CUdeviceptr, DType)>,
    stream: *mut c_void,
}

impl Args<'_> {
    /// The address of `input`'s first element.
    fn input<T: DeviceElem>(&self, input: In) -> *const T {
        let (address, dtype) = self.inputs[input.0];
        debug_assert!(T::takes(dtype), "input {} is {dtype:?}", input.0);
        address as *const T
    }

    /// The address of `output`'s first element.
    fn output<T: DeviceElem>(&self, output: Out) -> *mut T {
        let (address, dtype) = self.outputs[output.0];
        debug_assert!(T::takes(dtype), "output {} is {dtype:?}", output.0);
        address as *mut T
    }

    /// The addresses of `inputs`, in order (for a launcher taking an array
    /// of them).
    fn inputs<T: DeviceElem>(&self, inputs: &[In]) -> Vec<*const T> {
        inputs.iter().map(|&input| self.input(input)).collect()
    }

    /// The addresses of `outputs`, in order (for a launcher taking an array
    /// of them).
    fn outputs<T: DeviceElem>(&self, outputs: &[Out]) -> Vec<*mut T> {
        outputs.iter().map(|&output| self.output(output)).collect()
    }

    /// The address of the pool's first element (only with a pool).
    fn pool<T: DeviceElem>(&self) -> *mut T {
        let (address, dtype) = self.pool.expect("a launch in a pool");
        debug_assert!(T::takes(dtype), "the pool is {dtype:?}");
        address as *mut T
    }

    /// Candle's stream of the device, as the launchers take it.
    fn stream(&self) -> *mut c_void {
        self.stream
    }
}

/// The outputs of a launch, as tensors.
struct Outputs(Vec<Tensor>);

impl Outputs {
    fn tensor(&self, output: Out) -> Tensor {
        self.0[output.0].clone()
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
    let (base, guard) = match &storage.slice {
        CudaStorageSlice::F32(s) => s.device_ptr(stream),
        CudaStorageSlice::BF16(s) => s.device_ptr(stream),
        CudaStorageSlice::F16(s) => s.device_ptr(stream),
        CudaStorageSlice::U32(s) => s.device_ptr(stream),
        _ => {
            return Err(invalid_argument(
                op,
                "tensor",
                "unsupported dtype".to_string(),
            ))
        }
    };
    let offset = layout.start_offset() * storage.dtype().size_in_bytes();
    Ok((base + offset as CUdeviceptr, guard))
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

/// The distance in elements between consecutive rows of `layout`'s last
/// dimension, when that dimension is contiguous and the leading dimensions
/// collapse to rows at one stride of at least the row width (rows that do
/// not overlap); `None` for any other layout.
fn row_stride(layout: &Layout) -> Option<usize> {
    let (&width, leading) = layout.dims().split_last()?;
    let strides = layout.stride();
    if width > 1 && strides[leading.len()] != 1 {
        return None;
    }
    let mut row_stride = None;
    // Rows spanned by one step of the dimension being checked.
    let mut rows_inside = 1;
    for (&size, &stride) in leading.iter().zip(strides).rev() {
        if size == 1 {
            continue;
        }
        match row_stride {
            None => row_stride = Some(stride),
            Some(row) if stride == row * rows_inside => {}
            Some(_) => return None,
        }
        rows_inside *= size;
    }
    let row_stride = row_stride.unwrap_or(width);
    (row_stride >= width).then_some(row_stride)
}

/// The storage behind `tensor` (its address identifies the storage, which
/// tensors share through an `Arc`).
fn storage_address(tensor: &Tensor) -> *const Storage {
    let (storage, _) = tensor.storage_and_layout();
    &*storage as *const Storage
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
        let dtype = storage.dtype();
        let (base, _guard) = match &mut storage.slice {
            CudaStorageSlice::F32(slice) => slice.device_ptr_mut(self.stream),
            CudaStorageSlice::BF16(slice) => slice.device_ptr_mut(self.stream),
            CudaStorageSlice::F16(slice) => slice.device_ptr_mut(self.stream),
            _ => candle_core::bail!("{}: the pool's dtype is not f32, bf16 or f16", self.op),
        };
        let address = base + (layout.start_offset() * dtype.size_in_bytes()) as CUdeviceptr;
        (self.launch)(address, dtype).map_err(Into::into)
    }
}
