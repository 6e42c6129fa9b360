//! Per-position comparison of our logits with the reference's, and summaries
//! over sets of positions. Everything is computed in f64.

use std::cmp::Ordering;
use std::collections::HashSet;

use serde::Serialize;

/// A position is an outlier when the log-probability of the reference's top-1
/// token differs by more than this (a factor e in probability).
pub const OUTLIER_THRESHOLD: f64 = 1.0;

/// `log_softmax` of one row of logits, in f64.
pub fn log_softmax(row: &[f32]) -> Vec<f64> {
    let max = row
        .iter()
        .fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
    let sum: f64 = row.iter().map(|&x| (f64::from(x) - max).exp()).sum();
    let log_sum_exp = max + sum.ln();
    row.iter().map(|&x| f64::from(x) - log_sum_exp).collect()
}

/// Index of the largest logit (the first one on ties).
pub fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best
}

/// Indices of the `k` largest logits, largest first (lower index first on
/// ties; NaN above every number and -0 below +0, as `f32::total_cmp` orders
/// them). Selects the `k` before sorting them: a vocabulary of 180,224 logits
/// sorted whole took 16-22 ms a call, four calls a position, about 12 minutes
/// over 3 modes x 3000 positions.
pub fn top_k(row: &[f32], k: usize) -> Vec<usize> {
    let k = k.min(row.len());
    if k == 0 {
        return Vec::new();
    }
    let order = |a: &usize, b: &usize| row[*b].total_cmp(&row[*a]).then(a.cmp(b));
    let mut indices: Vec<usize> = (0..row.len()).collect();
    if k < indices.len() {
        indices.select_nth_unstable_by(k - 1, order);
        indices.truncate(k);
    }
    indices.sort_unstable_by(order);
    indices
}

/// Fraction of the `wanted` ids (the reference's top-k) that are among `ours`.
fn overlap(wanted: &[usize], ours: &[usize]) -> f64 {
    if wanted.is_empty() {
        return 1.0;
    }
    let ours: HashSet<usize> = ours.iter().copied().collect();
    wanted.iter().filter(|id| ours.contains(id)).count() as f64 / wanted.len() as f64
}

/// KL(reference || ours) from two rows of log-probabilities. Mathematically
/// non-negative; rounding below zero is clamped to 0.
pub fn kl_divergence(reference_logprobs: &[f64], our_logprobs: &[f64]) -> f64 {
    let kl: f64 = reference_logprobs
        .iter()
        .zip(our_logprobs)
        .map(|(&r, &o)| {
            let p = r.exp();
            if p == 0.0 {
                0.0
            } else {
                p * (r - o)
            }
        })
        .sum();
    kl.max(0.0)
}

/// Nearest-rank percentile: the smallest value with at least `q` percent of the
/// values at or below it (NaN for an empty list).
pub fn percentile(values: &[f64], q: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(|a, b| a.partial_cmp(b).unwrap_or(Ordering::Equal));
    let rank = ((q / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The comparison at one position.
#[derive(Clone, Copy, Debug)]
pub struct PositionStats {
    /// Our argmax is the reference's.
    pub top1_match: bool,
    /// |log p_ours(a) - log p_ref(a)| for the reference's argmax `a`.
    pub abs_logprob_diff: f64,
    /// KL(ref || ours).
    pub kl: f64,
    pub top5_overlap: f64,
    pub top20_overlap: f64,
}

/// Compares our logits row with the reference's at one position.
pub fn compare_position(reference: &[f32], ours: &[f32]) -> PositionStats {
    assert_eq!(reference.len(), ours.len(), "vocabulary sizes differ");
    let reference_top = argmax(reference);
    let reference_logprobs = log_softmax(reference);
    let our_logprobs = log_softmax(ours);
    // The top 5 are the first 5 of the top 20 (one order, ties included).
    let reference_top20 = top_k(reference, 20);
    let our_top20 = top_k(ours, 20);
    let five = reference_top20.len().min(5);
    PositionStats {
        top1_match: argmax(ours) == reference_top,
        abs_logprob_diff: (our_logprobs[reference_top] - reference_logprobs[reference_top]).abs(),
        kl: kl_divergence(&reference_logprobs, &our_logprobs),
        top5_overlap: overlap(&reference_top20[..five], &our_top20[..five]),
        top20_overlap: overlap(&reference_top20, &our_top20),
    }
}

/// Compares every row of two `[T, vocab]` logits, the rows spread over the
/// machine's cores (each position is independent; the result is in order).
pub fn compare_rows(reference: &[Vec<f32>], ours: &[Vec<f32>]) -> Vec<PositionStats> {
    assert_eq!(reference.len(), ours.len(), "position counts differ");
    let threads = std::thread::available_parallelism().map_or(1, usize::from);
    let per_thread = reference.len().div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        let parts: Vec<_> = reference
            .chunks(per_thread)
            .zip(ours.chunks(per_thread))
            .map(|(r, o)| {
                scope.spawn(move || {
                    r.iter()
                        .zip(o)
                        .map(|(r, o)| compare_position(r, o))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        parts
            .into_iter()
            .flat_map(|part| part.join().expect("a comparison thread panicked"))
            .collect()
    })
}

/// Statistics over a set of positions (NaN, written as `null` in JSON, when the set is empty).
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub positions: usize,
    /// Fraction of positions where our argmax is the reference's.
    pub top1_match: f64,
    pub top1_mismatches: usize,
    pub mean_abs_logprob_diff: f64,
    pub p95_abs_logprob_diff: f64,
    pub max_abs_logprob_diff: f64,
    pub kl_mean: f64,
    pub kl_p95: f64,
    pub kl_max: f64,
    pub top5_overlap: f64,
    pub top20_overlap: f64,
    /// Positions with |Δ logprob| > OUTLIER_THRESHOLD.
    pub outliers: usize,
}

fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        f64::NAN
    } else {
        values.iter().sum::<f64>() / values.len() as f64
    }
}

fn max(values: &[f64]) -> f64 {
    values.iter().copied().reduce(f64::max).unwrap_or(f64::NAN)
}

pub fn summarize<'a>(positions: impl IntoIterator<Item = &'a PositionStats>) -> Summary {
    let positions: Vec<&PositionStats> = positions.into_iter().collect();
    let diffs: Vec<f64> = positions.iter().map(|p| p.abs_logprob_diff).collect();
    let kls: Vec<f64> = positions.iter().map(|p| p.kl).collect();
    let matches = positions.iter().filter(|p| p.top1_match).count();
    let top5: Vec<f64> = positions.iter().map(|p| p.top5_overlap).collect();
    let top20: Vec<f64> = positions.iter().map(|p| p.top20_overlap).collect();
    Summary {
        positions: positions.len(),
        top1_match: if positions.is_empty() {
            f64::NAN
        } else {
            matches as f64 / positions.len() as f64
        },
        top1_mismatches: positions.len() - matches,
        mean_abs_logprob_diff: mean(&diffs),
        p95_abs_logprob_diff: percentile(&diffs, 95.0),
        max_abs_logprob_diff: max(&diffs),
        kl_mean: mean(&kls),
        kl_p95: percentile(&kls, 95.0),
        kl_max: max(&kls),
        top5_overlap: mean(&top5),
        top20_overlap: mean(&top20),
        outliers: diffs.iter().filter(|&&d| d > OUTLIER_THRESHOLD).count(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROW: [f32; 8] = [0.5, -1.25, 2.0, 0.0, 3.75, -4.5, 1.0, 0.25];

    /// Fraction of the reference's top-`k` ids that are among ours.
    fn top_k_overlap(reference: &[f32], ours: &[f32], k: usize) -> f64 {
        overlap(&top_k(reference, k), &top_k(ours, k))
    }

    #[test]
    fn kl_of_identical_distributions_is_zero() {
        let logprobs = log_softmax(&ROW);
        assert_eq!(kl_divergence(&logprobs, &logprobs), 0.0);
        assert_eq!(compare_position(&ROW, &ROW).kl, 0.0);
    }

    #[test]
    fn kl_of_two_known_distributions() {
        // p = (1/2, 1/2), q = (1/4, 3/4): KL(p||q) = 1/2 ln 2 + 1/2 ln(2/3).
        let p = [0.5f64.ln(), 0.5f64.ln()];
        let q = [0.25f64.ln(), 0.75f64.ln()];
        let expected = 0.5 * 2f64.ln() + 0.5 * (2.0f64 / 3.0).ln();
        assert!((kl_divergence(&p, &q) - expected).abs() < 1e-15);
    }

    #[test]
    fn top_k_overlap_of_identical_logits_is_one() {
        assert_eq!(top_k_overlap(&ROW, &ROW, 5), 1.0);
        // k larger than the vocabulary: every id, still 1.
        assert_eq!(top_k_overlap(&ROW, &ROW, 20), 1.0);
        let stats = compare_position(&ROW, &ROW);
        assert!(stats.top1_match);
        assert_eq!((stats.top5_overlap, stats.top20_overlap), (1.0, 1.0));
    }

    #[test]
    fn top_k_overlap_counts_shared_ids() {
        // The reference's top-2 is {0, 1}; ours is {1, 2}: one of two shared.
        let reference = [4.0, 3.0, 2.0, 1.0];
        let ours = [1.0, 3.0, 4.0, 2.0];
        assert_eq!(top_k_overlap(&reference, &ours, 2), 0.5);
        assert_eq!(top_k(&reference, 2), vec![0, 1]);
        // The reversed order shares none of the top-2.
        assert_eq!(top_k_overlap(&reference, &[1.0, 2.0, 3.0, 4.0], 2), 0.0);
    }

    #[test]
    fn top_k_is_the_head_of_the_whole_row_sorted() {
        // 1000 logits with many ties (60 distinct values): the selection
        // must give what sorting every index (largest first, lower index
        // first on ties) and keeping the first k gives.
        let row: Vec<f32> = (0..1000u32)
            .map(|i| ((i * 7919) % 60) as f32 * 0.25 - 3.0)
            .collect();
        let mut sorted: Vec<usize> = (0..row.len()).collect();
        sorted.sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap().then(a.cmp(&b)));
        for k in [0, 1, 5, 20, 999, 1000, 1200] {
            assert_eq!(top_k(&row, k), sorted[..k.min(1000)], "k = {k}");
        }
    }

    #[test]
    fn compare_rows_keeps_the_order_of_positions() {
        // More rows than a machine has cores, each its own comparison.
        let rows: Vec<Vec<f32>> = (0..257).map(|i| vec![0.0, i as f32 * 0.001, 1.0]).collect();
        let shifted: Vec<Vec<f32>> = rows
            .iter()
            .enumerate()
            .map(|(i, r)| {
                if i % 3 == 0 {
                    vec![2.0, r[1], r[2]]
                } else {
                    r.clone()
                }
            })
            .collect();
        let stats = compare_rows(&rows, &shifted);
        assert_eq!(stats.len(), 257);
        for (i, (s, (r, o))) in stats.iter().zip(rows.iter().zip(&shifted)).enumerate() {
            let alone = compare_position(r, o);
            assert_eq!(s.top1_match, i % 3 != 0, "position {i}");
            assert_eq!(
                (s.kl, s.abs_logprob_diff),
                (alone.kl, alone.abs_logprob_diff)
            );
        }
    }

    #[test]
    fn logprob_diff_of_a_row_shifted_by_a_constant_is_zero() {
        // Softmax is invariant to adding a constant to every logit.
        let shifted: Vec<f32> = ROW.iter().map(|x| x + 3.0).collect();
        let stats = compare_position(&ROW, &shifted);
        assert!(stats.abs_logprob_diff < 1e-12, "{}", stats.abs_logprob_diff);
        assert!(stats.kl < 1e-12, "{}", stats.kl);
        assert!(stats.top1_match);
    }

    #[test]
    fn log_softmax_of_a_uniform_row_is_minus_log_n() {
        let logprobs = log_softmax(&[7.0; 4]);
        for lp in logprobs {
            assert!((lp + 4f64.ln()).abs() < 1e-15);
        }
    }

    #[test]
    fn p95_of_known_lists() {
        // Nearest rank: the ceil(0.95 n)-th smallest value.
        let hundred: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&hundred, 95.0), 95.0);
        let twenty: Vec<f64> = (1..=20).rev().map(f64::from).collect();
        assert_eq!(percentile(&twenty, 95.0), 19.0);
        assert_eq!(percentile(&[3.5], 95.0), 3.5);
        assert_eq!(percentile(&[2.0, 1.0], 95.0), 2.0);
        assert!(percentile(&[], 95.0).is_nan());
    }

    #[test]
    fn summary_counts_matches_and_outliers() {
        let position = |top1_match, abs_logprob_diff| PositionStats {
            top1_match,
            abs_logprob_diff,
            kl: 0.0,
            top5_overlap: 1.0,
            top20_overlap: 1.0,
        };
        let positions = [
            position(true, 0.0),
            position(false, 1.5),
            position(true, 0.5),
            position(true, 2.0),
        ];
        let summary = summarize(&positions);
        assert_eq!(summary.positions, 4);
        assert_eq!(summary.top1_match, 0.75);
        assert_eq!(summary.top1_mismatches, 1);
        assert_eq!(summary.outliers, 2);
        assert_eq!(summary.max_abs_logprob_diff, 2.0);
        assert_eq!(summary.mean_abs_logprob_diff, 1.0);
        assert!(summarize(&Vec::<PositionStats>::new()).top1_match.is_nan());
    }
}
