//! The golden file and the ways we run the model against it: teacher-forced
//! (prefill, incremental, chunked) with the `Driver`, and free-running greedy
//! through the host engine.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use berrylm::driver::Driver;
use berrylm::model::BerryLm;
use candle_core::{DType, Device, Tensor};
use mistralrs::{IsqType, TextModelBuilder};
use mistralrs_core::{NormalRequest, Request, RequestMessage, Response, SamplingParams};
use serde::Serialize;

use crate::args::{Precision, Target};

/// Chunk length of the `chunked` mode.
pub const CHUNK: usize = 5;

/// One reference sequence: its ids and the reference's logits `[T][vocab]`.
pub struct Sequence {
    pub name: String,
    pub ids: Vec<u32>,
    pub logits_f32: Vec<Vec<f32>>,
    /// The reference's own bfloat16 run, when the file has it.
    pub logits_bf16: Option<Vec<Vec<f32>>>,
}

/// The reference's outputs (golden.safetensors).
pub struct Golden {
    pub sequences: Vec<Sequence>,
    pub prompt_ids: Vec<u32>,
    pub output_ids: Vec<u32>,
}

fn ids(tensors: &HashMap<String, Tensor>, key: &str) -> Result<Vec<u32>> {
    let tensor = tensors
        .get(key)
        .with_context(|| format!("the golden file has no `{key}`"))?;
    Ok(tensor
        .to_dtype(DType::I64)?
        .to_vec1::<i64>()?
        .into_iter()
        .map(|id| id as u32)
        .collect())
}

/// `[T, vocab]` logits as rows of f32 on the host.
pub fn rows(tensor: &Tensor) -> Result<Vec<Vec<f32>>> {
    Ok(tensor
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .to_vec2::<f32>()?)
}

impl Golden {
    pub fn load(path: &Path) -> Result<Golden> {
        let tensors = candle_core::safetensors::load(path, &Device::Cpu)
            .with_context(|| format!("reading the golden file {}", path.display()))?;
        let mut sequences = Vec::new();
        for i in 0.. {
            let name = format!("seq{i}");
            if !tensors.contains_key(&format!("{name}.input_ids")) {
                break;
            }
            let ids = ids(&tensors, &format!("{name}.input_ids"))?;
            let logits_f32 = rows(
                tensors
                    .get(&format!("{name}.logits_f32"))
                    .with_context(|| format!("the golden file has no `{name}.logits_f32`"))?,
            )?;
            anyhow::ensure!(
                logits_f32.len() == ids.len(),
                "{name}: {} ids but {} rows of logits",
                ids.len(),
                logits_f32.len()
            );
            let logits_bf16 = match tensors.get(&format!("{name}.logits_bf16")) {
                Some(tensor) => Some(rows(tensor)?),
                None => None,
            };
            sequences.push(Sequence {
                name,
                ids,
                logits_f32,
                logits_bf16,
            });
        }
        anyhow::ensure!(
            !sequences.is_empty(),
            "{} has no seq0.input_ids",
            path.display()
        );
        Ok(Golden {
            sequences,
            prompt_ids: ids(&tensors, "gen.prompt_ids")?,
            output_ids: ids(&tensors, "gen.output_ids")?,
        })
    }

    /// Whether the file has the reference's own bfloat16 logits for every sequence.
    pub fn has_bf16(&self) -> bool {
        self.sequences.iter().all(|s| s.logits_bf16.is_some())
    }
}

/// The first line of an error chain (candle appends a backtrace to its
/// messages when `RUST_BACKTRACE` is set).
pub fn error_line(error: &anyhow::Error) -> String {
    let text = format!("{error:#}");
    text.lines().next().unwrap_or_default().trim().to_string()
}

/// Our logits `[T, vocab]` (f32, on the host) for every sequence, in every
/// teacher-forced mode; a mode that fails on any sequence is an error.
pub struct TeacherForced {
    /// One-shot prefill of the whole sequence.
    pub prefill: Result<Vec<Tensor>>,
    /// Prefill of the first `prompt_lens[i]` tokens, then one token per step.
    pub incremental: Result<Vec<Tensor>>,
    /// Consecutive chunks of `CHUNK` tokens.
    pub chunked: Result<Vec<Tensor>>,
    /// The prefill length of the incremental mode per sequence: max(1, T/2).
    pub prompt_lens: Vec<usize>,
}

/// The prefill length of the incremental mode for a sequence of `len` tokens.
pub fn prompt_len(len: usize) -> usize {
    (len / 2).max(1)
}

/// Runs every sequence through `forward`, each on a fresh cache, and says on
/// standard error how long the mode `name` took (a long run shows its
/// progress).
fn run_mode(
    name: &str,
    model: &Result<BerryLm>,
    golden: &Golden,
    forward: impl Fn(&BerryLm, &[u32]) -> Result<Tensor>,
) -> Result<Vec<Tensor>> {
    let model = model
        .as_ref()
        .map_err(|error| anyhow::anyhow!("{}", error_line(error)))?;
    let start = std::time::Instant::now();
    let logits = golden
        .sequences
        .iter()
        .map(|sequence| {
            let logits = forward(model, &sequence.ids).with_context(|| sequence.name.clone())?;
            Ok(logits.to_device(&Device::Cpu)?.to_dtype(DType::F32)?)
        })
        .collect::<Result<Vec<_>>>()?;
    let positions: usize = golden.sequences.iter().map(|s| s.ids.len()).sum();
    eprintln!(
        "berrylm-align: {name} mode: {} sequences, {positions} positions in {:.1} s",
        golden.sequences.len(),
        start.elapsed().as_secs_f64()
    );
    Ok(logits)
}

/// Runs the teacher-forced modes (`model` is the loaded checkpoint, or why it did not load).
pub fn teacher_forced(model: &Result<BerryLm>, golden: &Golden) -> TeacherForced {
    TeacherForced {
        prefill: run_mode("prefill", model, golden, |model, ids| {
            Ok(Driver::new(model, 1)?.step(&[ids], None)?.squeeze(0)?)
        }),
        incremental: run_mode("incremental", model, golden, |model, ids| {
            let sizes = std::iter::once(prompt_len(ids.len())).chain(std::iter::repeat(1));
            Driver::new(model, 1)?.run_chunked(ids, sizes)
        }),
        chunked: run_mode("chunked", model, golden, |model, ids| {
            Driver::new(model, 1)?.run_chunked(ids, std::iter::repeat(CHUNK))
        }),
        prompt_lens: golden
            .sequences
            .iter()
            .map(|s| prompt_len(s.ids.len()))
            .collect(),
    }
}

/// Greedy decoding of `steps` tokens with the Driver (argmax of our logits,
/// the cache carried from step to step, no stop at EOS).
pub fn driver_greedy(model: &BerryLm, prompt: &[u32], steps: usize) -> Result<Vec<u32>> {
    let mut driver = Driver::new(model, 1)?;
    let mut logits = driver.step(&[prompt], None)?.squeeze(0)?;
    let mut tokens = Vec::with_capacity(steps);
    for _ in 0..steps {
        let last = rows(&logits)?.pop().context("empty logits")?;
        let token = crate::stats::argmax(&last) as u32;
        tokens.push(token);
        if tokens.len() < steps {
            logits = driver.step(&[&[token]], None)?.squeeze(0)?;
        }
    }
    Ok(tokens)
}

/// The checkpoint's EOS ids: `generation_config.json`'s `eos_token_id` and
/// `tokenizer_config.json`'s `eos_token` (looked up in `tokenizer.json`).
pub fn eos_ids(model_dir: &Path) -> Vec<u32> {
    let read = |name: &str| -> Option<serde_json::Value> {
        serde_json::from_str(&std::fs::read_to_string(model_dir.join(name)).ok()?).ok()
    };
    let mut eos = Vec::new();
    if let Some(config) = read("generation_config.json") {
        match &config["eos_token_id"] {
            serde_json::Value::Number(n) => eos.extend(n.as_u64().map(|id| id as u32)),
            serde_json::Value::Array(ids) => {
                eos.extend(ids.iter().filter_map(|id| id.as_u64().map(|id| id as u32)))
            }
            _ => {}
        }
    }
    let eos_token = read("tokenizer_config.json").and_then(|config| match &config["eos_token"] {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o
            .get("content")
            .and_then(|c| c.as_str())
            .map(str::to_string),
        _ => None,
    });
    if let (Some(token), Some(tokenizer)) = (eos_token, read("tokenizer.json")) {
        let added = tokenizer["added_tokens"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let id = added
            .iter()
            .find(|t| t["content"].as_str() == Some(token.as_str()))
            .and_then(|t| t["id"].as_u64())
            .or_else(|| tokenizer["model"]["vocab"][token.as_str()].as_u64());
        eos.extend(id.map(|id| id as u32));
    }
    eos.sort_unstable();
    eos.dedup();
    eos
}

/// Free-running greedy generation through the host engine, compared with the reference.
#[derive(Debug, Serialize)]
pub struct Greedy {
    /// Reference tokens whose text our generation reproduces (the longest
    /// prefix of the reference ids whose detokenization is a prefix of ours).
    pub matched: usize,
    /// Reference tokens compared: `gen.output_ids` up to and including its first EOS.
    pub total: usize,
    /// `len(gen.output_ids)`.
    pub reference_len: usize,
    /// The engine's text.
    pub text: String,
    /// The detokenized reference tokens compared.
    pub reference_text: String,
    /// Tokens of the Driver's greedy run (the ids in `--dump`) equal to the
    /// reference's, up to the first difference (out of `total`); `null` when
    /// the Driver could not run.
    pub driver_matched: Option<usize>,
}

/// The text of the host engine's greedy completion of `prompt` (token ids),
/// at most `max_len` tokens.
pub async fn greedy_completion(
    model: &mistralrs::Model,
    prompt: Vec<u32>,
    max_len: usize,
) -> Result<String> {
    let (tx, mut rx) = tokio::sync::mpsc::channel(1);
    let mut sampling = SamplingParams::deterministic();
    sampling.max_len = Some(max_len);
    let request = NormalRequest::new_simple(
        RequestMessage::CompletionTokens(prompt),
        sampling,
        tx,
        0,
        None,
        None,
    );
    model
        .inner()
        .get_sender(None)?
        .send(Request::Normal(Box::new(request)))
        .await
        .context("sending the request to the engine")?;
    match rx.recv().await.context("the engine sent no response")? {
        Response::CompletionDone(done) => Ok(done
            .choices
            .first()
            .context("the engine's response has no choice")?
            .text
            .clone()),
        Response::InternalError(error) | Response::ValidationError(error) => {
            bail!("the engine failed: {error}")
        }
        Response::CompletionModelError(message, _) | Response::ModelError(message, _) => {
            bail!("the model failed in the engine: {message}")
        }
        _ => bail!("unexpected response kind from the engine"),
    }
}

/// Runs the reference's greedy prompt through the host engine (loaded
/// in-process with the same dtype and device) and compares the generated text.
pub async fn engine_greedy(
    model_dir: &Path,
    dtype: Precision,
    target: Target,
    isq: Option<IsqType>,
    golden: &Golden,
    driver_tokens: Option<&[u32]>,
) -> Result<Greedy> {
    let eos = eos_ids(model_dir);
    let mut reference = golden.output_ids.clone();
    if let Some(position) = reference.iter().position(|id| eos.contains(id)) {
        reference.truncate(position + 1);
    }
    let ends_with_eos = reference.last().is_some_and(|id| eos.contains(id));
    let total = reference.len();

    let mut builder =
        TextModelBuilder::new(model_dir.display().to_string()).with_dtype(dtype.engine());
    builder = match target {
        Target::Cpu => builder.with_force_cpu(),
        Target::Cuda => builder.with_device(target.open()?),
    };
    if let Some(isq) = isq {
        builder = builder.with_isq(isq);
    }
    let model = builder
        .build()
        .await
        .with_context(|| format!("loading {} in the host engine", model_dir.display()))?;
    let text = greedy_completion(&model, golden.prompt_ids.clone(), total.max(1)).await?;

    let detokenize = |ids: &[u32]| model.detokenize(ids.to_vec(), false);
    let reference_text = detokenize(&reference).await?;
    // The engine may or may not render the final EOS in its text.
    let without_eos = if ends_with_eos {
        Some(detokenize(&reference[..total - 1]).await?)
    } else {
        None
    };
    // The host trims the leading whitespace of a completion's text.
    let matched = if text == reference_text.trim_start()
        || without_eos.as_deref().map(str::trim_start) == Some(text.as_str())
    {
        total
    } else {
        // The longest prefix of the reference whose text starts ours (a
        // prefix cut inside a multi-byte character does not match, so every
        // length is tried).
        let mut matched = 0;
        for k in (1..total).rev() {
            if text.starts_with(detokenize(&reference[..k]).await?.trim_start()) {
                matched = k;
                break;
            }
        }
        matched
    };
    let driver_matched = driver_tokens.map(|tokens| {
        reference
            .iter()
            .zip(tokens)
            .take_while(|(a, b)| a == b)
            .count()
    });
    Ok(Greedy {
        matched,
        total,
        reference_len: golden.output_ids.len(),
        text,
        reference_text,
        driver_matched,
    })
}
