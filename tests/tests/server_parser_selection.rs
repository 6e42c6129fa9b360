//! `mistralrs serve --reasoning-parser NAME --tool-call-parser NAME` picks a
//! registered chat output parser for a model of any architecture: a BerryLM
//! fine-tune saved as `LlamaForCausalLM` (here a random-weight Llama with
//! trained-tiny's tokenizer and chat template, written by the test) gets
//! BerryLM's typed tool calls, where without the options it gets
//! the host's own parsing. An unknown name stops the server at start with the
//! registered names.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use berrylm_tests::chat::{arguments, assemble};
use berrylm_tests::server::Server;
use berrylm_tests::{fixtures_dir, host_binary};
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};

const HIDDEN: usize = 64;
const INTERMEDIATE: usize = 128;
const LAYERS: usize = 2;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const VOCAB: usize = 2048;

/// A random-weight Llama checkpoint in `dir` that speaks trained-tiny's
/// tokenizer and ChatML template (which opens `<think>` for the answer).
fn write_llama_checkpoint(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let tokenizer_source = fixtures_dir().join("trained-tiny/model");
    for file in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(tokenizer_source.join(file), dir.join(file))
            .with_context(|| format!("copying trained-tiny's {file}"))?;
    }
    let config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "vocab_size": VOCAB,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": false,
        "bos_token_id": null,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    });
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;

    let device = Device::Cpu;
    let random = |shape: &[usize]| Tensor::randn(0f32, 0.02, shape, &device);
    let ones = |size: usize| Tensor::ones(size, DType::F32, &device);
    let kv = KV_HEADS * HIDDEN / HEADS;
    let mut tensors = HashMap::new();
    tensors.insert(
        "model.embed_tokens.weight".to_string(),
        random(&[VOCAB, HIDDEN])?,
    );
    tensors.insert("model.norm.weight".to_string(), ones(HIDDEN)?);
    tensors.insert("lm_head.weight".to_string(), random(&[VOCAB, HIDDEN])?);
    for layer in 0..LAYERS {
        let prefix = format!("model.layers.{layer}");
        for (name, shape) in [
            ("self_attn.q_proj", [HIDDEN, HIDDEN]),
            ("self_attn.k_proj", [kv, HIDDEN]),
            ("self_attn.v_proj", [kv, HIDDEN]),
            ("self_attn.o_proj", [HIDDEN, HIDDEN]),
            ("mlp.gate_proj", [INTERMEDIATE, HIDDEN]),
            ("mlp.up_proj", [INTERMEDIATE, HIDDEN]),
            ("mlp.down_proj", [HIDDEN, INTERMEDIATE]),
        ] {
            tensors.insert(format!("{prefix}.{name}.weight"), random(&shape)?);
        }
        for norm in ["input_layernorm", "post_attention_layernorm"] {
            tensors.insert(format!("{prefix}.{norm}.weight"), ones(HIDDEN)?);
        }
    }
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors"))?;
    Ok(())
}

fn scratch_dir(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("berrylm-{name}-{}", std::process::id()))
}

/// Token ids of the special tokens the grammar emits (trained-tiny's tokenizer).
const TOOL_CALL: u32 = 5;
const TOOL_CALL_END: u32 = 6;
const IM_END: u32 = 2;

/// A lark grammar that admits exactly one output: one call in BerryLM's
/// tool-call XML whose `days` needs the schema to be typed. The request turns
/// thinking off, so the grammar applies from the first token (with thinking
/// on it would apply only after the model closed its reasoning).
fn pinned_output_grammar() -> String {
    let call = "\\n<function=get_weather>\\n<parameter=city>\\nOslo\\n</parameter>\\n\
                <parameter=days>\\n3\\n</parameter>\\n</function>\\n";
    format!("start: <[{TOOL_CALL}]> \"{call}\" <[{TOOL_CALL_END}]> <[{IM_END}]>")
}

fn pinned_request(stream: bool) -> Value {
    json!({
        "model": "default",
        "messages": [{"role": "user", "content": "The weather in Oslo for 3 days?"}],
        "tools": [{
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather forecast for a city.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string"},
                        "days": {"type": "integer"},
                    },
                    "required": ["city"],
                },
            },
        }],
        "temperature": 0.0,
        "max_tokens": 256,
        "stream": stream,
        "enable_thinking": false,
        "grammar": {"type": "lark", "value": pinned_output_grammar()},
    })
}

#[test]
fn a_llama_checkpoint_served_with_the_berrylm_parsers_gives_typed_tool_calls() -> Result<()> {
    let dir = scratch_dir("llama-parsers");
    write_llama_checkpoint(&dir)?;
    let server = Server::start(
        &dir,
        &[
            "--tool-call-parser",
            "berrylm",
            "--reasoning-parser",
            "berrylm",
        ],
    )?;
    let expected_arguments = json!({"city": "Oslo", "days": 3});

    let (status, response) = server.post("/v1/chat/completions", &pinned_request(false))?;
    assert_eq!(status, 200, "{response}");
    assert_eq!(
        response["choices"][0]["finish_reason"],
        json!("tool_calls"),
        "{response}"
    );
    let message = &response["choices"][0]["message"];
    assert_eq!(message["reasoning_content"], Value::Null, "{response}");
    let calls = message["tool_calls"].as_array().context("tool_calls")?;
    assert_eq!(calls.len(), 1, "{response}");
    assert_eq!(calls[0]["type"], json!("function"), "{response}");
    assert_eq!(
        calls[0]["function"]["name"],
        json!("get_weather"),
        "{response}"
    );
    assert_eq!(
        arguments(&calls[0]["function"]["arguments"]),
        expected_arguments,
        "{response}"
    );

    let (status, chunks) = server.post_stream("/v1/chat/completions", &pinned_request(true))?;
    assert_eq!(status, 200, "{chunks:?}");
    let (streamed, finish_reason) = assemble(&chunks);
    assert_eq!(finish_reason.as_deref(), Some("tool_calls"), "{chunks:?}");
    assert_eq!(streamed["reasoning_content"], Value::Null, "{chunks:?}");
    let calls = streamed["tool_calls"].as_array().context("tool_calls")?;
    assert_eq!(calls.len(), 1, "{chunks:?}");
    assert_eq!(calls[0]["name"], json!("get_weather"), "{chunks:?}");
    assert_eq!(
        arguments(&calls[0]["arguments"]),
        expected_arguments,
        "{chunks:?}"
    );
    assert!(
        server
            .log()
            .contains("Chat output parser for every model: berrylm"),
        "the server did not log the selected parser"
    );
    drop(server);

    // Without the options the model keeps the host's own parsing, which does
    // not know BerryLM's tool-call XML: the call stays in the content.
    let server = Server::start(&dir, &[])?;
    let (status, response) = server.post("/v1/chat/completions", &pinned_request(false))?;
    assert_eq!(status, 200, "{response}");
    let message = &response["choices"][0]["message"];
    assert_eq!(message["tool_calls"], Value::Null, "{response}");
    assert!(
        message["content"]
            .as_str()
            .is_some_and(|content| content.contains("<function=get_weather>")),
        "{response}"
    );
    drop(server);
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

/// The error of a server that must not come up: it exited, and did not panic.
fn start_error(arguments: &[&str]) -> String {
    let model = fixtures_dir().join("trained-tiny/model");
    let Err(error) = Server::start(&model, arguments) else {
        panic!("the server came up with {arguments:?}");
    };
    let message = format!("{error:#}");
    assert!(message.contains("exited"), "{message}");
    assert!(
        !message.contains("panicked at"),
        "the server panicked:\n{message}"
    );
    message
}

#[test]
fn an_unknown_parser_name_fails_at_start_listing_the_registered_ones() {
    let message = start_error(&["--tool-call-parser", "nope"]);
    assert!(
        message.contains("--tool-call-parser nope")
            && message.contains("no chat output parser is registered as `nope`")
            && message.contains("the registered ones: berrylm"),
        "expected the error to name the option and list berrylm:\n{message}"
    );

    let message = start_error(&[
        "--reasoning-parser",
        "berrylm",
        "--tool-call-parser",
        "hermes",
    ]);
    assert!(
        message.contains(
            "--reasoning-parser berrylm and --tool-call-parser hermes name different parsers"
        ),
        "expected the error to refuse two different parsers:\n{message}"
    );
}

/// `mistralrs from-config` reads the same options from a serve config's
/// `[server]` table and refuses an unknown name the same way.
#[test]
fn a_serve_config_with_an_unknown_parser_fails_listing_the_registered_ones() -> Result<()> {
    let dir = scratch_dir("parser-config");
    std::fs::create_dir_all(&dir)?;
    let config = dir.join("serve.toml");
    let model = fixtures_dir().join("trained-tiny/model");
    std::fs::write(
        &config,
        format!(
            "command = \"serve\"\n\n[server]\ntool_call_parser = \"nope\"\n\n\
             [[models]]\nkind = \"auto\"\nmodel_id = {:?}\n",
            model.display().to_string()
        ),
    )?;
    let output = std::process::Command::new(host_binary()?)
        .arg("from-config")
        .arg("--file")
        .arg(&config)
        .output()?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("--tool-call-parser nope")
            && stderr.contains("the registered ones: berrylm")
            && !stderr.contains("panicked at"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
