//! `mistralrs tune` on a BerryLM checkpoint: the host's recommendation of a
//! quantization and device map, from the sizes BerryLM's loader gives it. In
//! mistral.rs 0.8.1 the command recognised only its built-in architectures
//! ("Unsupported ... model class `BerryLMForCausalLM`").

use std::process::Command;

use anyhow::{Context, Result};
use berrylm_tests::{checkpoint_tensors, fixtures_dir, host_binary, run_successfully};
use serde_json::Value;

#[test]
fn tune_sizes_the_bundled_model_from_its_checkpoint() -> Result<()> {
    let model = fixtures_dir().join("trained-tiny/model");
    let stdout = run_successfully(
        Command::new(host_binary()?)
            .args(["tune", "--cpu", "--json", "-m"])
            .arg(&model)
            .env("RUST_LOG", "error"),
    )?;
    let report: Value = serde_json::from_str(&stdout)
        .with_context(|| format!("`mistralrs tune --json` printed:\n{stdout}"))?;
    let candidates = report["candidates"]
        .as_array()
        .with_context(|| format!("no candidates in {report}"))?;
    let estimate = |isq: Value| -> Result<f64> {
        candidates
            .iter()
            .find(|candidate| candidate["isq"] == isq)
            .and_then(|candidate| candidate["estimated_size_bytes"].as_f64())
            .with_context(|| format!("no estimate for {isq} in {report}"))
    };
    // The CPU's default dtype is f16: two bytes a weight of the checkpoint.
    let f16_bytes: usize = checkpoint_tensors(&model)?
        .iter()
        .map(|(_, elements)| 2 * elements)
        .sum();
    let unquantized = estimate(Value::Null)?;
    let ratio = unquantized / f16_bytes as f64;
    assert!(
        (0.95..=1.05).contains(&ratio),
        "unquantized estimate {unquantized} bytes against the checkpoint's {f16_bytes} in f16"
    );
    let q8_0 = estimate(Value::from("Q8_0"))?;
    assert!(
        q8_0 < 0.6 * unquantized,
        "q8_0 estimate {q8_0} bytes against {unquantized} unquantized"
    );
    assert!(
        candidates
            .iter()
            .any(|candidate| candidate["recommended"] == true),
        "{report}"
    );
    Ok(())
}
