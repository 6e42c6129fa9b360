//! `--dump`: our logits of every teacher-forced mode and our greedy tokens, as safetensors.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};

use crate::modes::{Golden, TeacherForced};

/// Writes `seq{i}.prefill.logits`, `seq{i}.incremental.logits`, `seq{i}.chunked.logits`
/// (f32 `[T, vocab]`, for the modes that ran) and `gen.output_ids` (i64): the
/// greedy tokens of the Driver (argmax with the cache, the same model, dtype
/// and device; the engine only returns text, and re-tokenizing text does not
/// give back the ids exactly).
pub fn save(
    path: &Path,
    golden: &Golden,
    runs: &TeacherForced,
    greedy_tokens: Option<&[u32]>,
) -> Result<()> {
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    for (mode, logits) in [
        ("prefill", &runs.prefill),
        ("incremental", &runs.incremental),
        ("chunked", &runs.chunked),
    ] {
        if let Ok(logits) = logits {
            for (sequence, logits) in golden.sequences.iter().zip(logits) {
                tensors.insert(format!("{}.{mode}.logits", sequence.name), logits.clone());
            }
        }
    }
    if let Some(tokens) = greedy_tokens {
        tensors.insert("gen.output_ids".into(), ids_tensor(tokens)?);
    }
    candle_core::safetensors::save(&tensors, path)
        .with_context(|| format!("writing {}", path.display()))
}

/// Writes a golden file in the reference's layout (`seq{i}.input_ids`,
/// `seq{i}.logits_f32`, `gen.prompt_ids`, `gen.output_ids`) from our run:
/// `golden`'s ids, our `prefill` logits and the Driver's `greedy_tokens`.
pub fn save_golden(
    path: &Path,
    golden: &Golden,
    prefill: &[Tensor],
    greedy_tokens: &[u32],
) -> Result<()> {
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    for (sequence, logits) in golden.sequences.iter().zip(prefill) {
        tensors.insert(
            format!("{}.input_ids", sequence.name),
            ids_tensor(&sequence.ids)?,
        );
        tensors.insert(format!("{}.logits_f32", sequence.name), logits.clone());
    }
    tensors.insert("gen.prompt_ids".into(), ids_tensor(&golden.prompt_ids)?);
    tensors.insert("gen.output_ids".into(), ids_tensor(greedy_tokens)?);
    candle_core::safetensors::save(&tensors, path)
        .with_context(|| format!("writing {}", path.display()))
}

/// Token ids as the golden files hold them: i64 on the CPU.
fn ids_tensor(ids: &[u32]) -> candle_core::Result<Tensor> {
    let ids: Vec<i64> = ids.iter().map(|&id| i64::from(id)).collect();
    Tensor::new(ids.as_slice(), &Device::Cpu)
}
