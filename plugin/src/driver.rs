//! Running the model directly on a fresh host cache, outside the engine: the
//! way the host's non-paged path drives it (one recurrent slot per sequence,
//! attention KV batched). Used by the alignment tool and the tests.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use mistralrs_core::plugin_api::{FlashParams, HybridCache};
use mistralrs_quant::{IsqType, ShardedSafeTensors};

use crate::config::BerryLmConfig;
use crate::model::{BerryLm, ForwardBatch};
use crate::quantization::{self, QuantizationReport};
use crate::weights::Weights;

/// Loads a checkpoint folder (`config.json` and one or more `*.safetensors`)
/// with every weight in `dtype` on `device`.
pub fn load_checkpoint(dir: &Path, dtype: DType, device: &Device) -> Result<BerryLm> {
    let config_path = dir.join("config.json");
    let config = std::fs::read_to_string(&config_path)
        .with_context(|| format!("reading {}", config_path.display()))?;
    let cfg = BerryLmConfig::from_json(&config)?;
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|path| path.extension().is_some_and(|ext| ext == "safetensors"))
        .collect();
    files.sort();
    anyhow::ensure!(
        !files.is_empty(),
        "{} holds no .safetensors files",
        dir.display()
    );
    // SAFETY: the checkpoint files are not modified while they are mapped.
    let vb =
        unsafe { ShardedSafeTensors::sharded(&files, dtype, device, None, Arc::new(|_| true))? };
    Ok(BerryLm::load(cfg, &Weights::new(vb), false)?)
}

/// [`load_checkpoint`] with the host's in-situ quantization to `isq` applied
/// while loading, to the projections it quantizes by default (as `mistralrs
/// serve --isq TYPE`); returns the model and what the host made of it.
pub fn load_checkpoint_quantized(
    dir: &Path,
    dtype: DType,
    device: &Device,
    isq: IsqType,
) -> Result<(BerryLm, QuantizationReport)> {
    quantized_while_loading(isq, || load_checkpoint(dir, dtype, device))
}

/// The model `load` returns, with the host's in-situ quantization to `isq`
/// applied while it loads, to the projections the host quantizes by default;
/// returns the model and what the host made of it.
pub fn quantized_while_loading(
    isq: IsqType,
    load: impl FnOnce() -> Result<BerryLm>,
) -> Result<(BerryLm, QuantizationReport)> {
    mistralrs_quant::set_immediate_isq(Some(isq), quantization::quantizable_tensors()?);
    let model = load();
    mistralrs_quant::clear_immediate_isq();
    let mut model = model?;
    let report = QuantizationReport::of(&mut model)?
        .context("the host quantized none of the model's projections")?;
    Ok((model, report))
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
        cache.set_state_indices(Some(Tensor::new(slots.as_slice(), model.device())?));
        Ok(Driver {
            model,
            cache,
            offsets: vec![0; sequences],
        })
    }

    /// Feeds one chunk per sequence (all the same length); returns logits `[B, T, vocab]`
    /// and, if asked, every decoder layer's output.
    pub fn step(
        &mut self,
        chunks: &[&[u32]],
        layer_outputs: Option<&mut Vec<Tensor>>,
    ) -> Result<Tensor> {
        let hidden = self.forward_hidden(chunks, layer_outputs)?;
        Ok(self.model.logits(&hidden)?.to_dtype(DType::F32)?)
    }

    /// Like [`Driver::step`], but with the LM head on each sequence's last position
    /// only, as the engine does: returns logits `[B, vocab]`.
    pub fn step_last(&mut self, chunks: &[&[u32]]) -> Result<Tensor> {
        let hidden = self.forward_hidden(chunks, None)?;
        // Contiguous, as the engine's gather of the last positions is: CUDA's
        // matmul takes no strided rows.
        let last = hidden
            .narrow(1, hidden.dim(1)? - 1, 1)?
            .squeeze(1)?
            .contiguous()?;
        Ok(self.model.logits(&last)?.to_dtype(DType::F32)?)
    }

    /// Runs the decoder on one chunk per sequence; returns the final-normed hidden states.
    fn forward_hidden(
        &mut self,
        chunks: &[&[u32]],
        layer_outputs: Option<&mut Vec<Tensor>>,
    ) -> Result<Tensor> {
        let len = chunks[0].len();
        let rows: Vec<Tensor> = chunks
            .iter()
            .map(|chunk| Tensor::new(*chunk, self.model.device()))
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
        Ok(hidden)
    }

    /// Feeds one sequence in chunks of the given sizes; returns `[T, vocab]` logits.
    pub fn run_chunked(
        &mut self,
        ids: &[u32],
        chunk_sizes: impl IntoIterator<Item = usize>,
    ) -> Result<Tensor> {
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
        anyhow::ensure!(
            start == ids.len(),
            "chunk sizes cover {start} of {} tokens",
            ids.len()
        );
        Ok(Tensor::cat(&logits, 0)?)
    }
}
