use berrylm_kernels::{moe_route, Result};
use candle_core::{DType, Device, Tensor, D};

use crate::common::{f32_values, tensor, Rng};

/// `f32`'s unit roundoff, 2^-24.
const F32_U: f64 = 1.0 / 16_777_216.0;

/// The ids of a `moe_route` result, row by row.
fn id_rows(ids: &Tensor) -> Result<Vec<Vec<u32>>> {
    assert_eq!(ids.dtype(), DType::U32);
    Ok(ids.to_vec2::<u32>()?)
}

/// `softmax(row)` in `f64`.
fn softmax_f64(row: &[f32]) -> Vec<f64> {
    let max = row
        .iter()
        .fold(f64::NEG_INFINITY, |m, &v| m.max(f64::from(v)));
    let exps: Vec<f64> = row.iter().map(|&v| (f64::from(v) - max).exp()).collect();
    let sum: f64 = exps.iter().sum();
    exps.into_iter().map(|e| e / sum).collect()
}

/// Logits `[rows, experts]` drawn uniformly from `[-4, 4)`.
fn random_logits(seed: u64, rows: usize, experts: usize) -> Result<Tensor> {
    let mut rng = Rng::new(seed);
    tensor(rng.uniform_vec(rows * experts, -4.0, 4.0), &[rows, experts])
}

/// The relative error bound of an `f32` probability against the `f64`
/// softmax: the rounding of `x - max` (up to `|x - max| * u`, at most 8u for
/// logits in `[-4, 4)`), of the exponential (about 1u), of the sum of `E`
/// terms (at most `(E - 1)u`) and of the division (1u), with some margin.
fn probability_bound(experts: usize) -> f64 {
    (experts as f64 + 16.0) * F32_U
}

/// With `top_k = E` and no renormalisation the weights are all the
/// probabilities, by decreasing value: they sum to one and are the softmax.
#[test]
fn weights_are_the_softmax_and_sum_to_one() -> Result<()> {
    let (rows, experts) = (5, 40);
    let bound = probability_bound(experts);
    let logits = random_logits(1, rows, experts)?;
    let (weights, ids) = moe_route(&logits, experts, false, DType::F32)?;
    assert_eq!(weights.dims(), &[rows, experts]);
    assert_eq!(weights.dtype(), DType::F32);
    let weights = weights.to_vec2::<f32>()?;
    for ((logit_row, weight_row), id_row) in logits
        .to_vec2::<f32>()?
        .iter()
        .zip(&weights)
        .zip(id_rows(&ids)?)
    {
        let mut sorted_ids = id_row.clone();
        sorted_ids.sort_unstable();
        assert_eq!(sorted_ids, (0..experts as u32).collect::<Vec<_>>());
        let probs = softmax_f64(logit_row);
        for (&weight, &id) in weight_row.iter().zip(&id_row) {
            let want = probs[id as usize];
            let error = (f64::from(weight) - want).abs();
            assert!(error <= bound * want, "{weight} vs {want}");
        }
        assert!(weight_row.windows(2).all(|pair| pair[0] >= pair[1]));
        let total: f64 = weight_row.iter().map(|&w| f64::from(w)).sum();
        assert!((total - 1.0).abs() <= bound, "sum {total}");
    }
    Ok(())
}

/// On the CPU the probabilities are candle's softmax bit for bit, here its
/// op composition `exp(x - max) / sum` (the same `f32` operations and
/// summation as `candle_nn::ops::softmax_last_dim`).
#[test]
fn probabilities_are_candles_softmax_bit_for_bit() -> Result<()> {
    let (rows, experts) = (6, 128);
    let logits = random_logits(2, rows, experts)?;
    let (weights, ids) = moe_route(&logits, experts, false, DType::F32)?;
    let diff = logits.broadcast_sub(&logits.max_keepdim(D::Minus1)?)?;
    let exps = diff.exp()?;
    let candle = exps.broadcast_div(&exps.sum_keepdim(D::Minus1)?)?;
    for ((candle_row, weight_row), id_row) in candle
        .to_vec2::<f32>()?
        .iter()
        .zip(weights.to_vec2::<f32>()?)
        .zip(id_rows(&ids)?)
    {
        for (weight, id) in weight_row.into_iter().zip(id_row) {
            assert_eq!(weight.to_bits(), candle_row[id as usize].to_bits());
        }
    }
    Ok(())
}

/// Without ties the chosen experts are the `k` most probable ones by
/// decreasing probability, found here by sorting the `f64` softmax; both of
/// PyTorch's selection algorithms are covered (`64 k <= E`: heap select,
/// else introselect).
#[test]
fn chosen_experts_are_the_most_probable_by_decreasing_probability() -> Result<()> {
    for (seed, rows, experts, top_k) in [
        (3, 9, 128, 1),
        (4, 9, 128, 2),
        (5, 9, 128, 8),
        (6, 9, 128, 64),
        (7, 9, 128, 128),
        (8, 4, 512, 8),
        (9, 4, 512, 9),
        (10, 7, 7, 3),
    ] {
        let logits = random_logits(seed, rows, experts)?;
        let (weights, ids) = moe_route(&logits, top_k, false, DType::F32)?;
        assert_eq!(ids.dims(), &[rows, top_k]);
        for ((logit_row, weight_row), id_row) in logits
            .to_vec2::<f32>()?
            .iter()
            .zip(weights.to_vec2::<f32>()?)
            .zip(id_rows(&ids)?)
        {
            let probs = softmax_f64(logit_row);
            let mut by_probability: Vec<u32> = (0..experts as u32).collect();
            by_probability.sort_by(|&a, &b| probs[b as usize].total_cmp(&probs[a as usize]));
            assert_eq!(id_row, by_probability[..top_k], "E={experts} k={top_k}");
            for (weight, id) in weight_row.into_iter().zip(id_row) {
                let want = probs[id as usize];
                let bound = probability_bound(experts);
                assert!((f64::from(weight) - want).abs() <= bound * want);
            }
        }
    }
    Ok(())
}

/// Renormalised weights are the chosen probabilities over their sum: in
/// `f32` they sum to one up to the rounding of that sum and of each quotient.
#[test]
fn renormalised_weights_sum_to_one() -> Result<()> {
    let (rows, experts) = (8, 128);
    let logits = random_logits(11, rows, experts)?;
    for top_k in [1, 2, 8, 100] {
        let (weights, ids) = moe_route(&logits, top_k, true, DType::F32)?;
        let (plain, plain_ids) = moe_route(&logits, top_k, false, DType::F32)?;
        assert_eq!(id_rows(&ids)?, id_rows(&plain_ids)?);
        for (weight_row, plain_row) in weights
            .to_vec2::<f32>()?
            .iter()
            .zip(plain.to_vec2::<f32>()?)
        {
            let total: f64 = weight_row.iter().map(|&w| f64::from(w)).sum();
            let bound = (top_k as f64 + 2.0) * 2.0 * F32_U;
            assert!((total - 1.0).abs() <= bound, "k={top_k}: sum {total}");
            let plain_total: f64 = plain_row.iter().map(|&p| f64::from(p)).sum();
            for (&weight, &prob) in weight_row.iter().zip(&plain_row) {
                let want = f64::from(prob) / plain_total;
                assert!((f64::from(weight) - want).abs() <= bound * want);
            }
        }
    }
    Ok(())
}

/// The weights are rounded once to `weight_dtype` (round to nearest even,
/// candle's conversion) and returned as `f32`; the ids do not depend on it.
#[test]
fn weights_are_rounded_once_to_the_weight_dtype() -> Result<()> {
    let logits = random_logits(12, 6, 128)?;
    for renormalize in [false, true] {
        let (exact, exact_ids) = moe_route(&logits, 8, renormalize, DType::F32)?;
        for dtype in [DType::BF16, DType::F16] {
            let (weights, ids) = moe_route(&logits, 8, renormalize, dtype)?;
            assert_eq!(weights.dtype(), DType::F32);
            assert_eq!(id_rows(&ids)?, id_rows(&exact_ids)?);
            let rounded = exact.to_dtype(dtype)?.to_dtype(DType::F32)?;
            assert_eq!(f32_values(&weights)?, f32_values(&rounded)?, "{dtype:?}");
        }
    }
    Ok(())
}

/// Half-precision logits are widened exactly: the result equals that of the
/// same values in `f32`.
#[test]
fn half_precision_logits_are_widened() -> Result<()> {
    let logits = random_logits(13, 5, 128)?;
    for dtype in [DType::BF16, DType::F16] {
        let half = logits.to_dtype(dtype)?;
        let (weights, ids) = moe_route(&half, 8, true, DType::BF16)?;
        let (want_weights, want_ids) =
            moe_route(&half.to_dtype(DType::F32)?, 8, true, DType::BF16)?;
        assert_eq!(f32_values(&weights)?, f32_values(&want_weights)?);
        assert_eq!(id_rows(&ids)?, id_rows(&want_ids)?);
    }
    Ok(())
}

/// `values[i] = ((i * mul) % levels) * step` for `i < n`: rows with many
/// exactly equal values.
fn levels(n: usize, mul: usize, levels: usize, step: f32) -> Vec<f32> {
    (0..n).map(|i| ((i * mul) % levels) as f32 * step).collect()
}

/// Logits with exact ties (equal logits give equal probabilities) and the
/// ids `torch.topk` returns for them, in its order.
///
/// The expected ids are the output of ATen's CPU top-k (`TopKImpl.h`)
/// compiled against libstdc++ (GCC 12): `(value, index)` pairs,
/// `std::partial_sort` when `64 k <= n`, else `std::nth_element` at `k - 1`
/// then `std::sort` of the first `k - 1`, with the comparator
/// `(isnan(a) && !isnan(b)) || a > b`. The first eight rows are the cases
/// whose chosen sets were checked against PyTorch 2.x itself (the plugin's
/// `topk` tests); keeping the lowest or the highest tied indices would fail
/// on each of them.
fn tie_cases() -> Vec<(Vec<f32>, usize, Vec<u32>)> {
    let case = |values: &[f32], k: usize, ids: &[u32]| (values.to_vec(), k, ids.to_vec());
    vec![
        case(&[60., 0., 0., 60., 60., 60., 0., 60.], 2, &[5, 0]),
        case(&[36., 0., 12., 0., 48., 12., 24., 36.], 2, &[4, 7]),
        case(&[60., 0., 60., 30., 60., 60., 0., 0.], 2, &[0, 5]),
        case(&[48., 36., 24., 36., 48., 36.], 3, &[4, 0, 3]),
        case(&[40., 20., 20., 20., 0., 40.], 3, &[5, 0, 3]),
        case(&[36., 24., 60., 36.], 2, &[2, 3]),
        case(&[60., 0., 60., 60., 60., 0., 30., 60.], 1, &[4]),
        case(
            &[
                0., 0., 60., 20., 40., 20., 60., 60., 0., 0., 40., 40., 40., 60., 60., 0.,
            ],
            4,
            &[6, 14, 13, 7],
        ),
        // Heap select and heap sort (64 k <= n).
        case(&levels(128, 37, 16, 4.0), 2, &[19, 3]),
        case(
            &levels(512, 97, 40, 1.5),
            8,
            &[7, 87, 247, 207, 47, 287, 167, 127],
        ),
        // Introselect with a tie across the k-th place, then insertion sort.
        case(
            &levels(128, 53, 24, 2.0),
            8,
            &[67, 115, 19, 43, 91, 38, 62, 14],
        ),
        // Introselect, then introsort of the first 39 (more than 16).
        case(
            &levels(128, 53, 24, 2.0),
            40,
            &[
                67, 115, 19, 91, 43, 110, 86, 14, 38, 62, 81, 33, 9, 57, 105, 76, 100, 124, 4, 52,
                28, 71, 23, 119, 95, 47, 114, 42, 66, 18, 90, 109, 61, 37, 13, 85, 80, 104, 8, 56,
            ],
        ),
        // k = n: PyTorch still selects and sorts, so ties are not in index
        // order.
        case(&levels(8, 3, 4, 10.0), 8, &[1, 5, 2, 6, 7, 3, 4, 0]),
        // All equal.
        case(&[0.0; 128], 8, &[84, 87, 86, 85, 82, 81, 88, 83]),
    ]
}

#[test]
fn exact_ties_are_broken_as_torch_topk_breaks_them() -> Result<()> {
    for (values, top_k, expected) in tie_cases() {
        let experts = values.len();
        let logits = tensor(values, &[1, experts])?;
        // The values are exact in bf16 too.
        for dtype in [DType::F32, DType::BF16] {
            let (weights, ids) = moe_route(&logits.to_dtype(dtype)?, top_k, true, DType::F32)?;
            assert_eq!(
                id_rows(&ids)?[0],
                expected,
                "E={experts} k={top_k} {dtype:?}"
            );
            let weights = f32_values(&weights)?;
            assert!(weights.windows(2).all(|pair| pair[0] >= pair[1]));
        }
    }
    // Rows are routed independently: two of the cases in one call.
    let rows = [levels(128, 53, 24, 2.0), vec![0.0; 128]].concat();
    let (_, ids) = moe_route(&tensor(rows, &[2, 128])?, 8, false, DType::F32)?;
    assert_eq!(
        id_rows(&ids)?,
        [
            [67, 115, 19, 43, 91, 38, 62, 14],
            [84, 87, 86, 85, 82, 81, 88, 83]
        ]
    );
    Ok(())
}

/// A NaN logit makes the whole row's probabilities NaN (as candle's
/// softmax); PyTorch's comparator ranks NaN first and treats NaNs as equal,
/// so the ids are those of a row of equal values.
#[test]
fn nan_logits_give_nan_weights_and_the_order_of_a_full_tie() -> Result<()> {
    let mut values = vec![0.5; 128];
    values[17] = f32::NAN;
    let logits = tensor(values, &[1, 128])?;
    let (weights, ids) = moe_route(&logits, 8, true, DType::BF16)?;
    assert!(f32_values(&weights)?.iter().all(|w| w.is_nan()));
    assert_eq!(id_rows(&ids)?[0], [84, 87, 86, 85, 82, 81, 88, 83]);
    Ok(())
}

#[test]
fn no_rows_give_empty_results() -> Result<()> {
    let logits = Tensor::zeros((0, 128), DType::BF16, &Device::Cpu)?;
    let (weights, ids) = moe_route(&logits, 8, true, DType::BF16)?;
    assert_eq!(weights.dims(), &[0, 8]);
    assert_eq!(ids.dims(), &[0, 8]);
    Ok(())
}
