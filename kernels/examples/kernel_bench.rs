//! Times the CUDA KDA recurrence through the public `kda_recurrence_with` at
//! BerryLM-OS shapes (Hk 16, Hv 32, dk = dv = 128, q/k/v bf16, g/beta/state
//! f32):
//!
//! * decode (T = 1) at batch 1, 4, 8, 16, 32, 64 and 256, reporting the state bytes
//!   moved (read + write, 2 * B * Hv * dk * dv * 4) per second; the decode
//!   kernel is the one the library picks (`rows` when B * Hv >= 128, else
//!   `tiles`);
//! * prefill at T = 32, 64, 128, 256, 512, 1024, 2048, 4096 and 16384
//!   (batch 1) and T = 512 (batch 8) with each `KdaPrefillAlgorithm`
//!   (sequential, and chunked, which `kda_recurrence` uses from T = 64 on),
//!   reporting tokens per second.
//!
//! `--decode-only` / `--prefill-only` print one table. `--attention` times
//! `causal_attention` instead (B 1, Hq 16, Hkv 2, D 256, T = L = 4096 and
//! 16384, bf16), reporting ms and TFLOP/s of the causal FLOPs
//! `4 * B * Hq * D * T (T + 1) / 2`. `--moe` times `moe_experts_with` at
//! BerryLM-OS shapes (128 experts, top-8, hidden 2048, expert width 512,
//! bf16) for 16 to 32768 tokens (128 to 262144 routed rows), with each
//! `MoeExpertsAlgorithm` that takes the call (`Streamed` up to 4096 rows),
//! marking the one `moe_experts` picks, and reports ms, TFLOP/s of the
//! expert GEMMs `2 * rows * 3 * H * I` and the GB/s of the chosen experts'
//! weights read once (the decode floor). `--quantized` times
//! `quantized_matmul` at BerryLM-OS's decode projections (q4_K and q8_0
//! weights, bf16 activations, 1 and 8 rows) and `moe_experts_quantized` at
//! its experts (1 and 8 tokens), reporting µs and the GB/s of the weight
//! bytes a call reads (each chosen expert once).
//!
//! Each figure is the mean over many back-to-back calls on candle's stream,
//! timed with CUDA events around the loop (GPU time, outputs allocated per
//! call as in the model) and with a host clock after a stream sync.
//!
//! `cargo run --release --features cuda --example kernel_bench [-- --quick]`

use std::borrow::Cow;
use std::time::Instant;

use berrylm_kernels::{
    causal_attention, kda_recurrence_with, moe_experts_quantized, moe_experts_with, moe_route,
    quantized_matmul, KdaPrefillAlgorithm, MoeExpertsAlgorithm,
};
use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::{DType, Device, Tensor};

const HK: usize = 16;
const HV: usize = 32;
const DK: usize = 128;
const DV: usize = 128;

struct Inputs {
    /// `[q, k, v, g, beta]`.
    tokens: [Tensor; 5],
    state: Tensor,
}

fn inputs(device: &Device, batch: usize, seq_len: usize) -> candle_core::Result<Inputs> {
    let uniform = |dims: &[usize], lo: f32, hi: f32, dtype: DType| {
        Tensor::rand(lo, hi, dims, device)?.to_dtype(dtype)
    };
    Ok(Inputs {
        tokens: [
            uniform(&[batch, seq_len, HK, DK], -1.0, 1.0, DType::BF16)?,
            uniform(&[batch, seq_len, HK, DK], -1.0, 1.0, DType::BF16)?,
            uniform(&[batch, seq_len, HV, DV], -1.0, 1.0, DType::BF16)?,
            uniform(&[batch, seq_len, HV, DK], -1.0, 0.0, DType::F32)?,
            uniform(&[batch, seq_len, HV], 0.0, 1.0, DType::F32)?,
        ],
        state: uniform(&[batch, HV, DK, DV], -0.5, 0.5, DType::F32)?,
    })
}

fn recurrence_call(algorithm: KdaPrefillAlgorithm, x: &Inputs) -> candle_core::Result<()> {
    let [q, k, v, g, beta] = &x.tokens;
    let (out, state) = kda_recurrence_with(algorithm, q, k, v, g, beta, &x.state)?;
    drop((out, state));
    Ok(())
}

/// `KdaPrefillAlgorithm::default()` (sequential): what `kda_recurrence` runs
/// for decode, the only use here (warm-up and the decode table).
fn default_call(x: &Inputs) -> candle_core::Result<()> {
    recurrence_call(KdaPrefillAlgorithm::default(), x)
}

/// The copy-bandwidth baseline: a device-to-device copy of the state.
fn copy_call(x: &Inputs) -> candle_core::Result<()> {
    drop(x.state.copy()?);
    Ok(())
}

/// Mean seconds per call: (GPU time from events, host time after a sync).
fn time_calls<X>(
    device: &Device,
    x: &X,
    iters: usize,
    call: impl Fn(&X) -> candle_core::Result<()>,
) -> candle_core::Result<(f64, f64)> {
    let Device::Cuda(cuda) = device else {
        unreachable!()
    };
    let stream = cuda.cuda_stream();
    let call = || call(x);
    for _ in 0..3 {
        call()?;
    }
    device.synchronize()?;
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let start_event = stream
        .record_event(flags)
        .map_err(candle_core::Error::wrap)?;
    let start = Instant::now();
    for _ in 0..iters {
        call()?;
    }
    let end_event = stream
        .record_event(flags)
        .map_err(candle_core::Error::wrap)?;
    device.synchronize()?;
    let host = start.elapsed().as_secs_f64() / iters as f64;
    let gpu_ms = start_event
        .elapsed_ms(&end_event)
        .map_err(candle_core::Error::wrap)?;
    Ok((f64::from(gpu_ms) * 1e-3 / iters as f64, host))
}

fn main() -> candle_core::Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    let decode_only = std::env::args().any(|a| a == "--decode-only");
    let prefill_only = std::env::args().any(|a| a == "--prefill-only");
    let device = Device::new_cuda(0)?;
    if std::env::args().any(|a| a == "--attention") {
        return attention_table(&device);
    }
    if std::env::args().any(|a| a == "--moe") {
        return moe_table(&device);
    }
    if std::env::args().any(|a| a == "--quantized") {
        return quantized_table(&device);
    }
    println!("kda_recurrence, Hk={HK} Hv={HV} dk={DK} dv={DV}, q/k/v bf16, g/beta/state f32");
    // Warm-up (clocks, allocator pools) before anything is timed.
    {
        let x = inputs(&device, 64, 1)?;
        let start = Instant::now();
        while start.elapsed().as_secs_f64() < 0.5 {
            for _ in 0..50 {
                default_call(&x)?;
            }
            device.synchronize()?;
        }
    }
    if !prefill_only {
        decode_table(&device, quick)?;
    }
    if decode_only {
        return Ok(());
    }
    prefill_table(&device, quick)
}

fn prefill_table(device: &Device, quick: bool) -> candle_core::Result<()> {
    println!();
    println!("prefill, both KdaPrefillAlgorithm values");
    println!("| algorithm | batch | T | GPU ms/call | tokens/s (GPU) | host ms/call |");
    println!("|---|---:|---:|---:|---:|---:|");
    for (batch, seq_len) in [
        (1usize, 32usize),
        (1, 64),
        (1, 128),
        (1, 256),
        (1, 512),
        (1, 1024),
        (1, 2048),
        (1, 4096),
        (1, 16384),
        (8, 512),
    ] {
        let x = inputs(device, batch, seq_len)?;
        let iters = if quick {
            3
        } else if seq_len > 1000 {
            10
        } else {
            30
        };
        for algorithm in [
            KdaPrefillAlgorithm::Sequential,
            KdaPrefillAlgorithm::Chunked,
        ] {
            let call = |x: &Inputs| recurrence_call(algorithm, x);
            let (gpu, host) = time_calls(device, &x, iters, call)?;
            println!(
                "| {algorithm:?} | {batch} | {seq_len} | {:.3} | {:.0} | {:.3} |",
                gpu * 1e3,
                (batch * seq_len) as f64 / gpu,
                host * 1e3
            );
        }
    }
    Ok(())
}

fn decode_table(device: &Device, quick: bool) -> candle_core::Result<()> {
    println!();
    println!(
        "decode (T = 1), kernel chosen by the library; state bytes = 2 * B * Hv * dk * dv * 4 (read + write)"
    );
    println!(
        "| batch | state MiB (r+w) | GPU us/call | GB/s (GPU) | host us/call | GB/s (host) | copy GB/s |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    for batch in [1usize, 4, 8, 16, 32, 64, 256] {
        let x = inputs(device, batch, 1)?;
        let bytes = 2.0 * (batch * HV * DK * DV * 4) as f64;
        let iters = if quick {
            20
        } else {
            (2000 / batch).clamp(50, 1000)
        };
        let (gpu, host) = time_calls(device, &x, iters, default_call)?;
        let (copy, _) = time_calls(device, &x, iters, copy_call)?;
        println!(
            "| {batch} | {:.1} | {:.1} | {:.0} | {:.1} | {:.0} | {:.0} |",
            bytes / (1 << 20) as f64,
            gpu * 1e6,
            bytes / gpu * 1e-9,
            host * 1e6,
            bytes / host * 1e-9,
            bytes / copy * 1e-9
        );
    }
    Ok(())
}

/// `causal_attention` over a whole prompt at BerryLM's full-attention shape.
fn attention_table(device: &Device) -> candle_core::Result<()> {
    const HEADS: usize = 16;
    const KV_HEADS: usize = 2;
    const HEAD_DIM: usize = 256;
    println!("causal_attention, B=1 Hq={HEADS} Hkv={KV_HEADS} D={HEAD_DIM}, bf16, T = L");
    println!("| T | GPU ms/call | TFLOP/s (GPU) | host ms/call |");
    println!("|---|---|---|---|");
    for seq_len in [4096, 16384] {
        let uniform = |heads: usize, lo: f32, hi: f32| {
            Tensor::rand(lo, hi, (1, heads, seq_len, HEAD_DIM), device)?.to_dtype(DType::BF16)
        };
        let qkv = (
            uniform(HEADS, -2.0, 2.0)?,
            uniform(KV_HEADS, -2.0, 2.0)?,
            uniform(KV_HEADS, -1.0, 1.0)?,
        );
        let scale = 1.0 / (HEAD_DIM as f32).sqrt();
        let iters = if seq_len > 4096 { 5 } else { 20 };
        let (gpu, host) = time_calls(device, &qkv, iters, |(q, k, v)| {
            drop(causal_attention(q, k, v, scale)?);
            Ok(())
        })?;
        let t = seq_len as f64;
        let flops = 4.0 * (HEADS * HEAD_DIM) as f64 * t * (t + 1.0) / 2.0;
        println!(
            "| {seq_len} | {:.3} | {:.1} | {:.3} |",
            gpu * 1e3,
            flops / gpu * 1e-12,
            host * 1e3
        );
    }
    Ok(())
}

/// The routed experts' inputs of one call: `[x, weights, ids]` of `tokens`
/// tokens and the experts' `[gate_up, down]`.
struct MoeInputs {
    tokens: [Tensor; 3],
    experts: [Tensor; 2],
}

/// `moe_route` of random logits for `tokens` tokens: (weights, ids, the
/// number of distinct experts chosen).
fn random_routing(
    device: &Device,
    tokens: usize,
    experts: usize,
    top_k: usize,
) -> candle_core::Result<(Tensor, Tensor, usize)> {
    let logits = Tensor::rand(-3f32, 3.0, (tokens, experts), device)?;
    let (weights, ids) = moe_route(&logits, top_k, true, DType::F32)?;
    let mut chosen: Vec<u32> = ids.flatten_all()?.to_vec1()?;
    chosen.sort_unstable();
    chosen.dedup();
    Ok((weights, ids, chosen.len()))
}

/// `moe_experts_with` at BerryLM-OS shapes, routed by `moe_route` on random
/// logits, with each algorithm that takes the call.
fn moe_table(device: &Device) -> candle_core::Result<()> {
    // BerryLM-OS: experts, top-k, hidden size, expert width.
    let [experts, top_k, hidden, inter] = [128usize, 8, 2048, 512];
    println!("moe_experts, E={experts} k={top_k} H={hidden} I={inter}, bf16");
    println!("| tokens | routed rows | experts chosen | algorithm | GPU ms/call | TFLOP/s (GPU) | weights GB/s (GPU) | host ms/call |");
    println!("|---:|---:|---:|---|---:|---:|---:|---:|");
    let uniform = |dims: &[usize], scale: f32| {
        Tensor::rand(-scale, scale, dims, device)?.to_dtype(DType::BF16)
    };
    let expert_weights = [
        uniform(&[experts, 2 * inter, hidden], 0.05)?,
        uniform(&[experts, hidden, inter], 0.05)?,
    ];
    for tokens in [16usize, 32, 64, 128, 256, 4096, 32768] {
        let (weights, ids, chosen) = random_routing(device, tokens, experts, top_k)?;
        let x = MoeInputs {
            tokens: [uniform(&[tokens, hidden], 2.0)?, weights, ids],
            experts: expert_weights.clone(),
        };
        let iters = if tokens > 1000 { 20 } else { 200 };
        let routed = tokens * top_k;
        let picked = MoeExpertsAlgorithm::for_rows(routed);
        for algorithm in [MoeExpertsAlgorithm::Streamed, MoeExpertsAlgorithm::Grouped] {
            if algorithm == MoeExpertsAlgorithm::Streamed && routed > 4096 {
                continue;
            }
            let (gpu, host) = time_calls(device, &x, iters, |inputs| {
                let [x, weights, ids] = &inputs.tokens;
                let [gate_up, down] = &inputs.experts;
                drop(moe_experts_with(algorithm, x, weights, ids, gate_up, down)?);
                Ok(())
            })?;
            let flops = 2.0 * (routed * 3 * hidden * inter) as f64;
            let weight_bytes = (chosen * 3 * hidden * inter * 2) as f64;
            let mark = if algorithm == picked { " (picked)" } else { "" };
            println!(
                "| {tokens} | {routed} | {} | {algorithm:?}{mark} | {:.3} | {:.1} | {:.0} | {:.3} |",
                chosen,
                gpu * 1e3,
                flops / gpu * 1e-12,
                weight_bytes / gpu * 1e-9,
                host * 1e3
            );
        }
    }
    Ok(())
}

/// Weights of `dims` in GGUF blocks of `format` on `device`: random bytes
/// (the timing does not depend on the values) with every block's f16
/// scales (q8_0's d; q4_K's d and dmin) set to 0.001, so that the values are
/// finite.
fn random_blocks(
    device: &Device,
    format: GgmlDType,
    dims: &[usize],
) -> candle_core::Result<QTensor> {
    const SCALE_F16_LE: [u8; 2] = [0x19, 0x14];
    let blocks = dims.iter().product::<usize>() / format.block_size();
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut bytes: Vec<u8> = (0..blocks * format.type_size())
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 56) as u8
        })
        .collect();
    let scales = if format == GgmlDType::Q4K { 2 } else { 1 };
    for block in bytes.chunks_exact_mut(format.type_size()) {
        for scale in 0..scales {
            block[2 * scale..2 * scale + 2].copy_from_slice(&SCALE_F16_LE);
        }
    }
    // Borrowed: candle 0.10.2's `from_data` reads an owned buffer after
    // dropping it.
    let storage = QStorage::from_data(Cow::Borrowed(&bytes), device, format)?;
    QTensor::new(storage, dims)
}

fn block_bytes(format: GgmlDType, weights: usize) -> f64 {
    (weights / format.block_size() * format.type_size()) as f64
}

struct QuantizedInputs<'a> {
    x: Tensor,
    weight: &'a QTensor,
}

struct QuantizedMoeInputs<'a> {
    /// `[x, weights, ids]`.
    tokens: [Tensor; 3],
    gate_up: &'a QTensor,
    down: &'a QTensor,
}

/// `--quantized`: the decode projections of BerryLM-OS with quantized
/// weights, then its routed experts.
fn quantized_table(device: &Device) -> candle_core::Result<()> {
    // (projection, out, in): the KDA layer's quantized q|k|v|z, the attention
    // layer's q (with its output gate)|k|v, the shared expert's gate|up and
    // down, the KDA out_proj and attention o_proj, the LM head.
    let projections = [
        ("KDA q|k|v|z", 12_288usize, 2048usize),
        ("attention q|gate|k|v", 9216, 2048),
        ("shared expert gate|up", 1024, 2048),
        ("out_proj / o_proj", 2048, 4096),
        ("shared expert down", 2048, 512),
        ("LM head", 180_224, 2048),
    ];
    println!("quantized_matmul, x bf16, weights in GGUF blocks");
    println!("| format | projection | out x in | rows of x | GPU us/call | weight GB/s (GPU) | host us/call |");
    println!("|---|---|---|---:|---:|---:|---:|");
    for format in [GgmlDType::Q4K, GgmlDType::Q8_0] {
        for (name, out, width) in projections {
            let weight = random_blocks(device, format, &[out, width])?;
            for rows in [1usize, 8] {
                let x = QuantizedInputs {
                    x: Tensor::rand(-2f32, 2.0, (rows, width), device)?.to_dtype(DType::BF16)?,
                    weight: &weight,
                };
                let iters = if out > 100_000 { 200 } else { 2000 };
                let (gpu, host) = time_calls(device, &x, iters, |inputs| {
                    drop(quantized_matmul(&inputs.x, inputs.weight)?);
                    Ok(())
                })?;
                println!(
                    "| {format:?} | {name} | {out} x {width} | {rows} | {:.1} | {:.0} | {:.1} |",
                    gpu * 1e6,
                    block_bytes(format, out * width) / gpu * 1e-9,
                    host * 1e6
                );
            }
        }
    }
    let [experts, top_k, hidden, inter] = [128usize, 8, 2048, 512];
    println!();
    println!("moe_experts_quantized, E={experts} k={top_k} H={hidden} I={inter}, x bf16");
    println!(
        "| format | tokens | experts chosen | GPU us/call | weight GB/s (GPU) | host us/call |"
    );
    println!("|---|---:|---:|---:|---:|---:|");
    for format in [GgmlDType::Q4K, GgmlDType::Q8_0] {
        let gate_up = random_blocks(device, format, &[experts, 2 * inter, hidden])?;
        let down = random_blocks(device, format, &[experts, hidden, inter])?;
        for tokens in [1usize, 8] {
            let (weights, ids, chosen) = random_routing(device, tokens, experts, top_k)?;
            let x = QuantizedMoeInputs {
                tokens: [
                    Tensor::rand(-2f32, 2.0, (tokens, hidden), device)?.to_dtype(DType::BF16)?,
                    weights,
                    ids,
                ],
                gate_up: &gate_up,
                down: &down,
            };
            let (gpu, host) = time_calls(device, &x, 2000, |inputs| {
                let [x, weights, ids] = &inputs.tokens;
                drop(moe_experts_quantized(
                    x,
                    weights,
                    ids,
                    inputs.gate_up,
                    inputs.down,
                )?);
                Ok(())
            })?;
            println!(
                "| {format:?} | {tokens} | {} | {:.1} | {:.0} | {:.1} |",
                chosen,
                gpu * 1e6,
                block_bytes(format, chosen * 3 * hidden * inter) / gpu * 1e-9,
                host * 1e6
            );
        }
    }
    Ok(())
}
