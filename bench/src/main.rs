//! `berrylm-bench`: throughput of the berrylm plugin on a BerryLM-OS-shaped
//! model with random weights generated on the device (nothing is read from or
//! written to disk but the optional JSON report; `--save-checkpoint` writes the
//! model as a servable checkpoint instead, see checkpoint.rs).
//!
//! It measures, synchronising the device before every clock read:
//! * batch-1 prefill tokens/s at several prompt lengths;
//! * decode ms/step and tokens/s at several batch sizes, after a prefill;
//! * the kernels of one KDA layer (gate, conv, recurrence, gated norm, AttnRes
//!   mix) on random inputs, for a decode step and a long prefill;
//! * the device's copy bandwidth, and from it the weight-read floor of a decode
//!   step (the bytes of the weights one step reads / bandwidth).
//!
//! The model's figures come from `berrylm::driver::Driver::step_last`: the
//! plugin's whole forward (embeddings, layers, final norm, LM head of each
//! sequence's last position) on a fresh host hybrid cache, as the engine's
//! non-paged path runs it; sampling and scheduling are not included.

mod args;
mod checkpoint;
mod measure;
mod shape;

use std::collections::HashMap;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::Device;
use serde_json::{json, Value};

use crate::args::{Args, DecodeKv};
use crate::measure::{mean, median, DecodeSteps, KERNEL_OPS};
use crate::shape::ModelShape;

const MIB: f64 = (1u64 << 20) as f64;

fn main() -> ExitCode {
    // The plugin's warnings (a decode graph that could not be captured) on
    // stderr; RUST_LOG=berrylm=info also shows each capture.
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            eprintln!("berrylm-bench: error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// Runs every measurement; `Ok(false)` when some of them failed (each failure
/// is reported and the others still run).
fn run() -> Result<bool> {
    let args = Args::from_command_line();
    let device = args.device.open()?;
    let shape = if args.tiny {
        ModelShape::tiny(args.layers)
    } else {
        ModelShape::full(args.layers)
    };
    if let Some(dir) = &args.save_checkpoint {
        println!(
            "writing a random {} checkpoint ({}, {} layers) to {}",
            if args.tiny {
                "tiny"
            } else {
                "BerryLM-OS-shaped"
            },
            shape.layout(),
            shape.layers,
            dir.display()
        );
        checkpoint::save(&shape, dir, &device)?;
        return Ok(true);
    }
    let mut bench = Bench {
        args: &args,
        device: &device,
        shape: &shape,
        bandwidth: None,
        errors: Vec::new(),
    };
    let mut report = bench.header();

    report["bandwidth"] = bench.bandwidth();
    if args.op_costs {
        report["op_costs"] = bench.op_costs();
    }

    let start = Instant::now();
    let model = match args.isq {
        None => shape::build_model(&shape, args.dtype.candle(), &device)?,
        Some(isq) => {
            let (model, quantization) = berrylm::driver::quantized_while_loading(isq, || {
                shape::build_model(&shape, args.dtype.candle(), &device)
            })?;
            println!("in-situ quantization to {isq:?}: {quantization}");
            println!(
                "  (the decode floors below are of the unquantized weights; the weights now take \
                 {:.1} % of their bytes)",
                100.0 * quantization.bytes as f64 / quantization.full_precision_bytes as f64
            );
            report["isq"] = json!({
                "type": format!("{isq:?}"),
                "projections": quantization.projections,
                "quantized": quantization.quantized,
                "bytes": quantization.bytes,
                "full_precision_bytes": quantization.full_precision_bytes,
            });
            model
        }
    };
    device.synchronize()?;
    let build_s = start.elapsed().as_secs_f64();
    println!("random model generated on the device and loaded in {build_s:.1} s");
    report["model_build_s"] = json!(build_s);

    report["prefill"] = bench.prefill(&model);
    report["decode"] = bench.decode(&model);
    report["decode_floor_batch1"] = bench.floor_batch1();
    drop(model);
    report["kernels"] = bench.kernels();

    report["errors"] = json!(bench.errors);
    if !bench.errors.is_empty() {
        println!();
        println!("{} measurement(s) failed:", bench.errors.len());
        for error in &bench.errors {
            println!("  {error}");
        }
    }
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(bench.errors.is_empty())
}

struct Bench<'a> {
    args: &'a Args,
    device: &'a Device,
    shape: &'a ModelShape,
    /// Measured copy bandwidth, read + write bytes per second.
    bandwidth: Option<f64>,
    errors: Vec<String>,
}

/// Bytes one decode step of `batch` sequences moves, split into the weights it
/// reads and the cache state it reads and writes.
struct StepBytes {
    dense: f64,
    experts: f64,
    embedding_rows: f64,
    state: f64,
}

impl StepBytes {
    fn weights(&self) -> f64 {
        self.dense + self.experts + self.embedding_rows
    }
}

impl Bench<'_> {
    fn dtype_bytes(&self) -> f64 {
        self.args.dtype.candle().size_in_bytes() as f64
    }

    fn header(&self) -> Value {
        let (args, s) = (self.args, self.shape);
        let counts = s.parameter_counts();
        println!(
            "berrylm-bench: {} BerryLM-OS shape, {} layers {}, {} on {}",
            if args.tiny { "tiny" } else { "full-width" },
            s.layers,
            s.layout(),
            args.dtype.name(),
            args.device.name()
        );
        println!(
            "  hidden {}; attention {} heads / {} KV heads x {}; KDA Hk {} / Hv {}, dk {} / dv {}, conv {}, \
             gate rank {}; {} experts top-{} (intermediate {}, shared {}); vocabulary {}; AttnRes block {}",
            s.hidden,
            s.heads,
            s.kv_heads,
            s.head_dim,
            s.key_heads,
            s.value_heads,
            s.key_dim,
            s.value_dim,
            s.conv_kernel,
            s.gate_rank,
            s.experts,
            s.top_k,
            s.expert_intermediate,
            s.shared_intermediate,
            s.vocab,
            s.block_size
        );
        println!(
            "  {:.3} B parameters, {:.2} GiB of random weights",
            counts.total() as f64 * 1e-9,
            counts.total() as f64 * self.dtype_bytes() / (1u64 << 30) as f64
        );
        json!({
            "tool": "berrylm-bench",
            "device": args.device.name(),
            "dtype": args.dtype.name(),
            "tiny": args.tiny,
            "layout": s.layout(),
            "shape": {
                "hidden_size": s.hidden,
                "num_hidden_layers": s.layers,
                "kda_layers": s.kda_layers(),
                "attention_layers": s.attention_layers(),
                "num_attention_heads": s.heads,
                "num_key_value_heads": s.kv_heads,
                "head_dim": s.head_dim,
                "linear_num_key_heads": s.key_heads,
                "linear_num_value_heads": s.value_heads,
                "linear_key_head_dim": s.key_dim,
                "linear_value_head_dim": s.value_dim,
                "linear_conv_kernel_dim": s.conv_kernel,
                "kda_gate_bottleneck": s.gate_rank,
                "num_experts": s.experts,
                "num_experts_per_tok": s.top_k,
                "moe_intermediate_size": s.expert_intermediate,
                "shared_expert_intermediate_size": s.shared_intermediate,
                "vocab_size": s.vocab,
                "attn_res_block_size": s.block_size,
            },
            "parameters": {
                "total": counts.total(),
                "dense": counts.dense,
                "routed_experts": counts.experts,
                "embedding": counts.embedding,
            },
            "weight_bytes": counts.total() as f64 * self.dtype_bytes(),
        })
    }

    fn bandwidth(&mut self) -> Value {
        println!();
        println!("## Device copy bandwidth");
        let bytes = self.args.copy_mib << 20;
        match measure::copy_bandwidth(self.device, bytes, 0.3) {
            Ok(figures) => {
                for figure in &figures {
                    println!(
                        "device-to-device copy of {} MiB ({}): {:.3} ms, {:.1} GB/s (bytes read + written)",
                        self.args.copy_mib,
                        figure.method,
                        figure.seconds * 1e3,
                        figure.bandwidth * 1e-9
                    );
                }
                let best = figures
                    .iter()
                    .max_by(|a, b| a.bandwidth.total_cmp(&b.bandwidth))
                    .expect("two copy figures");
                println!(
                    "bandwidth used for the floors: {:.1} GB/s ({})",
                    best.bandwidth * 1e-9,
                    best.method
                );
                self.bandwidth = Some(best.bandwidth);
                let methods: Vec<Value> = figures
                    .iter()
                    .map(|f| {
                        json!({
                            "method": f.method,
                            "copy_ms": f.seconds * 1e3,
                            "read_write_bytes_per_s": f.bandwidth,
                        })
                    })
                    .collect();
                json!({
                    "copy_bytes": bytes,
                    "methods": methods,
                    "read_write_bytes_per_s": best.bandwidth,
                })
            }
            Err(error) => self.failed(format!("copy bandwidth: {error:#}")),
        }
    }

    fn op_costs(&mut self) -> Value {
        println!();
        println!(
            "## Host cost per operation ({} back-to-back calls each, hidden {}, {}): µs per call \
             until it returns (dispatch) and until its work is done",
            measure::OP_COST_CALLS,
            self.shape.hidden,
            self.args.dtype.name()
        );
        println!("| operation | dispatch µs | total µs |");
        println!("|---|---:|---:|");
        match measure::op_costs(self.device, self.args.dtype.candle(), self.shape.hidden) {
            Ok(costs) => Value::Array(
                costs
                    .iter()
                    .map(|cost| {
                        println!(
                            "| {} | {:.1} | {:.1} |",
                            cost.name,
                            cost.dispatch_s * 1e6,
                            cost.total_s * 1e6
                        );
                        json!({
                            "operation": cost.name,
                            "dispatch_us": cost.dispatch_s * 1e6,
                            "total_us": cost.total_s * 1e6,
                        })
                    })
                    .collect(),
            ),
            Err(error) => self.failed(format!("host cost per operation: {error:#}")),
        }
    }

    fn prefill(&mut self, model: &berrylm::model::BerryLm) -> Value {
        let args = self.args;
        let repeats = args.repeats;
        println!();
        println!(
            "## Prefill, batch 1 (forward to the LM head of the last position; median of {repeats} \
             runs after one warm-up, each on a fresh cache)"
        );
        println!("| prompt tokens | forward ms | tokens/s |");
        println!("|---:|---:|---:|");
        let mut figures = Vec::new();
        for &tokens in &args.prefill {
            match measure::prefill(model, tokens, repeats, args.seed) {
                Ok(seconds) => {
                    let forward = median(&seconds);
                    let runs_ms: Vec<f64> = seconds.iter().map(|s| s * 1e3).collect();
                    println!(
                        "| {tokens} | {} | {} |",
                        num(forward * 1e3),
                        num(tokens as f64 / forward)
                    );
                    figures.push(json!({
                        "tokens": tokens,
                        "batch": 1,
                        "runs_ms": runs_ms,
                        "forward_ms": forward * 1e3,
                        "tokens_per_s": tokens as f64 / forward,
                    }));
                }
                Err(error) => {
                    println!("| {tokens} | failed | |");
                    figures.push(self.failed(format!("prefill {tokens}: {error:#}")));
                }
            }
        }
        Value::Array(figures)
    }

    fn decode(&mut self, model: &berrylm::model::BerryLm) -> Value {
        let args = self.args;
        let (context, warmup, steps) = (args.context, args.warmup, args.steps);
        println!();
        println!(
            "## Decode (after a {context}-token prefill per sequence; {steps} timed steps after \
             {warmup} warm-up steps; floor: weights read + recurrent/conv state read and written + \
             KV read, at the copy bandwidth, experts assuming uniform routing)"
        );
        println!(
            "A graphs row's last column compares its last step's logits with the paged row's of \
             the same batch (the same tokens, run eagerly): `identical` bit for bit."
        );
        println!(
            "| batch | KV | ms/step (mean) | ms/step (median) | CPU dispatch ms/step | tokens/s | \
             weights read MiB | state MiB | floor ms | floor / measured | logits vs paged |"
        );
        println!("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|");
        let mut figures = Vec::new();
        // The last logits of each batch's eager paged run.
        let mut paged_logits: HashMap<usize, Vec<f32>> = HashMap::new();
        let runs = args
            .decode
            .iter()
            .flat_map(|&batch| args.decode_kv.iter().map(move |&kv| (batch, kv)));
        for (batch, kv) in runs {
            let run = measure::decode(
                model,
                batch,
                kv,
                &args.graph_batches,
                &DecodeSteps {
                    context,
                    warmup,
                    timed: steps,
                },
                args.seed,
            );
            match run {
                Ok(mut times) => {
                    let against_paged = match kv {
                        DecodeKv::Paged => {
                            paged_logits.insert(batch, std::mem::take(&mut times.last_logits));
                            None
                        }
                        DecodeKv::Graphs => paged_logits
                            .get(&batch)
                            .map(|paged| logits_difference(&times.last_logits, paged)),
                        DecodeKv::Contiguous => None,
                    };
                    let seconds = &times.total;
                    let step_ms: Vec<f64> = seconds.iter().map(|s| s * 1e3).collect();
                    let (mean_s, median_s) = (mean(seconds), median(seconds));
                    let dispatch_s = mean(&times.dispatch);
                    let bytes = self.step_bytes(batch, context + warmup + steps / 2);
                    let floor = self
                        .bandwidth
                        .map(|bw| (bytes.weights() + bytes.state) / bw);
                    let kv_name = match kv {
                        DecodeKv::Graphs => format!("graphs ({} replayed)", times.graph_replays),
                        _ => kv.name().to_string(),
                    };
                    println!(
                        "| {batch} | {kv_name} | {} | {} | {} | {} | {:.1} | {:.1} | {} | {} | {} |",
                        num(mean_s * 1e3),
                        num(median_s * 1e3),
                        num(dispatch_s * 1e3),
                        num(batch as f64 / mean_s),
                        bytes.weights() / MIB,
                        bytes.state / MIB,
                        floor.map_or("n/a".into(), |f| num(f * 1e3)),
                        floor.map_or("n/a".into(), |f| format!("{:.1} %", 100.0 * f / mean_s)),
                        against_paged.as_deref().unwrap_or(""),
                    );
                    figures.push(json!({
                        "batch": batch,
                        "kv": kv.name(),
                        "graph_replays": times.graph_replays,
                        "last_logits_vs_paged": against_paged,
                        "context": context,
                        "warmup_steps": warmup,
                        "steps": steps,
                        "step_ms": step_ms,
                        "ms_per_step": mean_s * 1e3,
                        "median_ms_per_step": median_s * 1e3,
                        "cpu_dispatch_ms_per_step": dispatch_s * 1e3,
                        "tokens_per_s": batch as f64 / mean_s,
                        "floor": {
                            "weight_bytes": bytes.weights(),
                            "state_bytes": bytes.state,
                            "ms_per_step": floor.map(|f| f * 1e3),
                        },
                    }));
                }
                Err(error) => {
                    println!("| {batch} | {} | failed | | | | | | | | |", kv.name());
                    figures.push(self.failed(format!(
                        "decode batch {batch} ({} KV): {error:#}",
                        kv.name()
                    )));
                }
            }
        }
        Value::Array(figures)
    }

    /// Bytes of one decode step of `batch` sequences at `context` cached tokens.
    fn step_bytes(&self, batch: usize, context: usize) -> StepBytes {
        let s = self.shape;
        let counts = s.parameter_counts();
        let size = self.dtype_bytes();
        let experts_read = s.expected_experts(batch) / s.experts as f64;
        // The recurrent pool is f32: the KDA state and the conv state are read and written.
        let kda_state = (s.value_heads * s.key_dim * s.value_dim + s.conv_dim() * s.conv_kernel)
            as f64
            * 4.0
            * 2.0;
        let kv_read = (2 * s.kv_heads * s.head_dim * context) as f64 * size;
        StepBytes {
            dense: counts.dense as f64 * size,
            experts: counts.experts as f64 * experts_read * size,
            embedding_rows: (batch.min(s.vocab) * s.hidden) as f64 * size,
            state: batch as f64
                * (s.kda_layers() as f64 * kda_state + s.attention_layers() as f64 * kv_read),
        }
    }

    /// The weight-read floor of a batch-1 decode step.
    fn floor_batch1(&mut self) -> Value {
        let bytes = self.step_bytes(1, 0);
        println!();
        println!("## Weight-read floor, decode batch 1");
        println!(
            "weights one step reads: {:.1} MiB = non-expert weights and LM head {:.1} MiB + top-{} experts \
             of every layer {:.1} MiB + one embedding row {:.3} MiB ({})",
            bytes.weights() / MIB,
            bytes.dense / MIB,
            self.shape.top_k,
            bytes.experts / MIB,
            bytes.embedding_rows / MIB,
            self.args.dtype.name()
        );
        let Some(bandwidth) = self.bandwidth else {
            println!("no floor: the copy bandwidth was not measured");
            return Value::Null;
        };
        let floor = bytes.weights() / bandwidth;
        println!(
            "floor at {:.1} GB/s: {} ms/step, {} tokens/s",
            bandwidth * 1e-9,
            num(floor * 1e3),
            num(1.0 / floor)
        );
        json!({
            "weight_bytes": bytes.weights(),
            "dense_bytes": bytes.dense,
            "experts_bytes": bytes.experts,
            "embedding_row_bytes": bytes.embedding_rows,
            "read_write_bytes_per_s": bandwidth,
            "ms_per_step": floor * 1e3,
            "tokens_per_s": 1.0 / floor,
        })
    }

    fn kernels(&mut self) -> Value {
        if !self.args.kernels {
            return Value::Null;
        }
        let mut cases: Vec<(String, &str, usize, usize)> = self
            .args
            .decode
            .iter()
            .map(|&batch| (format!("decode B={batch}"), "decode", batch, 1))
            .collect();
        let tokens = self.args.kernel_tokens;
        cases.push((format!("prefill T={tokens}"), "prefill", 1, tokens));
        let budget = self.args.kernel_ms * 1e-3;
        let dtype = self.args.dtype.candle();
        let mut columns: Vec<Option<Vec<f64>>> = Vec::new();
        let mut figures = Vec::new();
        for (label, phase, batch, seq_len) in &cases {
            match measure::kernel_times(self.shape, dtype, self.device, *batch, *seq_len, budget) {
                Ok(times) => {
                    let layer_us = times[..5].iter().sum::<f64>() * 1e6;
                    let ops: serde_json::Map<String, Value> = KERNEL_OPS
                        .iter()
                        .zip(&times)
                        .map(|(op, t)| (op.to_string(), json!(t * 1e6)))
                        .collect();
                    figures.push(json!({
                        "phase": phase,
                        "batch": batch,
                        "tokens": seq_len,
                        "us": ops,
                        "kda_layer_ops_us": layer_us,
                    }));
                    columns.push(Some(times));
                }
                Err(error) => {
                    figures.push(self.failed(format!("kernels, {label}: {error:#}")));
                    columns.push(None);
                }
            }
        }
        println!();
        println!(
            "## KDA layer kernels (berrylm-kernels on random inputs, µs per call, mean of back-to-back \
             calls over ~{} ms each)",
            self.args.kernel_ms
        );
        let labels: Vec<&str> = cases.iter().map(|c| c.0.as_str()).collect();
        println!("| op | {} |", labels.join(" | "));
        println!("|---|{}", "---:|".repeat(cases.len()));
        for (index, op) in KERNEL_OPS.iter().enumerate() {
            let cells: Vec<String> = columns.iter().map(|c| cell(c, |t| t[index])).collect();
            println!("| {op} | {} |", cells.join(" | "));
        }
        let cells: Vec<String> = columns
            .iter()
            .map(|c| cell(c, |t| t[..5].iter().sum()))
            .collect();
        println!(
            "| sum: one KDA layer's ops (2 sources) | {} |",
            cells.join(" | ")
        );
        Value::Array(figures)
    }

    /// Records a failed measurement; returns its JSON entry.
    fn failed(&mut self, message: String) -> Value {
        eprintln!("berrylm-bench: {message}");
        let entry = json!({ "error": message });
        self.errors.push(message);
        entry
    }
}

/// How two runs' last logits differ: `identical` bit for bit, else the
/// largest absolute difference and how many values differ.
fn logits_difference(logits: &[f32], reference: &[f32]) -> String {
    if logits.len() != reference.len() {
        return format!("{} values against {}", logits.len(), reference.len());
    }
    let differing: Vec<f32> = logits
        .iter()
        .zip(reference)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .map(|(a, b)| (a - b).abs())
        .collect();
    if differing.is_empty() {
        return "identical".into();
    }
    let largest = differing.iter().copied().fold(0.0f32, |max, d| {
        if d.is_nan() || max.is_nan() {
            f32::NAN
        } else {
            max.max(d)
        }
    });
    format!(
        "{} of {} differ, max |Δ| {largest:.3e}",
        differing.len(),
        logits.len()
    )
}

/// A kernel table cell: `value` of a column's seconds, in µs.
fn cell(column: &Option<Vec<f64>>, value: impl Fn(&[f64]) -> f64) -> String {
    column
        .as_ref()
        .map_or("failed".to_string(), |times| num(value(times) * 1e6))
}

/// A figure with three or four significant digits.
fn num(value: f64) -> String {
    let magnitude = value.abs();
    if magnitude >= 100.0 {
        format!("{value:.0}")
    } else if magnitude >= 10.0 {
        format!("{value:.1}")
    } else if magnitude >= 1.0 {
        format!("{value:.2}")
    } else {
        format!("{value:.3}")
    }
}

#[cfg(test)]
mod tests {
    use super::logits_difference;

    #[test]
    fn logits_difference_counts_the_values_whose_bits_differ() {
        assert_eq!(logits_difference(&[1.0, -2.0], &[1.0, -2.0]), "identical");
        assert_eq!(
            logits_difference(&[1.0, 2.5, 3.0], &[1.0, 2.0, 3.25]),
            "2 of 3 differ, max |Δ| 5.000e-1"
        );
        // -0.0 and 0.0 are equal numbers with other bits.
        assert_eq!(
            logits_difference(&[0.0], &[-0.0]),
            "1 of 1 differ, max |Δ| 0.000e0"
        );
        assert_eq!(
            logits_difference(&[f32::NAN, 1.0], &[0.0, 1.0]),
            "1 of 2 differ, max |Δ| NaN"
        );
        assert_eq!(logits_difference(&[1.0], &[]), "1 values against 0");
    }
}
