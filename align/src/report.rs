//! The report: statistics per mode and per decode step, as a table and as JSON.

use std::fmt::Write as _;

use serde::Serialize;

use candle_core::Tensor;

use crate::modes::{error_line, rows, Golden, Greedy, TeacherForced, CHUNK};
use crate::stats::{self, PositionStats, Summary};

#[derive(Serialize)]
pub struct Incremental {
    #[serde(flatten)]
    pub all: Summary,
    /// Positions computed by the prefill of the first max(1, T/2) tokens.
    pub prefill_positions: Summary,
    /// Positions computed by single-token decode steps.
    pub decode_positions: Summary,
}

#[derive(Serialize)]
pub struct Chunked {
    #[serde(flatten)]
    pub all: Summary,
    pub chunk_size: usize,
}

/// A mode's statistics, or why it could not run (`{"error": ...}` in JSON).
#[derive(Serialize)]
#[serde(untagged)]
pub enum Outcome<T> {
    Ran(T),
    Failed {
        error: String,
    },
    /// Left out by the command line (`{"not_run": why}` in JSON).
    NotRun {
        not_run: &'static str,
    },
}

impl<T> Outcome<T> {
    fn from_result(result: anyhow::Result<T>) -> Outcome<T> {
        match result {
            Ok(value) => Outcome::Ran(value),
            Err(error) => Outcome::Failed {
                error: error_line(&error),
            },
        }
    }

    fn ran(&self) -> Option<&T> {
        match self {
            Outcome::Ran(value) => Some(value),
            Outcome::Failed { .. } | Outcome::NotRun { .. } => None,
        }
    }

    fn error(&self) -> Option<&str> {
        match self {
            Outcome::Failed { error } => Some(error.as_str()),
            Outcome::Ran(_) | Outcome::NotRun { .. } => None,
        }
    }
}

#[derive(Serialize)]
pub struct Modes {
    pub prefill: Outcome<Summary>,
    pub incremental: Outcome<Incremental>,
    pub chunked: Outcome<Chunked>,
    pub greedy: Outcome<Greedy>,
}

/// One row of the per-position table.
#[derive(Serialize)]
pub struct PositionRow {
    /// `prefill` or `decode{k}` (the k-th decode step of the incremental mode).
    pub position: String,
    #[serde(flatten)]
    pub stats: Summary,
}

#[derive(Serialize)]
pub struct Report {
    pub model: String,
    pub model_dir: String,
    pub golden: String,
    pub dtype: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub isq: Option<String>,
    pub device: String,
    pub sequences: usize,
    pub modes: Modes,
    /// The reference's own bfloat16 logits against its float32 logits (all
    /// positions), when the golden file has them.
    pub noise_floor: Option<Summary>,
    /// Per-step rows of the incremental mode (empty when it failed).
    pub positions: Vec<PositionRow>,
}

/// The header fields of a report.
pub struct Run {
    pub model: String,
    pub model_dir: String,
    pub golden: String,
    pub dtype: String,
    /// The in-situ quantization type (`--isq`), if any.
    pub isq: Option<String>,
    pub device: String,
}

/// Every position of every sequence of one mode, against the reference's `logits_f32`.
fn compare_mode(golden: &Golden, logits: &[Tensor]) -> anyhow::Result<Vec<Vec<PositionStats>>> {
    golden
        .sequences
        .iter()
        .zip(logits)
        .map(|(sequence, ours)| {
            let ours = rows(ours)?;
            anyhow::ensure!(
                ours.len() == sequence.logits_f32.len(),
                "{}: {} positions of logits for {} tokens",
                sequence.name,
                ours.len(),
                sequence.logits_f32.len()
            );
            let (reference_vocab, our_vocab) = (
                sequence.logits_f32.first().map_or(0, Vec::len),
                ours.first().map_or(0, Vec::len),
            );
            anyhow::ensure!(
                reference_vocab == our_vocab,
                "{}: the golden file's logits have {reference_vocab} entries, the model's \
                 {our_vocab}: not the same vocabulary",
                sequence.name
            );
            Ok(stats::compare_rows(&sequence.logits_f32, &ours))
        })
        .collect()
}

fn compare_all(
    golden: &Golden,
    logits: &anyhow::Result<Vec<Tensor>>,
) -> anyhow::Result<Vec<PositionStats>> {
    match logits {
        Ok(logits) => Ok(compare_mode(golden, logits)?.concat()),
        Err(error) => Err(anyhow::anyhow!("{}", error_line(error))),
    }
}

impl Report {
    pub fn build(
        run: Run,
        golden: &Golden,
        runs: &TeacherForced,
        greedy: Option<anyhow::Result<Greedy>>,
    ) -> Report {
        let prefill = compare_all(golden, &runs.prefill).map(|p| stats::summarize(&p));
        let chunked = compare_all(golden, &runs.chunked).map(|p| Chunked {
            all: stats::summarize(&p),
            chunk_size: CHUNK,
        });

        // Split the incremental mode into its prefill positions and its decode
        // steps; decode_steps[k] = the (k+1)-th decode step of every sequence
        // long enough to have one.
        let mut positions = Vec::new();
        let incremental =
            match &runs.incremental {
                Ok(logits) => compare_mode(golden, logits).map(|per_sequence| {
                    let mut head = Vec::new();
                    let mut decode_steps: Vec<Vec<PositionStats>> = Vec::new();
                    for (sequence, prompt_len) in per_sequence.iter().zip(&runs.prompt_lens) {
                        let (prefill, decode) =
                            sequence.split_at((*prompt_len).min(sequence.len()));
                        head.extend_from_slice(prefill);
                        for (k, position) in decode.iter().enumerate() {
                            if decode_steps.len() <= k {
                                decode_steps.push(Vec::new());
                            }
                            decode_steps[k].push(*position);
                        }
                    }
                    let decode: Vec<PositionStats> = decode_steps.concat();
                    positions.push(PositionRow {
                        position: "prefill".into(),
                        stats: stats::summarize(&head),
                    });
                    positions.extend(decode_steps.iter().enumerate().map(|(k, step)| {
                        PositionRow {
                            position: format!("decode{}", k + 1),
                            stats: stats::summarize(step),
                        }
                    }));
                    Incremental {
                        all: stats::summarize(head.iter().chain(&decode)),
                        prefill_positions: stats::summarize(&head),
                        decode_positions: stats::summarize(&decode),
                    }
                }),
                Err(error) => Err(anyhow::anyhow!("{}", error_line(error))),
            };

        let noise_floor = golden.has_bf16().then(|| {
            let noise: Vec<PositionStats> = golden
                .sequences
                .iter()
                .filter_map(|s| {
                    s.logits_bf16
                        .as_ref()
                        .map(|bf16| stats::compare_rows(&s.logits_f32, bf16))
                })
                .flatten()
                .collect();
            stats::summarize(&noise)
        });

        Report {
            model: run.model,
            model_dir: run.model_dir,
            golden: run.golden,
            dtype: run.dtype,
            isq: run.isq,
            device: run.device,
            sequences: golden.sequences.len(),
            modes: Modes {
                prefill: Outcome::from_result(prefill),
                incremental: Outcome::from_result(incremental),
                chunked: Outcome::from_result(chunked),
                greedy: match greedy {
                    Some(greedy) => Outcome::from_result(greedy),
                    None => Outcome::NotRun {
                        not_run: "not run (--teacher-forced-only)",
                    },
                },
            },
            noise_floor,
            positions,
        }
    }

    /// The modes that could not run, with why.
    pub fn failures(&self) -> Vec<(&'static str, &str)> {
        let modes = &self.modes;
        [
            ("prefill", modes.prefill.error()),
            ("incremental", modes.incremental.error()),
            ("chunked", modes.chunked.error()),
            ("greedy", modes.greedy.error()),
        ]
        .into_iter()
        .filter_map(|(mode, error)| error.map(|error| (mode, error)))
        .collect()
    }

    /// The two tables (Markdown), then the failures if any.
    pub fn table(&self) -> String {
        let model = match &self.isq {
            Some(isq) => format!(
                "{} ({}, ISQ {isq}, {})",
                self.model, self.dtype, self.device
            ),
            None => format!("{} ({}, {})", self.model, self.dtype, self.device),
        };
        let mut modes = Vec::new();
        let mut mode = |name: &str, summary: Option<&Summary>| {
            modes.push(match summary {
                Some(summary) => mode_row(&model, name, summary),
                None => text_row(&model, name, "failed"),
            })
        };
        mode("prefill", self.modes.prefill.ran());
        let incremental = self.modes.incremental.ran();
        mode("incremental", incremental.map(|i| &i.all));
        mode(
            "incremental: prefill positions",
            incremental.map(|i| &i.prefill_positions),
        );
        mode(
            "incremental: decode positions",
            incremental.map(|i| &i.decode_positions),
        );
        mode(
            &format!("chunked ({CHUNK})"),
            self.modes.chunked.ran().map(|c| &c.all),
        );
        modes.push(match self.modes.greedy.ran() {
            Some(greedy) => text_row(
                &model,
                &format!(
                    "greedy (engine): {}/{} tokens",
                    greedy.matched, greedy.total
                ),
                &percent(greedy.matched as f64 / greedy.total.max(1) as f64),
            ),
            None => text_row(
                &model,
                "greedy (engine)",
                match self.modes.greedy {
                    Outcome::NotRun { not_run } => not_run,
                    _ => "failed",
                },
            ),
        });
        let noise = "noise floor (reference bf16 vs f32)";
        modes.push(match &self.noise_floor {
            Some(summary) => mode_row(&model, noise, summary),
            None => text_row(&model, noise, "n/a (no logits_bf16)"),
        });
        let positions: Vec<Vec<String>> = self
            .positions
            .iter()
            .map(|row| {
                vec![
                    row.position.clone(),
                    percent(row.stats.top1_match),
                    diff(row.stats.mean_abs_logprob_diff),
                    diff(row.stats.p95_abs_logprob_diff),
                    diff(row.stats.max_abs_logprob_diff),
                ]
            })
            .collect();
        let mut out = markdown(
            &[
                "Model",
                "Mode",
                "Match%",
                "Mean Diff",
                "p95 Diff",
                "Max Diff",
                "Outliers",
            ],
            &modes,
        );
        if !positions.is_empty() {
            out.push('\n');
            out.push_str(&markdown(
                &["Position", "Match%", "Mean Diff", "p95 Diff", "Max Diff"],
                &positions,
            ));
        }
        let failures = self.failures();
        if !failures.is_empty() {
            out.push_str("\nFailed:\n");
            for (mode, error) in failures {
                let _ = writeln!(out, "- {mode}: {error}");
            }
        }
        out
    }
}

fn text_row(model: &str, mode: &str, text: &str) -> Vec<String> {
    let mut row = vec![model.to_string(), mode.to_string(), text.to_string()];
    row.extend(std::iter::repeat_n("-".to_string(), 4));
    row
}

fn mode_row(model: &str, mode: &str, summary: &Summary) -> Vec<String> {
    vec![
        model.to_string(),
        format!("{mode} [{}]", summary.positions),
        percent(summary.top1_match),
        diff(summary.mean_abs_logprob_diff),
        diff(summary.p95_abs_logprob_diff),
        diff(summary.max_abs_logprob_diff),
        summary.outliers.to_string(),
    ]
}

fn percent(fraction: f64) -> String {
    if fraction.is_nan() {
        "-".into()
    } else {
        format!("{:.2}", 100.0 * fraction)
    }
}

fn diff(value: f64) -> String {
    if value.is_nan() {
        "-".into()
    } else if value == 0.0 {
        "0".into()
    } else {
        format!("{value:.2e}")
    }
}

/// A Markdown table with padded columns.
fn markdown(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut out = String::from("|");
        for (cell, width) in cells.zip(&widths) {
            let _ = write!(out, " {cell:<width$} |");
        }
        out.push('\n');
        out
    };
    let mut out = line(&mut header.iter().copied());
    out.push('|');
    for width in &widths {
        let _ = write!(out, "{}|", "-".repeat(width + 2));
    }
    out.push('\n');
    for row in rows {
        out.push_str(&line(&mut row.iter().map(String::as_str)));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::modes::Sequence;
    use candle_core::Device;

    #[test]
    fn logits_of_another_vocabulary_are_refused() {
        let golden = Golden {
            sequences: vec![Sequence {
                name: "seq0".into(),
                ids: vec![1, 2],
                logits_f32: vec![vec![0.0; 3], vec![0.0; 3]],
                logits_bf16: None,
            }],
            prompt_ids: vec![1],
            output_ids: vec![2],
        };
        let same = Tensor::zeros((2, 3), candle_core::DType::F32, &Device::Cpu).unwrap();
        assert_eq!(compare_mode(&golden, &[same]).unwrap()[0].len(), 2);
        let wider = Tensor::zeros((2, 4), candle_core::DType::F32, &Device::Cpu).unwrap();
        let error = compare_mode(&golden, &[wider]).unwrap_err().to_string();
        assert!(error.contains("3 entries, the model's 4"), "{error}");
    }
}
