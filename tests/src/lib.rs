//! Shared support for the berrylm tests: the vendored golden fixtures (outputs
//! of the transformers reference) and a driver that runs the model through
//! the host's hybrid cache.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use berrylm::model::{BerryLm, ForwardBatch};
use berrylm::weights::Weights;
use berrylm::BerryLmConfig;
use candle_core::{DType, Device, Tensor};
use mistralrs_core::plugin_api::{FlashParams, HybridCache};
use mistralrs_quant::ShardedSafeTensors;

pub mod server;

/// Every fixture vendored from the golden set.
pub const FIXTURES: [&str; 8] = [
    "tiny-hf",
    "small-hybrid",
    "small-hybrid-alt-layout",
    "small-hybrid-bf16",
    "variant-a",
    "variant-b",
    "no-attnres",
    "trained-tiny",
];

pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

/// One golden fixture: a checkpoint and the reference's outputs on it.
pub struct Fixture {
    pub name: String,
    pub model_dir: PathBuf,
    pub golden: HashMap<String, Tensor>,
    pub facts: serde_json::Value,
}

impl Fixture {
    pub fn load(name: &str) -> Result<Fixture> {
        let dir = fixtures_dir().join(name);
        let golden = candle_core::safetensors::load(dir.join("golden.safetensors"), &Device::Cpu)
            .with_context(|| format!("{name}: golden.safetensors"))?;
        let facts = serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json"))?)?;
        Ok(Fixture {
            name: name.to_string(),
            model_dir: dir.join("model"),
            golden,
            facts,
        })
    }

    pub fn tensor(&self, key: &str) -> Result<&Tensor> {
        self.golden
            .get(key)
            .with_context(|| format!("{}: golden tensor {key} is missing", self.name))
    }

    pub fn ids(&self, key: &str) -> Result<Vec<u32>> {
        Ok(self
            .tensor(key)?
            .to_dtype(DType::I64)?
            .to_vec1::<i64>()?
            .into_iter()
            .map(|id| id as u32)
            .collect())
    }

    /// Number of `seq{i}` entries.
    pub fn num_sequences(&self) -> usize {
        (0..)
            .take_while(|i| self.golden.contains_key(&format!("seq{i}.input_ids")))
            .count()
    }

    pub fn model(&self, dtype: DType) -> Result<BerryLm> {
        load_model(&self.model_dir, dtype)
    }
}

/// Loads a checkpoint folder (single file or shards) on the CPU.
pub fn load_model(dir: &Path, dtype: DType) -> Result<BerryLm> {
    let config = std::fs::read_to_string(dir.join("config.json"))?;
    let cfg = BerryLmConfig::from_json(&config)?;
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "safetensors"))
        .collect();
    files.sort();
    // SAFETY: the fixture files are not modified while mapped.
    let vb = unsafe {
        ShardedSafeTensors::sharded(&files, dtype, &Device::Cpu, None, Arc::new(|_| true))?
    };
    Ok(BerryLm::load(cfg, &Weights::new(vb), false)?)
}

/// Drives a batch of sequences through the model with the host's hybrid cache,
/// the way the host's non-paged path does: one recurrent slot per sequence and
/// the attention KV batched.
pub struct Driver<'m> {
    model: &'m BerryLm,
    cache: HybridCache,
    offsets: Vec<usize>,
}

impl<'m> Driver<'m> {
    pub fn new(model: &'m BerryLm, sequences: usize) -> Result<Driver<'m>> {
        let mut cache = model.new_cache()?;
        let mut slots = Vec::with_capacity(sequences);
        for _ in 0..sequences {
            let slot = cache.allocate_seq().context("no recurrent slot")?;
            slots.push(slot as u32);
        }
        cache.set_state_indices(Some(Tensor::new(slots.as_slice(), &Device::Cpu)?));
        Ok(Driver {
            model,
            cache,
            offsets: vec![0; sequences],
        })
    }

    /// Feeds one chunk per sequence (all the same length); returns logits `[B, T, vocab]`
    /// and, if asked, every decoder layer's output.
    pub fn step(&mut self, chunks: &[&[u32]], layer_outputs: Option<&mut Vec<Tensor>>) -> Result<Tensor> {
        let len = chunks[0].len();
        let rows: Vec<Tensor> = chunks
            .iter()
            .map(|chunk| Tensor::new(*chunk, &Device::Cpu))
            .collect::<candle_core::Result<_>>()?;
        let input_ids = Tensor::stack(&rows, 0)?;
        let counts = vec![len; chunks.len()];
        let batch = ForwardBatch {
            input_ids: &input_ids,
            seqlen_offsets: &self.offsets,
            token_counts: &counts,
        };
        let hidden = self.model.forward_hidden(
            &batch,
            &mut self.cache,
            None,
            &FlashParams::empty(true),
            layer_outputs,
        )?;
        for offset in &mut self.offsets {
            *offset += len;
        }
        Ok(self.model.logits(&hidden)?.to_dtype(DType::F32)?)
    }

    /// Feeds one sequence in chunks of the given sizes; returns `[T, vocab]` logits.
    pub fn run_chunked(&mut self, ids: &[u32], chunk_sizes: impl IntoIterator<Item = usize>) -> Result<Tensor> {
        let mut logits = Vec::new();
        let mut start = 0;
        for size in chunk_sizes {
            let end = (start + size).min(ids.len());
            if start == end {
                break;
            }
            logits.push(self.step(&[&ids[start..end]], None)?.squeeze(0)?);
            start = end;
        }
        anyhow::ensure!(start == ids.len(), "chunk sizes cover {start} of {} tokens", ids.len());
        Ok(Tensor::cat(&logits, 0)?)
    }
}

/// Largest absolute element-wise difference.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    let a = a.to_dtype(DType::F32)?;
    let b = b.to_dtype(DType::F32)?;
    anyhow::ensure!(a.dims() == b.dims(), "shapes differ: {:?} vs {:?}", a.dims(), b.dims());
    Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

/// Largest absolute element.
pub fn max_abs(a: &Tensor) -> Result<f32> {
    Ok(a.to_dtype(DType::F32)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

/// The path of the host CLI binary built beside the tests (`cargo xtask test`
/// builds it and sets `BERRYLM_HOST_BIN`).
pub fn host_binary() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("BERRYLM_HOST_BIN") {
        return Ok(PathBuf::from(path));
    }
    let exe = std::env::current_exe()?;
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .context("test binary has no profile folder")?;
    let candidate = profile_dir.join("mistralrs");
    anyhow::ensure!(
        candidate.is_file(),
        "the host CLI is not built at {}: run `cargo xtask test`",
        candidate.display()
    );
    Ok(candidate)
}
