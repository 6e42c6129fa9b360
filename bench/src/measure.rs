//! The measurements: the model's prefill and decode steps through the plugin's
//! `Driver`, one KDA layer's kernels, and the device's copy bandwidth. Every
//! clock is read after `Device::synchronize`.

use std::time::Instant;

use anyhow::Result;
use berrylm::driver::Driver;
use berrylm::graph_batches::GraphBatches;
use berrylm::model::BerryLm;
use candle_core::{DType, Device, Module, Tensor};

use crate::args::DecodeKv;
use crate::shape::ModelShape;

/// Seconds per call of `call`: after two warm-up calls, as many back-to-back
/// calls as fit in `budget_s` (at least 3), one synchronisation at the end.
pub fn time_calls(
    device: &Device,
    budget_s: f64,
    mut call: impl FnMut() -> Result<()>,
) -> Result<f64> {
    for _ in 0..2 {
        call()?;
    }
    device.synchronize()?;
    let start = Instant::now();
    call()?;
    device.synchronize()?;
    let once = start.elapsed().as_secs_f64().max(1e-7);
    let iterations = ((budget_s / once) as usize).clamp(3, 20_000);
    let start = Instant::now();
    for _ in 0..iterations {
        call()?;
    }
    device.synchronize()?;
    Ok(start.elapsed().as_secs_f64() / iterations as f64)
}

/// The time one call of an operation takes on the host until it returns
/// (for a GPU: with its work queued) and until its work is done, each per call
/// over back-to-back calls.
pub struct OpCost {
    pub name: &'static str,
    pub dispatch_s: f64,
    pub total_s: f64,
}

/// Calls of each operation in [`op_costs`].
pub const OP_COST_CALLS: usize = 2000;

/// Host cost of the kinds of operation a decode step is made of, at batch-1
/// decode sizes (`hidden` wide rows of `dtype`): candle's elementwise
/// operations on contiguous and broadcast operands, a copy, a dtype
/// conversion, a cuBLAS product with a projection weight, the plugin's own projection
/// (the host's GEMV kernel on CUDA), one of the plugin's
/// kernels, and a host-to-device upload. On a GPU a step is bound by the host
/// when the sum of its operations' dispatch times exceeds its GPU time.
pub fn op_costs(device: &Device, dtype: DType, hidden: usize) -> Result<Vec<OpCost>> {
    let normal = |dims: &[usize]| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, 1.0, dims, device)?.to_dtype(dtype)?)
    };
    let (x, y, gate) = (
        normal(&[1, hidden])?,
        normal(&[1, hidden])?,
        normal(&[1, 1])?,
    );
    let wide = normal(&[2, 3 * hidden])?;
    let weight = (normal(&[hidden, hidden])? * 0.02)?;
    let scale = Tensor::ones(hidden, DType::F32, device)?;
    let projection = berrylm::layers::linear::Linear::new(weight.clone(), None);
    type Op<'a> = (&'static str, Box<dyn Fn() -> Result<Tensor> + 'a>);
    let ops: Vec<Op> = vec![
        ("add of two contiguous [1, H]", Box::new(|| Ok((&x + &y)?))),
        (
            "broadcast_mul [1, H] by [1, 1]",
            Box::new(|| Ok(x.broadcast_mul(&gate)?)),
        ),
        (
            "copy of a [2, H] slice of [2, 3H] (narrow + contiguous)",
            Box::new(|| Ok(wide.narrow(1, hidden, hidden)?.contiguous()?)),
        ),
        (
            "to_dtype f32 of [1, H]",
            Box::new(|| Ok(x.to_dtype(DType::F32)?)),
        ),
        (
            "matmul [1, H] x [H, H]^T (cuBLAS on a GPU)",
            Box::new(|| Ok(berrylm::layers::ops::matmul(&x, &weight.t()?)?)),
        ),
        (
            "the plugin's projection [1, H] -> [1, H] (Linear::forward)",
            Box::new(|| Ok(projection.forward(&x)?)),
        ),
        (
            "offset_rms_norm [1, H] (a berrylm kernel)",
            Box::new(|| Ok(berrylm_kernels::offset_rms_norm(&x, &scale, 1e-6)?)),
        ),
        (
            "upload of 64 f32 (Tensor::from_vec)",
            Box::new(|| Ok(Tensor::from_vec(vec![0f32; 64], 64, device)?)),
        ),
    ];
    let mut costs = Vec::with_capacity(ops.len());
    for (name, op) in ops {
        for _ in 0..10 {
            drop(op()?);
        }
        device.synchronize()?;
        let start = Instant::now();
        for _ in 0..OP_COST_CALLS {
            drop(op()?);
        }
        let dispatch_s = start.elapsed().as_secs_f64() / OP_COST_CALLS as f64;
        device.synchronize()?;
        let total_s = start.elapsed().as_secs_f64() / OP_COST_CALLS as f64;
        costs.push(OpCost {
            name,
            dispatch_s,
            total_s,
        });
    }
    Ok(costs)
}

/// Deterministic pseudo-random token ids (splitmix64).
pub fn token_ids(count: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    (0..count)
        .map(|_| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            (z % vocab as u64) as u32
        })
        .collect()
}

/// Median of a non-empty sample.
pub fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    if sorted.len() % 2 == 1 {
        sorted[mid]
    } else {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    }
}

pub fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len() as f64
}

/// A batch-1 prefill of `tokens` tokens, timed `repeats` times on fresh caches
/// after one untimed run: seconds of each forward (embeddings to the LM head of
/// the last position, as the engine runs a prompt).
pub fn prefill(model: &BerryLm, tokens: usize, repeats: usize, seed: u64) -> Result<Vec<f64>> {
    let device = model.device();
    let ids = token_ids(tokens, model.config().vocab_size, seed);
    let mut seconds = Vec::with_capacity(repeats);
    for run in 0..=repeats {
        let mut driver = Driver::new(model, 1)?;
        device.synchronize()?;
        let start = Instant::now();
        let logits = driver.step_last(&[&ids])?;
        device.synchronize()?;
        let elapsed = start.elapsed().as_secs_f64();
        check_logits(&logits, 1)?;
        if run > 0 {
            seconds.push(elapsed);
        }
    }
    Ok(seconds)
}

/// Seconds of each timed decode step: until its results are on the device
/// (`total`), and until the forward call returned to the CPU with every
/// kernel queued (`dispatch`). A `dispatch` close to `total` means the step is
/// bound by the CPU's dispatch (or waits inside the forward), not by the GPU.
pub struct StepTimes {
    pub total: Vec<f64>,
    pub dispatch: Vec<f64>,
    /// Steps replayed from CUDA graphs (warm-up steps included).
    pub graph_replays: u64,
    /// The last step's logits, `[batch * vocab]` as f32.
    pub last_logits: Vec<f32>,
}

/// The steps of a decode run: a prefill of `context` tokens per sequence,
/// `warmup` untimed steps, then `timed` timed steps.
pub struct DecodeSteps {
    pub context: usize,
    pub warmup: usize,
    pub timed: usize,
}

/// Decoding at `batch` sequences, the steps of `run`.
pub fn decode(
    model: &BerryLm,
    batch: usize,
    kv: DecodeKv,
    graph_batches: &GraphBatches,
    run: &DecodeSteps,
    seed: u64,
) -> Result<StepTimes> {
    let &DecodeSteps {
        context,
        warmup,
        timed: steps,
    } = run;
    let device = model.device();
    let vocab = model.config().vocab_size;
    let tokens = context + warmup + steps;
    let mut driver = match kv {
        DecodeKv::Contiguous => Driver::new(model, batch)?,
        DecodeKv::Paged => Driver::paged(model, batch, tokens)?,
        DecodeKv::Graphs => {
            Driver::paged(model, batch, tokens)?.with_decode_graphs(graph_batches.clone())?
        }
    };
    let prompts: Vec<Vec<u32>> = (0..batch)
        .map(|row| token_ids(context, vocab, seed ^ ((row as u64 + 1) << 32)))
        .collect();
    let chunks: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    check_logits(&driver.step_last(&chunks)?, batch)?;
    let next = token_ids(batch * (warmup + steps), vocab, seed.wrapping_add(7));
    let mut times = StepTimes {
        total: Vec::with_capacity(steps),
        dispatch: Vec::with_capacity(steps),
        graph_replays: 0,
        last_logits: Vec::new(),
    };
    for (step, tokens) in next.chunks(batch).enumerate() {
        let rows: Vec<&[u32]> = tokens.chunks(1).collect();
        device.synchronize()?;
        let start = Instant::now();
        let logits = driver.step_last(&rows)?;
        let dispatched = start.elapsed().as_secs_f64();
        device.synchronize()?;
        let elapsed = start.elapsed().as_secs_f64();
        if step >= warmup {
            times.total.push(elapsed);
            times.dispatch.push(dispatched);
        }
        if step + 1 == warmup + steps {
            check_logits(&logits, batch)?;
            times.last_logits = logits.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
        }
    }
    times.graph_replays = driver.decode_graph_replays();
    Ok(times)
}

/// A benchmark whose logits are NaN or of the wrong shape measured nothing.
fn check_logits(logits: &Tensor, batch: usize) -> Result<()> {
    let (rows, _) = logits.dims2()?;
    anyhow::ensure!(
        rows == batch,
        "logits have {rows} rows for {batch} sequences"
    );
    let sum = logits.sum_all()?.to_dtype(DType::F32)?.to_scalar::<f32>()?;
    anyhow::ensure!(sum.is_finite(), "the logits are not finite ({sum})");
    Ok(())
}

/// The kernels of one KDA layer (and the AttnRes mix before it) timed by
/// [`kernel_times`], in table order.
pub const KERNEL_OPS: [&str; 6] = [
    "kda_gate",
    "causal_conv1d",
    "kda_recurrence",
    "gated_rms_norm",
    "attn_res_mix (2 sources)",
    "attn_res_mix (6 sources)",
];

/// Seconds per call of each of [`KERNEL_OPS`] on random inputs of one KDA
/// layer's shapes for `batch` sequences of `seq_len` tokens, in the dtypes the
/// model passes (activations and parameters in `dtype`; gate, beta and the
/// recurrent state in f32). AttnRes mixes 2 sources (layers 0-7) and 6 (the
/// last block of the 40-layer model).
pub fn kernel_times(
    shape: &ModelShape,
    dtype: DType,
    device: &Device,
    batch: usize,
    seq_len: usize,
    budget_s: f64,
) -> Result<Vec<f64>> {
    let tokens = batch * seq_len;
    let (hk, hv, dk, dv) = (
        shape.key_heads,
        shape.value_heads,
        shape.key_dim,
        shape.value_dim,
    );
    let normal = |dims: &[usize], std: f32, dtype: DType| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, std, dims, device)?.to_dtype(dtype)?)
    };
    let uniform = |dims: &[usize], lo: f32, hi: f32, dtype: DType| -> Result<Tensor> {
        Ok(Tensor::rand(lo, hi, dims, device)?.to_dtype(dtype)?)
    };
    let mut times = Vec::with_capacity(KERNEL_OPS.len());

    let raw = normal(&[tokens, shape.gate_dim()], 0.5, dtype)?;
    let a_log = uniform(&[hv], 1.0, 16.0, DType::F32)?
        .log()?
        .to_dtype(dtype)?;
    let dt_bias = uniform(&[shape.gate_dim()], -7.0, -2.3, dtype)?;
    times.push(time_calls(device, budget_s, || {
        drop(berrylm_kernels::kda_gate(&raw, &a_log, &dt_bias, hv, None)?);
        Ok(())
    })?);

    let x = normal(&[batch, seq_len, shape.conv_dim()], 1.0, dtype)?;
    let weight = uniform(&[shape.conv_dim(), shape.conv_kernel], -0.5, 0.5, dtype)?;
    let state = normal(&[batch, shape.conv_dim(), shape.conv_kernel], 1.0, dtype)?;
    times.push(time_calls(device, budget_s, || {
        drop(berrylm_kernels::causal_conv1d(&x, &weight, &state)?);
        Ok(())
    })?);

    let q = normal(&[batch, seq_len, hk, dk], 1.0, dtype)?;
    let k = normal(&[batch, seq_len, hk, dk], 1.0, dtype)?;
    let v = normal(&[batch, seq_len, hv, dv], 1.0, dtype)?;
    let g = uniform(&[batch, seq_len, hv, dk], -1.0, 0.0, DType::F32)?;
    let beta = uniform(&[batch, seq_len, hv], 0.0, 1.0, DType::F32)?;
    let recurrent = normal(&[batch, hv, dk, dv], 0.1, DType::F32)?;
    times.push(time_calls(device, budget_s, || {
        drop(berrylm_kernels::kda_recurrence(
            &q, &k, &v, &g, &beta, &recurrent,
        )?);
        Ok(())
    })?);

    let rows = tokens * hv;
    // The recurrence's f32 output, as the model passes it.
    let out = normal(&[rows, dv], 1.0, DType::F32)?;
    let z = normal(&[rows, dv], 1.0, dtype)?;
    let norm_weight = uniform(&[dv], 0.9, 1.1, dtype)?;
    times.push(time_calls(device, budget_s, || {
        drop(berrylm_kernels::gated_rms_norm(
            &out,
            &z,
            &norm_weight,
            1e-6,
            dtype,
        )?);
        Ok(())
    })?);

    let pseudo_query = normal(&[shape.hidden], 0.02, dtype)?;
    for count in [2, 6] {
        let sources = (0..count)
            .map(|_| normal(&[tokens, shape.hidden], 1.0, dtype))
            .collect::<Result<Vec<_>>>()?;
        times.push(time_calls(device, budget_s, || {
            drop(berrylm_kernels::attn_res_mix(
                &sources,
                &pseudo_query,
                Some(0.05),
                1e-6,
            )?);
            Ok(())
        })?);
    }
    Ok(times)
}

/// One way of copying a large buffer on the device.
pub struct CopyFigure {
    pub method: &'static str,
    /// Seconds per copy.
    pub seconds: f64,
    /// Bytes read plus bytes written per second.
    pub bandwidth: f64,
}

/// Device-to-device copies of `bytes` bytes, timed two ways: `Tensor::copy`
/// (a fresh output per copy; on CUDA a `cuMemcpyDtoD` from candle's stream-ordered
/// pool) and `Tensor::slice_set` into a preallocated tensor (no allocation; on the
/// CPU this avoids page-faulting a fresh buffer on every copy). The bandwidth
/// counts the bytes read plus the bytes written (`2 * bytes` per copy).
pub fn copy_bandwidth(device: &Device, bytes: usize, budget_s: f64) -> Result<Vec<CopyFigure>> {
    let elements = bytes / 4;
    let moved = 2.0 * (elements * 4) as f64;
    let source = Tensor::ones(elements, DType::F32, device)?;
    let destination = Tensor::zeros(elements, DType::F32, device)?;
    let copy = time_calls(device, budget_s, || {
        drop(source.copy()?);
        Ok(())
    })?;
    let slice_set = time_calls(device, budget_s, || {
        destination.slice_set(&source, 0, 0)?;
        Ok(())
    })?;
    Ok(vec![
        CopyFigure {
            method: "Tensor::copy",
            seconds: copy,
            bandwidth: moved / copy,
        },
        CopyFigure {
            method: "Tensor::slice_set",
            seconds: slice_set,
            bandwidth: moved / slice_set,
        },
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_ids_are_deterministic_and_in_range() {
        let a = token_ids(1000, 2048, 3);
        assert_eq!(a, token_ids(1000, 2048, 3));
        assert_ne!(a, token_ids(1000, 2048, 4));
        assert!(a.iter().all(|&id| id < 2048));
        let distinct: std::collections::HashSet<u32> = a.iter().copied().collect();
        assert!(distinct.len() > 300);
    }

    #[test]
    fn statistics() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
        assert_eq!(mean(&[1.0, 2.0, 6.0]), 3.0);
    }

    #[test]
    fn every_kernel_runs_on_the_cpu() {
        let shape = ModelShape::tiny(1);
        for (batch, seq_len) in [(2, 1), (1, 9)] {
            let times =
                kernel_times(&shape, DType::BF16, &Device::Cpu, batch, seq_len, 1e-3).unwrap();
            assert_eq!(times.len(), KERNEL_OPS.len());
            assert!(times.iter().all(|t| t.is_finite() && *t > 0.0), "{times:?}");
        }
    }
}
