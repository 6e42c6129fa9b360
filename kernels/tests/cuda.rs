//! Every CUDA kernel against its CPU reference on the same random inputs, at
//! BerryLM-OS shapes (hidden 2048, Hk 16, Hv 32, dk = dv = 128, conv kernel 4,
//! conv_dim 8192, head dim 256, 128 experts top-8) and at small odd shapes, in f32 (tight tolerance) and in
//! bf16/f16 (a rounding step of the output dtype), plus chained calls that
//! carry the conv and recurrent states. Every recurrence case runs once per
//! [`KdaPrefillAlgorithm`] (through `kda_recurrence_with`), each against the
//! CPU reference.
//!
//! Needs a CUDA GPU: `cargo test --release --features cuda --test cuda`.
#![cfg(feature = "cuda")]

#[allow(dead_code)]
#[path = "kernels/common.rs"]
mod common;

#[path = "cuda/attention.rs"]
mod attention;

#[path = "cuda/kda_core.rs"]
mod kda_core;

#[path = "cuda/paged_attention.rs"]
mod paged_attention;

#[path = "cuda/quantized.rs"]
mod quantized;

use berrylm_kernels::{
    add_moe_output, add_offset_rms_norm, add_offset_rms_norm_matmul, attn_res_mix,
    attn_res_mix_norm, causal_conv1d, causal_conv1d_split, causal_conv1d_split_in_pool, contiguous,
    decode_matmul, gated_rms_norm, kda_beta, kda_gate, kda_recurrence, kda_recurrence_in_pool_with,
    kda_recurrence_with, moe_block_decode, moe_experts, moe_experts_with, moe_route,
    offset_rms_norm, offset_rms_norm_rope, sigmoid_gate_mul, swiglu, KdaPrefillAlgorithm,
    KernelError, MoeBlockInputs, MoeBlockWeights, MoeExpertsAlgorithm, Result, StatePool, PAD_SLOT,
};
use std::sync::OnceLock;

use candle_core::{DType, Device, Tensor};

use common::{f32_values, pool_rows, random, tensor, Rng};

const HIDDEN: usize = 2048;
const HK: usize = 16;
const HV: usize = 32;
const DK: usize = 128;
const DV: usize = 128;
const CONV_K: usize = 4;
const CONV_DIM: usize = 2 * HK * DK + HV * DV;
/// Head dim of the full-attention layers (the q/k norms' width).
const HEAD_DIM: usize = 256;
/// Query heads of the full-attention layers.
const HEADS: usize = 16;
const EXPERTS: usize = 128;
const TOP_K: usize = 8;

/// One CUDA device shared by every test (tensors of two `Device::new_cuda`
/// handles count as different devices).
fn gpu() -> Device {
    static DEVICE: OnceLock<Device> = OnceLock::new();
    DEVICE
        .get_or_init(|| Device::new_cuda(0).expect("a CUDA device is required for these tests"))
        .clone()
}

fn to_gpu(tensor: &Tensor, device: &Device) -> Result<Tensor> {
    Ok(tensor.to_device(device)?)
}

/// Tolerance of a comparison: `|got - want| <= atol * max|want| + rtol * |want|`.
#[derive(Clone, Copy)]
struct Tol {
    atol: f64,
    rtol: f64,
}

/// For f32 outputs: agreement up to summation order.
const TIGHT: Tol = Tol {
    atol: 1e-5,
    rtol: 1e-4,
};

/// Unit roundoff of TF32 (10 explicit mantissa bits, rounded to nearest).
const TF32_UNIT_ROUNDOFF: f64 = 1.0 / 2048.0;

/// For the chunked prefill, whose matmuls round both operands to TF32 and
/// accumulate in f32 (chunked.cu). A product of two rounded operands is off
/// by at most 2u relative (u = 2^-11); the output is a second-level product,
/// `O = Q~ S + Aqk (U - W S)`, so a term carries at most 4u; and the sums of
/// the terms' magnitudes that these relative errors scale are at most about
/// twice the largest output (|q^| = |k^| = 1, 0 <= beta <= 1 and decays
/// <= 1 keep the state and the `d` of every chunk of the order of the
/// values; the recurrence is a contraction, so errors of earlier chunks
/// decay instead of adding up). Hence `8u * max|cpu|` absolute. The f32
/// parts (triangular solve, diagonal blocks, state carry) add errors of
/// order 2^-24 only.
const CHUNKED_TF32: Tol = Tol {
    atol: 8.0 * TF32_UNIT_ROUNDOFF,
    rtol: 0.0,
};

/// For outputs in `dtype`: two rounding steps of that dtype at the value,
/// or one at the largest magnitude of the result (the rounded intermediates,
/// e.g. AttnRes's `mix - x` or the norm's `n` and `w * n`, can flip by one
/// step when the f32 sums before them differ in their last bit).
fn output_tol(dtype: DType) -> Tol {
    match dtype {
        DType::BF16 => Tol {
            atol: 8e-3,
            rtol: 1.6e-2,
        },
        DType::F16 => Tol {
            atol: 1e-3,
            rtol: 2e-3,
        },
        _ => TIGHT,
    }
}

/// Compares a CUDA result with the CPU reference: same shape and dtype, and
/// values within `tol`; in half precision, at most 2 % of the values may
/// differ at all (a single rounding flips rarely). Returns the number of
/// elements that differ.
fn compare(what: &str, cuda: &Tensor, cpu: &Tensor, tol: Tol) -> Result<usize> {
    let differing = within(what, cuda, cpu, tol)?;
    if matches!(cpu.dtype(), DType::BF16 | DType::F16) {
        // Rounding flips are rare; a systematic error would touch many.
        assert!(
            differing <= cpu.elem_count() / 50 + 2,
            "{what}: {differing} of {} half-precision values differ",
            cpu.elem_count()
        );
    }
    Ok(differing)
}

/// Same shape and dtype, values within `tol`; returns the number of
/// elements that differ at all.
fn within(what: &str, cuda: &Tensor, cpu: &Tensor, tol: Tol) -> Result<usize> {
    assert_eq!(cuda.dims(), cpu.dims(), "{what}: shapes differ");
    assert_eq!(cuda.dtype(), cpu.dtype(), "{what}: dtypes differ");
    assert!(cuda.device().is_cuda(), "{what}: result is not on the GPU");
    let got = f32_values(&cuda.to_device(&Device::Cpu)?)?;
    let want = f32_values(cpu)?;
    let scale = want.iter().fold(0f64, |m, &v| m.max(f64::from(v).abs()));
    let mut differing = 0;
    let mut worst = (0usize, 0f64);
    for (index, (&g, &w)) in got.iter().zip(&want).enumerate() {
        if g.to_bits() != w.to_bits() {
            differing += 1;
        }
        let error = (f64::from(g) - f64::from(w)).abs();
        let allowed = tol.atol * scale + tol.rtol * f64::from(w).abs();
        let within = error <= allowed || (g.is_nan() && w.is_nan());
        if !within {
            panic!(
                "{what}: element {index}: cuda {g}, cpu {w} (error {error:e}, allowed {allowed:e}, scale {scale:e})"
            );
        }
        if error > worst.1 {
            worst = (index, error);
        }
    }
    eprintln!(
        "{what}: {} elements, {differing} differ, max error {:e} (scale {scale:e})",
        want.len(),
        worst.1
    );
    Ok(differing)
}

/// Asserts bit-identical values (same shape and dtype).
fn identical(what: &str, cuda: &Tensor, cpu: &Tensor) -> Result<()> {
    assert_eq!(compare(what, cuda, cpu, TIGHT)?, 0, "{what}: values differ");
    Ok(())
}

/// Copies of CPU tensors on the GPU.
fn to_gpu_all(tensors: &[Tensor]) -> Result<Vec<Tensor>> {
    let dev = gpu();
    tensors.iter().map(|t| to_gpu(t, &dev)).collect()
}

/// `op` of the CPU tensors `inputs` and of their copies on the GPU, as
/// `(cuda, cpu)`.
fn on_both<const N: usize, T>(
    inputs: [&Tensor; N],
    op: impl Fn([&Tensor; N]) -> Result<T>,
) -> Result<(T, T)> {
    let cpu = op(inputs)?;
    let copies = to_gpu_all(&inputs.map(Tensor::clone))?;
    let cuda = op(std::array::from_fn(|i| &copies[i]))?;
    Ok((cuda, cpu))
}

/// [`on_both`] of an operation with one tensor result, compared as
/// [`compare`] does.
fn compare_on_both<const N: usize>(
    what: &str,
    inputs: [&Tensor; N],
    tol: Tol,
    op: impl Fn([&Tensor; N]) -> Result<Tensor>,
) -> Result<usize> {
    let (cuda, cpu) = on_both(inputs, op)?;
    compare(what, &cuda, &cpu, tol)
}

/// The three activation dtypes.
const ALL_DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// The half-precision activation dtypes.
const HALF_DTYPES: [DType; 2] = [DType::BF16, DType::F16];

/// The activation dtypes without f16.
const F32_BF16: [DType; 2] = [DType::F32, DType::BF16];

/// `(batch, seq_len)` of the conv calls at model shapes: decode at B = 1 and
/// 8 and a 200-token prefill.
const CONV_MODEL_CALLS: [(usize, usize); 3] = [(1, 1), (8, 1), (1, 200)];

/// The widths of the KDA layer's conv outputs: q | k | v.
const CONV_WIDTHS: [usize; 3] = [HK * DK, HK * DK, HV * DV];

/// `x` `[batch, seq_len, CONV_DIM]` in `dtype` and the (f32) weights of a
/// conv call at model shapes, drawn from `rng` in that order.
fn conv_model_inputs(
    rng: &mut Rng,
    (batch, seq_len): (usize, usize),
    dtype: DType,
) -> Result<(Tensor, Tensor)> {
    let x = random(rng, &[batch, seq_len, CONV_DIM], -2.0, 2.0, dtype)?;
    let weight = random(rng, &[CONV_DIM, CONV_K], -0.6, 0.6, DType::F32)?;
    Ok((x, weight))
}

/// Runs `case` for every case and variant (a dtype, mostly; cases outer),
/// each with a seed of its own: `first_seed + 1`, `first_seed + 2`, ... in
/// that order.
fn sweep_seeds<C: Copy, V: Copy>(
    first_seed: u64,
    cases: impl IntoIterator<Item = C>,
    variants: &[V],
    mut case: impl FnMut(u64, C, V) -> Result<()>,
) -> Result<()> {
    let mut seed = first_seed;
    for item in cases {
        for &variant in variants {
            seed += 1;
            case(seed, item, variant)?;
        }
    }
    Ok(())
}

/// [`sweep_seeds`] over dtypes, each case with a generator of its own seed.
fn sweep<C: Copy>(
    first_seed: u64,
    cases: impl IntoIterator<Item = C>,
    dtypes: &[DType],
    mut case: impl FnMut(&mut Rng, C, DType) -> Result<()>,
) -> Result<()> {
    sweep_seeds(first_seed, cases, dtypes, |seed, item, dtype| {
        case(&mut Rng::new(seed), item, dtype)
    })
}

/// Every `(a, b)` of `outer` and `inner`, `outer` first: the cases of two
/// nested loops.
fn pairs<A: Copy, B: Copy>(outer: &[A], inner: &[B]) -> Vec<(A, B)> {
    outer
        .iter()
        .flat_map(|&a| inner.iter().map(move |&b| (a, b)))
        .collect()
}

/// `view` of the CPU tensor `base` and the same view of its copy on the GPU,
/// as `(cpu, cuda)`: layouts (strides, start offsets) the kernels must read.
fn view_on_both(
    base: &Tensor,
    view: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
) -> Result<(Tensor, Tensor)> {
    Ok((view(base)?, view(&to_gpu(base, &gpu())?)?))
}

/// Compares the parts of a split result (`{what} part {index}`).
fn compare_parts(what: &str, cuda: &[Tensor], cpu: &[Tensor], tol: Tol) -> Result<()> {
    for (index, (cuda, cpu)) in cuda.iter().zip(cpu).enumerate() {
        compare(&format!("{what} part {index}"), cuda, cpu, tol)?;
    }
    Ok(())
}

// ---------------------------------------------------------------- contiguous

#[test]
fn contiguous_matches_cpu_for_strided_views() -> Result<()> {
    let mut rng = Rng::new(2650);
    type View = fn(&Tensor) -> candle_core::Result<Tensor>;
    let cases: [(&str, &[usize], DType, View); 5] = [
        // The gate half of the per-head interleaved `q_proj` output.
        ("gate half", &[3, 1, 4, 16], DType::BF16, |t| {
            t.narrow(3, 8, 8)
        }),
        ("transposed heads", &[2, 5, 3, 6], DType::F32, |t| {
            t.transpose(1, 2)
        }),
        ("column slice", &[4, 37], DType::F16, |t| t.narrow(1, 5, 20)),
        ("transposed ids", &[6, 7], DType::U32, |t| t.t()),
        ("broadcast row", &[1, 5], DType::F32, |t| {
            t.broadcast_as((4, 5))
        }),
    ];
    for (what, dims, dtype, view) in cases {
        let base = random(&mut rng, dims, 0.0, 1000.0, dtype)?;
        let (cpu, cuda) = view_on_both(&base, view)?;
        assert!(!cuda.is_contiguous(), "{what}: the view is contiguous");
        let copy = contiguous(&cuda)?;
        assert!(copy.is_contiguous(), "{what}: the copy is not contiguous");
        identical(what, &copy, &contiguous(&cpu)?)?;
    }
    Ok(())
}

// ---------------------------------------------------------------- kda_gate

#[test]
fn beta_matches_cpu() -> Result<()> {
    let mut rng = Rng::new(2700);
    for (tokens, dtype) in [(1, DType::BF16), (64, DType::F32), (300, DType::F16)] {
        let b = random(&mut rng, &[tokens, HV], -12.0, 12.0, dtype)?;
        compare_on_both(
            &format!("kda_beta [{tokens}, {HV}] {dtype:?}"),
            [&b],
            TIGHT,
            |[b]| kda_beta(b),
        )?;
    }
    Ok(())
}

/// Tolerance of `kda_gate`.
const GATE_TOL: Tol = Tol {
    atol: 1e-6,
    rtol: 1e-5,
};

fn gate_case(seed: u64, tokens: usize, heads: usize, dk: usize, dtype: DType) -> Result<()> {
    let mut rng = Rng::new(seed);
    let raw = random(&mut rng, &[tokens, heads * dk], -8.0, 25.0, dtype)?;
    let a_log = random(&mut rng, &[heads], -2.0, 2.0, DType::F32)?;
    let dt_bias = random(&mut rng, &[heads * dk], -1.0, 1.0, DType::F32)?;
    for lower_bound in [None, Some(-5.0f32)] {
        let what = format!("kda_gate N={tokens} Hv={heads} dk={dk} {dtype:?} lb={lower_bound:?}");
        compare_on_both(
            &what,
            [&raw, &a_log, &dt_bias],
            GATE_TOL,
            |[raw, a_log, dt_bias]| kda_gate(raw, a_log, dt_bias, heads, lower_bound),
        )?;
    }
    Ok(())
}

#[test]
fn gate_matches_cpu_at_model_shapes() -> Result<()> {
    for (i, tokens) in [1, 64, 200].into_iter().enumerate() {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            gate_case(10 + i as u64, tokens, HV, DK, dtype)?;
        }
    }
    Ok(())
}

#[test]
fn gate_matches_cpu_at_odd_shape() -> Result<()> {
    gate_case(20, 7, 4, 12, DType::F32)?;
    gate_case(21, 7, 4, 12, DType::BF16)?;
    // Parameters in bf16 are widened exactly.
    let mut rng = Rng::new(22);
    let raw = random(&mut rng, &[5, 24], -4.0, 4.0, DType::BF16)?;
    let a_log = random(&mut rng, &[2], -1.0, 1.0, DType::BF16)?;
    let dt_bias = random(&mut rng, &[24], -1.0, 1.0, DType::BF16)?;
    compare_on_both(
        "kda_gate bf16 params",
        [&raw, &a_log, &dt_bias],
        GATE_TOL,
        |[raw, a_log, dt_bias]| kda_gate(raw, a_log, dt_bias, 2, None),
    )?;
    Ok(())
}

// ----------------------------------------------------------- causal_conv1d

struct ConvCase {
    batch: usize,
    seq_len: usize,
    channels: usize,
    kernel: usize,
    x_dtype: DType,
    state_dtype: DType,
}

fn conv_case(seed: u64, case: &ConvCase) -> Result<()> {
    let mut rng = Rng::new(seed);
    let ConvCase {
        batch,
        seq_len,
        channels,
        kernel,
        x_dtype,
        state_dtype,
    } = *case;
    let x = random(&mut rng, &[batch, seq_len, channels], -2.0, 2.0, x_dtype)?;
    let weight = random(&mut rng, &[channels, kernel], -0.6, 0.6, x_dtype)?;
    let state = random(&mut rng, &[batch, channels, kernel], -2.0, 2.0, state_dtype)?;
    let ((out_cuda, state_cuda), (out_cpu, state_cpu)) =
        on_both([&x, &weight, &state], |[x, weight, state]| {
            causal_conv1d(x, weight, state)
        })?;
    let what = format!(
        "causal_conv1d B={batch} T={seq_len} C={channels} K={kernel} x={x_dtype:?} state={state_dtype:?}"
    );
    compare(&what, &out_cuda, &out_cpu, output_tol(x_dtype))?;
    identical(&format!("{what} new state"), &state_cuda, &state_cpu)?;
    Ok(())
}

/// The KDA layer's call: q | k | v as three outputs, at decode and prefill.
#[test]
fn conv_split_matches_cpu_at_model_shapes() -> Result<()> {
    sweep(
        2400,
        CONV_MODEL_CALLS,
        &F32_BF16,
        |rng, (batch, seq_len), dtype| {
            let (x, weight) = conv_model_inputs(rng, (batch, seq_len), dtype)?;
            let state = random(rng, &[batch, CONV_DIM, CONV_K], -2.0, 2.0, DType::F32)?;
            let ((parts_cuda, state_cuda), (parts_cpu, state_cpu)) =
                on_both([&x, &weight, &state], |[x, weight, state]| {
                    causal_conv1d_split(x, weight, state, &CONV_WIDTHS)
                })?;
            let what = format!("causal_conv1d_split B={batch} T={seq_len} {dtype:?}");
            compare_parts(&what, &parts_cuda, &parts_cpu, output_tol(dtype))?;
            identical(&format!("{what} new state"), &state_cuda, &state_cpu)
        },
    )
}

#[test]
fn conv_matches_cpu_at_model_shapes() -> Result<()> {
    let cases = pairs(&[1, 8], &[1, 3, 64, 200]);
    sweep_seeds(100, cases, &F32_BF16, |seed, (batch, seq_len), dtype| {
        conv_case(
            seed,
            &ConvCase {
                batch,
                seq_len,
                channels: CONV_DIM,
                kernel: CONV_K,
                x_dtype: dtype,
                state_dtype: dtype,
            },
        )
    })?;
    // Decode at a large batch.
    conv_case(
        99,
        &ConvCase {
            batch: 64,
            seq_len: 1,
            channels: CONV_DIM,
            kernel: CONV_K,
            x_dtype: DType::BF16,
            state_dtype: DType::BF16,
        },
    )?;
    Ok(())
}

#[test]
fn conv_matches_cpu_at_odd_shapes_and_dtypes() -> Result<()> {
    let channels = 2 * 2 * 12 + 4 * 24;
    let cases = pairs(&[2, 3, 4, 5], &[1, 2, 3, 7, 130]);
    let dtypes = [
        (DType::F32, DType::F32),
        (DType::BF16, DType::BF16),
        (DType::F16, DType::F16),
        (DType::BF16, DType::F32),
        (DType::F32, DType::BF16),
    ];
    sweep_seeds(
        200,
        cases,
        &dtypes,
        |seed, (kernel, seq_len), (x_dtype, state_dtype)| {
            conv_case(
                seed,
                &ConvCase {
                    batch: 3,
                    seq_len,
                    channels,
                    kernel,
                    x_dtype,
                    state_dtype,
                },
            )
        },
    )
}

#[test]
fn conv_chained_calls_carry_the_state() -> Result<()> {
    let dev = gpu();
    for dtype in [DType::F32, DType::BF16] {
        let mut rng = Rng::new(300);
        let (batch, channels) = (2, CONV_DIM);
        let weight = random(&mut rng, &[channels, CONV_K], -0.6, 0.6, dtype)?;
        let weight_gpu = to_gpu(&weight, &dev)?;
        let mut state_cpu = Tensor::zeros((batch, channels, CONV_K), dtype, &Device::Cpu)?;
        let mut state_gpu = to_gpu(&state_cpu, &dev)?;
        for (step, seq_len) in [2, 1, 1, 1, 70, 1, 3].into_iter().enumerate() {
            let x = random(&mut rng, &[batch, seq_len, channels], -2.0, 2.0, dtype)?;
            let (out_cpu, next_cpu) = causal_conv1d(&x, &weight, &state_cpu)?;
            let (out_gpu, next_gpu) = causal_conv1d(&to_gpu(&x, &dev)?, &weight_gpu, &state_gpu)?;
            let what = format!("conv chain {dtype:?} step {step} T={seq_len}");
            compare(&what, &out_gpu, &out_cpu, output_tol(dtype))?;
            identical(&format!("{what} state"), &next_gpu, &next_cpu)?;
            state_cpu = next_cpu;
            state_gpu = next_gpu;
        }
    }
    Ok(())
}

// ---------------------------------------------------------- kda_recurrence

/// The CUDA prefill algorithms; each recurrence case runs with every one.
const ALGORITHMS: [KdaPrefillAlgorithm; 2] = [
    KdaPrefillAlgorithm::Sequential,
    KdaPrefillAlgorithm::Chunked,
];

#[derive(Clone, Copy)]
struct RecSizes {
    batch: usize,
    seq_len: usize,
    hk: usize,
    hv: usize,
    dk: usize,
    dv: usize,
}

struct RecInputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    /// `q`, `k`, `v` before rounding to a half-precision `qkv` dtype.
    unrounded: Option<[Tensor; 3]>,
}

impl RecInputs {
    /// `[q, k, v, g, beta]`.
    fn tokens(&self) -> [&Tensor; 5] {
        [&self.q, &self.k, &self.v, &self.g, &self.beta]
    }
}

fn rec_inputs(rng: &mut Rng, s: RecSizes, qkv: DType, g_low: f32) -> Result<RecInputs> {
    let RecSizes {
        batch: b,
        seq_len: t,
        hk,
        hv,
        dk,
        dv,
    } = s;
    let q = random(rng, &[b, t, hk, dk], -1.0, 1.0, DType::F32)?;
    let k = random(rng, &[b, t, hk, dk], -1.0, 1.0, DType::F32)?;
    let v = random(rng, &[b, t, hv, dv], -1.0, 1.0, DType::F32)?;
    Ok(RecInputs {
        q: q.to_dtype(qkv)?,
        k: k.to_dtype(qkv)?,
        v: v.to_dtype(qkv)?,
        g: random(rng, &[b, t, hv, dk], g_low, 0.0, DType::F32)?,
        beta: random(rng, &[b, t, hv], 0.0, 1.0, DType::F32)?,
        unrounded: (qkv != DType::F32).then_some([q, k, v]),
    })
}

fn rec_state(rng: &mut Rng, s: RecSizes, fresh: bool) -> Result<Tensor> {
    let dims = [s.batch, s.hv, s.dk, s.dv];
    if fresh {
        Ok(Tensor::zeros(&dims, DType::F32, &Device::Cpu)?)
    } else {
        random(rng, &dims, -0.5, 0.5, DType::F32)
    }
}

/// Runs one recurrence call on both devices (on the GPU with `algorithm`)
/// and compares; returns the states and whether the GPU ran the chunked
/// tensor-core kernels. `carried_tf32`: the GPU state comes from an earlier
/// chunked call (so it carries that call's TF32 error).
fn rec_step(
    what: &str,
    algorithm: KdaPrefillAlgorithm,
    inputs: &RecInputs,
    state_cpu: &Tensor,
    state_gpu: &Tensor,
    carried_tf32: bool,
) -> Result<(Tensor, Tensor, bool)> {
    let dev = gpu();
    let what = format!("{what} [{algorithm:?}]");
    let [q, k, v, g, beta] = inputs.tokens();
    let (o_cpu, s_cpu) = kda_recurrence(q, k, v, g, beta, state_cpu)?;
    let [q, k, v, g, beta] = [q, k, v, g, beta].map(|t| to_gpu(t, &dev));
    let (o_gpu, s_gpu) = kda_recurrence_with(algorithm, &q?, &k?, &v?, &g?, &beta?, state_gpu)?;
    let [_, t, _, dk] = *inputs.q.dims() else {
        unreachable!()
    };
    let dv = inputs.v.dims()[3];
    let tensor_cores = algorithm == KdaPrefillAlgorithm::Chunked && t > 1 && dk <= 128 && dv <= 128;
    let tol = if tensor_cores || carried_tf32 {
        CHUNKED_TF32
    } else {
        TIGHT
    };
    compare(&format!("{what} output"), &o_gpu, &o_cpu, tol)?;
    compare(&format!("{what} state"), &s_gpu, &s_cpu, tol)?;
    if let (true, DType::BF16, Some([q, k, v])) =
        (tensor_cores, inputs.q.dtype(), &inputs.unrounded)
    {
        let (o_exact, s_exact) = kda_recurrence(q, k, v, &inputs.g, &inputs.beta, state_cpu)?;
        within_input_rounding(&format!("{what} output"), &o_gpu, &o_cpu, &o_exact)?;
        within_input_rounding(&format!("{what} state"), &s_gpu, &s_cpu, &s_exact)?;
    }
    Ok((s_cpu, s_gpu, tensor_cores))
}

/// Root mean square of `a - b`.
fn rms_diff(a: &[f32], b: &[f32]) -> f64 {
    let sum: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (f64::from(x) - f64::from(y)).powi(2))
        .sum();
    (sum / a.len().max(1) as f64).sqrt()
}

/// The criterion for the chunked prefill on bf16 inputs. `rounded` is the
/// CPU reference on the bf16 inputs, `exact` the CPU reference on the f32
/// values they were rounded from. The kernel's own error (`cuda - rounded`)
/// must be at most half the error that rounding the inputs to bf16 causes
/// (`rounded - exact`), in RMS over the tensor: then `cuda` is at most 1.5x,
/// and for independent errors about sqrt(1 + 1/4) = 1.12x, as far from the
/// f32 result as any bf16-input computation in exact arithmetic is. TF32's
/// unit roundoff (2^-11) is a quarter of bf16's (2^-9), which is where the
/// margin comes from.
fn within_input_rounding(
    what: &str,
    cuda: &Tensor,
    rounded: &Tensor,
    exact: &Tensor,
) -> Result<()> {
    let cuda = f32_values(&cuda.to_device(&Device::Cpu)?)?;
    let rounded = f32_values(rounded)?;
    let exact = f32_values(exact)?;
    let kernel = rms_diff(&cuda, &rounded);
    let input = rms_diff(&rounded, &exact);
    let total = rms_diff(&cuda, &exact);
    eprintln!(
        "{what}: RMS error vs the f32-input reference {total:e}; of the bf16-input reference {input:e}; kernel's own {kernel:e} ({:.3} of the input rounding's)",
        kernel / input
    );
    assert!(
        kernel <= 0.5 * input,
        "{what}: kernel error {kernel:e} exceeds half the bf16 input-rounding error {input:e}"
    );
    Ok(())
}

fn rec_case(seed: u64, s: RecSizes, qkv: DType, fresh: bool, g_low: f32) -> Result<()> {
    let dev = gpu();
    let mut rng = Rng::new(seed);
    let state = rec_state(&mut rng, s, fresh)?;
    let inputs = rec_inputs(&mut rng, s, qkv, g_low)?;
    let what = format!(
        "kda_recurrence B={} T={} Hk={} Hv={} dk={} dv={} {qkv:?} fresh={fresh} g>={g_low}",
        s.batch, s.seq_len, s.hk, s.hv, s.dk, s.dv
    );
    rec_all_algorithms(&what, &inputs, &state, &to_gpu(&state, &dev)?)
}

/// [`rec_step`] once per algorithm, from the same states.
fn rec_all_algorithms(
    what: &str,
    inputs: &RecInputs,
    state_cpu: &Tensor,
    state_gpu: &Tensor,
) -> Result<()> {
    for algorithm in ALGORITHMS {
        rec_step(what, algorithm, inputs, state_cpu, state_gpu, false)?;
    }
    Ok(())
}

fn model(batch: usize, seq_len: usize) -> RecSizes {
    RecSizes {
        batch,
        seq_len,
        hk: HK,
        hv: HV,
        dk: DK,
        dv: DV,
    }
}

#[test]
fn recurrence_decode_matches_cpu_at_model_shapes() -> Result<()> {
    for (i, batch) in [1, 8, 64].into_iter().enumerate() {
        for qkv in [DType::F32, DType::BF16] {
            rec_case(400 + i as u64, model(batch, 1), qkv, false, -1.0)?;
        }
    }
    rec_case(410, model(8, 1), DType::BF16, true, -1.0)?;
    Ok(())
}

#[test]
fn recurrence_prefill_matches_cpu_at_model_shapes() -> Result<()> {
    for (i, seq_len) in [3, 64, 200].into_iter().enumerate() {
        for qkv in [DType::F32, DType::BF16] {
            rec_case(500 + i as u64, model(1, seq_len), qkv, i == 0, -1.0)?;
        }
    }
    rec_case(510, model(2, 64), DType::BF16, false, -1.0)?;
    // Strong decay (trained gates reach far below -1).
    rec_case(511, model(1, 64), DType::F32, false, -30.0)?;
    // Many chunks (16, the last one partial): errors of the chunked state
    // carry must not grow along the sequence.
    for qkv in [DType::F32, DType::BF16] {
        rec_case(512, model(1, 1000), qkv, false, -1.0)?;
    }
    Ok(())
}

/// Around the chunked prefill's chunk size (64), with gates
/// from nearly no decay to decay far below f32's exp range.
#[test]
fn recurrence_prefill_chunk_boundaries_and_extreme_gates() -> Result<()> {
    let mut seed = 550;
    let small = |batch, seq_len| RecSizes {
        batch,
        seq_len,
        hk: 2,
        hv: 4,
        dk: DK,
        dv: DV,
    };
    for seq_len in [63, 64, 65, 127, 128, 129] {
        seed += 1;
        rec_case(seed, small(2, seq_len), DType::BF16, false, -1.0)?;
    }
    for g_low in [-1e-3, -5.0, -300.0] {
        seed += 1;
        rec_case(seed, small(1, 150), DType::F32, false, g_low)?;
    }
    Ok(())
}

#[test]
fn recurrence_matches_cpu_at_odd_shapes() -> Result<()> {
    let heads = [
        (2, 4, 12, 24),
        (2, 4, 12, 40),
        (1, 2, 200, 8),
        (3, 3, 65, 33),
    ];
    let cases = pairs(&heads, &[1, 5, 70]);
    sweep_seeds(
        600,
        cases,
        &ALL_DTYPES,
        |seed, ((hk, hv, dk, dv), seq_len), qkv| {
            let s = RecSizes {
                batch: 2,
                seq_len,
                hk,
                hv,
                dk,
                dv,
            };
            rec_case(seed, s, qkv, false, -1.0)
        },
    )
}

#[test]
fn recurrence_chained_calls_carry_the_state() -> Result<()> {
    let dev = gpu();
    for algorithm in ALGORITHMS {
        recurrence_chain(&dev, algorithm)?;
    }
    Ok(())
}

fn recurrence_chain(dev: &Device, algorithm: KdaPrefillAlgorithm) -> Result<()> {
    for (sizes, qkv) in [
        (model(2, 1), DType::BF16),
        (
            RecSizes {
                batch: 2,
                seq_len: 1,
                hk: 2,
                hv: 4,
                dk: 12,
                dv: 24,
            },
            DType::F32,
        ),
    ] {
        let mut rng = Rng::new(700);
        let mut state_cpu = rec_state(&mut rng, sizes, true)?;
        let mut state_gpu = to_gpu(&state_cpu, dev)?;
        let mut carried_tf32 = false;
        for (step, seq_len) in [64, 1, 1, 1, 3, 1].into_iter().enumerate() {
            let s = RecSizes { seq_len, ..sizes };
            let inputs = rec_inputs(&mut rng, s, qkv, -1.0)?;
            let what = format!(
                "recurrence chain dk={} {qkv:?} step {step} T={seq_len}",
                s.dk
            );
            let tensor_cores;
            (state_cpu, state_gpu, tensor_cores) = rec_step(
                &what,
                algorithm,
                &inputs,
                &state_cpu,
                &state_gpu,
                carried_tf32,
            )?;
            carried_tf32 |= tensor_cores;
        }
    }
    Ok(())
}

/// Decode at a batch that selects the row-streaming kernel, with the state
/// at an offset that is not 16-byte aligned (the tile kernel takes over).
#[test]
fn recurrence_decode_with_unaligned_state() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng::new(850);
    let s = model(8, 1);
    let inputs = rec_inputs(&mut rng, s, DType::BF16, -1.0)?;
    let len = s.batch * s.hv * s.dk * s.dv;
    let padded = random(&mut rng, &[len + 1], -0.5, 0.5, DType::F32)?;
    let state = padded
        .narrow(0, 1, len)?
        .reshape((s.batch, s.hv, s.dk, s.dv))?;
    let state_gpu = to_gpu(&padded, &dev)?
        .narrow(0, 1, len)?
        .reshape((s.batch, s.hv, s.dk, s.dv))?;
    assert_eq!(state_gpu.layout().start_offset(), 1);
    rec_all_algorithms(
        "recurrence decode, unaligned state",
        &inputs,
        &state,
        &state_gpu,
    )
}

#[test]
fn recurrence_widens_mixed_dtypes() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng::new(800);
    let s = RecSizes {
        batch: 1,
        seq_len: 4,
        hk: 2,
        hv: 4,
        dk: 12,
        dv: 24,
    };
    let mut inputs = rec_inputs(&mut rng, s, DType::BF16, -1.0)?;
    inputs.v = inputs.v.to_dtype(DType::F32)?;
    inputs.beta = inputs.beta.to_dtype(DType::BF16)?;
    let state = rec_state(&mut rng, s, false)?.to_dtype(DType::BF16)?;
    rec_all_algorithms(
        "recurrence mixed dtypes",
        &inputs,
        &state,
        &to_gpu(&state, &dev)?,
    )
}

// -------------------------------------------------- kda_recurrence_in_pool

/// Rows of the state pool in the pool tests (more than the largest batch).
const POOL_ROWS: usize = 80;

/// `batch` distinct slots of a pool of `rows`, scattered and out of order
/// (the start of a random permutation).
fn scattered_slots(rng: &mut Rng, batch: usize, rows: usize) -> Vec<u32> {
    let mut all: Vec<u32> = (0..rows as u32).collect();
    for i in (1..rows).rev() {
        let j = ((rng.uniform(0.0, 1.0) * (i + 1) as f32) as usize).min(i);
        all.swap(i, j);
    }
    all.truncate(batch);
    all
}

/// `slots` with every third entry from the second made a pad row
/// ([`PAD_SLOT`]): a decode batch padded to a graph's size.
fn with_pad_rows(mut slots: Vec<u32>) -> Vec<u32> {
    for slot in slots.iter_mut().skip(1).step_by(3) {
        *slot = PAD_SLOT;
    }
    slots
}

/// The slots of `slots` that are pool rows, and their positions in it.
fn real_slots(slots: &[u32]) -> (Vec<u32>, Vec<u32>) {
    slots
        .iter()
        .enumerate()
        .filter(|(_, &slot)| slot != PAD_SLOT)
        .map(|(row, &slot)| (slot, row as u32))
        .unzip()
}

/// One `kda_recurrence_in_pool_with` call (with the algorithm
/// `kda_recurrence` picks) on a pool of [`POOL_ROWS`] random
/// states, on both devices. The CUDA output and the rows at `slots` are
/// compared with the CPU reference under `rec_step`'s tolerances (`TIGHT`
/// for the sequential kernels, agreement up to summation order;
/// `CHUNKED_TF32` when the chunked tensor-core prefill runs, whose bound is
/// derived at that constant); every other row must be untouched bit for
/// bit; and the CUDA results must equal bit for bit those of
/// `kda_recurrence` on the gathered rows, which runs the same kernels.
/// With `pad`, some rows are pad rows ([`with_pad_rows`]): they start from a
/// zero state and write no row.
fn pool_case(seed: u64, s: RecSizes, qkv: DType, pad: bool) -> Result<()> {
    let dev = gpu();
    let mut rng = Rng::new(seed);
    let mut slots = scattered_slots(&mut rng, s.batch, POOL_ROWS);
    if pad {
        slots = with_pad_rows(slots);
    }
    let (real, real_rows) = real_slots(&slots);
    let pool = random(
        &mut rng,
        &[POOL_ROWS, s.hv, s.dk, s.dv],
        -0.5,
        0.5,
        DType::F32,
    )?;
    let inputs = rec_inputs(&mut rng, s, qkv, -1.0)?;
    let what = format!(
        "kda_recurrence_in_pool B={} T={} {qkv:?} slots {:?}",
        s.batch,
        s.seq_len,
        &slots[..slots.len().min(4)]
    );

    let algorithm = KdaPrefillAlgorithm::for_len(s.seq_len);
    let pool_cpu = pool.copy()?;
    // `kda_recurrence_in_pool_with` of `[q, k, v, g, beta]` on `states`, a
    // pool on `device`, at rows `slots`.
    let in_pool =
        |[q, k, v, g, beta]: [&Tensor; 5], states: &Tensor, device: &Device| -> Result<Tensor> {
            let pool = StatePool {
                states,
                slots: &Tensor::new(slots.as_slice(), device)?,
                host_slots: &slots,
            };
            kda_recurrence_in_pool_with(algorithm, q, k, v, g, beta, pool)
        };
    let o_cpu = in_pool(inputs.tokens(), &pool_cpu, &Device::Cpu)?;

    let [q, k, v, g, beta] = inputs
        .tokens()
        .map(|t| to_gpu(t, &dev).expect("copy to the GPU"));
    let pool_gpu = to_gpu(&pool, &dev)?;
    let (o_gathered, s_gathered) =
        kda_recurrence(&q, &k, &v, &g, &beta, &pool_rows(&pool_gpu, &slots)?)?;
    let o_gpu = in_pool([&q, &k, &v, &g, &beta], &pool_gpu, &dev)?;

    let tensor_cores = s.seq_len >= 64;
    let tol = if tensor_cores { CHUNKED_TF32 } else { TIGHT };
    compare(&format!("{what} output"), &o_gpu, &o_cpu, tol)?;
    compare_pool_rows(&what, &pool_gpu, &pool_cpu, &pool, &real, tol)?;
    identical(
        &format!("{what} output vs kda_recurrence"),
        &o_gpu,
        &o_gathered.to_device(&Device::Cpu)?,
    )?;
    identical(
        &format!("{what} state rows vs kda_recurrence"),
        &pool_rows(&pool_gpu, &real)?,
        &pool_rows(&s_gathered.to_device(&Device::Cpu)?, &real_rows)?,
    )?;
    Ok(())
}

/// The rows `real` of a pool updated on the GPU (`pool_gpu`) within `tol` of
/// those of the same update on the CPU (`pool_cpu`), and every other row
/// equal bit for bit to the pool before the update (`before`).
fn compare_pool_rows(
    what: &str,
    pool_gpu: &Tensor,
    pool_cpu: &Tensor,
    before: &Tensor,
    real: &[u32],
    tol: Tol,
) -> Result<()> {
    compare(
        &format!("{what} state rows"),
        &pool_rows(pool_gpu, real)?,
        &pool_rows(pool_cpu, real)?,
        tol,
    )?;
    let others: Vec<u32> = (0..POOL_ROWS as u32)
        .filter(|row| !real.contains(row))
        .collect();
    identical(
        &format!("{what} other rows"),
        &pool_rows(pool_gpu, &others)?,
        &pool_rows(before, &others)?,
    )
}

/// Decode (T = 1: the `rows` kernel from B * Hv >= 128, i.e. B >= 4 here,
/// else `tiles`) and a short prefill (T = 3: `tiles`) in the pool.
#[test]
fn recurrence_in_pool_matches_cpu_at_model_shapes() -> Result<()> {
    let cases = pairs(&[1, 8, 64], &[1, 3]);
    sweep_seeds(900, cases, &F32_BF16, |seed, (batch, seq_len), qkv| {
        pool_case(seed, model(batch, seq_len), qkv, false)
    })
}

/// A prefill of 64 tokens continuing pooled states: the chunked kernels.
#[test]
fn recurrence_in_pool_chunked_prefill() -> Result<()> {
    pool_case(950, model(8, 64), DType::BF16, false)
}

/// Odd head sizes (the `tiles` kernel with partial tiles and rows) in the pool.
#[test]
fn recurrence_in_pool_matches_cpu_at_odd_shapes() -> Result<()> {
    let s = |seq_len| RecSizes {
        batch: 5,
        seq_len,
        hk: 3,
        hv: 3,
        dk: 65,
        dv: 33,
    };
    pool_case(960, s(1), DType::F16, false)?;
    pool_case(961, s(5), DType::F32, false)
}

/// Pad rows among a batch's sequences (a decode batch padded to a graph's
/// size, and a prompt for the other kernels): zero initial states, no row
/// written, the real rows as without them. Decode at B = 8 (`rows`) and 3
/// (`tiles`), a 64-token prefill (the chunked kernels).
#[test]
fn recurrence_in_pool_pad_rows() -> Result<()> {
    pool_case(970, model(8, 1), DType::BF16, true)?;
    pool_case(971, model(3, 1), DType::BF16, true)?;
    pool_case(972, model(8, 64), DType::BF16, true)?;
    pool_case(973, model(4, 3), DType::F32, true)
}

// ------------------------------------------------------------ attn_res_mix

fn attn_res_case(
    seed: u64,
    tokens: usize,
    hidden: usize,
    count: usize,
    dtype: DType,
    gate: Option<f32>,
) -> Result<()> {
    let dev = gpu();
    let mut rng = Rng::new(seed);
    let sources = (0..count)
        .map(|i| {
            let scale = 0.5 + i as f32;
            random(&mut rng, &[tokens, hidden], -scale, scale, dtype)
        })
        .collect::<Result<Vec<_>>>()?;
    let query = random(&mut rng, &[hidden], -0.1, 0.1, DType::F32)?;
    let scale = random(&mut rng, &[hidden], 0.5, 1.5, DType::F32)?;
    let cpu = attn_res_mix(&sources, &query, gate, 1e-6)?;
    let (sources_gpu, query_gpu) = (to_gpu_all(&sources)?, to_gpu(&query, &dev)?);
    let cuda = attn_res_mix(&sources_gpu, &query_gpu, gate, 1e-6)?;
    let what = format!("attn_res_mix N={tokens} H={hidden} S={count} {dtype:?} gate={gate:?}");
    compare(&what, &cuda, &cpu, output_tol(dtype))?;
    if gate == Some(0.0) {
        identical(&format!("{what} is x"), &cuda, &sources[count - 1])?;
    }
    // With the input norm: the same mix, and the norm kernel's values of it
    // bit for bit (one kernel where the vector path runs, two otherwise);
    // the CPU's norm of its own mix within a rounding step.
    let scale_gpu = to_gpu(&scale, &dev)?;
    let (mix, normed) = attn_res_mix_norm(&sources_gpu, &query_gpu, gate, 1e-6, &scale_gpu, 1e-5)?;
    identical(&format!("{what} mix beside its norm"), &mix, &cuda)?;
    let separate = offset_rms_norm(&cuda, &scale_gpu, 1e-5)?;
    identical(&format!("{what} norm"), &normed, &separate)?;
    let (_, cpu_normed) = attn_res_mix_norm(&sources, &query, gate, 1e-6, &scale, 1e-5)?;
    compare(
        &format!("{what} norm"),
        &normed,
        &cpu_normed,
        output_tol(dtype),
    )?;
    Ok(())
}

#[test]
fn attn_res_matches_cpu_at_model_shapes() -> Result<()> {
    let cases = pairs(&pairs(&[1, 64, 200], &[2, 3, 6]), &F32_BF16);
    let gates = [None, Some(0.0), Some(0.7)];
    sweep_seeds(
        900,
        cases,
        &gates,
        |seed, ((tokens, count), dtype), gate| {
            attn_res_case(seed, tokens, HIDDEN, count, dtype, gate)
        },
    )?;
    attn_res_case(990, 8, HIDDEN, 4, DType::F16, Some(-1.3))?;
    // More than 8 sources: those past the 4th kept in shared memory (over
    // 48 KiB of it for 12 f32 ones), or, where they don't fit (28 f32 rows
    // of 4096), read again in every pass.
    attn_res_case(991, 64, HIDDEN, 11, DType::BF16, Some(0.7))?;
    attn_res_case(992, 64, HIDDEN, 16, DType::F16, None)?;
    attn_res_case(993, 64, HIDDEN, 20, DType::BF16, Some(0.7))?;
    attn_res_case(994, 64, HIDDEN, 12, DType::F32, None)?;
    attn_res_case(995, 3, 2 * HIDDEN, 32, DType::F32, Some(0.7))?;
    Ok(())
}

#[test]
fn attn_res_matches_cpu_at_odd_shapes() -> Result<()> {
    let cases = pairs(&[24, 300], &[1, 3, 32]);
    sweep_seeds(1000, cases, &ALL_DTYPES, |seed, (hidden, count), dtype| {
        attn_res_case(seed, 5, hidden, count, dtype, Some(0.4))?;
        attn_res_case(seed, 5, hidden, count, dtype, None)
    })
}

#[test]
fn attn_res_mixed_dtypes_and_limits() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng::new(1100);
    let mut sources = vec![
        random(&mut rng, &[6, 64], -1.0, 1.0, DType::F32)?,
        random(&mut rng, &[6, 64], -2.0, 2.0, DType::F16)?,
        random(&mut rng, &[6, 64], -3.0, 3.0, DType::BF16)?,
    ];
    let query = random(&mut rng, &[64], -0.3, 0.3, DType::BF16)?;
    let cpu = attn_res_mix(&sources, &query, Some(0.5), 1e-6)?;
    let cuda = attn_res_mix(
        &to_gpu_all(&sources)?,
        &to_gpu(&query, &dev)?,
        Some(0.5),
        1e-6,
    )?;
    compare(
        "attn_res_mix mixed dtypes",
        &cuda,
        &cpu,
        output_tol(DType::BF16),
    )?;

    // More sources than the CUDA kernel takes: a clear error.
    let x = sources.pop().unwrap();
    let many = vec![to_gpu(&x, &dev)?; 33];
    match attn_res_mix(&many, &to_gpu(&query, &dev)?, None, 1e-6) {
        Err(KernelError::InvalidArgument { arg: "sources", .. }) => {}
        other => panic!("expected an InvalidArgument error, got {other:?}"),
    }
    Ok(())
}

// ---------------------------------------------------------- gated_rms_norm

/// `gated_rms_norm` into `dtype` of `x` and `z` of their own dtypes (each
/// `dtype` or f32).
fn norm_case(
    seed: u64,
    rows: usize,
    width: usize,
    [x_dtype, z_dtype, dtype]: [DType; 3],
) -> Result<()> {
    let mut rng = Rng::new(seed);
    let x = random(&mut rng, &[rows, width], -3.0, 3.0, x_dtype)?;
    let z = random(&mut rng, &[rows, width], -4.0, 4.0, z_dtype)?;
    let weight = random(&mut rng, &[width], 0.5, 1.5, dtype)?;
    let what =
        format!("gated_rms_norm rows={rows} D={width} x={x_dtype:?} z={z_dtype:?} {dtype:?}");
    compare_on_both(
        &what,
        [&x, &z, &weight],
        output_tol(dtype),
        |[x, z, weight]| gated_rms_norm(x, z, weight, 1e-6, dtype),
    )?;
    Ok(())
}

#[test]
fn norm_matches_cpu_at_model_shapes() -> Result<()> {
    sweep_seeds(1200, [1, 8, 64, 200], &ALL_DTYPES, |seed, tokens, dtype| {
        norm_case(seed, tokens * HV, DV, [dtype; 3])
    })?;
    norm_case(1250, 64 * HV, DV, [DType::BF16, DType::F32, DType::BF16])?;
    // The KDA layer's call: the recurrence's f32 output, rounded as it is read.
    norm_case(1260, 64 * HV, DV, [DType::F32, DType::BF16, DType::BF16])?;
    norm_case(1270, HV, DV, [DType::F32, DType::F32, DType::F16])?;
    Ok(())
}

#[test]
fn norm_matches_cpu_at_odd_shapes_and_layouts() -> Result<()> {
    let widths = [1, 24, 1000, HIDDEN];
    sweep_seeds(1300, widths, &F32_BF16, |seed, width, dtype| {
        norm_case(seed, 9, width, [dtype; 3])
    })?;
    // Views: a row range (non-zero start offset) and a column range
    // (non-contiguous).
    let dev = gpu();
    let mut rng = Rng::new(1400);
    let big_x = random(&mut rng, &[10, 48], -3.0, 3.0, DType::BF16)?;
    let big_z = random(&mut rng, &[10, 48], -3.0, 3.0, DType::BF16)?;
    let weight = random(&mut rng, &[24], 0.5, 1.5, DType::BF16)?;
    let x = big_x.narrow(0, 3, 5)?.narrow(1, 24, 24)?;
    let z = big_z.narrow(0, 2, 5)?.narrow(1, 0, 24)?;
    let cpu = gated_rms_norm(&x, &z, &weight, 1e-5, DType::BF16)?;
    let (gx, gz) = (to_gpu(&big_x, &dev)?, to_gpu(&big_z, &dev)?);
    let cuda = gated_rms_norm(
        &gx.narrow(0, 3, 5)?.narrow(1, 24, 24)?,
        &gz.narrow(0, 2, 5)?.narrow(1, 0, 24)?,
        &to_gpu(&weight, &dev)?,
        1e-5,
        DType::BF16,
    )?;
    compare("gated_rms_norm views", &cuda, &cpu, output_tol(DType::BF16))?;
    // A contiguous view with a non-zero start offset.
    let rows = to_gpu(&big_x, &dev)?.narrow(0, 4, 6)?;
    let zs = to_gpu(&big_z, &dev)?.narrow(0, 1, 6)?;
    let w48 = random(&mut rng, &[48], 0.5, 1.5, DType::F32)?;
    let cpu = gated_rms_norm(
        &big_x.narrow(0, 4, 6)?,
        &big_z.narrow(0, 1, 6)?,
        &w48,
        1e-5,
        DType::BF16,
    )?;
    let cuda = gated_rms_norm(&rows, &zs, &to_gpu(&w48, &dev)?, 1e-5, DType::BF16)?;
    compare(
        "gated_rms_norm offset view",
        &cuda,
        &cpu,
        output_tol(DType::BF16),
    )?;
    Ok(())
}

// --------------------------------------------------------- offset_rms_norm

/// `f32`'s unit roundoff, 2^-24.
const F32_U: f64 = 1.0 / 16_777_216.0;

/// Tolerance of `offset_rms_norm` at width `width`, relative to each value.
///
/// Both devices square each value in f32 (the same squares) and then run the
/// same f32 operations (times `1/D`, `+ eps`, sqrt, division, product); only
/// the order of the sum of squares differs. A sum of `D` non-negative terms
/// is within `(D - 1)u` of the exact sum in any order, so the two sums differ
/// by at most `2(D - 1)u` relative, and `times 1/D` and `+ eps` add one
/// rounding (u) on each side: `2(D - 1)u + 4u` before the root, which halves
/// it and adds its own rounding on each side (2u); the division and the
/// product add 2u each: `(D + 7)u`, here `(D + 8)u`. Every element of a row
/// carries its row's error, so the bound is per element (typical
/// differences are a few ulp). Half-precision outputs add one step of their
/// dtype (a rounding flip: at most 2^-7 of the value for bf16, 2^-10 for
/// f16) and, for f16, its subnormal step 2^-24 near zero (`atol` is scaled by
/// the largest value, which is above 1 here).
fn offset_norm_tol(width: usize, dtype: DType) -> Tol {
    let f32_part = (width as f64 + 8.0) * F32_U;
    match dtype {
        DType::BF16 => Tol {
            atol: 0.0,
            rtol: 1.0 / 128.0 + f32_part,
        },
        DType::F16 => Tol {
            atol: 1e-7,
            rtol: 1.0 / 1024.0 + f32_part,
        },
        _ => Tol {
            atol: 0.0,
            rtol: f32_part,
        },
    }
}

/// `offset_rms_norm` of `view` of `base` on the CPU and on the GPU (see
/// [`view_on_both`]).
fn offset_norm_check(
    what: &str,
    base: &Tensor,
    view: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
    scale: &Tensor,
) -> Result<()> {
    let width = scale.dims()[0];
    let (x, x_gpu) = view_on_both(base, view)?;
    let cpu = offset_rms_norm(&x, scale, 1e-6)?;
    let cuda = offset_rms_norm(&x_gpu, &to_gpu(scale, &gpu())?, 1e-6)?;
    compare(what, &cuda, &cpu, offset_norm_tol(width, x.dtype()))?;
    Ok(())
}

fn offset_norm_case(seed: u64, dims: &[usize], dtype: DType) -> Result<()> {
    let mut rng = Rng::new(seed);
    let width = dims[dims.len() - 1];
    let x = random(&mut rng, dims, -3.0, 3.0, dtype)?;
    let scale = random(&mut rng, &[width], 0.5, 1.5, DType::F32)?;
    let what = format!("offset_rms_norm {dims:?} {dtype:?}");
    offset_norm_check(&what, &x, |x| Ok(x.clone()), &scale)
}

#[test]
fn offset_norm_matches_cpu_at_model_shapes() -> Result<()> {
    sweep_seeds(1600, [1, 7, 300], &ALL_DTYPES, |seed, rows, dtype| {
        // Layer and final norms: [B, T, hidden].
        offset_norm_case(seed, &[1, rows, HIDDEN], dtype)?;
        // q/k norms: [B, T, heads, head_dim].
        offset_norm_case(seed, &[1, rows, HEADS, HEAD_DIM], dtype)
    })
}

/// The residual add and norm of a decoder layer, at its shapes: the sum
/// bit for bit (one rounding of an f32 addition), the norm as above.
#[test]
fn add_offset_norm_matches_cpu() -> Result<()> {
    sweep(2800, [1, 7, 300], &ALL_DTYPES, |rng, rows, dtype| {
        let x = random(rng, &[rows, HIDDEN], -3.0, 3.0, dtype)?;
        let delta = random(rng, &[rows, HIDDEN], -1.0, 1.0, dtype)?;
        let scale = random(rng, &[HIDDEN], 0.5, 1.5, DType::F32)?;
        let ((sum_cuda, normed_cuda), (sum_cpu, normed_cpu)) =
            on_both([&x, &delta, &scale], |[x, delta, scale]| {
                add_offset_rms_norm(x, delta, scale, 1e-6)
            })?;
        let what = format!("add_offset_rms_norm [{rows}, {HIDDEN}] {dtype:?}");
        identical(&format!("{what} sum"), &sum_cuda, &sum_cpu)?;
        let tol = offset_norm_tol(HIDDEN, dtype);
        compare(&what, &normed_cuda, &normed_cpu, tol).map(drop)
    })
}

/// The residual norm and a decode step's projection of it in one call: bit
/// for bit the two CUDA ops in turn (one kernel up to 8 rows of a width up
/// to 2048; the two ops for 9 rows, a 4096-wide row and 8 f32 rows of 2048,
/// whose normed rows exceed the kernel's shared memory), within a rounding
/// step of the CPU's.
#[test]
fn add_offset_norm_matmul_matches_the_separate_ops() -> Result<()> {
    let cases = [
        (1, HIDDEN, 1160),
        (4, HIDDEN, 1163),
        (8, HIDDEN, 64),
        (3, 24, 40),
        (9, HIDDEN, 32),
        (1, 2 * HIDDEN, 16),
    ];
    sweep(
        2900,
        cases,
        &ALL_DTYPES,
        |rng, (rows, width, out_dim), dtype| {
            let x = random(rng, &[rows, width], -3.0, 3.0, dtype)?;
            let delta = random(rng, &[rows, width], -1.0, 1.0, dtype)?;
            let scale = random(rng, &[width], 0.5, 1.5, DType::F32)?;
            let weight = random(rng, &[out_dim, width], -0.1, 0.1, dtype)?;
            let ((sum, normed, y), (_, normed_cpu, y_cpu)) =
                on_both([&x, &delta, &scale, &weight], |[x, delta, scale, weight]| {
                    add_offset_rms_norm_matmul(x, delta, scale, 1e-6, weight)
                })?;
            let dev = gpu();
            let (x, delta) = (to_gpu(&x, &dev)?, to_gpu(&delta, &dev)?);
            let (scale, weight) = (to_gpu(&scale, &dev)?, to_gpu(&weight, &dev)?);
            let (separate_sum, separate_normed) = add_offset_rms_norm(&x, &delta, &scale, 1e-6)?;
            let separate_y = decode_matmul(&separate_normed, &weight)?;
            let what =
                format!("add_offset_rms_norm_matmul [{rows}, {width}] x {out_dim} {dtype:?}");
            identical(&format!("{what} sum"), &sum, &separate_sum)?;
            identical(&format!("{what} normed"), &normed, &separate_normed)?;
            identical(&format!("{what} projection"), &y, &separate_y)?;
            compare(&what, &normed, &normed_cpu, offset_norm_tol(width, dtype))?;
            within(&what, &y, &y_cpu, output_tol(dtype)).map(drop)
        },
    )
}

#[test]
fn offset_norm_matches_cpu_at_odd_widths_and_layouts() -> Result<()> {
    // One warp per row up to 256, then 2, 4 and 8 warps; 8192 is the widest.
    let widths = [1, 24, 255, 257, 513, 1000, 1025, 8192];
    let cases = pairs(&widths, &F32_BF16);
    sweep_seeds(1700, cases, &[1, 7, 300], |seed, (width, dtype), rows| {
        offset_norm_case(seed, &[rows, width], dtype)
    })?;
    // A transposed view ([B, T, H, D] -> [B, H, T, D], non-contiguous) and a
    // row range (contiguous, non-zero start offset).
    let mut rng = Rng::new(1800);
    let x = random(&mut rng, &[2, 5, HEADS, HEAD_DIM], -3.0, 3.0, DType::BF16)?;
    let scale = random(&mut rng, &[HEAD_DIM], 0.5, 1.5, DType::F32)?;
    offset_norm_check(
        "offset_rms_norm transposed view",
        &x,
        |x| x.transpose(1, 2),
        &scale,
    )?;
    offset_norm_check(
        "offset_rms_norm row range",
        &x,
        |x| x.reshape((10 * HEADS, HEAD_DIM))?.narrow(0, 3, 50),
        &scale,
    )?;
    Ok(())
}

// --------------------------------------------------------------- moe_route

/// CPU probabilities whose order the two devices may see differently: the
/// exponentials differ by at most one ulp (double-precision `exp` rounded
/// once on the GPU, glibc's `expf`, within 0.502 ulp, on the CPU) and the
/// division by the (differently summed) total rounds each side once, so a
/// pair can compare differently only when its CPU probabilities are within
/// about 3 ulp; 8 ulp (relative 2^-20) leaves a margin.
const NEAR_TIE: f64 = 8.0 / 8_388_608.0;

/// Tolerance of the routing weights, relative to each weight.
///
/// f32: the probabilities differ by one ulp of the exponential (2u), the
/// order of the softmax sum of `E` terms (at most `(E - 1)u` relative on the
/// CPU's sequential side, at most about 20u on the GPU's lanes-then-warps
/// side) and the rounding of the division on each side (2u); renormalised
/// weights divide by a sum of the same `k` values in the same order, which
/// cancels the softmax sum. `(E + 32)u` bounds both. Half-precision weights
/// add one step of their dtype (a rounding flip); f16 also its subnormal step
/// 2^-24 (absolute).
fn route_tol(experts: usize, weight_dtype: DType) -> (f64, f64) {
    let f32_part = (experts as f64 + 32.0) * F32_U;
    match weight_dtype {
        DType::BF16 => (0.0, 1.0 / 128.0 + f32_part),
        DType::F16 => (F32_U, 1.0 / 1024.0 + f32_part),
        _ => (0.0, f32_part),
    }
}

/// `f32` values of a `[rows, cols]` tensor (any device), row by row.
fn rows_f32(tensor: &Tensor) -> Result<Vec<Vec<f32>>> {
    Ok(tensor
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .to_vec2::<f32>()?)
}

/// Routes `logits` (a CPU tensor) on both devices and compares.
///
/// Ids must be identical, except in a row where two of its `k + 1` most
/// probable experts are a near tie: different `x - max` (so not an exact tie
/// on either device: equal logits give bit-identical probabilities on both)
/// with CPU probabilities within [`NEAR_TIE`]. In such a row the GPU's
/// expert at each place must have a CPU probability within `NEAR_TIE` of
/// the CPU's expert's there. Weights are compared place by place. Returns
/// the number of rows with a near tie whose ids differ.
fn route_check(
    what: &str,
    logits: &Tensor,
    top_k: usize,
    renormalize: bool,
    weight_dtype: DType,
) -> Result<usize> {
    let [rows, experts] = *logits.dims() else {
        unreachable!()
    };
    let (cpu_w, cpu_ids) = moe_route(logits, top_k, renormalize, weight_dtype)?;
    let (cuda_w, cuda_ids) = moe_route(&to_gpu(logits, &gpu())?, top_k, renormalize, weight_dtype)?;
    for (name, tensor, dtype) in [
        ("weights", &cuda_w, DType::F32),
        ("ids", &cuda_ids, DType::U32),
    ] {
        assert!(tensor.device().is_cuda(), "{what}: {name} not on the GPU");
        assert_eq!(tensor.dims(), &[rows, top_k], "{what}: {name} shape");
        assert_eq!(tensor.dtype(), dtype, "{what}: {name} dtype");
    }
    // Every CPU probability, by decreasing value and by expert, and
    // x - max, to tell near ties.
    let (all_w, all_ids) = moe_route(logits, experts, false, DType::F32)?;
    let (all_w, all_ids): (Vec<Vec<f32>>, Vec<Vec<u32>>) = (rows_f32(&all_w)?, all_ids.to_vec2()?);
    let logit_rows = rows_f32(logits)?;
    let (cpu_w, cuda_w) = (rows_f32(&cpu_w)?, rows_f32(&cuda_w)?);
    let cpu_ids: Vec<Vec<u32>> = cpu_ids.to_vec2()?;
    let cuda_ids: Vec<Vec<u32>> = cuda_ids.to_device(&Device::Cpu)?.to_vec2()?;
    let (atol, rtol) = route_tol(experts, weight_dtype);
    let (mut near_tie_rows, mut differing, mut worst) = (0, 0, 0f64);
    for row in 0..rows {
        let sorted = &all_ids[row];
        let mut prob = vec![0f32; experts];
        for (&w, &id) in all_w[row].iter().zip(sorted) {
            prob[id as usize] = w;
        }
        let logit_row = &logit_rows[row];
        let max = logit_row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let near = |a: u32, b: u32| {
            let (pa, pb) = (f64::from(prob[a as usize]), f64::from(prob[b as usize]));
            let (da, db) = (logit_row[a as usize] - max, logit_row[b as usize] - max);
            da != db && (pa - pb).abs() <= NEAR_TIE * pa.max(pb)
        };
        let candidates = &sorted[..(top_k + 1).min(experts)];
        let has_near_tie = candidates.windows(2).any(|pair| near(pair[0], pair[1]));
        if cuda_ids[row] != cpu_ids[row] {
            assert!(
                has_near_tie,
                "{what}: row {row}: ids differ without a near tie: cuda {:?}, cpu {:?}",
                cuda_ids[row], cpu_ids[row]
            );
            for (&g, &c) in cuda_ids[row].iter().zip(&cpu_ids[row]) {
                let (pg, pc) = (f64::from(prob[g as usize]), f64::from(prob[c as usize]));
                assert!(
                    (pg - pc).abs() <= NEAR_TIE * pg.max(pc),
                    "{what}: row {row}: expert {g} (cpu p {pg}) in place of {c} (cpu p {pc})"
                );
            }
            near_tie_rows += 1;
        }
        for (place, (&g, &w)) in cuda_w[row].iter().zip(&cpu_w[row]).enumerate() {
            if g.to_bits() != w.to_bits() {
                differing += 1;
            }
            let error = (f64::from(g) - f64::from(w)).abs();
            let allowed = atol + rtol * f64::from(w).abs();
            assert!(
                error <= allowed || (g.is_nan() && w.is_nan()),
                "{what}: row {row} place {place}: cuda {g}, cpu {w} (error {error:e}, allowed {allowed:e})"
            );
            if error.is_finite() && error > worst {
                worst = error;
            }
        }
    }
    eprintln!(
        "{what}: {rows} rows, {near_tie_rows} with near-tie id differences, {differing} weights differ, max error {worst:e}"
    );
    if weight_dtype != DType::F32 {
        // Rounding flips are rare; a systematic error would touch many.
        assert!(
            differing <= rows * top_k / 50 + 2,
            "{what}: {differing} half-precision weights differ"
        );
    }
    Ok(near_tie_rows)
}

#[test]
fn route_matches_cpu_at_model_shapes() -> Result<()> {
    let (mut routed_rows, mut near_tie_rows) = (0, 0);
    let logits_dtypes = [DType::F32, DType::BF16];
    sweep(
        1900,
        [1, 7, 300],
        &logits_dtypes,
        |rng, rows, logits_dtype| {
            let logits = random(rng, &[rows, EXPERTS], -4.0, 4.0, logits_dtype)?;
            for renormalize in [true, false] {
                for weight_dtype in [DType::F32, DType::BF16] {
                    let what = format!(
                    "moe_route N={rows} E={EXPERTS} k={TOP_K} {logits_dtype:?} renorm={renormalize} w={weight_dtype:?}"
                );
                    near_tie_rows += route_check(&what, &logits, TOP_K, renormalize, weight_dtype)?;
                    routed_rows += rows;
                }
            }
            Ok(())
        },
    )?;
    // A near tie needs two of the 9 largest logits within a few f32 ulp of
    // each other, which these draws make rare (bf16 logits tie exactly
    // instead, which must not count).
    assert!(
        near_tie_rows <= routed_rows / 100,
        "{near_tie_rows} of {routed_rows} rows with near-tie id differences"
    );
    Ok(())
}

/// Logits on a coarse grid (multiples of 1/4 in [-4, 4]): most rows have
/// exact ties among their largest probabilities, so the GPU replays
/// PyTorch's selection; distinct logits are at least 1/4 apart (a factor
/// e^(1/4) in probability), far from any near tie, so ids must be
/// identical. Covers PyTorch's heap select (`64 k <= E`), introselect with
/// insertion sort, introselect with introsort (`k - 1 > 16`) and `k = E`,
/// plus a row of equal logits and a row with a NaN.
#[test]
fn route_breaks_exact_ties_like_cpu() -> Result<()> {
    let cases = [
        (EXPERTS, TOP_K),
        (EXPERTS, 1),
        (EXPERTS, 2),
        (EXPERTS, 40),
        (512, 8),
        (512, 512),
        (16, 16),
        (7, 3),
    ];
    sweep(
        2000,
        cases,
        &F32_BF16,
        |rng, (experts, top_k), logits_dtype| {
            let rows = 300;
            let mut values: Vec<f32> = rng
                .uniform_vec(rows * experts, -4.0, 4.0)
                .into_iter()
                .map(|v| (v * 4.0).round() / 4.0)
                .collect();
            values[..experts].fill(0.5);
            values[experts + 3] = f32::NAN;
            let logits = tensor(values, &[rows, experts])?.to_dtype(logits_dtype)?;
            let what = format!("moe_route ties E={experts} k={top_k} {logits_dtype:?}");
            let near_tie_rows = route_check(&what, &logits, top_k, true, DType::F32)?;
            assert_eq!(near_tie_rows, 0, "{what}");
            Ok(())
        },
    )
}

#[test]
fn route_matches_cpu_at_odd_sizes() -> Result<()> {
    let mut seed = 2100;
    for experts in [1, 7, 33, 300, 512] {
        for top_k in [1, 3, experts] {
            if top_k > experts {
                continue;
            }
            seed += 1;
            let mut rng = Rng::new(seed);
            let logits = random(&mut rng, &[7, experts], -6.0, 6.0, DType::F16)?;
            let what = format!("moe_route E={experts} k={top_k} F16");
            route_check(&what, &logits, top_k, seed % 2 == 0, DType::F16)?;
        }
    }
    // More experts than the kernel's block takes: a clear error.
    let logits = Tensor::zeros((2, 513), DType::F32, &gpu())?;
    match moe_route(&logits, 8, true, DType::F32) {
        Err(KernelError::InvalidArgument {
            arg: "router_logits",
            ..
        }) => {}
        other => panic!("expected an InvalidArgument error, got {other:?}"),
    }
    Ok(())
}

/// The KDA output path chained on one device: gate, conv, recurrence and
/// norm of a small layer, GPU against CPU.
#[test]
fn kda_layer_pipeline_matches_cpu() -> Result<()> {
    let dev = gpu();
    let mut rng = Rng::new(1500);
    let (b, t, hk, hv, dk, dv, kc) = (2, 9, 2, 4, 12, 24, 4);
    let conv_dim = 2 * hk * dk + hv * dv;
    let mixed = random(&mut rng, &[b, t, conv_dim], -2.0, 2.0, DType::BF16)?;
    let conv_w = random(&mut rng, &[conv_dim, kc], -0.5, 0.5, DType::BF16)?;
    let conv_state = Tensor::zeros((b, conv_dim, kc), DType::BF16, &Device::Cpu)?;
    let raw = random(&mut rng, &[b * t, hv * dk], -3.0, 3.0, DType::BF16)?;
    let a_log = random(&mut rng, &[hv], -1.0, 1.0, DType::F32)?;
    let dt_bias = random(&mut rng, &[hv * dk], -1.0, 1.0, DType::F32)?;
    let beta = random(&mut rng, &[b, t, hv], 0.0, 1.0, DType::F32)?;
    let z = random(&mut rng, &[b * t * hv, dv], -3.0, 3.0, DType::BF16)?;
    let norm_w = random(&mut rng, &[dv], 0.5, 1.5, DType::BF16)?;

    let run = |device: &Device| -> Result<Tensor> {
        let g = kda_gate(
            &raw.to_device(device)?,
            &a_log.to_device(device)?,
            &dt_bias.to_device(device)?,
            hv,
            Some(-5.0),
        )?
        .reshape((b, t, hv, dk))?;
        let (act, _) = causal_conv1d(
            &mixed.to_device(device)?,
            &conv_w.to_device(device)?,
            &conv_state.to_device(device)?,
        )?;
        let q = act.narrow(2, 0, hk * dk)?.reshape((b, t, hk, dk))?;
        let k = act.narrow(2, hk * dk, hk * dk)?.reshape((b, t, hk, dk))?;
        let v = act
            .narrow(2, 2 * hk * dk, hv * dv)?
            .reshape((b, t, hv, dv))?;
        let state = Tensor::zeros((b, hv, dk, dv), DType::F32, device)?;
        let (o, _) = kda_recurrence(&q, &k, &v, &g, &beta.to_device(device)?, &state)?;
        let o = o.reshape((b * t * hv, dv))?;
        gated_rms_norm(
            &o,
            &z.to_device(device)?,
            &norm_w.to_device(device)?,
            1e-6,
            DType::BF16,
        )
    };
    let cpu = run(&Device::Cpu)?;
    let cuda = run(&dev)?;
    compare(
        "kda layer pipeline",
        &cuda,
        &cpu,
        Tol {
            atol: 1e-2,
            rtol: 2e-2,
        },
    )?;
    Ok(())
}

// ------------------------------------------------- swiglu, add_moe_output

/// Expert width of the shared expert and of each routed expert.
const MOE_INTERMEDIATE: usize = 512;

#[test]
fn swiglu_matches_cpu_at_model_shapes() -> Result<()> {
    sweep(2100, [1, 8, 300], &ALL_DTYPES, |rng, rows, dtype| {
        let gate_up = random(rng, &[rows, 2 * MOE_INTERMEDIATE], -6.0, 6.0, dtype)?;
        compare_on_both(
            &format!("swiglu [{rows}, {}] {dtype:?}", 2 * MOE_INTERMEDIATE),
            [&gate_up],
            output_tol(dtype),
            |[gate_up]| swiglu(gate_up),
        )
        .map(drop)
    })?;
    // Rank 3 and an odd width.
    let mut rng = Rng::new(2200);
    let gate_up = random(&mut rng, &[2, 3, 2 * 37], -6.0, 6.0, DType::BF16)?;
    compare_on_both(
        "swiglu [2, 3, 74] bf16",
        [&gate_up],
        output_tol(DType::BF16),
        |[gate_up]| swiglu(gate_up),
    )?;
    Ok(())
}

#[test]
fn add_moe_output_matches_cpu_at_model_shapes() -> Result<()> {
    sweep(2300, [1, 8, 300], &ALL_DTYPES, |rng, rows, dtype| {
        let residual = random(rng, &[rows, HIDDEN], -8.0, 8.0, dtype)?;
        let routed = random(rng, &[rows, HIDDEN], -2.0, 2.0, dtype)?;
        let shared = random(rng, &[rows, HIDDEN], -2.0, 2.0, dtype)?;
        let logit = random(rng, &[rows, 1], -6.0, 6.0, dtype)?;
        compare_on_both(
            &format!("add_moe_output [{rows}, {HIDDEN}] {dtype:?}"),
            [&residual, &routed, &shared, &logit],
            output_tol(dtype),
            |[residual, routed, shared, logit]| add_moe_output(residual, routed, shared, logit),
        )
        .map(drop)
    })
}

/// The kernels that read columns of a stacked projection's output in place
/// (rows at a stride, at more than one token): the shared expert's gate | up
/// (`swiglu`), the router's logits (`moe_route`), the shared expert gate's
/// logit (`add_moe_output`) and a KDA layer's b (`kda_beta`), each on views
/// of one wide `[64, columns]` output, against the CPU reference on the same
/// views; the router also against its own run on a contiguous copy.
#[test]
fn stacked_projection_views_match_cpu() -> Result<()> {
    const ROWS: usize = 64;
    let gate_up_width = 2 * MOE_INTERMEDIATE;
    // shared gate | up, router, shared expert gate, and 3 columns of another part
    let columns = gate_up_width + EXPERTS + 1 + 3;
    sweep(2350, [ROWS], &F32_BF16, |rng, rows, dtype| {
        let wide = random(rng, &[rows, columns], -4.0, 4.0, dtype)?;
        let view_of =
            |start: usize, width: usize| view_on_both(&wide, move |t| t.narrow(1, start, width));
        let (gate_up, gate_up_gpu) = view_of(0, gate_up_width)?;
        let (router, router_gpu) = view_of(gate_up_width, EXPERTS)?;
        let (logit, logit_gpu) = view_of(gate_up_width + EXPERTS, 1)?;
        for (name, view) in [
            ("gate_up", &gate_up_gpu),
            ("router", &router_gpu),
            ("logit", &logit_gpu),
        ] {
            assert!(!view.is_contiguous(), "{name}: the view is contiguous");
        }
        let tol = output_tol(dtype);
        compare(
            &format!("swiglu of a view [{rows}, {gate_up_width}] {dtype:?}"),
            &swiglu(&gate_up_gpu)?,
            &swiglu(&gate_up)?,
            tol,
        )?;
        let [residual, routed, shared] = [(-8.0, 8.0), (-2.0, 2.0), (-2.0, 2.0)]
            .map(|(low, high)| random(rng, &[rows, HIDDEN], low, high, dtype));
        let (residual, routed, shared) = (residual?, routed?, shared?);
        let on_gpu = to_gpu_all(&[residual.clone(), routed.clone(), shared.clone()])?;
        compare(
            &format!("add_moe_output with a view of the gate logit [{rows}, 1] {dtype:?}"),
            &add_moe_output(&on_gpu[0], &on_gpu[1], &on_gpu[2], &logit_gpu)?,
            &add_moe_output(&residual, &routed, &shared, &logit)?,
            tol,
        )?;
        let what = format!("moe_route of a view [{rows}, {EXPERTS}] {dtype:?}");
        route_check(&what, &contiguous(&router)?, TOP_K, true, dtype)?;
        let (view_w, view_ids) = moe_route(&router_gpu, TOP_K, true, dtype)?;
        let (copy_w, copy_ids) = moe_route(&contiguous(&router_gpu)?, TOP_K, true, dtype)?;
        identical(&format!("{what}: weights"), &view_w, &copy_w)?;
        assert_eq!(
            view_ids.to_device(&Device::Cpu)?.to_vec2::<u32>()?,
            copy_ids.to_device(&Device::Cpu)?.to_vec2::<u32>()?,
            "{what}: ids"
        );
        let kda = random(rng, &[rows, 5 + HV + 7], -12.0, 12.0, dtype)?;
        let (b, b_gpu) = view_on_both(&kda, |t| t.narrow(1, 5, HV))?;
        assert!(!b_gpu.is_contiguous(), "b: the view is contiguous");
        compare(
            &format!("kda_beta of a view [{rows}, {HV}] {dtype:?}"),
            &kda_beta(&b_gpu)?,
            &kda_beta(&b)?,
            TIGHT,
        )
        .map(drop)
    })
}

// --------------------------------- offset_rms_norm_rope, sigmoid_gate_mul

/// Rotated channels of the full-attention heads (a quarter of `HEAD_DIM`).
const ROTARY: usize = 64;
/// Key/value heads of the full-attention layers.
const KV_HEADS: usize = 2;

/// cos and sin `[B, T, rotary]` on the CPU for rows at positions `offset + t`
/// (`offsets[b]` for row b), built as the model builds them: angles in f32,
/// each frequency twice, rounded to `dtype`.
fn rope_tables(
    offsets: &[usize],
    seq_len: usize,
    rotary: usize,
    dtype: DType,
) -> Result<(Tensor, Tensor)> {
    let half = rotary / 2;
    let inv_freq: Vec<f32> = (0..half)
        .map(|j| 1.0 / 10_000f32.powf((2 * j) as f32 / rotary as f32))
        .collect();
    let mut angles = Vec::with_capacity(offsets.len() * seq_len * rotary);
    for &offset in offsets {
        for position in offset..offset + seq_len {
            let row: Vec<f32> = inv_freq.iter().map(|f| position as f32 * f).collect();
            angles.extend_from_slice(&row);
            angles.extend_from_slice(&row);
        }
    }
    let angles = tensor(angles, &[offsets.len(), seq_len, rotary])?;
    Ok((
        angles.cos()?.to_dtype(dtype)?,
        angles.sin()?.to_dtype(dtype)?,
    ))
}

/// Tolerance of `offset_rms_norm_rope` at head dim `width`, as a multiple of
/// the largest output magnitude `S` (an absolute tolerance only: a rotated
/// channel is a sum of two products that can cancel).
///
/// Every normalised value `n` differs between the devices by at most
/// `r|n| + a`, with `r` and `a` those of [`offset_norm_tol`]. A rotated
/// channel is `round(round(n c) + round(m s))` with `|c| + |s| <= sqrt(2)`; a
/// pair of rotated channels keeps the length of its pair of `n` (up to the
/// rounding of the tables and outputs), so `|n|, |m| <= sqrt(2) S`, the
/// products' magnitudes add up to at most `2S` and the output's is at most
/// `S`. The products then differ by at most `sqrt(2)(r sqrt(2) S + a)`
/// together, plus one step `e` (relative) of the dtype each where their
/// roundings flip, and the sum by one more: `2rS + 2a + 3eS`, plus one step
/// `eS` for the rounded tables' and outputs' share in the length argument.
/// `e` is 2^-7 for bf16, 2^-10 for f16 and, in f32, `2u` (each device
/// rounds once). Pass-through channels are within `rS + a`.
fn rope_tol(width: usize, dtype: DType) -> Tol {
    let norm = offset_norm_tol(width, dtype);
    let step = match dtype {
        DType::BF16 => 1.0 / 128.0,
        DType::F16 => 1.0 / 1024.0,
        _ => 2.0 * F32_U,
    };
    Tol {
        atol: 2.0 * norm.rtol + 2.0 * norm.atol + 4.0 * step,
        rtol: 0.0,
    }
}

/// What an `offset_rms_norm_rope` check applies to the rows: the `f32`
/// `scale` and the rotary tables `(cos, sin)` of [`rope_tables`].
struct RopeParams {
    scale: Tensor,
    tables: (Tensor, Tensor),
}

impl RopeParams {
    /// `offset_rms_norm_rope` of `view` of `base` with these parameters on
    /// the CPU and on the GPU (see [`view_on_both`]).
    fn check(
        &self,
        what: &str,
        base: &Tensor,
        view: impl Fn(&Tensor) -> candle_core::Result<Tensor>,
    ) -> Result<()> {
        let device = gpu();
        let (x, x_gpu) = view_on_both(base, view)?;
        let (scale, (cos, sin)) = (&self.scale, &self.tables);
        let cpu = offset_rms_norm_rope(&x, scale, 1e-6, cos, sin)?;
        let cuda = offset_rms_norm_rope(
            &x_gpu,
            &to_gpu(scale, &device)?,
            1e-6,
            &to_gpu(cos, &device)?,
            &to_gpu(sin, &device)?,
        )?;
        assert!(cuda.is_contiguous(), "{what}: result is not contiguous");
        compare(what, &cuda, &cpu, rope_tol(x.dims()[3], x.dtype()))?;
        Ok(())
    }
}

#[test]
fn offset_norm_rope_matches_cpu_at_model_shapes() -> Result<()> {
    let cases = pairs(&[(1, 1), (4, 1), (1, 37), (4, 37)], &ALL_DTYPES);
    sweep_seeds(
        2400,
        cases,
        &[ROTARY, HEAD_DIM],
        |seed, ((batch, seq_len), dtype), rotary| {
            let mut rng = Rng::new(seed);
            let offsets: Vec<usize> = (0..batch).map(|b| 1000 * b + 3).collect();
            let params = RopeParams {
                tables: rope_tables(&offsets, seq_len, rotary, dtype)?,
                scale: random(&mut rng, &[HEAD_DIM], 0.5, 1.5, DType::F32)?,
            };
            // q: the first half of each head of the interleaved q | gate
            // projection, read in place (rows 2 * HEAD_DIM apart).
            let q2 = random(
                &mut rng,
                &[batch, seq_len, HEADS, 2 * HEAD_DIM],
                -3.0,
                3.0,
                dtype,
            )?;
            params.check(
                &format!("offset_rms_norm_rope q [{batch}, {seq_len}] R {rotary} {dtype:?}"),
                &q2,
                |q2| q2.narrow(3, 0, HEAD_DIM),
            )?;
            // k: contiguous.
            let k = random(
                &mut rng,
                &[batch, seq_len, KV_HEADS, HEAD_DIM],
                -3.0,
                3.0,
                dtype,
            )?;
            params.check(
                &format!("offset_rms_norm_rope k [{batch}, {seq_len}] R {rotary} {dtype:?}"),
                &k,
                |k| Ok(k.clone()),
            )
        },
    )
}

#[test]
fn offset_norm_rope_matches_cpu_at_odd_shapes_and_layouts() -> Result<()> {
    let mut rng = Rng::new(2500);
    // A transposed view (copied before the launch), a row range of a
    // contiguous tensor (read in place at its start offset), and head dims
    // of one to eight warps per row with a single rotated pair.
    let x = random(&mut rng, &[2, HEADS, 5, HEAD_DIM], -3.0, 3.0, DType::BF16)?;
    let params = RopeParams {
        scale: random(&mut rng, &[HEAD_DIM], 0.5, 1.5, DType::F32)?,
        tables: rope_tables(&[7, 70_000], 5, ROTARY, DType::BF16)?,
    };
    params.check("offset_rms_norm_rope transposed view", &x, |x| {
        x.transpose(1, 2)
    })?;
    let params = RopeParams {
        tables: rope_tables(&[0], 4, ROTARY, DType::BF16)?,
        ..params
    };
    let row_range = |x: &Tensor| {
        x.reshape((2 * HEADS * 5, HEAD_DIM))?
            .narrow(0, 9, 12)?
            .reshape((1, 4, 3, HEAD_DIM))
    };
    params.check("offset_rms_norm_rope start offset", &x, row_range)?;
    for width in [2, 24, 257, 513, 1025] {
        for dtype in [DType::F32, DType::BF16] {
            let x2 = random(&mut rng, &[3, 2, 5, 2 * width], -3.0, 3.0, dtype)?;
            let params = RopeParams {
                scale: random(&mut rng, &[width], 0.5, 1.5, DType::F32)?,
                tables: rope_tables(&[1, 2, 3], 2, 2, dtype)?,
            };
            params.check(
                &format!("offset_rms_norm_rope width {width} {dtype:?}"),
                &x2,
                |x2| x2.narrow(3, width, width),
            )?;
        }
    }
    Ok(())
}

#[test]
fn sigmoid_gate_mul_matches_cpu_at_model_shapes() -> Result<()> {
    let cases = [(1, 1), (4, 1), (1, 37), (4, 37)];
    sweep(2600, cases, &ALL_DTYPES, |rng, (batch, seq_len), dtype| {
        let device = gpu();
        let x = random(rng, &[batch, seq_len, HEADS, HEAD_DIM], -4.0, 4.0, dtype)?;
        let x_gpu = to_gpu(&x, &device)?;
        // The gate: the second half of each head of the interleaved
        // q | gate projection, read in place.
        let q2 = random(
            rng,
            &[batch, seq_len, HEADS, 2 * HEAD_DIM],
            -8.0,
            8.0,
            dtype,
        )?;
        let q2_gpu = to_gpu(&q2, &device)?;
        let gate = q2.narrow(3, HEAD_DIM, HEAD_DIM)?;
        let gate_gpu = q2_gpu.narrow(3, HEAD_DIM, HEAD_DIM)?;
        let cpu = sigmoid_gate_mul(&x, &gate)?;
        let what = format!("sigmoid_gate_mul [{batch}, {seq_len}] {dtype:?}");
        let cuda = sigmoid_gate_mul(&x_gpu, &gate_gpu)?;
        assert!(cuda.is_contiguous(), "{what}: result is not contiguous");
        compare(&what, &cuda, &cpu, output_tol(dtype))?;
        // A contiguous gate, and a transposed x (copied before the launch).
        let x_t_gpu = x_gpu.transpose(1, 2)?.contiguous()?.transpose(1, 2)?;
        compare(
            &format!("{what} contiguous gate, transposed x"),
            &sigmoid_gate_mul(&x_t_gpu, &gate_gpu.contiguous()?)?,
            &cpu,
            output_tol(dtype),
        )
        .map(drop)
    })
}

// ------------------------------------------------------------ moe_experts

/// Routes every token to `top_k` distinct experts (its logits random, top-k
/// by the CPU's `moe_route`), and returns the (weights, ids).
fn moe_routing(
    rng: &mut Rng,
    tokens: usize,
    experts: usize,
    top_k: usize,
) -> Result<(Tensor, Tensor)> {
    let logits = random(rng, &[tokens, experts], -3.0, 3.0, DType::F32)?;
    moe_route(&logits, top_k, true, DType::F32)
}

/// How a `moe_experts` case routes its tokens.
#[derive(Clone, Copy)]
enum Routing {
    /// [`moe_routing`] of random logits.
    Random,
    /// Every token to this one expert, weight in [0.5, 1) (top-1).
    AllTo(u32),
}

/// A `moe_experts` case: `tokens` tokens at `[E, k, H, I]`, routed by
/// `routing`; the CPU reference checks every `check_every`-th token and the
/// last.
#[derive(Clone, Copy)]
struct MoeCase {
    tokens: usize,
    dims: [usize; 4],
    routing: Routing,
    check_every: usize,
}

impl MoeCase {
    /// `tokens` tokens at `dims`, routed by [`moe_routing`], all checked.
    const fn routed(tokens: usize, dims: [usize; 4]) -> MoeCase {
        MoeCase {
            tokens,
            dims,
            routing: Routing::Random,
            check_every: 1,
        }
    }

    fn describe(&self, dtype: DType) -> String {
        let [experts, top_k, hidden, inter] = self.dims;
        let tokens = self.tokens;
        format!("moe_experts N={tokens} E={experts} k={top_k} H={hidden} I={inter} {dtype:?}")
    }
}

/// The CPU inputs `[x, weights, ids, gate_up, down]` of `case`.
fn moe_inputs(rng: &mut Rng, case: MoeCase, dtype: DType) -> Result<[Tensor; 5]> {
    let [experts, top_k, hidden, inter] = case.dims;
    let tokens = case.tokens;
    let x = random(rng, &[tokens, hidden], -2.0, 2.0, dtype)?;
    let gate_up = random(rng, &[experts, 2 * inter, hidden], -0.05, 0.05, dtype)?;
    let down = random(rng, &[experts, hidden, inter], -0.05, 0.05, dtype)?;
    let (weights, ids) = match case.routing {
        Routing::Random => moe_routing(rng, tokens, experts, top_k)?,
        Routing::AllTo(expert) => {
            assert_eq!(top_k, 1, "one expert per token");
            let weights = random(rng, &[tokens, 1], 0.5, 1.0, DType::F32)?;
            (weights, Tensor::full(expert, (tokens, 1), &Device::Cpu)?)
        }
    };
    Ok([x, weights, ids, gate_up, down])
}

/// `moe_experts_with(algorithm)` on GPU copies of the CPU tensors
/// `[x, weights, ids, gate_up, down]` against the CPU reference, on every
/// `check_every`-th token and the last: a token's output depends on its own
/// rows of x, weights and ids only, so the reference of those rows alone is
/// theirs, while the GPU groups all the tokens.
///
/// Bounded by `output_tol`, not counted: a rounding of `gate | up` or `h`
/// that flips (the projections' f32 sums run in another order) moves every
/// output that reads it, so in f16 a fifth of the outputs can differ by a
/// step. The bound is one step of the dtype at the value plus one at the
/// largest output, twice: enough for a flipped rounding of a term or of the
/// running sum, and far below the error of a wrong row, expert or weight.
fn moe_checked(
    what: &str,
    inputs: [&Tensor; 5],
    algorithm: MoeExpertsAlgorithm,
    check_every: usize,
) -> Result<()> {
    let [x, weights, ids, gate_up, down] = inputs;
    let tokens = x.dim(0)?;
    let mut checked: Vec<u32> = (0..tokens as u32).step_by(check_every).collect();
    if checked.last() != Some(&(tokens as u32 - 1)) {
        checked.push(tokens as u32 - 1);
    }
    let checked = Tensor::new(checked.as_slice(), &Device::Cpu)?;
    let rows = |tensor: &Tensor| tensor.index_select(&checked, 0);
    let cpu = moe_experts(&rows(x)?, &rows(weights)?, &rows(ids)?, gate_up, down)?;
    let copies = to_gpu_all(&inputs.map(Tensor::clone))?;
    let [x, weights, ids, gate_up, down] = std::array::from_fn(|i| &copies[i]);
    let cuda = moe_experts_with(algorithm, x, weights, ids, gate_up, down)?
        .index_select(&to_gpu(&checked, &gpu())?, 0)?;
    within(what, &cuda, &cpu, output_tol(x.dtype()))?;
    Ok(())
}

/// [`moe_checked`] of `case`'s inputs, drawn from `rng`, with `algorithm`.
fn moe_case_with(
    rng: &mut Rng,
    case: MoeCase,
    dtype: DType,
    algorithm: MoeExpertsAlgorithm,
) -> Result<()> {
    let inputs = moe_inputs(rng, case, dtype)?;
    let what = format!("{} {algorithm:?}", case.describe(dtype));
    moe_checked(&what, inputs.each_ref(), algorithm, case.check_every)
}

/// `moe_experts` (the algorithm it picks) on `tokens` tokens routed at
/// `dims`, every token checked.
fn moe_experts_case(seed: u64, tokens: usize, dims: [usize; 4], dtype: DType) -> Result<()> {
    let algorithm = MoeExpertsAlgorithm::for_rows(tokens * dims[1]);
    let case = MoeCase::routed(tokens, dims);
    moe_case_with(&mut Rng::new(seed), case, dtype, algorithm)
}

/// BerryLM-OS widths (hidden 2048, expert width 512, top-8) with 16 experts
/// (the CPU reference's time), at decode batches 1, 8 and 32, through what
/// `moe_experts` picks: the streamed kernels with fewer routed rows than
/// experts (a block per routed row) and more (a block per expert, several
/// tokens per expert), and the grouped GEMMs at 256 routed rows.
#[test]
fn moe_experts_matches_cpu_at_model_widths() -> Result<()> {
    sweep_seeds(2500, [1, 8, 32], &ALL_DTYPES, |seed, tokens, dtype| {
        moe_experts_case(seed, tokens, [16, TOP_K, HIDDEN, MOE_INTERMEDIATE], dtype)
    })
}

/// Widths that are no multiple of the 16-byte vectors (the scalar path),
/// top-1 and top-10; top-33 is refused.
#[test]
fn moe_experts_matches_cpu_at_odd_sizes() -> Result<()> {
    moe_experts_case(2600, 5, [7, 3, 40, 13], DType::BF16)?;
    moe_experts_case(2601, 3, [7, 3, 40, 13], DType::F32)?;
    moe_experts_case(2602, 9, [4, 1, 64, 24], DType::BF16)?;
    // More than 8 experts per token: the combine's wider sorting network.
    moe_experts_case(2603, 4, [16, 10, 40, 16], DType::BF16)?;
    // More than the 32 it takes: a clear error.
    let inputs = moe_inputs(
        &mut Rng::new(2604),
        MoeCase::routed(2, [40, 33, 40, 16]),
        DType::BF16,
    )?;
    let copies = to_gpu_all(&inputs)?;
    let [x, weights, ids, gate_up, down] = std::array::from_fn(|i| &copies[i]);
    match moe_experts(x, weights, ids, gate_up, down) {
        Err(KernelError::InvalidArgument { arg: "ids", .. }) => {}
        other => panic!("expected an InvalidArgument error, got {other:?}"),
    }
    Ok(())
}

// -------------------------------------------------------- moe_block_decode

/// `moe_block_decode` of `tokens` tokens at `[E, k, H, I, Is]` (`Is` the
/// shared expert's width) on the GPU against the CPU reference (the four
/// operations it replaces), bounded as [`moe_checked`] bounds the routed
/// experts; the shared expert's gate | up and gate logit are views of one
/// stacked projection output, as in the model. With `unfused`, also against
/// those four operations' CUDA kernels: the same sums in the same order, so
/// the same bits.
fn moe_block_case(
    seed: u64,
    tokens: usize,
    [experts, top_k, hidden, inter, shared_inter]: [usize; 5],
    dtype: DType,
    unfused: bool,
) -> Result<()> {
    let mut rng = Rng::new(seed);
    let case = MoeCase::routed(tokens, [experts, top_k, hidden, inter]);
    let [x, weights, ids, gate_up, down] = moe_inputs(&mut rng, case, dtype)?;
    let residual = random(&mut rng, &[tokens, hidden], -8.0, 8.0, dtype)?;
    // The shared expert's gate | up, one column of another projection, its
    // gate logit and six more columns (rows 16-byte aligned at model widths,
    // as the model pads its stacked projections).
    let stacked = random(&mut rng, &[tokens, 2 * shared_inter + 8], -4.0, 4.0, dtype)?;
    let shared_down = random(&mut rng, &[hidden, shared_inter], -0.05, 0.05, dtype)?;
    let shared_views = |stacked: &Tensor| -> Result<(Tensor, Tensor)> {
        Ok((
            stacked.narrow(1, 0, 2 * shared_inter)?,
            stacked.narrow(1, 2 * shared_inter + 1, 1)?,
        ))
    };
    let block = |[x, residual, weights, ids, stacked, gate_up, down, shared_down]: [&Tensor; 8]| {
        let (shared_gate_up, shared_gate_logit) = shared_views(stacked)?;
        moe_block_decode(
            &MoeBlockInputs {
                x,
                residual,
                weights,
                ids,
                shared_gate_up: &shared_gate_up,
                shared_gate_logit: &shared_gate_logit,
            },
            &MoeBlockWeights {
                gate_up,
                down,
                shared_down,
            },
        )
    };
    let inputs = [
        &x,
        &residual,
        &weights,
        &ids,
        &stacked,
        &gate_up,
        &down,
        &shared_down,
    ];
    let what = format!(
        "moe_block_decode N={tokens} E={experts} k={top_k} H={hidden} I={inter} Is={shared_inter} {dtype:?}"
    );
    let (cuda, cpu) = on_both(inputs, block)?;
    within(&what, &cuda, &cpu, output_tol(dtype))?;
    if unfused {
        let copies = to_gpu_all(&inputs.map(Tensor::clone))?;
        let [x, residual, weights, ids, stacked, gate_up, down, shared_down] =
            std::array::from_fn(|i| &copies[i]);
        let (shared_gate_up, shared_gate_logit) = shared_views(stacked)?;
        let routed = moe_experts_with(
            MoeExpertsAlgorithm::Streamed,
            x,
            weights,
            ids,
            gate_up,
            down,
        )?;
        let shared = decode_matmul(&swiglu(&shared_gate_up)?, shared_down)?;
        let expected = add_moe_output(residual, &routed, &shared, &shared_gate_logit)?;
        identical(
            &format!("{what} against the unfused kernels"),
            &cuda,
            &expected,
        )?;
    }
    Ok(())
}

/// BerryLM-OS widths with 16 experts (the CPU reference's time) at decode
/// batches 1, 3 and 8 and top-8, and top-2 (the kernel's instance for up to
/// four experts a token), in every dtype.
#[test]
fn moe_block_decode_matches_cpu_at_model_widths() -> Result<()> {
    let widths = [16, TOP_K, HIDDEN, MOE_INTERMEDIATE, MOE_INTERMEDIATE];
    sweep_seeds(2700, [1, 3, 8], &ALL_DTYPES, |seed, tokens, dtype| {
        moe_block_case(seed, tokens, widths, dtype, true)
    })?;
    moe_block_case(
        2710,
        4,
        [16, 2, HIDDEN, MOE_INTERMEDIATE, 256],
        DType::BF16,
        true,
    )
}

/// The bundled model's widths (`trained-tiny`: 8 experts, top-2, hidden 256,
/// expert and shared expert width 128), which the served bf16 model decodes
/// with: a decode step, a batch of 4 and a 17-token prompt (routed rows that
/// still stream).
#[test]
fn moe_block_decode_matches_cpu_at_the_bundled_models_widths() -> Result<()> {
    for (seed, tokens) in [(2730, 1), (2731, 4), (2732, 17)] {
        moe_block_case(seed, tokens, [8, 2, 256, 128, 128], DType::BF16, true)?;
    }
    Ok(())
}

/// Widths that are no multiple of the 16-byte vectors (the scalar path),
/// the shared expert wider than the routed ones and narrower, and more than
/// 8 experts a token refused with the argument named.
#[test]
fn moe_block_decode_matches_cpu_at_odd_sizes() -> Result<()> {
    moe_block_case(2720, 5, [7, 3, 40, 13, 20], DType::BF16, false)?;
    moe_block_case(2721, 2, [7, 3, 40, 13, 6], DType::F32, false)?;
    moe_block_case(2722, 1, [8, 1, 64, 24, 48], DType::F16, false)?;
    match moe_block_case(2723, 1, [16, 10, 40, 16, 16], DType::BF16, false) {
        Err(KernelError::InvalidArgument { arg: "ids", .. }) => Ok(()),
        other => panic!("expected an InvalidArgument error for 10 experts a token, got {other:?}"),
    }
}

/// Prompt-sized calls and decode steps of more than 32 sequences: more routed
/// rows than `moe_experts` streams, so both projections run as grouped
/// GEMMs before the same combine: at model widths on the tensor cores (bf16,
/// f16) and through cuBLAS (f32), and with an expert width that is no
/// multiple of 8 (13), which the tensor-core kernels do not take, through
/// cuBLAS in bf16.
#[test]
fn moe_experts_grouped_gemms_match_cpu() -> Result<()> {
    sweep_seeds(2650, [80], &ALL_DTYPES, |seed, tokens, dtype| {
        moe_experts_case(seed, tokens, [16, TOP_K, HIDDEN, MOE_INTERMEDIATE], dtype)
    })?;
    moe_experts_case(2660, 200, [7, 3, 40, 13], DType::BF16)?;
    Ok(())
}

/// The tensor-core grouped GEMMs (64-row tiles, 32-column K stages, 256
/// output columns or 128 h columns per block) where tiles are partly filled
/// or empty.
const GROUPED_TILE_CASES: [MoeCase; 4] = [
    // 128 routed rows over 128 experts: most experts get 0 to 2 rows; I = 64
    // fills half of a block's gate columns.
    MoeCase::routed(16, [EXPERTS, TOP_K, 256, 64]),
    // K = 40 (H, then I = 24): a full stage and 8 columns of the next; about
    // 86 rows per expert (a full tile and a partial one); 24 h columns.
    MoeCase::routed(200, [7, 3, 40, 24]),
    // One expert takes all 300 rows (4 full tiles and 44 rows), 7 get none.
    MoeCase {
        tokens: 300,
        dims: [8, 1, 256, 128],
        routing: Routing::AllTo(5),
        check_every: 1,
    },
    // Decode at batch 100 at model widths: about 6 rows per expert.
    MoeCase::routed(100, [EXPERTS, TOP_K, HIDDEN, MOE_INTERMEDIATE]),
];

/// [`MoeExpertsAlgorithm::Grouped`] on the tensor cores (bf16, f16) for
/// [`GROUPED_TILE_CASES`].
#[test]
fn moe_experts_tensor_core_tiles_match_cpu() -> Result<()> {
    sweep(
        2670,
        GROUPED_TILE_CASES,
        &HALF_DTYPES,
        |rng, case, dtype| moe_case_with(rng, case, dtype, MoeExpertsAlgorithm::Grouped),
    )
}

/// The prompt-sized grouped GEMMs (more than 2048 routed rows: 128-row tiles,
/// on sm_90a builds the warpgroup-MMA kernels) where tiles are partly filled
/// and K ends inside a 64-column stage: K = 40 (H, then I = 24) over 2400
/// routed rows, and one expert taking 2100 rows (16 full tiles and 52 rows).
#[test]
fn moe_experts_prompt_tiles_match_cpu() -> Result<()> {
    let cases = [
        MoeCase {
            tokens: 800,
            dims: [7, 3, 40, 24],
            routing: Routing::Random,
            check_every: 4,
        },
        MoeCase {
            tokens: 2100,
            dims: [8, 1, 256, 128],
            routing: Routing::AllTo(5),
            check_every: 8,
        },
    ];
    sweep(2675, cases, &HALF_DTYPES, |rng, case, dtype| {
        let algorithm = MoeExpertsAlgorithm::for_rows(case.tokens * case.dims[1]);
        assert_eq!(algorithm, MoeExpertsAlgorithm::Grouped);
        moe_case_with(rng, case, dtype, algorithm)
    })
}

/// A prompt of 512 and one of 4096 tokens at BerryLM-OS shapes (128 experts,
/// top-8, hidden 2048, expert width 512; about 32 and 256 rows per expert),
/// through what `moe_experts` picks for them (the tensor-core grouped
/// GEMMs), checked on every 4th and every 32nd token (128 tokens each: the
/// CPU reference's time).
#[test]
fn moe_experts_matches_cpu_at_berrylm_os_prompts() -> Result<()> {
    let cases = [512, 4096].map(|tokens| MoeCase {
        tokens,
        dims: [EXPERTS, TOP_K, HIDDEN, MOE_INTERMEDIATE],
        routing: Routing::Random,
        check_every: tokens / 128,
    });
    sweep(2690, cases, &HALF_DTYPES, |rng, case, dtype| {
        let algorithm = MoeExpertsAlgorithm::for_rows(case.tokens * TOP_K);
        assert_eq!(algorithm, MoeExpertsAlgorithm::Grouped);
        moe_case_with(rng, case, dtype, algorithm)
    })
}

/// [`MoeExpertsAlgorithm::Streamed`] up to the 4096 routed rows its kernels
/// take (512 tokens at top-8), in f32 and bf16.
#[test]
fn moe_experts_streamed_matches_cpu_up_to_its_limit() -> Result<()> {
    let case = MoeCase::routed(512, [16, TOP_K, 64, 24]);
    sweep(2700, [case], &F32_BF16, |rng, case, dtype| {
        moe_case_with(rng, case, dtype, MoeExpertsAlgorithm::Streamed)
    })
}

/// The CUDA paths that cannot check the ids (the streamed kernels, the
/// tensor-core grouped GEMMs) skip an id at or above E: the result is the
/// CPU reference's for the same call with that slot's weight 0 and its id an
/// expert the token did not choose (a zero term added anywhere in the sum
/// leaves it unchanged).
#[test]
fn moe_experts_skip_ids_past_the_experts() -> Result<()> {
    let case = MoeCase::routed(40, [8, 2, 64, 16]);
    let algorithms = [MoeExpertsAlgorithm::Streamed, MoeExpertsAlgorithm::Grouped];
    sweep_seeds(2710, [case], &algorithms, |seed, case, algorithm| {
        let dtype = DType::BF16;
        let [x, weights, ids, gate_up, down] = moe_inputs(&mut Rng::new(seed), case, dtype)?;
        let experts = case.dims[0] as u32;
        let mut bad_ids: Vec<u32> = ids.flatten_all()?.to_vec1()?;
        let mut stand_in_ids = bad_ids.clone();
        let mut stand_in_weights: Vec<f32> = weights.flatten_all()?.to_vec1()?;
        for token in (0..case.tokens).step_by(3) {
            let [first, second] = [2 * token, 2 * token + 1];
            bad_ids[second] = if token % 2 == 0 {
                experts + token as u32
            } else {
                u32::MAX
            };
            stand_in_ids[second] = (0..experts)
                .find(|&e| e != bad_ids[first])
                .expect("another expert");
            stand_in_weights[second] = 0.0;
        }
        let shape = ids.dims();
        let stand_in = moe_experts(
            &x,
            &Tensor::from_vec(stand_in_weights, shape, &Device::Cpu)?,
            &Tensor::from_vec(stand_in_ids, shape, &Device::Cpu)?,
            &gate_up,
            &down,
        )?;
        let copies = to_gpu_all(&[
            x,
            weights,
            Tensor::from_vec(bad_ids, shape, &Device::Cpu)?,
            gate_up,
            down,
        ])?;
        let [x, weights, ids, gate_up, down] = std::array::from_fn(|i| &copies[i]);
        let cuda = moe_experts_with(algorithm, x, weights, ids, gate_up, down)?;
        let what = format!("{} {algorithm:?} with ids past E", case.describe(dtype));
        within(&what, &cuda, &stand_in, output_tol(dtype))?;
        Ok(())
    })
}

// ------------------------------------------------ causal_conv1d_split_in_pool

/// The KDA layer's conv call on the host's f32 pool: `causal_conv1d_split_in_pool`
/// on the GPU against the CPU's, on a pool of [`POOL_ROWS`] random rows with
/// scattered slots. Decode at B = 1 and 8 (one chunk: the convolution
/// kernel writes the rows in place) and a 200-token prefill (four chunks:
/// the convolution reads the old rows, then a second launch writes the new
/// ones, the case a single launch would race in). Outputs within
/// `output_tol`; the whole pool, new rows and untouched ones, bit for bit.
#[test]
fn conv_in_pool_matches_cpu_at_model_shapes() -> Result<()> {
    sweep(2700, CONV_MODEL_CALLS, &F32_BF16, |rng, call, dtype| {
        conv_pool_case(rng, call, dtype, ConvPoolInput::Plain)
    })
}

/// The input as a view of the conv's columns of a wider tensor (the KDA
/// in-projection's output), read in place: decode at B = 64 and a 150-token
/// prompt (three time chunks, so the pool's state is written by its own
/// kernel after the convolution).
#[test]
fn conv_in_pool_reads_a_view_of_wider_rows() -> Result<()> {
    sweep(2780, [(64, 1), (3, 150)], &F32_BF16, |rng, call, dtype| {
        conv_pool_case(rng, call, dtype, ConvPoolInput::ViewOfWiderRows)
    })
}

/// Pad rows ([`with_pad_rows`]) in the conv pool: zero initial states, no
/// row written, as on the CPU. Decode at B = 8 and a 200-token prompt.
#[test]
fn conv_in_pool_pad_rows() -> Result<()> {
    sweep(2750, [(8, 1), (4, 200)], &F32_BF16, |rng, call, dtype| {
        conv_pool_case(rng, call, dtype, ConvPoolInput::PadRows)
    })
}

/// The input of a [`conv_pool_case`].
#[derive(Clone, Copy, PartialEq)]
enum ConvPoolInput {
    Plain,
    /// Some rows are pad rows ([`with_pad_rows`]).
    PadRows,
    /// `x` is a non-contiguous view of the middle columns of wider rows.
    ViewOfWiderRows,
}

/// `causal_conv1d_split_in_pool` on the GPU against the CPU's.
fn conv_pool_case(
    rng: &mut Rng,
    (batch, seq_len): (usize, usize),
    dtype: DType,
    input: ConvPoolInput,
) -> Result<()> {
    let dev = gpu();
    let mut slots = scattered_slots(rng, batch, POOL_ROWS);
    if input == ConvPoolInput::PadRows {
        slots = with_pad_rows(slots);
    }
    let (x, weight) = conv_model_inputs(rng, (batch, seq_len), dtype)?;
    let x = if input == ConvPoolInput::ViewOfWiderRows {
        let before = random(rng, &[batch, seq_len, 24], -2.0, 2.0, dtype)?;
        let after = random(rng, &[batch, seq_len, 40], -2.0, 2.0, dtype)?;
        let view = Tensor::cat(&[&before, &x, &after], 2)?.narrow(2, 24, CONV_DIM)?;
        assert!(!view.is_contiguous(), "the view is contiguous");
        view
    } else {
        x
    };
    let pool = random(rng, &[POOL_ROWS, CONV_DIM, CONV_K], -2.0, 2.0, DType::F32)?;
    let what = format!(
        "causal_conv1d_split_in_pool B={batch} T={seq_len} {dtype:?} slots {:?}",
        &slots[..slots.len().min(4)]
    );

    let pool_cpu = pool.copy()?;
    let parts_cpu = causal_conv1d_split_in_pool(
        &x,
        &weight,
        StatePool {
            states: &pool_cpu,
            slots: &Tensor::new(slots.as_slice(), &Device::Cpu)?,
            host_slots: &slots,
        },
        &CONV_WIDTHS,
    )?;
    let pool_gpu = to_gpu(&pool, &dev)?;
    let parts_cuda = causal_conv1d_split_in_pool(
        &to_gpu(&x, &dev)?,
        &to_gpu(&weight, &dev)?,
        StatePool {
            states: &pool_gpu,
            slots: &Tensor::new(slots.as_slice(), &dev)?,
            host_slots: &slots,
        },
        &CONV_WIDTHS,
    )?;

    assert_eq!(parts_cuda.len(), CONV_WIDTHS.len(), "{what}");
    compare_parts(&what, &parts_cuda, &parts_cpu, output_tol(dtype))?;
    identical(&format!("{what} pool"), &pool_gpu, &pool_cpu)
}
