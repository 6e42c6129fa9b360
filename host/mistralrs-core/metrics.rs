//! Serving metrics, recorded where the engine already knows the events and
//! read as one [`MetricsSnapshot`] (the server's `/metrics` endpoint renders
//! it in the Prometheus text format).
//!
//! * occupancy (running and waiting sequences, recurrent-state slots, paged KV
//!   blocks) after every scheduler step, once finished sequences are freed;
//! * time to first token (from the sequence's creation, when the engine
//!   accepted its request, to its first sampled token) and the time between
//!   two tokens of a sequence, when a token is added to it;
//! * finished sequences by reason, when a sequence enters a finished state;
//! * process resident memory and, on CUDA, device memory, when read.
//!
//! The figures are process-wide: with several models loaded, the counters and
//! histograms add up every engine's events and the occupancy is the last
//! step's of any engine.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use candle_core::Device;

use crate::pipeline::Pipeline;
use crate::scheduler::Scheduler;
use crate::sequence::{SequenceState, StopReason};
use crate::MemoryUsage;

/// Bucket upper bounds (seconds) of the time-to-first-token histogram.
pub const TIME_TO_FIRST_TOKEN_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0,
];

/// Bucket upper bounds (seconds) of the inter-token latency histogram.
pub const INTER_TOKEN_LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
    5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
];

/// Why a sequence finished, as the metrics count it (in the order of
/// [`MetricsSnapshot::finished`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// End of sequence, a stop token or string, or a complete tool call.
    Stop,
    /// `max_tokens` or the model's context reached; or, under paged attention,
    /// a prompt the KV cache can never hold.
    Length,
    /// The model failed the sequence's step.
    Error,
    /// The client left or the engine was told to stop.
    Cancelled,
}

impl FinishReason {
    pub const ALL: [FinishReason; 4] = [
        FinishReason::Stop,
        FinishReason::Length,
        FinishReason::Error,
        FinishReason::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Error => "error",
            FinishReason::Cancelled => "cancelled",
        }
    }

    /// The reason a sequence finishes by entering `state`, if `state` is a
    /// finished one.
    fn of(state: SequenceState) -> Option<FinishReason> {
        match state {
            SequenceState::Done(StopReason::Length(_) | StopReason::ModelLength(_))
            | SequenceState::FinishedIgnored => Some(FinishReason::Length),
            SequenceState::Done(StopReason::Canceled) | SequenceState::FinishedAborted => {
                Some(FinishReason::Cancelled)
            }
            SequenceState::Done(_) => Some(FinishReason::Stop),
            SequenceState::Error => Some(FinishReason::Error),
            SequenceState::RunningPrompt
            | SequenceState::RunningCompletion
            | SequenceState::Waiting
            | SequenceState::RunningPrefillPrompt
            | SequenceState::Swapped => None,
        }
    }
}

/// How much of a pool is in use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Occupancy {
    pub in_use: usize,
    pub total: usize,
}

/// Observations of one histogram: `counts[i]` holds those at most
/// `bounds[i]` and above the bound before it (not cumulative); `count` holds
/// every observation, so `count - counts.sum()` are above the last bound.
#[derive(Clone, Debug, PartialEq)]
pub struct Histogram {
    pub bounds: &'static [f64],
    pub counts: Vec<u64>,
    pub count: u64,
    pub sum_seconds: f64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            count: 0,
            sum_seconds: 0.0,
        }
    }

    fn observe(&mut self, duration: Duration) {
        let seconds = duration.as_secs_f64();
        if let Some(bucket) = self.bounds.iter().position(|bound| seconds <= *bound) {
            self.counts[bucket] += 1;
        }
        self.count += 1;
        self.sum_seconds += seconds;
    }
}

/// Everything `/metrics` reports, at one moment.
#[derive(Clone, Debug, PartialEq)]
pub struct MetricsSnapshot {
    pub running: usize,
    pub waiting: usize,
    /// The hybrid cache's recurrent-state pool (`None` for models without one).
    pub recurrent_slots: Option<Occupancy>,
    /// The paged KV cache's blocks, without the placeholder block (`None`
    /// without paged attention).
    pub kv_blocks: Option<Occupancy>,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    /// Finished sequences, in the order of [`FinishReason::ALL`].
    pub finished: [u64; 4],
    pub generated_tokens: u64,
    /// Resident memory of this process (Linux only).
    pub resident_memory_bytes: Option<u64>,
    /// Memory used and total of the engine's CUDA device (`None` elsewhere).
    pub device_memory_bytes: Option<Occupancy>,
}

struct Recorder {
    running: usize,
    waiting: usize,
    recurrent_slots: Option<Occupancy>,
    kv_blocks: Option<Occupancy>,
    time_to_first_token: Histogram,
    inter_token_latency: Histogram,
    finished: [u64; 4],
    generated_tokens: u64,
    device: Option<Device>,
}

static RECORDER: Mutex<Option<Recorder>> = Mutex::new(None);

fn with_recorder<T>(f: impl FnOnce(&mut Recorder) -> T) -> T {
    let mut guard = RECORDER.lock().unwrap_or_else(PoisonError::into_inner);
    let recorder = guard.get_or_insert_with(|| Recorder {
        running: 0,
        waiting: 0,
        recurrent_slots: None,
        kv_blocks: None,
        time_to_first_token: Histogram::new(TIME_TO_FIRST_TOKEN_BUCKETS),
        inter_token_latency: Histogram::new(INTER_TOKEN_LATENCY_BUCKETS),
        finished: [0; 4],
        generated_tokens: 0,
        device: None,
    });
    f(recorder)
}

/// The device whose memory the metrics report (the engine's).
pub(crate) fn record_device(device: Device) {
    with_recorder(|r| r.device = Some(device));
}

/// Occupancy after a scheduler step (finished sequences already freed).
pub(crate) fn record_occupancy(scheduler: &dyn Scheduler, pipeline: &dyn Pipeline) {
    let recurrent_slots = (!pipeline.get_metadata().no_kv_cache && pipeline.cache().is_hybrid())
        .then(|| {
            let hybrid = pipeline.cache().hybrid();
            hybrid
                .caches
                .iter()
                .find_map(|layer| layer.as_recurrent_pool())
                .map(|pool| Occupancy {
                    in_use: pool.capacity() - pool.num_free_slots(),
                    total: pool.capacity(),
                })
        })
        .flatten();
    let kv_blocks = scheduler.kv_cache_manager().map(|manager| {
        let manager = crate::get_mut_arcmutex!(manager);
        let total = manager.block_pool().num_gpu_blocks().saturating_sub(1);
        Occupancy {
            in_use: total.saturating_sub(manager.num_free_blocks()),
            total,
        }
    });
    let (running, waiting) = (scheduler.running_len(), scheduler.waiting_len());
    with_recorder(|r| {
        r.running = running;
        r.waiting = waiting;
        r.recurrent_slots = recurrent_slots;
        r.kv_blocks = kv_blocks;
    });
}

/// Forgets the counted events (histograms, finished sequences, generated
/// tokens): the start-up dummy run is not the server's traffic.
pub(crate) fn reset_counters() {
    with_recorder(|r| {
        r.time_to_first_token = Histogram::new(TIME_TO_FIRST_TOKEN_BUCKETS);
        r.inter_token_latency = Histogram::new(INTER_TOKEN_LATENCY_BUCKETS);
        r.finished = [0; 4];
        r.generated_tokens = 0;
    });
}

/// A sequence's first token, `since_creation` after the sequence was created.
pub(crate) fn record_first_token(since_creation: Duration) {
    with_recorder(|r| {
        r.time_to_first_token.observe(since_creation);
        r.generated_tokens += 1;
    });
}

/// A later token of a sequence, `since_previous` after its previous one.
pub(crate) fn record_next_token(since_previous: Duration) {
    with_recorder(|r| {
        r.inter_token_latency.observe(since_previous);
        r.generated_tokens += 1;
    });
}

/// A sequence moved from `previous` to `state`: counted once, when it enters
/// a finished state.
pub(crate) fn record_state_change(previous: SequenceState, state: SequenceState) {
    if FinishReason::of(previous).is_some() {
        return;
    }
    if let Some(reason) = FinishReason::of(state) {
        with_recorder(|r| r.finished[reason as usize] += 1);
    }
}

/// Resident memory of this process: the second field of `/proc/self/statm`
/// (pages) times the page size.
#[cfg(target_os = "linux")]
fn resident_memory_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf only reads a configuration value.
    let page_size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * u64::try_from(page_size).ok()?)
}

#[cfg(not(target_os = "linux"))]
fn resident_memory_bytes() -> Option<u64> {
    None
}

fn device_memory_bytes(device: &Device) -> Option<Occupancy> {
    if !matches!(device, Device::Cuda(_)) {
        return None;
    }
    let total = MemoryUsage.get_total_memory(device).ok()?;
    let available = MemoryUsage.get_memory_available(device).ok()?;
    Some(Occupancy {
        in_use: total.saturating_sub(available),
        total,
    })
}

/// The metrics now.
pub fn snapshot() -> MetricsSnapshot {
    let (mut snapshot, device) = with_recorder(|r| {
        (
            MetricsSnapshot {
                running: r.running,
                waiting: r.waiting,
                recurrent_slots: r.recurrent_slots,
                kv_blocks: r.kv_blocks,
                time_to_first_token: r.time_to_first_token.clone(),
                inter_token_latency: r.inter_token_latency.clone(),
                finished: r.finished,
                generated_tokens: r.generated_tokens,
                resident_memory_bytes: None,
                device_memory_bytes: None,
            },
            r.device.clone(),
        )
    });
    snapshot.resident_memory_bytes = resident_memory_bytes();
    snapshot.device_memory_bytes = device.as_ref().and_then(device_memory_bytes);
    snapshot
}
