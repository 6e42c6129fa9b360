//! The alignment tool (`berrylm-align`, the binary behind `cargo xtask align`)
//! on `small-hybrid` in float32 on the CPU: the acceptance of the alignment
//! report (docs/alignment.md).

use anyhow::{Context, Result};
use berrylm_tests::{align_binary, fixtures_dir};
use candle_core::Device;

/// Largest |Δ logprob| of the reference's top-1 token accepted in float32.
const MAX_LOGPROB_DIFF: f64 = 2e-3;

#[test]
fn small_hybrid_f32_is_aligned_in_every_mode() -> Result<()> {
    let fixture = fixtures_dir().join("small-hybrid");
    let out = std::env::temp_dir().join(format!("berrylm-align-test-{}", std::process::id()));
    std::fs::create_dir_all(&out)?;
    let (json_path, dump_path) = (out.join("report.json"), out.join("dump.safetensors"));
    let output = std::process::Command::new(align_binary()?)
        .arg("--model")
        .arg(fixture.join("model"))
        .arg("--golden")
        .arg(fixture.join("golden.safetensors"))
        .args(["--dtype", "f32", "--device", "cpu", "--json"])
        .arg(&json_path)
        .arg("--dump")
        .arg(&dump_path)
        .output()
        .context("running berrylm-align")?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "berrylm-align failed ({}):\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        stdout.contains("| Model") && stdout.contains("| Position"),
        "no tables:\n{stdout}"
    );

    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json_path)?)?;
    let modes = &report["modes"];
    for mode in ["prefill", "incremental", "chunked"] {
        let stats = &modes[mode];
        let top1 = stats["top1_match"].as_f64().context("top1_match")?;
        let max_diff = stats["max_abs_logprob_diff"]
            .as_f64()
            .context("max_abs_logprob_diff")?;
        assert_eq!(top1, 1.0, "{mode}: top-1 match {top1}\n{stdout}");
        assert!(
            max_diff <= MAX_LOGPROB_DIFF,
            "{mode}: max |Δ logprob| {max_diff}\n{stdout}"
        );
        assert!(stats["positions"].as_u64().context("positions")? > 0);
    }
    let incremental = &modes["incremental"];
    let split = incremental["prefill_positions"]["positions"]
        .as_u64()
        .context("prefill positions")?
        + incremental["decode_positions"]["positions"]
            .as_u64()
            .context("decode positions")?;
    assert_eq!(Some(split), incremental["positions"].as_u64());
    let matched = modes["greedy"]["matched"]
        .as_u64()
        .context("greedy.matched")?;
    let total = modes["greedy"]["total"].as_u64().context("greedy.total")?;
    assert!(total > 0);
    assert_eq!(matched, total, "free-running greedy diverges\n{stdout}");
    assert!(
        report["noise_floor"]["top1_match"].is_number(),
        "small-hybrid has logits_bf16"
    );

    let dump = candle_core::safetensors::load(&dump_path, &Device::Cpu)?;
    let golden = candle_core::safetensors::load(fixture.join("golden.safetensors"), &Device::Cpu)?;
    for mode in ["prefill", "incremental", "chunked"] {
        let ours = dump
            .get(&format!("seq3.{mode}.logits"))
            .context("dumped logits")?;
        assert_eq!(ours.dims(), golden["seq3.logits_f32"].dims(), "{mode}");
    }
    let dumped_ids = dump["gen.output_ids"].to_vec1::<i64>()?;
    assert_eq!(dumped_ids, golden["gen.output_ids"].to_vec1::<i64>()?);
    std::fs::remove_dir_all(&out)?;
    Ok(())
}
