//! The benchmark tool (`berrylm-bench`, the binary behind `cargo xtask bench`)
//! on the CPU at the tiny shape: it builds the random model under the
//! checkpoint's names, runs every measurement and reports positive, finite
//! figures for every requested size, in its table and in its JSON.

use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result};
use berrylm_tests::{run_successfully, workspace_binary};
use candle_core::{DType, Device};
use serde_json::Value;

fn positive(value: &Value, what: &str) -> f64 {
    let number = value
        .as_f64()
        .unwrap_or_else(|| panic!("{what} is not a number: {value}"));
    assert!(
        number.is_finite() && number > 0.0,
        "{what} is not positive and finite: {number}"
    );
    number
}

/// Checks a throughput figure of `count` tokens: its `ms_key` time and its
/// `tokens_per_s` are positive and agree; returns the time.
fn throughput(figure: &Value, ms_key: &str, count: u32, what: &str) -> f64 {
    let ms = positive(&figure[ms_key], &format!("{what} {ms_key}"));
    let rate = positive(&figure["tokens_per_s"], &format!("{what} tokens_per_s"));
    let count = f64::from(count);
    assert!((rate * ms / 1e3 - count).abs() < 1e-6 * count);
    ms
}

/// Runs `berrylm-bench` on the CPU at the tiny shape with 4 layers and
/// `args`, the last of which takes `path`; asserts that it succeeds and
/// returns its standard output.
fn run_tiny_bench(args: &[&str], path: &Path) -> Result<String> {
    run_successfully(
        Command::new(workspace_binary("berrylm-bench")?)
            .args(["--device", "cpu", "--tiny", "--layers", "4"])
            .args(args)
            .arg(path),
    )
}

#[test]
fn tiny_cpu_run_reports_every_requested_figure() -> Result<()> {
    let out = std::env::temp_dir().join(format!("berrylm-bench-test-{}", std::process::id()));
    std::fs::create_dir_all(&out)?;
    let json_path = out.join("bench.json");
    let stdout = run_tiny_bench(
        &[
            "--prefill",
            "16,24",
            "--decode",
            "1,3",
            "--context",
            "8",
            "--steps",
            "4",
            "--warmup",
            "1",
            "--repeats",
            "2",
            "--kernel-tokens",
            "32",
            "--kernel-ms",
            "5",
            "--copy-mib",
            "8",
            "--json",
        ],
        &json_path,
    )?;
    for heading in [
        "## Prefill",
        "## Decode",
        "## KDA layer kernels",
        "## Weight-read floor",
    ] {
        assert!(stdout.contains(heading), "no `{heading}` table:\n{stdout}");
    }
    assert!(stdout.contains("[KDA,KDA,KDA,attn]x1"), "{stdout}");

    let report: Value = serde_json::from_str(&std::fs::read_to_string(&json_path)?)?;
    assert_eq!(report["errors"], Value::Array(Vec::new()), "{report:#}");
    assert_eq!(report["shape"]["attention_layers"], 1);
    // The CPU's default: candle's CPU matmul has no bf16.
    assert_eq!(report["dtype"], "f32");

    let prefill = report["prefill"].as_array().context("prefill")?;
    assert_eq!(prefill.len(), 2);
    for (figure, tokens) in prefill.iter().zip([16, 24]) {
        assert_eq!(figure["tokens"], tokens);
        assert_eq!(figure["runs_ms"].as_array().map(Vec::len), Some(2));
        throughput(figure, "forward_ms", tokens, "prefill");
    }

    let decode = report["decode"].as_array().context("decode")?;
    assert_eq!(decode.len(), 2);
    for (figure, batch) in decode.iter().zip([1, 3]) {
        assert_eq!(figure["batch"], batch);
        assert_eq!(figure["step_ms"].as_array().map(Vec::len), Some(4));
        let ms = throughput(figure, "ms_per_step", batch, "decode");
        // Queuing a step's work cannot take longer than the step itself.
        let dispatch = positive(&figure["cpu_dispatch_ms_per_step"], "decode dispatch");
        assert!(dispatch <= ms, "dispatch {dispatch} ms of a {ms} ms step");
        positive(&figure["floor"]["ms_per_step"], "decode floor");
    }

    let floor = &report["decode_floor_batch1"];
    positive(&floor["ms_per_step"], "batch-1 floor");
    let bandwidth = positive(&report["bandwidth"]["read_write_bytes_per_s"], "bandwidth");
    let methods = report["bandwidth"]["methods"]
        .as_array()
        .context("copy methods")?;
    assert_eq!(methods.len(), 2);
    for method in methods {
        assert!(positive(&method["read_write_bytes_per_s"], "copy bandwidth") <= bandwidth);
    }
    // A batch-1 step reads every non-expert weight, 2 of the 8 experts of each
    // layer and one embedding row.
    let parameters = &report["parameters"];
    let expected = (parameters["dense"].as_f64().unwrap()
        + parameters["routed_experts"].as_f64().unwrap() * 2.0 / 8.0
        + 256.0)
        * 4.0;
    let weight_bytes = positive(&floor["weight_bytes"], "batch-1 weight bytes");
    assert!(
        (weight_bytes - expected).abs() <= 1e-9 * expected,
        "{weight_bytes} != {expected}"
    );

    let kernels = report["kernels"].as_array().context("kernels")?;
    let cases: Vec<(String, u64, u64)> = kernels
        .iter()
        .map(|k| {
            (
                k["phase"].as_str().unwrap_or_default().to_string(),
                k["batch"].as_u64().unwrap_or_default(),
                k["tokens"].as_u64().unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(
        cases,
        vec![
            ("decode".to_string(), 1, 1),
            ("decode".to_string(), 3, 1),
            ("prefill".to_string(), 1, 32)
        ]
    );
    for case in kernels {
        let ops = case["us"].as_object().context("kernel times")?;
        assert_eq!(ops.len(), 6, "{case}");
        for (op, us) in ops {
            positive(us, op);
        }
        positive(&case["kda_layer_ops_us"], "KDA layer sum");
    }
    std::fs::remove_dir_all(&out).ok();
    Ok(())
}

/// `--isq q8_0`: the host quantizes the projections BerryLM lets it quantize
/// (4 layers, [KDA x3, attention]: the LM head, 3 KDA projections per KDA
/// layer and 4 attention projections, 8 experts x 3 plus the shared expert's
/// 3 per layer) and the quantized model prefills and decodes.
#[test]
fn tiny_cpu_run_quantized_in_situ() -> Result<()> {
    let out = std::env::temp_dir().join(format!("berrylm-bench-isq-{}", std::process::id()));
    std::fs::create_dir_all(&out)?;
    let json_path = out.join("bench.json");
    let stdout = run_tiny_bench(
        &[
            "--isq",
            "q8_0",
            "--prefill",
            "16",
            "--decode",
            "1",
            "--context",
            "8",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--repeats",
            "1",
            "--no-kernels",
            "--no-op-costs",
            "--copy-mib",
            "8",
            "--json",
        ],
        &json_path,
    )?;
    assert!(stdout.contains("in-situ quantization to Q8_0"), "{stdout}");
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&json_path)?)?;
    assert_eq!(report["errors"], Value::Array(Vec::new()), "{report:#}");
    let expected = 1 + (3 * 3 + 4) + 4 * (3 * 8 + 3);
    assert_eq!(report["isq"]["projections"], expected, "{report:#}");
    assert_eq!(report["isq"]["quantized"], expected, "{report:#}");
    let bytes = positive(&report["isq"]["bytes"], "quantized bytes");
    let full = positive(&report["isq"]["full_precision_bytes"], "f32 bytes");
    // q8_0 keeps 34 bytes of 32 f32 weights (128 bytes); the embedding,
    // norms, routers and gates stay in f32.
    assert!(bytes < 0.5 * full, "{bytes} of {full} bytes");
    throughput(&report["prefill"][0], "forward_ms", 16, "prefill");
    throughput(&report["decode"][0], "ms_per_step", 1, "decode");
    std::fs::remove_dir_all(&out).ok();
    Ok(())
}

/// `--save-checkpoint`: the tiny model written as a checkpoint folder loads
/// back through the plugin (so every tensor is there under its HF name), its
/// config round-trips and the word-level tokenizer covers the vocabulary.
#[test]
fn saved_tiny_checkpoint_loads_back() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("berrylm-bench-ckpt-{}", std::process::id()));
    run_tiny_bench(&["--save-checkpoint"], &dir)?;
    for file in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        assert!(dir.join(file).is_file(), "no {file} in {}", dir.display());
    }

    let config_text = std::fs::read_to_string(dir.join("config.json"))?;
    let config: Value = serde_json::from_str(&config_text)?;
    assert_eq!(config["model_type"], "berrylm");
    assert_eq!(config["eos_token_id"], 2047);
    let parsed = berrylm::BerryLmConfig::from_json(&config_text)?;
    assert_eq!(
        (
            parsed.vocab_size,
            parsed.hidden_size,
            parsed.num_hidden_layers
        ),
        (2048, 256, 4)
    );
    assert_eq!((parsed.num_experts, parsed.num_experts_per_tok), (8, 2));
    assert_eq!(parsed.linear_num_value_heads, 8);
    assert_eq!(parsed.kda_gate_bottleneck, 32);
    assert_eq!(parsed.num_full_attention_layers(), 1);

    // Every weight is stored in bf16; the plugin loads the whole set.
    let tensors = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)?;
    assert!(tensors.values().all(|t| t.dtype() == DType::BF16));
    assert_eq!(
        tensors["model.embed_tokens.weight"].dims(),
        &[2048usize, 256][..]
    );
    let model = berrylm::driver::load_checkpoint(&dir, DType::F32, &Device::Cpu)
        .context("loading the saved checkpoint")?;
    assert_eq!(model.config().num_hidden_layers, 4);

    let tokenizer: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer.json"))?)?;
    let vocab = tokenizer["model"]["vocab"].as_object().context("vocab")?;
    assert_eq!(vocab.len(), 2048);
    assert_eq!(vocab["t0"], 0);
    assert_eq!(vocab["t2047"], 2047);
    assert_eq!(tokenizer["model"]["type"], "WordLevel");
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}
