//! CUDA graphs of decode steps: a step's thousand-odd kernel launches
//! replayed with one call, so that batch-1 decode stops waiting for the host
//! CPU to queue them (docs/performance.md).
//!
//! A decode step under paged attention in half precision (every sequence
//! feeding one token) is keyed by its number of sequences, padded up to the
//! next of the model's [`GraphBatches`], and its longest context rounded up
//! to a power of two ([`GraphKey`]). The first step of a
//! key runs eagerly (it loads every kernel and library handle it uses); the
//! second is captured: the decoder layers, the final norm and the LM head
//! run once on the stream in capture mode, reading fixed device buffers
//! ([`StaticBuffers`]: the embedded tokens, their rotary rows, the
//! recurrent slots, the paged KV slots, block tables and context lengths)
//! and writing the logits into a fixed one. Every later step of the key
//! copies its own inputs into those buffers, replays the graph and returns
//! a copy of the logits. What the host computes for a step (the embedding
//! gather, the rotary rows, the recurrent pools' token counts) stays outside
//! the graph, as does everything with other shapes: prompts, f32 models,
//! batches beyond the largest size, steps without paged attention, and
//! every step of a model whose quantized experts run in the host's kernels
//! (types BerryLM's do not take, such as q4k's q4_1 fallback for rows its
//! blocks do not divide).
//!
//! A step of fewer sequences than its key fills the remaining rows with pad
//! rows: each attends over the first sequence's context, starts from a zero
//! recurrent state ([`PAD_SLOT`]) and writes nothing (no recurrent state, no
//! KV slot); its logits are dropped. Rows do not mix, so the real rows'
//! logits are those of the eager forward up to the rounding of kernels that
//! choose their algorithm by the number of rows (cuBLAS).
//!
//! A capture that fails (an operation the stream cannot record) is logged
//! once and its key runs eagerly from then on; the replayed logits equal the
//! eager ones bit for bit (the same kernels on the same values:
//! `tests/tests/decode_graphs.rs`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use berrylm_kernels::PAD_SLOT;
use candle_core::cuda_backend::cudarc::driver::{sys, CudaGraph, CudaStream};
use candle_core::{DType, Device, Result, Tensor};
use mistralrs_core::plugin_api::{FlashParams, HybridCache, PagedAttentionInputMetadata};

use crate::graph_batches::GraphBatches;
use crate::model::{
    advance_recurrent_offsets, BerryLm, ForwardBatch, PagedKv, RecurrentSlots, StepInputs,
};

/// The most graphs kept; the one replayed least recently goes first.
const MAX_GRAPHS: usize = 64;

/// The smallest context a key rounds up to, in tokens (the partition size of
/// the paged decode attention kernels, BerryLM's and the host's).
const MIN_CONTEXT: usize = 512;

const MIB: f64 = (1u64 << 20) as f64;

/// The KV slot of a row with nothing to write (the host's `_PAD_SLOT_ID`:
/// its cache kernel skips negative slots).
const NO_KV_SLOT: i64 = -1;

/// What a decode graph is captured for: the batch's rows (its sequences
/// padded up to one of the model's [`GraphBatches`]) and the longest context
/// it attends over (the paged attention kernel's launch depends on it) or
/// its block tables hold, rounded up to a power of two of at least
/// [`MIN_CONTEXT`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct GraphKey {
    rows: usize,
    context: usize,
}

/// The decode graphs of one model, with what is known of each key.
pub struct DecodeGraphs {
    batches: GraphBatches,
    table: Mutex<GraphTable>,
}

#[derive(Default)]
struct GraphTable {
    entries: HashMap<GraphKey, Entry>,
    /// Counts replays, for the least recently replayed graph.
    clock: u64,
    /// Whether the model's decode steps run in BerryLM's kernels only, as
    /// graphs need (asked at the first decode step after the weights last
    /// changed).
    model_takes_graphs: Option<bool>,
}

enum Entry {
    /// Run eagerly once: captured at the next step.
    WarmedUp,
    Captured(Box<DecodeGraph>),
    /// The capture failed: runs eagerly.
    Failed,
}

struct DecodeGraph {
    graph: ExecutableGraph,
    buffers: StaticBuffers,
    last_replay: u64,
}

/// An instantiated graph, launched on the stream it was captured on.
struct ExecutableGraph(CudaGraph);

// SAFETY: a CUDA graph and its executable are driver handles any thread may
// use once the context is bound, which `CudaGraph::launch` does; the table
// holding them is behind a mutex, so one thread launches or drops one at a
// time.
unsafe impl Send for ExecutableGraph {}

/// The device buffers a graph reads and writes, at fixed addresses.
struct StaticBuffers {
    /// What they are shaped for.
    key: GraphKey,
    inputs: StepInputs,
    /// `[B]` u32 recurrent slots.
    slots: Tensor,
    /// The paged KV slot of each sequence's new token (the host's dtype).
    slot_mapping: Tensor,
    /// `[B, context / block_size]` u32.
    block_tables: Tensor,
    /// `[B]` u32.
    context_lens: Tensor,
    /// `[B, 1, vocab]`.
    logits: Tensor,
    /// `[B]` [`PAD_SLOT`]s and [`NO_KV_SLOT`]s: the pad rows' slots.
    pad_slots: Tensor,
    no_kv_slots: Tensor,
}

/// The paged attention tensors of a decode step, as the host's decode
/// kernel reads them (the unwindowed ones when the host gives both).
struct PagedStep<'a> {
    slot_mapping: &'a Tensor,
    block_tables: &'a Tensor,
    context_lens: &'a Tensor,
    max_context_len: usize,
}

impl<'a> PagedStep<'a> {
    fn of(metadata: &'a PagedAttentionInputMetadata, device: &Device) -> Option<PagedStep<'a>> {
        let location = device.location();
        let (block_tables, context_lens, max_context_len) = match &metadata.full_block_tables {
            Some(tables) => (
                tables.get(&location)?,
                metadata.full_context_lens.as_ref()?.get(&location)?,
                metadata.full_max_context_len?,
            ),
            None => (
                metadata.block_tables.as_ref()?.get(&location)?,
                metadata.context_lens.as_ref()?.get(&location)?,
                metadata.max_context_len?,
            ),
        };
        Some(PagedStep {
            slot_mapping: metadata.slot_mappings.get(&location)?,
            block_tables,
            context_lens,
            max_context_len,
        })
    }
}

impl Default for DecodeGraphs {
    fn default() -> Self {
        DecodeGraphs::new(GraphBatches::standard())
    }
}

impl DecodeGraphs {
    /// Graphs for the decode steps of the sizes in `batches`.
    pub fn new(batches: GraphBatches) -> DecodeGraphs {
        DecodeGraphs {
            batches,
            table: Mutex::new(GraphTable::default()),
        }
    }

    /// Drops every graph (each key is warmed up and captured again when it
    /// next comes): a graph reads the weights at the addresses it was
    /// captured with, so it must go when the model's weights are replaced.
    pub fn clear(&mut self) {
        if let Ok(table) = self.table.get_mut() {
            table.entries.clear();
            table.model_takes_graphs = None;
        }
    }

    /// Decode steps replayed so far.
    pub fn replays(&self) -> u64 {
        self.table.lock().map_or(0, |table| table.clock)
    }

    /// The logits `[B, 1, vocab]` of the decode step `batch` replayed from
    /// its graph, padded to the graph's rows (captured first if this is the
    /// key's second step), with the
    /// caches updated as the eager forward updates them; `None` when the
    /// step is for the eager forward (not a decode step graphs take, the
    /// key's first step, or a key whose capture failed).
    pub fn forward(
        &self,
        model: &BerryLm,
        batch: &ForwardBatch<'_>,
        cache: &mut HybridCache,
        paged: &PagedKv<'_>,
        flash_params: &FlashParams,
    ) -> Result<Option<Tensor>> {
        let Device::Cuda(cuda) = model.device() else {
            return Ok(None);
        };
        let Some(step) = PagedStep::of(paged.metadata, model.device()) else {
            return Ok(None);
        };
        let Some(key) = graph_key(model, batch, paged, &step, &self.batches)? else {
            return Ok(None);
        };
        let mut table = self
            .table
            .lock()
            .map_err(|_| candle_core::Error::Msg("the decode graph table is poisoned".into()))?;
        let model_takes_graphs = *table.model_takes_graphs.get_or_insert_with(|| {
            let takes = model.decodes_in_berrylm_kernels();
            if !takes {
                tracing::info!(
                    "BerryLM: decode steps run without CUDA graphs: quantized experts of a type \
                     BerryLM's kernels do not take run in the host's kernels, which a graph \
                     cannot replay"
                );
            }
            takes
        });
        if !model_takes_graphs {
            return Ok(None);
        }
        match table.entries.get(&key) {
            None => {
                table.entries.insert(key, Entry::WarmedUp);
                return Ok(None);
            }
            Some(Entry::Failed) => return Ok(None),
            Some(Entry::WarmedUp | Entry::Captured(_)) => {}
        }

        model.check_batch(batch, true)?;
        let rows = batch.token_counts.len();
        let slots = model.recurrent_slots(cache, rows)?;
        if let Some(slot) = slots
            .as_ref()
            .and_then(|slots| berrylm_kernels::repeated_slot(&slots.host))
        {
            // The kernels check it on every eager call; a replay checks
            // nothing on the device.
            candle_core::bail!(
                "BerryLM forward: recurrent state slot {slot} is given to two sequences"
            );
        }
        let inputs = model.step_inputs(batch)?;
        let stream = cuda.cuda_stream();
        if matches!(table.entries.get(&key), Some(Entry::WarmedUp)) {
            let started = Instant::now();
            let captured = block_size(paged)
                .and_then(|block_size| StaticBuffers::new(model, key, &inputs, &step, block_size))
                .and_then(|buffers| {
                    let host_slots = slots.as_ref().map(|slots| {
                        let mut padded = slots.host.clone();
                        padded.resize(key.rows, PAD_SLOT);
                        padded
                    });
                    let graph = capture(
                        model,
                        &stream,
                        &buffers,
                        host_slots.as_deref(),
                        cache,
                        paged,
                        flash_params,
                    )?;
                    Ok(DecodeGraph {
                        graph: ExecutableGraph(graph),
                        buffers,
                        last_replay: 0,
                    })
                });
            match captured {
                Ok(graph) => {
                    table.insert_captured(key, graph);
                    log_capture(&table, key, started, &stream);
                }
                Err(error) => {
                    // A failed capture may leave an error recorded by a
                    // buffer freed while the stream captured: clear it.
                    let _ = stream.context().check_err();
                    tracing::warn!(
                        "BerryLM: decode steps of {} sequences (context up to {} tokens) \
                         run without a CUDA graph: capturing one failed: {error}",
                        key.rows,
                        key.context
                    );
                    table.entries.insert(key, Entry::Failed);
                    return Ok(None);
                }
            }
        }
        table.clock += 1;
        let clock = table.clock;
        let Some(Entry::Captured(graph)) = table.entries.get_mut(&key) else {
            candle_core::bail!("the decode graph of {key:?} is missing")
        };
        graph.last_replay = clock;
        graph.buffers.load(&inputs, slots.as_ref(), &step)?;
        graph.graph.0.launch().map_err(driver_error)?;
        if let Some(slots) = &slots {
            advance_recurrent_offsets(cache, &slots.host, batch);
        }
        Ok(Some(graph.buffers.logits.narrow(0, 0, rows)?.copy()?))
    }
}

impl GraphTable {
    /// Keeps `graph` for `key`, dropping the least recently replayed graph
    /// beyond [`MAX_GRAPHS`] (its key is captured again when it next comes).
    fn insert_captured(&mut self, key: GraphKey, graph: DecodeGraph) {
        self.entries.insert(key, Entry::Captured(Box::new(graph)));
        if self.captured().count() <= MAX_GRAPHS {
            return;
        }
        let oldest = self
            .captured()
            .filter(|(other, _)| **other != key)
            .min_by_key(|(_, graph)| graph.last_replay)
            .map(|(other, _)| *other);
        if let Some(oldest) = oldest {
            self.entries.insert(oldest, Entry::WarmedUp);
        }
    }

    fn captured(&self) -> impl Iterator<Item = (&GraphKey, &DecodeGraph)> {
        self.entries.iter().filter_map(|(key, entry)| match entry {
            Entry::Captured(graph) => Some((key, graph.as_ref())),
            _ => None,
        })
    }
}

/// The key of a decode step graphs take: every sequence feeding one token
/// in half precision, no more sequences than the largest of `batches`,
/// under paged attention without a cached prefix to gather.
fn graph_key(
    model: &BerryLm,
    batch: &ForwardBatch<'_>,
    paged: &PagedKv<'_>,
    step: &PagedStep<'_>,
    batches: &GraphBatches,
) -> Result<Option<GraphKey>> {
    let (rows, seq_len) = batch.input_ids.dims2()?;
    let Some(padded) = batches.padded(rows) else {
        return Ok(None);
    };
    let takes = seq_len == 1
        && batch.token_counts.iter().all(|&count| count == 1)
        && model.dtype() != DType::F32
        && !paged.metadata.is_first_prompt_chunk
        && paged.metadata.num_cached_tokens.is_none()
        && paged.blocks.len() == model.config().num_full_attention_layers();
    if !takes {
        return Ok(None);
    }
    // A sequence's block table holds a block for the token after this step's
    // once its context fills its last block (the host allocates a step ahead),
    // so the table can be one block wider than the context needs.
    let table_tokens = step.block_tables.dim(1)? * block_size(paged)?;
    let context = step
        .max_context_len
        .max(table_tokens)
        .max(MIN_CONTEXT)
        .checked_next_power_of_two()
        .ok_or_else(|| candle_core::Error::Msg("a decode context beyond usize".into()))?;
    Ok(Some(GraphKey {
        rows: padded,
        context,
    }))
}

/// The tokens of a paged KV block (the key cache is `[blocks, kv_heads,
/// head_dim / x, block_size, x]`).
fn block_size(paged: &PagedKv<'_>) -> Result<usize> {
    match paged.blocks.first() {
        Some((key_cache, _)) => key_cache.dim(3),
        None => candle_core::bail!("a decode graph needs the attention layers' paged KV blocks"),
    }
}

impl StaticBuffers {
    /// Buffers of `key`'s shapes, in the dtypes of `inputs` and `step`.
    fn new(
        model: &BerryLm,
        key: GraphKey,
        inputs: &StepInputs,
        step: &PagedStep<'_>,
        block_size: usize,
    ) -> Result<StaticBuffers> {
        let device = model.device();
        let rows_of = |tensor: &Tensor| {
            let mut dims = tensor.dims().to_vec();
            dims[0] = key.rows;
            Tensor::zeros(dims, tensor.dtype(), device)
        };
        let slot_mapping = rows_of(&step.slot_mapping.flatten_all()?)?;
        let no_kv_slots = Tensor::from_vec(vec![NO_KV_SLOT; key.rows], key.rows, device)?
            .to_dtype(slot_mapping.dtype())?;
        Ok(StaticBuffers {
            key,
            inputs: StepInputs {
                embedded: rows_of(&inputs.embedded)?,
                cos: rows_of(&inputs.cos)?,
                sin: rows_of(&inputs.sin)?,
            },
            slots: Tensor::zeros(key.rows, DType::U32, device)?,
            slot_mapping,
            block_tables: Tensor::zeros(
                (key.rows, key.context.div_ceil(block_size)),
                step.block_tables.dtype(),
                device,
            )?,
            context_lens: rows_of(step.context_lens)?,
            logits: Tensor::zeros(
                (key.rows, 1, model.config().vocab_size),
                model.dtype(),
                device,
            )?,
            pad_slots: Tensor::from_vec(vec![PAD_SLOT; key.rows], key.rows, device)?,
            no_kv_slots,
        })
    }

    /// Copies a step's inputs into the buffers (on the stream, before the
    /// replay): the block tables into their leftmost columns, and the rows
    /// past the step's sequences made pad rows (the first sequence's context,
    /// no recurrent or KV slot; their embeddings and rotary rows are left
    /// from earlier steps: finite values whose results are dropped).
    fn load(
        &self,
        inputs: &StepInputs,
        slots: Option<&RecurrentSlots>,
        step: &PagedStep<'_>,
    ) -> Result<()> {
        self.inputs.embedded.slice_set(&inputs.embedded, 0, 0)?;
        self.inputs.cos.slice_set(&inputs.cos, 0, 0)?;
        self.inputs.sin.slice_set(&inputs.sin, 0, 0)?;
        if let Some(slots) = slots {
            self.slots.slice_set(&slots.indices, 0, 0)?;
        }
        let slot_mapping = step.slot_mapping.flatten_all()?;
        let rows = slot_mapping.dim(0)?;
        self.slot_mapping.slice_set(&slot_mapping, 0, 0)?;
        self.block_tables
            .narrow(0, 0, rows)?
            .slice_set(step.block_tables, 1, 0)?;
        self.context_lens.slice_set(step.context_lens, 0, 0)?;

        let pad = self.key.rows - rows;
        if pad == 0 {
            return Ok(());
        }
        self.slots
            .slice_set(&self.pad_slots.narrow(0, 0, pad)?, 0, rows)?;
        self.slot_mapping
            .slice_set(&self.no_kv_slots.narrow(0, 0, pad)?, 0, rows)?;
        let first_of = |tensor: &Tensor, dims: &[usize]| {
            tensor.narrow(0, 0, 1)?.broadcast_as(dims)?.contiguous()
        };
        let (_, columns) = step.block_tables.dims2()?;
        self.block_tables.narrow(0, rows, pad)?.slice_set(
            &first_of(step.block_tables, &[pad, columns])?,
            1,
            0,
        )?;
        self.context_lens
            .slice_set(&first_of(step.context_lens, &[pad])?, 0, rows)
    }

    /// The paged attention metadata of the capture: the step's, reading the
    /// buffers, with the key's context as the longest.
    fn metadata(
        &self,
        step: &PagedAttentionInputMetadata,
        device: &Device,
    ) -> PagedAttentionInputMetadata {
        let context = self.key.context;
        let on_device =
            |tensor: &Tensor| Some(HashMap::from([(device.location(), tensor.clone())]));
        let mut metadata = step.clone();
        metadata.slot_mappings = HashMap::from([(device.location(), self.slot_mapping.clone())]);
        metadata.block_tables = on_device(&self.block_tables);
        metadata.full_block_tables = on_device(&self.block_tables);
        metadata.context_lens = on_device(&self.context_lens);
        metadata.full_context_lens = on_device(&self.context_lens);
        metadata.max_context_len = Some(context);
        metadata.full_max_context_len = Some(context);
        metadata
    }

    fn bytes(&self) -> usize {
        [
            &self.inputs.embedded,
            &self.inputs.cos,
            &self.inputs.sin,
            &self.slots,
            &self.slot_mapping,
            &self.block_tables,
            &self.context_lens,
            &self.logits,
            &self.pad_slots,
            &self.no_kv_slots,
        ]
        .iter()
        .map(|tensor| tensor.elem_count() * tensor.dtype().size_in_bytes())
        .sum()
    }
}

/// Records the decode step over `buffers` on `stream` and instantiates it.
/// Nothing runs: the stream only records (its other work waits until the
/// capture ends, whether it succeeds or not).
/// `host_slots` are the step's recurrent slots (the kernels check them as
/// they record; the graph reads the slots from the buffer).
fn capture(
    model: &BerryLm,
    stream: &Arc<CudaStream>,
    buffers: &StaticBuffers,
    host_slots: Option<&[u32]>,
    cache: &mut HybridCache,
    paged: &PagedKv<'_>,
    flash_params: &FlashParams,
) -> Result<CudaGraph> {
    let metadata = buffers.metadata(paged.metadata, model.device());
    let slots = host_slots.map(|host| RecurrentSlots {
        indices: buffers.slots.clone(),
        host: host.to_vec(),
    });
    let token_counts = vec![1; buffers.key.rows];
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(driver_error)?;
    // Every tensor this allocates is freed before the capture ends.
    let recorded = (|| -> Result<()> {
        let hidden = model.run_layers(
            &buffers.inputs,
            &token_counts,
            slots.as_ref(),
            cache,
            Some(PagedKv {
                blocks: paged.blocks,
                metadata: &metadata,
            }),
            None,
            flash_params,
            None,
        )?;
        buffers.logits.slice_set(&model.logits(&hidden)?, 0, 0)
    })();
    let graph = stream.end_capture(
        sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
    );
    recorded?;
    graph
        .map_err(driver_error)?
        .ok_or_else(|| candle_core::Error::Msg("the capture recorded no work".into()))
}

/// Logs a capture: its time, and the memory every graph holds.
fn log_capture(table: &GraphTable, key: GraphKey, started: Instant, stream: &CudaStream) {
    let (count, buffer_bytes) = table.captured().fold((0, 0), |(count, bytes), (_, graph)| {
        (count + 1, bytes + graph.buffers.bytes())
    });
    let mut reserved: u64 = 0;
    // SAFETY: the attribute is a u64 written to `reserved`, for the stream's
    // device.
    let status = unsafe {
        sys::cuDeviceGetGraphMemAttribute(
            stream.context().cu_device(),
            sys::CUgraphMem_attribute::CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT,
            (&mut reserved as *mut u64).cast(),
        )
    };
    let graph_memory = if status == sys::CUresult::CUDA_SUCCESS {
        format!("{:.1} MiB", reserved as f64 / MIB)
    } else {
        format!("unknown ({status:?})")
    };
    tracing::info!(
        "BerryLM: captured the decode graph of {} sequences (context up to {} tokens) in {:.0} ms; \
         {count} graphs hold {graph_memory} of graph memory and {:.1} MiB of input and output buffers",
        key.rows,
        key.context,
        started.elapsed().as_secs_f64() * 1e3,
        buffer_bytes as f64 / MIB,
    );
}

fn driver_error(error: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Msg(format!("CUDA graph: {error:?}"))
}
