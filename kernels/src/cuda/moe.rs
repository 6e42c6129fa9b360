//! Binding of `moe.cu` and the grouped GEMMs: the routed experts of a decode
//! step in `moe.cu`'s kernels, those of a prompt as two cuBLAS grouped GEMMs
//! on the tensor cores between a gather and `moe.cu`'s combine.

use std::ffi::{c_int, c_void};

use candle_core::cuda_backend::cudarc::cublas::sys as cublas;
use candle_core::cuda_backend::cudarc::driver::DevicePtr;
use candle_core::{DType, Shape, Tensor};

use super::{
    c_size, check, cuda_device, dtype_code, input_ptr, into_tensor, output_ptr, Input, Launch,
};
use crate::{invalid_argument, KernelError, Result};

/// Up to this many routed rows (tokens x top-k: a decode step of 64
/// sequences at top-8) run in `moe.cu`'s kernels, which stream each chosen
/// expert's weights once per group of 8 of its rows; more rows run as grouped
/// GEMMs. It must not exceed `kMaxRouted` in moe.cu (a block keeps the list of
/// the rows sent to its expert in shared memory).
const MOE_KERNEL_MAX_ROUTED_ROWS: usize = 512;

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

    fn berrylm_moe_combine(
        dtype: c_int,
        expert_out: *const c_void,
        weights: *const f32,
        ids: *const u32,
        rows: *const u32,
        y: *mut c_void,
        tokens: c_int,
        top_k: c_int,
        experts: c_int,
        hidden: c_int,
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

const OP: &str = "moe_experts";

/// CUDA `moe_experts`; arguments already validated by the caller.
pub(crate) fn moe_experts(
    x: &Tensor,
    weights: &Tensor,
    ids: &Tensor,
    gate_up: &Tensor,
    down: &Tensor,
    dims: &MoeDims,
) -> Result<Tensor> {
    let routed = dims.tokens * dims.top_k;
    if routed > MOE_KERNEL_MAX_ROUTED_ROWS {
        return moe_experts_grouped(x, weights, ids, gate_up, down, dims);
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

/// The routed rows of a call grouped by expert, from its ids read back once
/// (a prompt's ids are small next to its activations).
struct ExpertGroups {
    /// For each row of the grouped buffers, the token it is a row of.
    tokens: Vec<u32>,
    /// For each routed row `n * top_k + s`, its row in the grouped buffers.
    rows: Vec<u32>,
    /// `(expert, first row, rows)` of every expert some token chose, in
    /// increasing expert id; each expert's rows in token order.
    groups: Vec<(usize, usize, usize)>,
}

impl ExpertGroups {
    fn new(ids: &[u32], top_k: usize, experts: usize) -> Result<ExpertGroups> {
        let mut counts = vec![0usize; experts];
        for &id in ids {
            match counts.get_mut(id as usize) {
                Some(count) => *count += 1,
                None => {
                    return Err(invalid_argument(
                        OP,
                        "ids",
                        format!("expert id {id} is not below the {experts} experts"),
                    ))
                }
            }
        }
        let mut next = Vec::with_capacity(experts);
        let mut groups = Vec::new();
        let mut first = 0;
        for (expert, &count) in counts.iter().enumerate() {
            next.push(first);
            if count > 0 {
                groups.push((expert, first, count));
            }
            first += count;
        }
        let mut tokens = vec![0; ids.len()];
        let mut rows = vec![0; ids.len()];
        for (routed, &id) in ids.iter().enumerate() {
            let row = next[id as usize];
            next[id as usize] += 1;
            tokens[row] = (routed / top_k) as u32;
            rows[routed] = row as u32;
        }
        Ok(ExpertGroups {
            tokens,
            rows,
            groups,
        })
    }
}

/// `moe_experts` for many routed rows: the rows of `x` gathered by expert,
/// `gate | up` and the down projection as one grouped GEMM each (cuBLAS,
/// f32 accumulation, each output rounded once to the dtype of `x`, as a
/// `Linear` of the reference), SwiGLU in between with the reference's
/// rounding, and `moe.cu`'s combine (the weighted terms added in increasing
/// expert id).
fn moe_experts_grouped(
    x: &Tensor,
    weights: &Tensor,
    ids: &Tensor,
    gate_up: &Tensor,
    down: &Tensor,
    dims: &MoeDims,
) -> Result<Tensor> {
    let host_ids: Vec<u32> = ids.flatten_all()?.to_vec1()?;
    let grouped = ExpertGroups::new(&host_ids, dims.top_k, dims.experts)?;
    let device = x.device();
    let routed = grouped.rows.len();
    let tokens = Tensor::from_vec(grouped.tokens, routed, device)?;
    let rows = Tensor::from_vec(grouped.rows, routed, device)?;
    let launch = Launch::new(cuda_device(OP, x)?)?;
    let x_rows = x.contiguous()?.index_select(&tokens, 0)?;
    let projected = grouped_gemm(
        &launch,
        &x_rows,
        gate_up,
        &grouped.groups,
        2 * dims.inter,
        dims.hidden,
    )?;
    let h = crate::swiglu(&projected)?;
    let expert_out = grouped_gemm(
        &launch,
        &h,
        down,
        &grouped.groups,
        dims.hidden,
        dims.inter,
    )?;
    combine(&launch, &expert_out, weights, ids, &rows, dims)
}

/// `out[r] = W[e] a[r]` for every row `r` of every group `(e, first, rows)`:
/// `a` `[R, k]`, `w` `[E, m, k]`, `out` `[R, m]`, one dtype. One cuBLAS
/// grouped-batched GEMM (a group per expert).
fn grouped_gemm(
    launch: &Launch,
    a: &Tensor,
    w: &Tensor,
    groups: &[(usize, usize, usize)],
    m: usize,
    k: usize,
) -> Result<Tensor> {
    let dtype = a.dtype();
    let (data_type, compute_type) = match dtype {
        DType::BF16 => (
            cublas::cudaDataType_t::CUDA_R_16BF,
            cublas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        DType::F16 => (
            cublas::cudaDataType_t::CUDA_R_16F,
            cublas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        DType::F32 => (
            cublas::cudaDataType_t::CUDA_R_32F,
            cublas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        ),
        other => {
            return Err(invalid_argument(
                OP,
                "x",
                format!("unsupported dtype {other:?}"),
            ))
        }
    };
    let shape = Shape::from_dims(&[a.dim(0)?, m]);
    let mut out = launch.alloc(&shape, dtype)?;
    let a = Input::new(a, None)?;
    let w = Input::new(w, None)?;
    let count = groups.len();
    let elem = dtype.size_in_bytes() as u64;
    {
        input_ptrs!(OP, launch, a_p <- a, w_p <- w);
        let out_p = output_ptr(&mut out, &launch.stream)?;
        // The A (weights), B (activations) and C (outputs) pointer arrays,
        // which cuBLAS reads from device memory.
        let mut pointers = Vec::with_capacity(3 * count);
        pointers.extend(groups.iter().map(|&(e, _, _)| w_p.0 + (e * m * k) as u64 * elem));
        pointers.extend(groups.iter().map(|&(_, first, _)| a_p.0 + (first * k) as u64 * elem));
        pointers.extend(groups.iter().map(|&(_, first, _)| out_p.0 + (first * m) as u64 * elem));
        let device_pointers = launch.stream.clone_htod(&pointers).map_err(driver_error)?;
        let (base, _read) = device_pointers.device_ptr(&launch.stream);
        let table = |part: usize| base + (part * count * std::mem::size_of::<u64>()) as u64;
        let size = |value: usize, arg| c_size(OP, arg, value);
        // Row-major `out = a W^T` is column-major `out^T = W a^T`: op(A) = W^T
        // (A column-major [k, m], lda k), B = a^T ([k, rows], ldb k), C [m, rows].
        let transa = vec![cublas::cublasOperation_t::CUBLAS_OP_T; count];
        let transb = vec![cublas::cublasOperation_t::CUBLAS_OP_N; count];
        let ms = vec![size(m, "gate_up")?; count];
        let ks = vec![size(k, "x")?; count];
        let ns = groups
            .iter()
            .map(|&(_, _, rows)| size(rows, "ids"))
            .collect::<Result<Vec<_>>>()?;
        let alphas = vec![1f32; count];
        let betas = vec![0f32; count];
        let group_sizes = vec![1 as c_int; count];
        // SAFETY: the pointer tables address live contiguous device buffers
        // of the sizes given (each group's rows lie within `a` and `out`, each
        // expert within `w`); the host arrays have `count` entries and outlive
        // the call; the handle is candle's, on the stream of this launch.
        unsafe {
            cublas::cublasGemmGroupedBatchedEx(
                *launch.device.cublas_handle().handle(),
                transa.as_ptr(),
                transb.as_ptr(),
                ms.as_ptr(),
                ns.as_ptr(),
                ks.as_ptr(),
                alphas.as_ptr().cast(),
                table(0) as *const *const c_void,
                data_type,
                ks.as_ptr(),
                table(1) as *const *const c_void,
                data_type,
                ks.as_ptr(),
                betas.as_ptr().cast(),
                table(2) as *const *mut c_void,
                data_type,
                ms.as_ptr(),
                size(count, "gate_up")?,
                group_sizes.as_ptr(),
                compute_type,
            )
        }
        .result()
        .map_err(|e| KernelError::Candle(candle_core::Error::Msg(format!("{OP}: cuBLAS {e}"))))?;
    }
    Ok(into_tensor(out, shape))
}

fn driver_error(error: impl std::fmt::Debug) -> KernelError {
    KernelError::Candle(candle_core::Error::Msg(format!("{OP}: {error:?}")))
}

/// `moe.cu`'s combine over expert outputs grouped by expert (`rows` maps each
/// routed row to its row of `expert_out`).
fn combine(
    launch: &Launch,
    expert_out: &Tensor,
    weights: &Tensor,
    ids: &Tensor,
    rows: &Tensor,
    dims: &MoeDims,
) -> Result<Tensor> {
    let expert_out = Input::new(expert_out, None)?;
    let weights = Input::new(weights, Some(DType::F32))?;
    let ids = Input::new(ids, None)?;
    let rows = Input::new(rows, None)?;
    let dtype = expert_out.dtype();
    let shape = Shape::from_dims(&[dims.tokens, dims.hidden]);
    let mut y = launch.alloc(&shape, dtype)?;
    {
        input_ptrs!(OP, launch, out_p <- expert_out, weights_p <- weights, ids_p <- ids,
                           rows_p <- rows);
        let y_p = output_ptr(&mut y, &launch.stream)?;
        // SAFETY: as in `moe_experts`.
        let code = unsafe {
            berrylm_moe_combine(
                dtype_code(OP, dtype)?,
                out_p.0 as *const c_void,
                weights_p.0 as *const f32,
                ids_p.0 as *const u32,
                rows_p.0 as *const u32,
                y_p.0 as *mut c_void,
                c_size(OP, "x", dims.tokens)?,
                c_size(OP, "ids", dims.top_k)?,
                c_size(OP, "gate_up", dims.experts)?,
                c_size(OP, "x", dims.hidden)?,
                launch.raw_stream(),
            )
        };
        check(OP, code)?;
    }
    Ok(into_tensor(y, shape))
}
