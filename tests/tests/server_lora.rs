//! LoRA adapters (`mistralrs serve --lora ID`): the host merges a static
//! adapter into the weights while loading, and BerryLM merges it into its
//! own projections the same way. A PEFT-style adapter for the bundled model's
//! attention `q_proj` and KDA `in_proj_qkv` (random, made here) served with
//! `--lora` answers exactly as a checkpoint holding the merged weights
//! `W + (alpha / r) B A` (written here, in f32); an adapter that matches no
//! BerryLM projection is refused at load. Until BerryLM merged adapters the
//! server loaded them and answered without them.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result};
use berrylm_tests::chat::golden_chat_request;
use berrylm_tests::server::Server;
use berrylm_tests::{fixtures_dir, Fixture, TempDir};
use candle_core::{DType, Device, Tensor};
use serde_json::json;

const RANK: usize = 4;
const ALPHA: f64 = 8.0;
/// The adapter's name on the (local, offline) Hugging Face cache.
const ADAPTER_ID: &str = "berrylm-tests/tiny-lora";
const REVISION: &str = "0123456789abcdef0123456789abcdef01234567";

/// Every tensor of the checkpoint in `model_dir`, by name.
fn checkpoint(model_dir: &Path) -> Result<HashMap<String, Tensor>> {
    let mut tensors = HashMap::new();
    for entry in std::fs::read_dir(model_dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|ext| ext == "safetensors") {
            tensors.extend(candle_core::safetensors::load(&path, &Device::Cpu)?);
        }
    }
    Ok(tensors)
}

/// Writes an adapter with `target_modules` into the Hugging Face cache at
/// `hub` (its layout: `models--{org}--{name}/refs/main` naming a snapshot);
/// `tensors` are PEFT's `base_model.model.{module}.lora_{A,B}.weight`.
fn write_adapter(
    hub: &Path,
    target_modules: &[&str],
    tensors: &HashMap<String, Tensor>,
) -> Result<()> {
    let repo = hub.join(format!("models--{}", ADAPTER_ID.replace('/', "--")));
    let snapshot = repo.join("snapshots").join(REVISION);
    std::fs::create_dir_all(&snapshot)?;
    std::fs::create_dir_all(repo.join("refs"))?;
    std::fs::write(repo.join("refs/main"), REVISION)?;
    let config = json!({"r": RANK, "lora_alpha": ALPHA, "target_modules": target_modules, "peft_type": "LORA"});
    std::fs::write(snapshot.join("adapter_config.json"), config.to_string())?;
    candle_core::safetensors::save(tensors, snapshot.join("adapter_model.safetensors"))?;
    Ok(())
}

/// Greedy answers to the golden chats, each token with its log-probability.
fn answers(server: &Server, fixture: &Fixture) -> Result<Vec<Vec<(String, f64)>>> {
    let sequences = fixture.facts["sequences"].as_array().context("sequences")?;
    sequences
        .iter()
        .map(|sequence| {
            let mut request = golden_chat_request(sequence, 24, false)?;
            request["logprobs"] = json!(true);
            let (status, response) = server.post("/v1/chat/completions", &request)?;
            anyhow::ensure!(status == 200, "HTTP {status}: {response}");
            let tokens = response["choices"][0]["logprobs"]["content"]
                .as_array()
                .with_context(|| format!("no logprobs in {response}"))?;
            Ok(tokens
                .iter()
                .map(|token| {
                    (
                        token["token"].as_str().unwrap_or_default().to_string(),
                        token["logprob"].as_f64().unwrap_or(f64::NAN),
                    )
                })
                .collect())
        })
        .collect()
}

#[test]
fn a_lora_adapter_serves_as_its_merged_checkpoint() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let model_dir = fixtures_dir().join("trained-tiny/model");
    let mut weights = checkpoint(&model_dir)?;
    let temp = TempDir::new("berrylm-lora")?;

    // Random low-rank updates of every attention q_proj and KDA in_proj_qkv,
    // and the checkpoint with them merged.
    let mut adapter = HashMap::new();
    let modules: Vec<String> = weights
        .keys()
        .filter_map(|name| name.strip_suffix(".weight"))
        .filter(|module| {
            module.ends_with("self_attn.q_proj") || module.ends_with("linear_attn.in_proj_qkv")
        })
        .map(str::to_string)
        .collect();
    assert_eq!(
        modules.len(),
        8,
        "one adapted projection per layer: {modules:?}"
    );
    for module in &modules {
        let name = format!("{module}.weight");
        let weight = weights[&name].to_dtype(DType::F32)?;
        let (out_dim, in_dim) = weight.dims2()?;
        let a = (Tensor::randn(0f32, 1.0, (RANK, in_dim), &Device::Cpu)? * 0.05)?;
        let b = (Tensor::randn(0f32, 1.0, (out_dim, RANK), &Device::Cpu)? * 0.05)?;
        let merged = (weight + (b.matmul(&a)? * (ALPHA / RANK as f64))?)?;
        adapter.insert(format!("base_model.model.{module}.lora_A.weight"), a);
        adapter.insert(format!("base_model.model.{module}.lora_B.weight"), b);
        weights.insert(name, merged);
    }
    let merged_dir = temp.0.join("merged");
    std::fs::create_dir_all(&merged_dir)?;
    for file in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(model_dir.join(file), merged_dir.join(file))?;
    }
    candle_core::safetensors::save(&weights, merged_dir.join("model.safetensors"))?;
    let hub = temp.0.join("hub");
    write_adapter(&hub, &["q_proj", "in_proj_qkv"], &adapter)?;
    let hub = hub.to_string_lossy().into_owned();
    let offline = [("HF_HUB_CACHE", hub.as_str()), ("HF_HUB_OFFLINE", "1")];

    let expected = answers(&Server::start(&merged_dir, &["--dtype", "f32"])?, &fixture)?;
    let base = answers(&Server::start(&model_dir, &["--dtype", "f32"])?, &fixture)?;
    assert_ne!(expected, base, "the adapter changes the answers");
    let server = Server::start_with_environment(
        &model_dir,
        &["--dtype", "f32", "--lora", ADAPTER_ID],
        &offline,
    )?;
    assert!(
        server
            .log()
            .contains("BerryLM: LoRA adapters (--lora) merged into 8 projections"),
        "{}",
        server.log()
    );
    let served = answers(&server, &fixture)?;
    assert_eq!(served.len(), expected.len());
    for (served, expected) in served.iter().zip(&expected) {
        let tokens = |answer: &[(String, f64)]| {
            answer
                .iter()
                .map(|(token, _)| token.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(tokens(served), tokens(expected));
        for ((token, a), (_, b)) in served.iter().zip(expected) {
            assert!(
                (a - b).abs() <= 1e-5,
                "{token:?}: log-probability {a} with --lora, {b} merged"
            );
        }
    }
    drop(server);

    // An adapter for modules BerryLM does not have is refused, naming --lora.
    std::fs::remove_dir_all(temp.0.join("hub"))?;
    write_adapter(&temp.0.join("hub"), &["no_such_proj"], &adapter)?;
    let Err(error) = Server::start_with_environment(
        &model_dir,
        &["--dtype", "f32", "--lora", ADAPTER_ID],
        &offline,
    ) else {
        panic!("the server came up with an adapter that matches no BerryLM projection");
    };
    let message = format!("{error:#}");
    assert!(
        message.contains("--lora") && !message.contains("panicked at"),
        "{message}"
    );
    Ok(())
}
