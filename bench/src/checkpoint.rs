//! `--save-checkpoint DIR`: the benchmarked model as a servable checkpoint
//! folder (config.json, model.safetensors in bf16, a word-level tokenizer), for
//! measuring decode end to end through `mistralrs serve`.
//!
//! The safetensors file is written tensor by tensor (header first, every
//! tensor's size being known from its shape), so the host never holds more
//! than one tensor at a time.

use std::io::{BufWriter, Write};
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use serde_json::{json, Map, Value};

use crate::shape::ModelShape;

/// The end-of-sequence token: the last of the vocabulary, which the word
/// prompts of tools/e2e_decode.py (`t1 t2 ...`) never use.
pub fn eos_id(shape: &ModelShape) -> usize {
    shape.vocab - 1
}

/// Writes the checkpoint folder `dir` of `shape` with weights generated on `device`.
pub fn save(shape: &ModelShape, dir: &Path, device: &Device) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let eos = eos_id(shape);

    let mut config = shape.config_json();
    config["eos_token_id"] = json!(eos);
    config["bos_token_id"] = Value::Null;
    config["pad_token_id"] = json!(0);
    config["torch_dtype"] = json!("bfloat16");
    config["use_cache"] = json!(true);
    write_json(&dir.join("config.json"), &config)?;
    write_json(
        &dir.join("generation_config.json"),
        &json!({ "eos_token_id": eos, "pad_token_id": 0, "do_sample": false }),
    )?;
    write_json(&dir.join("tokenizer.json"), &tokenizer_json(shape.vocab))?;
    write_json(
        &dir.join("tokenizer_config.json"),
        &json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": 262_144,
            "eos_token": format!("t{eos}"),
            "pad_token": "t0",
            "unk_token": "t0",
            "bos_token": Value::Null,
            "clean_up_tokenization_spaces": false
        }),
    )?;

    let start = Instant::now();
    let bytes = write_safetensors(shape, &dir.join("model.safetensors"), device)?;
    println!(
        "wrote {} ({:.2} GB of bf16 weights, {} tensors) in {:.1} s",
        dir.display(),
        bytes as f64 / 1e9,
        shape.weight_specs().len(),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

fn write_json(path: &Path, value: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value)?;
    std::fs::write(path, text + "\n").with_context(|| format!("writing {}", path.display()))
}

/// A `tokenizers` WordLevel tokenizer over `t0 ... t{vocab-1}`: whitespace
/// split, generated words joined with spaces (a WordPiece decoder whose `##`
/// prefix no word carries, as the tiny-hf fixture has it).
pub fn tokenizer_json(vocab: usize) -> Value {
    let mut words = Map::with_capacity(vocab);
    for id in 0..vocab {
        words.insert(format!("t{id}"), json!(id));
    }
    json!({
        "version": "1.0",
        "truncation": Value::Null,
        "padding": Value::Null,
        "added_tokens": [],
        "normalizer": Value::Null,
        "pre_tokenizer": { "type": "WhitespaceSplit" },
        "post_processor": Value::Null,
        "decoder": { "type": "WordPiece", "prefix": "##", "cleanup": false },
        "model": { "type": "WordLevel", "vocab": Value::Object(words), "unk_token": "t0" }
    })
}

/// Writes every weight of `shape` as bf16 safetensors; returns the data size.
fn write_safetensors(shape: &ModelShape, path: &Path, device: &Device) -> Result<u64> {
    let specs = shape.weight_specs();
    let mut header = Map::new();
    header.insert("__metadata__".into(), json!({ "format": "pt" }));
    let mut offset = 0u64;
    for spec in &specs {
        let bytes = spec.dims.iter().product::<usize>() as u64 * 2;
        header.insert(
            spec.name.clone(),
            json!({ "dtype": "BF16", "shape": spec.dims, "data_offsets": [offset, offset + bytes] }),
        );
        offset += bytes;
    }
    let mut header = serde_json::to_string(&Value::Object(header))?.into_bytes();
    // The data starts 8-byte aligned, the header padded with spaces.
    while header.len() % 8 != 0 {
        header.push(b' ');
    }
    let file =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut out = BufWriter::with_capacity(1 << 24, file);
    out.write_all(&(header.len() as u64).to_le_bytes())?;
    out.write_all(&header)?;
    let mut written = 0u64;
    for spec in &specs {
        let tensor = spec
            .generate(DType::BF16, device)
            .with_context(|| format!("generating {} {:?}", spec.name, spec.dims))?
            .to_device(&Device::Cpu)?;
        tensor
            .write_bytes(&mut out)
            .with_context(|| format!("writing {}", spec.name))?;
        written += tensor.elem_count() as u64 * 2;
    }
    anyhow::ensure!(
        written == offset,
        "wrote {written} bytes, expected {offset}"
    );
    out.flush()?;
    out.into_inner()
        .map_err(|e| e.into_error())?
        .sync_all()
        .ok();
    Ok(offset)
}
