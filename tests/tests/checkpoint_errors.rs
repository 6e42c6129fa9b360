//! A broken checkpoint fails to load with an error naming the tensor, and the
//! shapes involved, instead of panicking; through the real `mistralrs serve`,
//! broken files and bad config values make the server exit non-zero with a
//! message naming the problem.

use std::collections::HashMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::Result;
use berrylm::model::BerryLm;
use berrylm::weights::Weights;
use berrylm::BerryLmConfig;
use berrylm_tests::{fixtures_dir, host_binary};
use candle_core::{DType, Device, Tensor};
use mistralrs_quant::ShardedSafeTensors;

fn small_hybrid() -> Result<(BerryLmConfig, HashMap<String, Tensor>)> {
    let dir = fixtures_dir().join("small-hybrid/model");
    let cfg = BerryLmConfig::from_json(&std::fs::read_to_string(dir.join("config.json"))?)?;
    let tensors = candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)?;
    Ok((cfg, tensors))
}

fn load_error(cfg: BerryLmConfig, tensors: HashMap<String, Tensor>) -> String {
    let vb = ShardedSafeTensors::wrap(Box::new(tensors), DType::F32, Device::Cpu);
    match BerryLm::load(cfg, &Weights::new(vb), false) {
        Ok(_) => panic!("a broken checkpoint loaded"),
        Err(error) => error.to_string(),
    }
}

#[test]
fn the_unbroken_tensors_load() -> Result<()> {
    let (cfg, tensors) = small_hybrid()?;
    let vb = ShardedSafeTensors::wrap(Box::new(tensors), DType::F32, Device::Cpu);
    BerryLm::load(cfg, &Weights::new(vb), false)?;
    Ok(())
}

#[test]
fn a_missing_tensor_is_named() -> Result<()> {
    let (cfg, mut tensors) = small_hybrid()?;
    let name = "model.layers.5.linear_attn.in_proj_z.weight";
    assert!(tensors.remove(name).is_some());
    let error = load_error(cfg, tensors);
    assert!(error.contains(name) && error.contains("missing"), "{error}");
    Ok(())
}

#[test]
fn a_wrong_shape_is_named_with_both_shapes() -> Result<()> {
    let (cfg, mut tensors) = small_hybrid()?;
    let name = "model.layers.3.self_attn.k_norm.weight";
    let expected = tensors[name].dims().to_vec();
    tensors.insert(
        name.to_string(),
        Tensor::zeros(7, DType::F32, &Device::Cpu)?,
    );
    let error = load_error(cfg, tensors);
    assert!(error.contains(name), "{error}");
    assert!(
        error.contains("[7]") && error.contains(&format!("{expected:?}")),
        "{error}"
    );
    Ok(())
}

#[test]
fn a_checkpoint_without_the_kda_module_names_both_layouts() -> Result<()> {
    let (cfg, mut tensors) = small_hybrid()?;
    tensors.retain(|name, _| !name.starts_with("model.layers.0.linear_attn."));
    let error = load_error(cfg, tensors);
    assert!(
        error.contains("model.layers.0.linear_attn.in_proj_qkv.weight"),
        "{error}"
    );
    assert!(
        error.contains("model.layers.0.kda.in_proj_qkv.weight"),
        "{error}"
    );
    Ok(())
}

// Through the real `mistralrs serve` binary: a broken checkpoint makes the
// server exit non-zero, without a panic, with a message naming the problem.

/// A copy of the bundled trained model in a fresh temporary folder.
fn trained_tiny_copy(case: &str) -> Result<PathBuf> {
    let source = fixtures_dir().join("trained-tiny/model");
    let dir = std::env::temp_dir().join(format!("berrylm-broken-{case}-{}", std::process::id()));
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    std::fs::create_dir_all(&dir)?;
    for entry in std::fs::read_dir(&source)? {
        let path = entry?.path();
        if let Some(name) = path.file_name() {
            std::fs::copy(&path, dir.join(name))?;
        }
    }
    Ok(dir)
}

/// Edits the copy's `config.json`.
fn edit_config(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) -> Result<()> {
    let path = dir.join("config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    edit(&mut config);
    std::fs::write(&path, config.to_string())?;
    Ok(())
}

/// Cuts the copy's file `name` to its first half.
fn truncate_to_half(dir: &Path, name: &str) -> Result<()> {
    let path = dir.join(name);
    let bytes = std::fs::read(&path)?;
    std::fs::write(&path, &bytes[..bytes.len() / 2])?;
    Ok(())
}

/// Runs `mistralrs serve` on `model_dir`, expects it to exit within two
/// minutes and returns its exit status and output.
fn serve_until_exit(model_dir: &Path) -> Result<(ExitStatus, String)> {
    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let log_path = model_dir.with_extension("log");
    let log = std::fs::File::create(&log_path)?;
    let mut child = Command::new(host_binary()?)
        .args(["serve", "--host", "127.0.0.1", "--port", &port.to_string()])
        .arg("-m")
        .arg(model_dir)
        .args(["--dtype", "f32"])
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .env("RUST_LOG", "info")
        .spawn()?;
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            let output = std::fs::read_to_string(&log_path).unwrap_or_default();
            panic!("the broken checkpoint loaded and the server kept running:\n{output}");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let output = std::fs::read_to_string(&log_path)?;
    std::fs::remove_file(&log_path)?;
    Ok((status, output))
}

/// Loads the broken copy in `dir` and asserts a clean failure whose `Error:`
/// line contains every one of `names`.
fn assert_fails_to_serve(dir: &Path, names: &[&str]) -> Result<()> {
    let (status, output) = serve_until_exit(dir)?;
    assert!(
        !status.success(),
        "the server exited successfully:\n{output}"
    );
    assert!(
        !output.contains("panicked at") && status.code() != Some(101),
        "the server panicked ({status}):\n{output}"
    );
    let error = output
        .lines()
        .find(|line| line.starts_with("Error: "))
        .unwrap_or_else(|| panic!("no `Error:` line ({status}):\n{output}"));
    for name in names {
        assert!(
            error.contains(name),
            "the error does not name {name:?}: {error}"
        );
    }
    std::fs::remove_dir_all(dir)?;
    Ok(())
}

#[test]
fn a_truncated_safetensors_file_fails_to_serve_naming_the_file() -> Result<()> {
    let dir = trained_tiny_copy("truncated")?;
    truncate_to_half(&dir, "model-00002-of-00002.safetensors")?;
    assert_fails_to_serve(&dir, &["model-00002-of-00002.safetensors", "incomplete"])
}

#[test]
fn a_safetensors_file_of_garbage_fails_to_serve_naming_the_file() -> Result<()> {
    let dir = trained_tiny_copy("garbage")?;
    let shard = dir.join("model-00001-of-00002.safetensors");
    let length = std::fs::metadata(&shard)?.len() as usize;
    let garbage: Vec<u8> = b"this is not a safetensors file\n"
        .iter()
        .copied()
        .cycle()
        .take(length)
        .collect();
    std::fs::write(&shard, garbage)?;
    assert_fails_to_serve(&dir, &["model-00001-of-00002.safetensors"])
}

#[test]
fn a_missing_tokenizer_fails_to_serve_naming_the_file() -> Result<()> {
    let dir = trained_tiny_copy("no-tokenizer")?;
    std::fs::remove_file(dir.join("tokenizer.json"))?;
    assert_fails_to_serve(&dir, &["tokenizer.json", "not found"])
}

#[test]
fn bad_config_values_fail_to_serve_naming_the_field_and_value() -> Result<()> {
    type Edit = fn(&mut serde_json::Value);
    let cases: [(&str, Edit, &[&str]); 7] = [
        (
            "zero-hidden",
            |c| c["hidden_size"] = 0.into(),
            &["hidden_size", "0"],
        ),
        (
            "negative-heads",
            |c| c["num_attention_heads"] = (-4).into(),
            &["num_attention_heads", "-4"],
        ),
        (
            "negative-vocab",
            |c| c["vocab_size"] = (-1).into(),
            &["vocab_size", "-1"],
        ),
        (
            "hv-not-multiple-of-hk",
            |c| c["linear_num_value_heads"] = 3.into(),
            &["linear_num_value_heads", "3", "linear_num_key_heads"],
        ),
        (
            "unknown-layer-type",
            |c| c["layer_types"][2] = "mamba".into(),
            &["layer_types", "mamba"],
        ),
        (
            "layer-count",
            |c| c["num_hidden_layers"] = 6.into(),
            &["layer_types", "num_hidden_layers", "6"],
        ),
        (
            "wrong-type",
            |c| c["hidden_size"] = "large".into(),
            &["config.json", "large"],
        ),
    ];
    for (case, edit, names) in cases {
        let dir = trained_tiny_copy(case)?;
        edit_config(&dir, edit)?;
        assert_fails_to_serve(&dir, names)?;
    }
    Ok(())
}

#[test]
fn a_config_that_is_not_json_fails_to_serve_naming_the_file() -> Result<()> {
    let dir = trained_tiny_copy("config-not-json")?;
    std::fs::write(
        dir.join("config.json"),
        r#"{"model_type": "berrylm", "hidden_size": "#,
    )?;
    assert_fails_to_serve(&dir, &["config.json"])
}

#[test]
fn a_truncated_tokenizer_fails_to_serve_naming_the_file() -> Result<()> {
    let dir = trained_tiny_copy("truncated-tokenizer")?;
    truncate_to_half(&dir, "tokenizer.json")?;
    assert_fails_to_serve(&dir, &["tokenizer.json"])
}
