//! Binding of `moe.cu` and the grouped GEMMs: the routed experts of a decode
//! step in `moe.cu`'s kernels; those of more rows in bf16/f16 as
//! `moe_grouped.cu`'s tensor-core grouped GEMMs (grouping on the device, no
//! read-back), in f32 as two cuBLAS grouped GEMMs; both before `moe.cu`'s
//! combine.

use std::ffi::{c_int, c_void};

use candle_core::cuda_backend::cudarc::cublas::sys as cublas;
use candle_core::cuda_backend::cudarc::driver::DevicePtr;
use candle_core::quantized::QTensor;
use candle_core::{DType, Tensor};

use super::quantized::{aligned16, blocks_address, gguf_code};
use super::{c_size, dtype_code, Launch};
use crate::moe::{
    MoeBlockInputs, MoeBlockWeights, MoeExpertsAlgorithm, MoeExpertsArgs, RoutedSizes,
};
use crate::{invalid_argument, KernelError, Result};

const OP: &str = "moe_experts";

/// The most routed rows `moe.cu`'s kernels take (`kMaxRouted` in moe.cu: a
/// block keeps the list of the rows sent to its expert in shared memory);
/// [`MoeExpertsAlgorithm::Streamed`] calls with more run the grouped GEMMs.
const STREAMED_MAX_ROUTED_ROWS: usize = 4096;
/// The most experts per token the combine takes (`kMaxCombineTopK` in
/// moe.cu).
const MAX_TOP_K: usize = 32;

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

    fn berrylm_moe_experts_quantized(
        dtype: c_int,
        format: c_int,
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

    fn berrylm_moe_block_decode(
        dtype: c_int,
        x: *const c_void,
        weights: *const f32,
        ids: *const u32,
        gate_up: *const c_void,
        down: *const c_void,
        shared_gate_up: *const c_void,
        shared_gate_up_stride: i64,
        shared_down: *const c_void,
        shared_inter: c_int,
        shared_gate_logit: *const c_void,
        shared_gate_logit_stride: i64,
        residual: *const c_void,
        h: *mut c_void,
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

    fn berrylm_moe_grouped_scratch(
        routed: c_int,
        experts: c_int,
        chunk_counts: *mut i64,
        tiles: *mut i64,
    );

    fn berrylm_moe_grouped_max_experts() -> c_int;

    fn berrylm_moe_grouped_experts(
        dtype: c_int,
        x: *const c_void,
        ids: *const u32,
        gate_up: *const c_void,
        down: *const c_void,
        chunk_counts: *mut u32,
        offsets: *mut u32,
        tiles: *mut u32,
        tile_count: *mut u32,
        positions: *mut u32,
        tokens_of: *mut u32,
        h: *mut c_void,
        expert_out: *mut c_void,
        sizes: MoeSizes,
        stream: *mut c_void,
    ) -> c_int;
}

/// The sizes of a `berrylm_moe_grouped_experts` call (`MoeSizes` in
/// moe_grouped.cu).
#[repr(C)]
#[derive(Clone, Copy)]
struct MoeSizes {
    tokens: c_int,
    top_k: c_int,
    experts: c_int,
    hidden: c_int,
    inter: c_int,
}

impl RoutedSizes {
    /// The routed rows `tokens * top_k`, which `moe.cu`'s streaming kernels
    /// take up to [`STREAMED_MAX_ROUTED_ROWS`] of (an error of `op` beyond).
    fn streamed_rows(&self, op: &'static str) -> Result<usize> {
        let routed = self.tokens * self.top_k;
        if routed > STREAMED_MAX_ROUTED_ROWS {
            return Err(invalid_argument(
                op,
                "ids",
                format!(
                    "{routed} routed rows; the streaming kernels take up to \
                     {STREAMED_MAX_ROUTED_ROWS}"
                ),
            ));
        }
        Ok(routed)
    }

    /// `[tokens, top_k, experts, hidden, inter]` as the launchers take them.
    fn c_sizes(&self) -> Result<[c_int; 5]> {
        if self.top_k > MAX_TOP_K {
            return Err(invalid_argument(
                OP,
                "ids",
                format!(
                    "{} experts per token; the CUDA kernels take at most {MAX_TOP_K}",
                    self.top_k
                ),
            ));
        }
        Ok([
            c_size(OP, "x", self.tokens)?,
            c_size(OP, "ids", self.top_k)?,
            c_size(OP, "gate_up", self.experts)?,
            c_size(OP, "x", self.hidden)?,
            c_size(OP, "down", self.inter)?,
        ])
    }
}

/// CUDA `moe_experts` with `algorithm`; arguments already validated by the
/// caller.
pub(crate) fn moe_experts(
    args: &MoeExpertsArgs<'_>,
    algorithm: MoeExpertsAlgorithm,
) -> Result<Tensor> {
    let routed = args.sizes.tokens * args.sizes.top_k;
    if algorithm == MoeExpertsAlgorithm::Streamed && routed <= STREAMED_MAX_ROUTED_ROWS {
        moe_experts_streamed(args)
    } else if takes_tensor_cores(args) {
        moe_experts_tensor_cores(args)
    } else {
        moe_experts_cublas(args)
    }
}

/// `moe.cu`'s three launches: each chosen expert's weights streamed once per
/// group of up to 8 of its routed rows, then the combine.
fn moe_experts_streamed(args: &MoeExpertsArgs<'_>) -> Result<Tensor> {
    let routed = args.sizes.tokens * args.sizes.top_k;
    let mut launch = Launch::new(OP, args.x)?;
    let x = launch.input("x", args.x)?;
    let weights = launch.input_as("weights", args.weights, DType::F32)?;
    let ids = launch.input("ids", args.ids)?;
    let gate_up = launch.input("gate_up", args.gate_up)?;
    let down = launch.input("down", args.down)?;
    let dtype = launch.dtype(x);
    // Scratch: each routed row's `h` and expert output.
    let h = launch.output(&[routed, args.sizes.inter], dtype)?;
    let expert_out = launch.output(&[routed, args.sizes.hidden], dtype)?;
    let y = launch.output(&[args.sizes.tokens, args.sizes.hidden], dtype)?;
    let [tokens, top_k, experts, hidden, inter] = args.sizes.c_sizes()?;
    let outputs = run_kernel!(launch => berrylm_moe_experts(
        dtype(dtype), input(x), input(weights), input(ids), input(gate_up), input(down),
        output(h), output(expert_out), output(y),
        tokens, top_k, experts, hidden, inter
    ))?;
    Ok(outputs.tensor(y))
}

/// CUDA `moe_block_decode`: `moe.cu`'s `gate | up` kernel, then its block
/// output kernel; arguments validated by the caller (`shared_inter` the
/// shared expert's width).
pub(crate) fn moe_block_decode(
    inputs: &MoeBlockInputs<'_>,
    weights: &MoeBlockWeights<'_>,
    sizes: &RoutedSizes,
    shared_inter: usize,
) -> Result<Tensor> {
    const BLOCK_OP: &str = "moe_block_decode";
    let routed = sizes.streamed_rows(BLOCK_OP)?;
    let mut launch = Launch::new(BLOCK_OP, inputs.x)?;
    let [x, ids, residual, gate_up, down, shared_down] = launch.inputs([
        ("x", inputs.x),
        ("ids", inputs.ids),
        ("residual", inputs.residual),
        ("gate_up", weights.gate_up),
        ("down", weights.down),
        ("shared_down", weights.shared_down),
    ])?;
    let routing_weights = launch.input_as("weights", inputs.weights, DType::F32)?;
    let (shared_gate_up, shared_gate_up_stride) =
        launch.input_rows("shared_gate_up", inputs.shared_gate_up)?;
    let (shared_gate_logit, shared_gate_logit_stride) =
        launch.input_rows("shared_gate_logit", inputs.shared_gate_logit)?;
    let dtype = launch.dtype(x);
    // Scratch: each routed row's `h`.
    let h = launch.output(&[routed, sizes.inter], dtype)?;
    let y = launch.output(&[sizes.tokens, sizes.hidden], dtype)?;
    let [tokens, top_k, experts, hidden, inter] = sizes.c_sizes()?;
    // SAFETY (with `run_kernel!`'s): `shared_gate_up` is read as `tokens` rows of
    // `2 * shared_inter` elements and `shared_gate_logit` as `tokens` elements, each
    // row or element its stride apart from the one before, which their layouts span.
    let outputs = run_kernel!(launch => berrylm_moe_block_decode(
        dtype(dtype), input(x), input(routing_weights), input(ids), input(gate_up), input(down),
        input(shared_gate_up), shared_gate_up_stride as i64, input(shared_down),
        c_size(BLOCK_OP, "shared_down", shared_inter)?, input(shared_gate_logit),
        shared_gate_logit_stride as i64, input(residual), output(h), output(y),
        tokens, top_k, experts, hidden, inter
    ))?;
    Ok(outputs.tensor(y))
}

/// CUDA `moe_experts_quantized`: `moe.cu`'s three launches, decoding the
/// GGUF blocks of the chosen experts as they are streamed; arguments
/// validated by the caller.
pub(crate) fn moe_experts_quantized(
    sizes: &RoutedSizes,
    x: &Tensor,
    weights: &Tensor,
    ids: &Tensor,
    gate_up: &QTensor,
    down: &QTensor,
) -> Result<Tensor> {
    let routed = sizes.streamed_rows(OP)?;
    if gate_up.dtype() != down.dtype() {
        return Err(invalid_argument(
            OP,
            "down",
            format!(
                "quantized to {:?}, `gate_up` to {:?}: the kernels take one type",
                down.dtype(),
                gate_up.dtype()
            ),
        ));
    }
    let format = gguf_code(OP, "gate_up", gate_up.dtype())?;
    let (gate_up, down) = (blocks_address(gate_up)?, blocks_address(down)?);
    let mut launch = Launch::new(OP, x)?;
    let x = launch.input("x", &aligned16(x)?)?;
    let weights = launch.input_as("weights", weights, DType::F32)?;
    let ids = launch.input("ids", ids)?;
    let dtype = launch.dtype(x);
    let h = launch.output(&[routed, sizes.inter], dtype)?;
    let expert_out = launch.output(&[routed, sizes.hidden], dtype)?;
    let y = launch.output(&[sizes.tokens, sizes.hidden], dtype)?;
    let [tokens, top_k, experts, hidden, inter] = sizes.c_sizes()?;
    let outputs = run_kernel!(launch => berrylm_moe_experts_quantized(
        dtype(dtype), format, input(x), input(weights), input(ids), gate_up, down,
        output(h), output(expert_out), output(y),
        tokens, top_k, experts, hidden, inter
    ))?;
    Ok(outputs.tensor(y))
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

/// Whether `moe_grouped.cu` takes the call: bf16 or f16, `hidden` and
/// `inter` multiples of 8 and `x`, `gate_up` and `down` starting on a
/// 16-byte boundary (it copies rows in 16-byte pieces; candle's allocations
/// are aligned, so a contiguous view must start at a multiple of 8
/// elements; other views are copied first), and at most
/// `berrylm_moe_grouped_max_experts()` experts.
fn takes_tensor_cores(args: &MoeExpertsArgs<'_>) -> bool {
    let starts_aligned = |tensor: &Tensor| {
        !tensor.is_contiguous() || tensor.layout().start_offset().is_multiple_of(8)
    };
    // SAFETY: a constant query without arguments.
    let max_experts = unsafe { berrylm_moe_grouped_max_experts() };
    matches!(args.x.dtype(), DType::BF16 | DType::F16)
        && args.sizes.hidden.is_multiple_of(8)
        && args.sizes.inter.is_multiple_of(8)
        && [args.x, args.gate_up, args.down]
            .into_iter()
            .all(starts_aligned)
        && usize::try_from(max_experts).is_ok_and(|max| args.sizes.experts <= max)
}

/// `moe_experts` for many routed rows in bf16/f16 (`moe_grouped.cu`): the
/// rows grouped by expert on the device, `gate | up` with the SwiGLU fused
/// into its epilogue and the down projection as grouped GEMMs on the tensor
/// cores (f32 accumulation, the reference's roundings), then `moe.cu`'s
/// combine with each routed row's grouped position. Nothing is read back to
/// the host; ids at or above E are skipped, as the decode kernels do.
fn moe_experts_tensor_cores(args: &MoeExpertsArgs<'_>) -> Result<Tensor> {
    let routed = args.sizes.tokens * args.sizes.top_k;
    let [tokens, top_k, experts, hidden, inter] = args.sizes.c_sizes()?;
    let sizes = MoeSizes {
        tokens,
        top_k,
        experts,
        hidden,
        inter,
    };
    let routed_c = c_size(OP, "ids", routed)?;
    let (mut chunk_len, mut tiles_len) = (0i64, 0i64);
    // SAFETY: writes the two lengths through valid pointers.
    unsafe { berrylm_moe_grouped_scratch(routed_c, experts, &mut chunk_len, &mut tiles_len) };
    let scratch_len = |len: i64| {
        usize::try_from(len).map_err(|_| invalid_argument(OP, "ids", format!("scratch of {len}")))
    };
    let mut launch = Launch::new(OP, args.x)?;
    let x = launch.input("x", args.x)?;
    let ids = launch.input("ids", args.ids)?;
    let gate_up = launch.input("gate_up", args.gate_up)?;
    let down = launch.input("down", args.down)?;
    let dtype = launch.dtype(x);
    let chunk_counts = launch.output(scratch_len(chunk_len)?, DType::U32)?;
    let offsets = launch.output(args.sizes.experts, DType::U32)?;
    let tiles = launch.output(scratch_len(tiles_len)?, DType::U32)?;
    let tile_count = launch.output(1, DType::U32)?;
    let positions = launch.output(routed, DType::U32)?;
    let tokens_of = launch.output(routed, DType::U32)?;
    let h = launch.output(&[routed, args.sizes.inter], dtype)?;
    let expert_out = launch.output(&[routed, args.sizes.hidden], dtype)?;
    let outputs = run_kernel!(launch => berrylm_moe_grouped_experts(
        dtype(dtype), input(x), input(ids), input(gate_up), input(down),
        output(chunk_counts), output(offsets), output(tiles), output(tile_count),
        output(positions), output(tokens_of), output(h), output(expert_out), sizes
    ))?;
    combine(
        &outputs.tensor(expert_out),
        &outputs.tensor(positions),
        args,
    )
}

/// `moe_experts` for many routed rows in f32 (the exactness path) and for
/// what `moe_grouped.cu` does not take: the ids read back once (a device
/// synchronisation), the rows of `x` gathered by expert,
/// `gate | up` and the down projection as one grouped GEMM each (cuBLAS,
/// f32 accumulation, each output rounded once to the dtype of `x`, as a
/// `Linear` of the reference), SwiGLU in between with the reference's
/// rounding, and `moe.cu`'s combine (the weighted terms added in increasing
/// expert id).
fn moe_experts_cublas(args: &MoeExpertsArgs<'_>) -> Result<Tensor> {
    let host_ids: Vec<u32> = args.ids.flatten_all()?.to_vec1()?;
    let grouped = ExpertGroups::new(&host_ids, args.sizes.top_k, args.sizes.experts)?;
    let device = args.x.device();
    let routed = grouped.rows.len();
    let tokens = Tensor::from_vec(grouped.tokens, routed, device)?;
    let rows = Tensor::from_vec(grouped.rows, routed, device)?;
    let x_rows = args.x.contiguous()?.index_select(&tokens, 0)?;
    let (gate_up, down, inter, hidden) =
        (args.gate_up, args.down, args.sizes.inter, args.sizes.hidden);
    let projected = grouped_gemm(&x_rows, gate_up, &grouped.groups, 2 * inter, hidden)?;
    let h = crate::swiglu(&projected)?;
    let expert_out = grouped_gemm(&h, down, &grouped.groups, hidden, inter)?;
    combine(&expert_out, &rows, args)
}

/// `out[r] = W[e] a[r]` for every row `r` of every group `(e, first, rows)`:
/// `a` `[R, k]`, `w` `[E, m, k]`, `out` `[R, m]`, one dtype. One cuBLAS
/// grouped-batched GEMM (a group per expert) on candle's handle and stream.
fn grouped_gemm(
    a: &Tensor,
    w: &Tensor,
    groups: &[(usize, usize, usize)],
    m: usize,
    k: usize,
) -> Result<Tensor> {
    let data_type = match a.dtype() {
        DType::BF16 => cublas::cudaDataType_t::CUDA_R_16BF,
        DType::F16 => cublas::cudaDataType_t::CUDA_R_16F,
        DType::F32 => cublas::cudaDataType_t::CUDA_R_32F,
        other => {
            return Err(invalid_argument(
                OP,
                "x",
                format!("unsupported dtype {other:?}"),
            ))
        }
    };
    let cuda = a.device().as_cuda_device()?;
    let stream = cuda.cuda_stream();
    let blas = cuda.cublas_handle();
    let mut launch = Launch::new(OP, a)?;
    let a = launch.input("x", a)?;
    let w = launch.input("gate_up", w)?;
    let dtype = launch.dtype(a);
    let rows = launch.shape(a).dims()[0];
    let out = launch.output(&[rows, m], dtype)?;
    let count = groups.len();
    let elem = dtype.size_in_bytes() as u64;
    // Row-major `out = a W^T` is column-major `out^T = W a^T`: op(A) = W^T
    // (A column-major [k, m], lda k), B = a^T ([k, rows], ldb k), C [m, rows].
    let transa = vec![cublas::cublasOperation_t::CUBLAS_OP_T; count];
    let transb = vec![cublas::cublasOperation_t::CUBLAS_OP_N; count];
    let ms = vec![c_size(OP, "gate_up", m)?; count];
    let ks = vec![c_size(OP, "x", k)?; count];
    let ns = groups
        .iter()
        .map(|&(_, _, rows)| c_size(OP, "ids", rows))
        .collect::<Result<Vec<_>>>()?;
    let alphas = vec![1f32; count];
    let betas = vec![0f32; count];
    let group_sizes = vec![1 as c_int; count];
    let group_count = c_size(OP, "gate_up", count)?;
    let outputs = launch.run(|p| {
        let (w_base, a_base) = (p.input::<c_void>(w) as u64, p.input::<c_void>(a) as u64);
        let out_base = p.output::<c_void>(out) as u64;
        // The A (weights), B (activations) and C (outputs) pointer tables,
        // which cuBLAS reads from device memory; freed on the stream after
        // the call.
        let mut pointers = Vec::with_capacity(3 * count);
        pointers.extend(
            groups
                .iter()
                .map(|&(e, _, _)| w_base + (e * m * k) as u64 * elem),
        );
        pointers.extend(
            groups
                .iter()
                .map(|&(_, first, _)| a_base + (first * k) as u64 * elem),
        );
        pointers.extend(
            groups
                .iter()
                .map(|&(_, first, _)| out_base + (first * m) as u64 * elem),
        );
        let tables = stream
            .clone_htod(&pointers)
            .map_err(|e| error(format!("{e:?}")))?;
        let (base, _read) = tables.device_ptr(&stream);
        let table = |part: usize| base + (part * count * std::mem::size_of::<u64>()) as u64;
        // SAFETY: the pointer tables address live contiguous device buffers
        // of the sizes given (each group's rows lie within `a` and `out`, each
        // expert within `w`); the host arrays have `count` entries and outlive
        // the call; the handle is candle's, on the stream of this launch.
        unsafe {
            cublas::cublasGemmGroupedBatchedEx(
                *blas.handle(),
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
                group_count,
                group_sizes.as_ptr(),
                cublas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            )
        }
        .result()
        .map_err(|e| error(format!("cuBLAS {e}")))?;
        Ok(0)
    })?;
    Ok(outputs.tensor(out))
}

fn error(reason: String) -> KernelError {
    KernelError::Candle(candle_core::Error::Msg(format!("{OP}: {reason}")))
}

/// `moe.cu`'s combine over expert outputs grouped by expert (`rows` maps each
/// routed row to its row of `expert_out`) with the weights and ids of `args`.
fn combine(expert_out: &Tensor, rows: &Tensor, args: &MoeExpertsArgs<'_>) -> Result<Tensor> {
    let mut launch = Launch::new(OP, expert_out)?;
    let expert_out = launch.input("x", expert_out)?;
    let weights = launch.input_as("weights", args.weights, DType::F32)?;
    let ids = launch.input("ids", args.ids)?;
    let rows = launch.input("ids", rows)?;
    let dtype = launch.dtype(expert_out);
    let y = launch.output(&[args.sizes.tokens, args.sizes.hidden], dtype)?;
    let [tokens, top_k, experts, hidden, _] = args.sizes.c_sizes()?;
    let outputs = run_kernel!(launch => berrylm_moe_combine(
        dtype(dtype), input(expert_out), input(weights), input(ids), input(rows), output(y),
        tokens, top_k, experts, hidden
    ))?;
    Ok(outputs.tensor(y))
}
