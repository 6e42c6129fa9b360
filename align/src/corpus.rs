//! The corpus protocol: a reference file of windows sampled from a corpus
//! (`tools/reference_dump.py --corpus`, the format of
//! `../shared/golden/trained-tiny-corpus`) and the seed's table, twice:
//!
//! * **free-running** (the seed's method): our model continues each window
//!   greedily on its own (the `Driver`'s cache carried from step to step)
//!   and is compared step by step with the reference's continuation: whether
//!   the chosen tokens match, and |Δ| of the chosen tokens' log-probabilities
//!   (ours under our logits, the reference's under its). After a first
//!   mismatch the two sides continue different texts, so later positions
//!   measure divergence, as in the seed.
//! * **teacher-forced**: one forward over the window followed by the
//!   reference's float32 continuation, every position compared with the
//!   reference's logits on the same tokens (top-1 and |Δ logprob| of the
//!   reference's argmax, as the other modes of the tool).
//!
//! Positions: `prefill` (the window's last token, which predicts the first
//! continuation token), then `decode1` ... `decode{D-1}`. Next to our rows,
//! the reference's own bfloat16 run against its float32 run is the noise
//! floor (`greedy_bf16` / `teacher_bf16_logits` against the f32 ones).

use std::path::Path;

use anyhow::{Context, Result};
use berrylm::driver::Driver;
use berrylm::model::BerryLm;
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use serde::Serialize;

use crate::modes::rows;
use crate::stats::{self, PositionStats, Summary};

/// One reference run (float32 or bfloat16) of a window.
struct ReferenceRun {
    /// The free-running continuation `[D]` and the logits that chose it.
    greedy: Vec<u32>,
    greedy_logits: Vec<Vec<f32>>,
    /// Logits over the window and the float32 continuation, `[P + D][vocab]`.
    teacher_logits: Vec<Vec<f32>>,
}

struct Window {
    ids: Vec<u32>,
    f32: ReferenceRun,
    bf16: Option<ReferenceRun>,
}

/// A corpus-protocol reference file.
pub struct CorpusGolden {
    windows: Vec<Window>,
}

/// The golden file memory-mapped: only the tensors read are loaded (a
/// corpus file of a full-vocabulary model holds gigabytes of logits).
fn map(path: &Path) -> Result<MmapedSafetensors> {
    // SAFETY: the golden file is not modified while it is mapped.
    unsafe { MmapedSafetensors::new(path) }
        .with_context(|| format!("reading the golden file {}", path.display()))
}

/// Whether the file holds the corpus protocol (`prompt0.ids`) rather than
/// the fixed-sequence format (`seq0.input_ids`); reads only its header.
pub fn is_corpus_file(path: &Path) -> Result<bool> {
    Ok(map(path)?.get("prompt0.ids").is_ok())
}

fn tensor(tensors: &MmapedSafetensors, key: &str) -> Result<Tensor> {
    tensors
        .load(key, &Device::Cpu)
        .with_context(|| format!("the corpus file has no `{key}`"))
}

fn ids(tensors: &MmapedSafetensors, key: &str) -> Result<Vec<u32>> {
    Ok(tensor(tensors, key)?
        .to_dtype(DType::I64)?
        .to_vec1::<i64>()?
        .into_iter()
        .map(|id| id as u32)
        .collect())
}

fn reference_run(tensors: &MmapedSafetensors, window: usize, dtype: &str) -> Result<ReferenceRun> {
    let prefix = format!("prompt{window}");
    Ok(ReferenceRun {
        greedy: ids(tensors, &format!("{prefix}.greedy_{dtype}"))?,
        greedy_logits: rows(&tensor(
            tensors,
            &format!("{prefix}.greedy_{dtype}_logits"),
        )?)?,
        teacher_logits: rows(&tensor(
            tensors,
            &format!("{prefix}.teacher_{dtype}_logits"),
        )?)?,
    })
}

impl CorpusGolden {
    /// Loads the first `limit` windows (all when `None`).
    pub fn load(path: &Path, limit: Option<usize>) -> Result<CorpusGolden> {
        let tensors = map(path)?;
        let mut windows = Vec::new();
        for i in 0..limit.unwrap_or(usize::MAX) {
            if tensors.get(&format!("prompt{i}.ids")).is_err() {
                break;
            }
            let ids = ids(&tensors, &format!("prompt{i}.ids"))?;
            let f32 = reference_run(&tensors, i, "f32")?;
            let bf16 = if tensors.get(&format!("prompt{i}.greedy_bf16")).is_ok() {
                Some(reference_run(&tensors, i, "bf16")?)
            } else {
                None
            };
            let decode = f32.greedy.len();
            anyhow::ensure!(
                decode > 0
                    && f32.greedy_logits.len() == decode
                    && f32.teacher_logits.len() == ids.len() + decode,
                "prompt{i}: {} window ids, {decode} continuation tokens, {} greedy and {} \
                 teacher-forced logits rows",
                ids.len(),
                f32.greedy_logits.len(),
                f32.teacher_logits.len()
            );
            windows.push(Window { ids, f32, bf16 });
        }
        anyhow::ensure!(!windows.is_empty(), "{} has no prompt0.ids", path.display());
        Ok(CorpusGolden { windows })
    }

    fn decode_length(&self) -> usize {
        self.windows[0].f32.greedy.len()
    }
}

/// The log-probability of `token` under `logits`.
fn logprob(logits: &[f32], token: u32) -> f64 {
    stats::log_softmax(logits)[token as usize]
}

/// One free-running step: whether the chosen tokens match, and |Δ| of their
/// log-probabilities, each under its own side's logits.
fn free_running_step(
    reference: &[f32],
    reference_token: u32,
    ours: &[f32],
    our_token: u32,
) -> PositionStats {
    let mut stats = stats::compare_position(reference, ours);
    stats.top1_match = reference_token == our_token;
    stats.abs_logprob_diff = (logprob(ours, our_token) - logprob(reference, reference_token)).abs();
    stats
}

/// Our free-running continuation of `window`: `steps` greedy tokens and the
/// logits that chose them.
fn continue_greedily(
    model: &BerryLm,
    window: &[u32],
    steps: usize,
) -> Result<Vec<(u32, Vec<f32>)>> {
    let mut driver = Driver::new(model, 1)?;
    let mut logits = rows(&driver.step_last(&[window])?)?.remove(0);
    let mut chosen = Vec::with_capacity(steps);
    loop {
        let token = stats::argmax(&logits) as u32;
        let next = if chosen.len() + 1 < steps {
            Some(rows(&driver.step_last(&[&[token]])?)?.remove(0))
        } else {
            None
        };
        chosen.push((token, logits));
        match next {
            Some(next) => logits = next,
            None => return Ok(chosen),
        }
    }
}

/// Per-position statistics `[position][window]` of one side of a table.
type Positions = Vec<Vec<PositionStats>>;

fn push_window(positions: &mut Positions, window: impl IntoIterator<Item = PositionStats>) {
    for (position, stats) in window.into_iter().enumerate() {
        positions[position].push(stats);
    }
}

/// Runs both protocols of every window; returns (free-running, teacher-forced)
/// statistics of our model and of the reference's bfloat16 run.
fn measure(model: &BerryLm, golden: &CorpusGolden) -> Result<[(Positions, Positions); 2]> {
    let decode = golden.decode_length();
    let empty = || vec![Vec::new(); decode];
    let (mut free_ours, mut free_floor) = (empty(), empty());
    let (mut teacher_ours, mut teacher_floor) = (empty(), empty());
    for window in &golden.windows {
        let reference = &window.f32;
        let ours = continue_greedily(model, &window.ids, decode)?;
        push_window(
            &mut free_ours,
            ours.iter().enumerate().map(|(s, (token, logits))| {
                free_running_step(
                    &reference.greedy_logits[s],
                    reference.greedy[s],
                    logits,
                    *token,
                )
            }),
        );
        let mut forced = window.ids.clone();
        forced.extend(&reference.greedy);
        let our_rows = rows(
            &Driver::new(model, 1)?
                .step(&[forced.as_slice()], None)?
                .squeeze(0)?,
        )?;
        let first = window.ids.len() - 1;
        push_window(
            &mut teacher_ours,
            (first..first + decode)
                .map(|p| stats::compare_position(&reference.teacher_logits[p], &our_rows[p])),
        );
        if let Some(bf16) = &window.bf16 {
            push_window(
                &mut free_floor,
                (0..decode).map(|s| {
                    free_running_step(
                        &reference.greedy_logits[s],
                        reference.greedy[s],
                        &bf16.greedy_logits[s],
                        bf16.greedy[s],
                    )
                }),
            );
            push_window(
                &mut teacher_floor,
                (first..first + decode).map(|p| {
                    stats::compare_position(&reference.teacher_logits[p], &bf16.teacher_logits[p])
                }),
            );
        }
    }
    Ok([(free_ours, free_floor), (teacher_ours, teacher_floor)])
}

/// One position's row of a table.
#[derive(Debug, Serialize)]
pub struct PositionRow {
    pub position: String,
    #[serde(flatten)]
    pub summary: Summary,
}

/// One table: the summary over every position, then each position's.
#[derive(Debug, Serialize)]
pub struct Table {
    #[serde(flatten)]
    pub summary: Summary,
    pub per_position: Vec<PositionRow>,
    /// The reference's own bfloat16 run against its float32 run.
    pub reference_bf16: Option<Box<Table>>,
}

fn position_name(position: usize) -> String {
    if position == 0 {
        "prefill".to_string()
    } else {
        format!("decode{position}")
    }
}

fn table(positions: &Positions) -> Table {
    Table {
        summary: stats::summarize(positions.iter().flatten()),
        per_position: positions
            .iter()
            .enumerate()
            .map(|(position, stats)| PositionRow {
                position: position_name(position),
                summary: stats::summarize(stats),
            })
            .collect(),
        reference_bf16: None,
    }
}

fn with_floor(ours: &Positions, floor: &Positions) -> Table {
    let mut ours = table(ours);
    if floor.iter().all(|stats| !stats.is_empty()) {
        ours.reference_bf16 = Some(Box::new(table(floor)));
    }
    ours
}

/// The corpus report: both tables of one run.
#[derive(Debug, Serialize)]
pub struct CorpusReport {
    pub model: String,
    pub model_dir: String,
    pub golden: String,
    pub dtype: String,
    pub device: String,
    pub windows: usize,
    pub prompt_length: usize,
    pub decode_length: usize,
    pub free_running: Table,
    pub teacher_forced: Table,
}

impl CorpusReport {
    pub fn build(run: crate::report::Run, model: &BerryLm, golden: &CorpusGolden) -> Result<Self> {
        let [(free_ours, free_floor), (teacher_ours, teacher_floor)] = measure(model, golden)?;
        Ok(CorpusReport {
            model: run.model,
            model_dir: run.model_dir,
            golden: run.golden,
            dtype: run.dtype,
            device: run.device,
            windows: golden.windows.len(),
            prompt_length: golden.windows[0].ids.len(),
            decode_length: golden.decode_length(),
            free_running: with_floor(&free_ours, &free_floor),
            teacher_forced: with_floor(&teacher_ours, &teacher_floor),
        })
    }

    /// The seed's table twice, as markdown.
    pub fn tables(&self) -> String {
        let mut out = format!(
            "# Corpus protocol: {} ({}, {}), {} windows of {} tokens, {} continuation tokens\n",
            self.model,
            self.dtype,
            self.device,
            self.windows,
            self.prompt_length,
            self.decode_length
        );
        for (name, table) in [
            ("Free-running (the seed's method)", &self.free_running),
            ("Teacher-forced", &self.teacher_forced),
        ] {
            out.push_str(&format!(
                "\n## {name}\n\n| Model | Match% | mean |Δ| | p95 |Δ| | max |Δ| | outliers |\n\
                 |---|---:|---:|---:|---:|---:|\n"
            ));
            let sides = std::iter::once((format!("berrylm {}", self.dtype), table))
                .chain(
                    table
                        .reference_bf16
                        .as_deref()
                        .map(|floor| ("reference bf16 (noise floor)".to_string(), floor)),
                )
                .collect::<Vec<_>>();
            for (label, side) in &sides {
                let s = &side.summary;
                out.push_str(&format!(
                    "| {label} | {:.2} | {:.3e} | {:.3e} | {:.3e} | {} |\n",
                    100.0 * s.top1_match,
                    s.mean_abs_logprob_diff,
                    s.p95_abs_logprob_diff,
                    s.max_abs_logprob_diff,
                    s.outliers
                ));
            }
            out.push_str("\n| Position |");
            for (label, _) in &sides {
                out.push_str(&format!(" {label} Match% |"));
            }
            out.push_str(&format!("\n|---|{}\n", "---:|".repeat(sides.len())));
            for (position, row) in table.per_position.iter().enumerate() {
                out.push_str(&format!("| {} |", row.position));
                for (_, side) in &sides {
                    out.push_str(&format!(
                        " {:.2} |",
                        100.0 * side.per_position[position].summary.top1_match
                    ));
                }
                out.push('\n');
            }
        }
        out
    }
}
