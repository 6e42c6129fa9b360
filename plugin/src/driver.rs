//! Running the model directly on a fresh host cache, outside the engine: the
//! way the host drives it (one recurrent slot per sequence, attention KV
//! batched, or in paged blocks as under `--paged-attn`). Used by the
//! alignment tool, the benchmark and the tests.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use mistralrs_core::plugin_api::{FlashParams, HybridCache, PagedAttentionInputMetadata};
use mistralrs_quant::{IsqType, ShardedSafeTensors};

use crate::config::BerryLmConfig;
use crate::graph_batches::GraphBatches;
use crate::model::{BerryLm, ForwardBatch, PagedKv};
use crate::quantization::{self, QuantizationReport};
use crate::weights::Weights;

/// Loads a checkpoint folder (`config.json` and one or more `*.safetensors`)
/// with every weight in `dtype` on `device` (on CUDA able to run paged KV
/// too, as [`Driver::paged`] gives it).
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
    Ok(BerryLm::load(cfg, &Weights::new(vb), device.is_cuda())?)
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
/// the way the host does: one recurrent slot per sequence and the attention
/// KV batched ([`Driver::new`], the non-paged path) or in paged blocks
/// ([`Driver::paged`]).
pub struct Driver<'m> {
    model: &'m BerryLm,
    cache: HybridCache,
    offsets: Vec<usize>,
    paged: Option<PagedBlocks>,
    #[cfg(feature = "cuda")]
    decode_graphs: Option<crate::decode_graph::DecodeGraphs>,
}

/// The attention layers' KV in paged blocks, laid out as the host's cache
/// engine lays them out, sequence `i` owning blocks `i * per_sequence ..
/// (i + 1) * per_sequence`.
struct PagedBlocks {
    /// `(key, value)` blocks of each attention layer.
    blocks: Vec<(Tensor, Tensor)>,
    block_size: usize,
    per_sequence: usize,
}

/// Tokens per paged block (the host's default).
const PAGED_BLOCK_SIZE: usize = 32;

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
            paged: None,
            #[cfg(feature = "cuda")]
            decode_graphs: None,
        })
    }

    /// A driver whose attention layers keep their KV in paged blocks (room
    /// for `max_tokens` per sequence), as the host's paged attention does:
    /// prompts from the start, then decode steps of one token.
    pub fn paged(model: &'m BerryLm, sequences: usize, max_tokens: usize) -> Result<Driver<'m>> {
        anyhow::ensure!(
            model.paged_attention(),
            "the model was loaded without paged attention (it is on CUDA only)"
        );
        let mut driver = Driver::new(model, sequences)?;
        let cfg = model.config();
        let dtype = model.dtype();
        let per_sequence = max_tokens.div_ceil(PAGED_BLOCK_SIZE);
        let blocks = sequences * per_sequence;
        // Keys `[blocks, kv_heads, head_dim / x, block_size, x]` with `x`
        // elements in 16 bytes; values `[blocks, kv_heads, head_dim, block_size]`.
        let x = 16 / dtype.size_in_bytes();
        let key_shape = (
            blocks,
            cfg.num_key_value_heads,
            cfg.head_dim / x,
            PAGED_BLOCK_SIZE,
            x,
        );
        let value_shape = (
            blocks,
            cfg.num_key_value_heads,
            cfg.head_dim,
            PAGED_BLOCK_SIZE,
        );
        let blocks = (0..cfg.num_full_attention_layers())
            .map(|_| {
                Ok((
                    Tensor::zeros(key_shape, dtype, model.device())?,
                    Tensor::zeros(value_shape, dtype, model.device())?,
                ))
            })
            .collect::<candle_core::Result<_>>()?;
        driver.paged = Some(PagedBlocks {
            blocks,
            block_size: PAGED_BLOCK_SIZE,
            per_sequence,
        });
        Ok(driver)
    }

    /// This paged driver, its decode steps of the sizes in `batches` replayed
    /// from CUDA graphs as the server's are (`crate::decode_graph`, CUDA
    /// builds only; the server takes [`GraphBatches::standard`]).
    pub fn with_decode_graphs(
        #[allow(unused_mut)] mut self,
        #[allow(unused_variables)] batches: GraphBatches,
    ) -> Result<Driver<'m>> {
        anyhow::ensure!(self.paged.is_some(), "decode graphs need paged KV");
        #[cfg(feature = "cuda")]
        {
            self.decode_graphs = Some(crate::decode_graph::DecodeGraphs::new(batches));
            Ok(self)
        }
        #[cfg(not(feature = "cuda"))]
        anyhow::bail!("decode graphs need a CUDA build")
    }

    /// Feeds one chunk per sequence (all the same length); returns logits `[B, T, vocab]`
    /// and, if asked, every decoder layer's output.
    pub fn step(
        &mut self,
        chunks: &[&[u32]],
        layer_outputs: Option<&mut Vec<Tensor>>,
    ) -> Result<Tensor> {
        let hidden = match self.run(chunks, layer_outputs, false)? {
            StepOutput::Hidden(hidden) => hidden,
            StepOutput::Logits(_) => {
                anyhow::bail!("a step asked for hidden states replayed a graph")
            }
        };
        Ok(self.model.logits(&hidden)?.to_dtype(DType::F32)?)
    }

    /// Like [`Driver::step`], but with the LM head on each sequence's last position
    /// only, as the engine does (a decode step replayed from its CUDA graph
    /// when the driver has graphs and the step is one they take): returns
    /// logits `[B, vocab]`.
    pub fn step_last(&mut self, chunks: &[&[u32]]) -> Result<Tensor> {
        let last = match self.run(chunks, None, true)? {
            StepOutput::Logits(logits) => return Ok(logits.squeeze(1)?.to_dtype(DType::F32)?),
            // Contiguous, as the engine's gather of the last positions is:
            // CUDA's matmul takes no strided rows.
            StepOutput::Hidden(hidden) => hidden
                .narrow(1, hidden.dim(1)? - 1, 1)?
                .squeeze(1)?
                .contiguous()?,
        };
        Ok(self.model.logits(&last)?.to_dtype(DType::F32)?)
    }

    /// Decode steps this driver replayed from CUDA graphs.
    pub fn decode_graph_replays(&self) -> u64 {
        #[cfg(feature = "cuda")]
        if let Some(graphs) = &self.decode_graphs {
            return graphs.replays();
        }
        0
    }

    /// Feeds one chunk per sequence: the logits `[B, 1, vocab]` of a decode
    /// step replayed from its graph (with `replay`, when the driver has
    /// graphs and they take the step), else the final-normed hidden states.
    fn run(
        &mut self,
        chunks: &[&[u32]],
        layer_outputs: Option<&mut Vec<Tensor>>,
        #[cfg_attr(not(feature = "cuda"), allow(unused_variables))] replay: bool,
    ) -> Result<StepOutput> {
        let input_ids = input_ids(chunks, self.model.device())?;
        let len = input_ids.dim(1)?;
        let counts = vec![len; chunks.len()];
        let batch = ForwardBatch {
            input_ids: &input_ids,
            seqlen_offsets: &self.offsets,
            token_counts: &counts,
        };
        let metadata = self
            .paged
            .as_ref()
            .map(|paged| paged.metadata(&self.offsets, len, self.model.device()))
            .transpose()?;
        let paged = self
            .paged
            .as_ref()
            .zip(metadata.as_ref())
            .map(|(paged, metadata)| PagedKv {
                blocks: &paged.blocks,
                metadata,
            });
        let flash_params = FlashParams::empty(true);
        #[cfg(feature = "cuda")]
        let replayed = match (&self.decode_graphs, &paged) {
            (Some(graphs), Some(kv)) if replay => {
                graphs.forward(self.model, &batch, &mut self.cache, kv, &flash_params)?
            }
            _ => None,
        };
        #[cfg(not(feature = "cuda"))]
        let replayed = None;
        let output = match replayed {
            Some(logits) => StepOutput::Logits(logits),
            None => StepOutput::Hidden(self.model.forward_hidden(
                &batch,
                &mut self.cache,
                paged,
                &flash_params,
                layer_outputs,
            )?),
        };
        for offset in &mut self.offsets {
            *offset += len;
        }
        Ok(output)
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

/// What [`Driver::run`] gives for a step.
enum StepOutput {
    /// The final-normed hidden states `[B, T, hidden]`.
    Hidden(Tensor),
    /// The logits `[B, 1, vocab]` of a decode step replayed from its graph.
    Logits(Tensor),
}

/// The chunks (one per sequence, all the same length) as `[B, T]` token ids.
fn input_ids(chunks: &[&[u32]], device: &Device) -> Result<Tensor> {
    let len = chunks.first().map_or(0, |chunk| chunk.len());
    anyhow::ensure!(
        chunks.iter().all(|chunk| chunk.len() == len),
        "the sequences of a step have chunks of different lengths"
    );
    Ok(Tensor::from_vec(
        chunks.concat(),
        (chunks.len(), len),
        device,
    )?)
}

impl PagedBlocks {
    /// The host's paged attention metadata of a step feeding `len` tokens to
    /// each sequence from `offsets`: a prompt from the start, one token (a
    /// decode step), or more tokens after the start as the host gives a
    /// prompt whose first `offset` positions the prefix cache supplied.
    fn metadata(
        &self,
        offsets: &[usize],
        len: usize,
        device: &Device,
    ) -> Result<PagedAttentionInputMetadata> {
        let prompt = offsets.iter().all(|&offset| offset == 0);
        let prefix_hit = !prompt && len > 1;
        anyhow::ensure!(
            prompt || offsets.iter().all(|&offset| offset > 0),
            "a paged driver's step starts every sequence from the start or none"
        );
        let ends: Vec<usize> = offsets.iter().map(|offset| offset + len).collect();
        let longest = ends.iter().copied().max().unwrap_or(0);
        anyhow::ensure!(
            longest <= self.per_sequence * self.block_size,
            "{longest} tokens do not fit the paged driver's {} blocks of {} per sequence",
            self.per_sequence,
            self.block_size
        );
        let first_block = |row: usize| row * self.per_sequence;
        let slots: Vec<i64> = offsets
            .iter()
            .enumerate()
            .flat_map(|(row, &offset)| {
                (offset..offset + len).map(move |position| {
                    ((first_block(row) + position / self.block_size) * self.block_size
                        + position % self.block_size) as i64
                })
            })
            .collect();
        let width = longest.div_ceil(self.block_size);
        let tables: Vec<u32> = (0..offsets.len())
            .flat_map(|row| (0..width).map(move |block| (first_block(row) + block) as u32))
            .collect();
        let context_lens: Vec<u32> = ends.iter().map(|&end| end as u32).collect();
        let location = device.location();
        let on_device = |tensor: Tensor| HashMap::from([(location, tensor)]);
        Ok(PagedAttentionInputMetadata {
            block_tables: Some(on_device(Tensor::from_vec(
                tables,
                (offsets.len(), width),
                device,
            )?)),
            context_lens: Some(on_device(Tensor::new(context_lens.as_slice(), device)?)),
            // One slot per new token, flat, as the host's inputs give them.
            slot_mappings: on_device(Tensor::from_vec(slots, offsets.len() * len, device)?),
            max_context_len: Some(longest),
            full_block_tables: None,
            full_context_lens: None,
            full_max_context_len: None,
            is_first_prompt_chunk: prompt || prefix_hit,
            paged_kv_indptr: None,
            paged_kv_indices: None,
            paged_kv_last_page_len: None,
            paged_kv_request_indices: None,
            paged_kv_tile_indices: None,
            paged_kv_o_indptr: None,
            paged_kv_chunk_size: None,
            num_cached_tokens: prefix_hit.then(|| offsets.to_vec()),
            query_lens: prefix_hit.then(|| vec![len; offsets.len()]),
            cu_seqlens_q: prefix_hit
                .then(|| cumulative(offsets.iter().map(|_| len), device))
                .transpose()?
                .map(&on_device),
            cu_seqlens_kv: prefix_hit
                .then(|| cumulative(ends.iter().copied(), device))
                .transpose()?
                .map(&on_device),
        })
    }
}

/// `[0, l0, l0 + l1, ...]` of `lengths` as a `u32` tensor, as the host gives
/// cumulative sequence lengths.
fn cumulative(lengths: impl Iterator<Item = usize>, device: &Device) -> Result<Tensor> {
    let sums: Vec<u32> = std::iter::once(0)
        .chain(lengths.scan(0u32, |sum, length| {
            *sum += length as u32;
            Some(*sum)
        }))
        .collect();
    Ok(Tensor::new(sums.as_slice(), device)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks() -> PagedBlocks {
        PagedBlocks {
            blocks: Vec::new(),
            block_size: 4,
            per_sequence: 3,
        }
    }

    fn values(map: &HashMap<candle_core::DeviceLocation, Tensor>) -> Vec<i64> {
        let tensor = map.values().next().expect("one device");
        tensor
            .to_dtype(DType::I64)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1())
            .expect("a tensor of integers")
    }

    #[test]
    fn paged_metadata_places_each_sequence_in_its_own_blocks() -> Result<()> {
        // Blocks of 4 tokens, 3 per sequence: sequence 1 owns blocks 3..6.
        let prompt = blocks().metadata(&[0, 0], 5, &Device::Cpu)?;
        assert!(prompt.is_first_prompt_chunk);
        assert_eq!(
            values(&prompt.slot_mappings),
            [0, 1, 2, 3, 4, 12, 13, 14, 15, 16]
        );
        assert_eq!(values(prompt.block_tables.as_ref().unwrap()), [0, 1, 3, 4]);
        assert_eq!(values(prompt.context_lens.as_ref().unwrap()), [5, 5]);
        assert_eq!(prompt.max_context_len, Some(5));

        // Position 5 is block 1's second slot; position 7 the last slot of
        // sequence 1's second block (block 4).
        let decode = blocks().metadata(&[5, 7], 1, &Device::Cpu)?;
        assert!(!decode.is_first_prompt_chunk);
        assert_eq!(values(&decode.slot_mappings), [5, 19]);
        assert_eq!(values(decode.block_tables.as_ref().unwrap()), [0, 1, 3, 4]);
        assert_eq!(values(decode.context_lens.as_ref().unwrap()), [6, 8]);
        assert_eq!(decode.max_context_len, Some(8));
        Ok(())
    }

    #[test]
    fn paged_metadata_gives_a_chunk_after_the_start_as_a_prefix_hit() -> Result<()> {
        // 2 new tokens after 3 and 6 cached ones: sequence 1's positions 6-7
        // are the last two slots of its second block (block 4).
        let chunk = blocks().metadata(&[3, 6], 2, &Device::Cpu)?;
        assert!(chunk.is_first_prompt_chunk);
        assert_eq!(chunk.num_cached_tokens, Some(vec![3, 6]));
        assert_eq!(chunk.query_lens, Some(vec![2, 2]));
        assert_eq!(values(&chunk.slot_mappings), [3, 4, 18, 19]);
        assert_eq!(values(chunk.block_tables.as_ref().unwrap()), [0, 1, 3, 4]);
        assert_eq!(values(chunk.context_lens.as_ref().unwrap()), [5, 8]);
        assert_eq!(values(chunk.cu_seqlens_q.as_ref().unwrap()), [0, 2, 4]);
        assert_eq!(values(chunk.cu_seqlens_kv.as_ref().unwrap()), [0, 5, 13]);
        Ok(())
    }

    #[test]
    fn paged_metadata_refuses_mixed_starts_and_overflow() {
        let mixed = blocks().metadata(&[0, 4], 2, &Device::Cpu).unwrap_err();
        assert!(
            mixed.to_string().contains("from the start or none"),
            "{mixed}"
        );
        let overflow = blocks().metadata(&[12], 1, &Device::Cpu).unwrap_err();
        assert!(overflow.to_string().contains("do not fit"), "{overflow}");
    }
}
