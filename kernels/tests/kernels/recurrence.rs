use berrylm_kernels::{
    kda_recurrence, kda_recurrence_in_pool_with, kda_recurrence_with, repeated_slot,
    KdaPrefillAlgorithm, Result, StatePool, PAD_SLOT,
};
use candle_core::{DType, Device, Tensor};

use crate::common::{
    assert_close, assert_identical, f32_values, f64_values, pool_rows, tensor, Rng,
};

#[derive(Clone, Copy)]
struct Sizes {
    batch: usize,
    seq_len: usize,
    key_heads: usize,
    value_heads: usize,
    key_dim: usize,
    value_dim: usize,
}

impl Sizes {
    /// These head sizes for `batch` sequences of `seq_len` tokens.
    fn with_batch(self, batch: usize, seq_len: usize) -> Sizes {
        Sizes {
            batch,
            seq_len,
            ..self
        }
    }
}

struct RecurrenceInputs {
    sizes: Sizes,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
}

impl RecurrenceInputs {
    /// `[q, k, v, g, beta]`.
    fn tokens(&self) -> [&Tensor; 5] {
        [&self.q, &self.k, &self.v, &self.g, &self.beta]
    }
}

/// Random inputs like HF's `test_kda_chunked_matches_recurrent`:
/// `g = -U(0, 1)`, `beta = U(0, 1)`.
fn inputs(seed: u64, sizes: Sizes, fresh_state: bool) -> Result<RecurrenceInputs> {
    let Sizes {
        batch: b,
        seq_len: t,
        key_heads: hk,
        value_heads: hv,
        key_dim: dk,
        value_dim: dv,
    } = sizes;
    let mut rng = Rng::new(seed);
    let state_values = if fresh_state {
        vec![0.0; b * hv * dk * dv]
    } else {
        rng.uniform_vec(b * hv * dk * dv, -0.5, 0.5)
    };
    Ok(RecurrenceInputs {
        sizes,
        q: tensor(rng.uniform_vec(b * t * hk * dk, -1.0, 1.0), &[b, t, hk, dk])?,
        k: tensor(rng.uniform_vec(b * t * hk * dk, -1.0, 1.0), &[b, t, hk, dk])?,
        v: tensor(rng.uniform_vec(b * t * hv * dv, -1.0, 1.0), &[b, t, hv, dv])?,
        g: tensor(rng.uniform_vec(b * t * hv * dk, -1.0, 0.0), &[b, t, hv, dk])?,
        beta: tensor(rng.uniform_vec(b * t * hv, 0.0, 1.0), &[b, t, hv])?,
        state: tensor(state_values, &[b, hv, dk, dv])?,
    })
}

/// Row-major `rows x inner` times `inner x cols`.
fn matmul(lhs: &[f64], rhs: &[f64], rows: usize, inner: usize, cols: usize) -> Vec<f64> {
    let mut product = vec![0.0; rows * cols];
    for i in 0..rows {
        for j in 0..cols {
            product[i * cols + j] = (0..inner)
                .map(|m| lhs[i * inner + m] * rhs[m * cols + j])
                .sum();
        }
    }
    product
}

fn l2_normalized(values: &[f64]) -> Vec<f64> {
    let norm = (values.iter().map(|v| v * v).sum::<f64>() + 1e-6).sqrt();
    values.iter().map(|v| v / norm).collect()
}

/// Output and final state in `f64` from the closed form
/// `S_t = (I - beta k k^T) D_t S_{t-1} + beta k v^T`, `o_t = S_t^T q`,
/// with value head `j` reading key head `j / (Hv / Hk)`.
fn reference(inputs: &RecurrenceInputs) -> Result<(Vec<f64>, Vec<f64>)> {
    let Sizes {
        batch,
        seq_len,
        key_heads,
        value_heads,
        key_dim: dk,
        value_dim: dv,
    } = inputs.sizes;
    let q = f64_values(&inputs.q)?;
    let k = f64_values(&inputs.k)?;
    let v = f64_values(&inputs.v)?;
    let g = f64_values(&inputs.g)?;
    let beta = f64_values(&inputs.beta)?;
    let mut states = f64_values(&inputs.state)?;
    let mut output = vec![0.0; batch * seq_len * value_heads * dv];
    let group = value_heads / key_heads;
    for b in 0..batch {
        for j in 0..value_heads {
            let key_head = j / group;
            let state_range = (b * value_heads + j) * dk * dv..(b * value_heads + j + 1) * dk * dv;
            let mut state = states[state_range.clone()].to_vec();
            for t in 0..seq_len {
                let key_offset = ((b * seq_len + t) * key_heads + key_head) * dk;
                let token_head = (b * seq_len + t) * value_heads + j;
                let query: Vec<f64> = l2_normalized(&q[key_offset..key_offset + dk])
                    .iter()
                    .map(|x| x / (dk as f64).sqrt())
                    .collect();
                let key = l2_normalized(&k[key_offset..key_offset + dk]);
                let value = &v[token_head * dv..(token_head + 1) * dv];
                let strength = beta[token_head];
                let mut transition = vec![0.0; dk * dk];
                for r in 0..dk {
                    for c in 0..dk {
                        let identity = if r == c { 1.0 } else { 0.0 };
                        let decay = g[token_head * dk + c].exp();
                        transition[r * dk + c] = (identity - strength * key[r] * key[c]) * decay;
                    }
                }
                let write: Vec<f64> = (0..dk * dv)
                    .map(|index| strength * key[index / dv] * value[index % dv])
                    .collect();
                state = matmul(&transition, &state, dk, dk, dv)
                    .iter()
                    .zip(&write)
                    .map(|(kept, written)| kept + written)
                    .collect();
                let read = matmul(&query, &state, 1, dk, dv);
                output[token_head * dv..(token_head + 1) * dv].copy_from_slice(&read);
            }
            states[state_range].copy_from_slice(&state);
        }
    }
    Ok((output, states))
}

/// `kda_recurrence` of `inputs` from their state.
fn run(inputs: &RecurrenceInputs) -> Result<(Tensor, Tensor)> {
    run_from(inputs, &inputs.state)
}

/// `kda_recurrence` of the token inputs of `inputs` from `state`.
fn run_from(inputs: &RecurrenceInputs, state: &Tensor) -> Result<(Tensor, Tensor)> {
    let [q, k, v, g, beta] = inputs.tokens();
    kda_recurrence(q, k, v, g, beta, state)
}

fn check_against_reference(inputs: &RecurrenceInputs) -> Result<()> {
    let sizes = inputs.sizes;
    let (output, state) = run(inputs)?;
    assert_eq!(
        output.dims(),
        &[
            sizes.batch,
            sizes.seq_len,
            sizes.value_heads,
            sizes.value_dim
        ]
    );
    assert_eq!(
        state.dims(),
        &[
            sizes.batch,
            sizes.value_heads,
            sizes.key_dim,
            sizes.value_dim
        ]
    );
    assert_eq!(output.dtype(), DType::F32);
    assert_eq!(state.dtype(), DType::F32);
    let (expected_output, expected_state) = reference(inputs)?;
    assert_close(&f32_values(&output)?, &expected_output, 1e-5, 1e-4);
    assert_close(&f32_values(&state)?, &expected_state, 1e-5, 1e-4);
    Ok(())
}

const HF_TEST_SIZES: Sizes = Sizes {
    batch: 2,
    seq_len: 13,
    key_heads: 3,
    value_heads: 3,
    key_dim: 8,
    value_dim: 16,
};

#[test]
fn matches_closed_form_reference() -> Result<()> {
    check_against_reference(&inputs(1, HF_TEST_SIZES, true)?)?;
    check_against_reference(&inputs(2, HF_TEST_SIZES, false)?)
}

#[test]
fn key_dim_may_differ_from_value_dim() -> Result<()> {
    for (key_dim, value_dim) in [(5, 3), (3, 6)] {
        let sizes = Sizes {
            batch: 1,
            seq_len: 6,
            key_heads: 2,
            value_heads: 2,
            key_dim,
            value_dim,
        };
        check_against_reference(&inputs(3, sizes, false)?)?;
    }
    Ok(())
}

const GROUPED_SIZES: Sizes = Sizes {
    batch: 2,
    seq_len: 5,
    key_heads: 2,
    value_heads: 4,
    key_dim: 4,
    value_dim: 3,
};

#[test]
fn grouped_heads_match_reference() -> Result<()> {
    check_against_reference(&inputs(4, GROUPED_SIZES, false)?)
}

#[test]
fn grouped_value_heads_read_key_head_j_over_group_size() -> Result<()> {
    let original = inputs(5, GROUPED_SIZES, false)?;
    let (output, _) = run(&original)?;
    // Replace key head 1; with Hv = 2 Hk only value heads 2 and 3 read it.
    let Sizes {
        batch,
        seq_len,
        key_dim,
        ..
    } = GROUPED_SIZES;
    let replacement = tensor(
        Rng::new(6).uniform_vec(batch * seq_len * key_dim, -1.0, 1.0),
        &[batch, seq_len, 1, key_dim],
    )?;
    let changed = RecurrenceInputs {
        k: original
            .k
            .slice_assign(&[0..batch, 0..seq_len, 1..2, 0..key_dim], &replacement)?,
        ..original
    };
    let (changed_output, _) = run(&changed)?;
    assert_identical(&changed_output.narrow(2, 0, 2)?, &output.narrow(2, 0, 2)?)?;
    let upper_before = f32_values(&output.narrow(2, 2, 2)?)?;
    let upper_after = f32_values(&changed_output.narrow(2, 2, 2)?)?;
    assert!(upper_before
        .iter()
        .zip(&upper_after)
        .all(|(before, after)| before != after));
    Ok(())
}

#[test]
fn split_sequence_with_carried_state_equals_one_call() -> Result<()> {
    let whole = inputs(7, HF_TEST_SIZES, false)?;
    let (whole_output, whole_state) = run(&whole)?;
    for split in [1, 6, 12] {
        let mut state = whole.state.clone();
        let mut outputs = Vec::new();
        for (start, length) in [(0, split), (split, HF_TEST_SIZES.seq_len - split)] {
            let part = RecurrenceInputs {
                sizes: Sizes {
                    seq_len: length,
                    ..HF_TEST_SIZES
                },
                q: whole.q.narrow(1, start, length)?,
                k: whole.k.narrow(1, start, length)?,
                v: whole.v.narrow(1, start, length)?,
                g: whole.g.narrow(1, start, length)?,
                beta: whole.beta.narrow(1, start, length)?,
                state,
            };
            let (output, next_state) = run(&part)?;
            outputs.push(output);
            state = next_state;
        }
        assert_identical(&Tensor::cat(&outputs, 1)?, &whole_output)?;
        assert_identical(&state, &whole_state)?;
    }
    Ok(())
}

#[test]
fn empty_sequence_keeps_state() -> Result<()> {
    let inputs = inputs(
        8,
        Sizes {
            seq_len: 0,
            ..GROUPED_SIZES
        },
        false,
    )?;
    let (output, state) = run(&inputs)?;
    assert_eq!(output.dims(), &[2, 0, 4, 3]);
    assert_identical(&state, &inputs.state)
}

#[test]
fn bf16_inputs_are_within_bf16_tolerance_of_f32() -> Result<()> {
    let original = inputs(9, HF_TEST_SIZES, false)?;
    let (f32_output, f32_state) = run(&original)?;
    let half = RecurrenceInputs {
        q: original.q.to_dtype(DType::BF16)?,
        k: original.k.to_dtype(DType::BF16)?,
        v: original.v.to_dtype(DType::BF16)?,
        ..original
    };
    let (output, state) = run(&half)?;
    assert_eq!(output.dtype(), DType::F32);
    assert_close(&f32_values(&output)?, &f64_values(&f32_output)?, 2e-2, 2e-2);
    assert_close(&f32_values(&state)?, &f64_values(&f32_state)?, 2e-2, 2e-2);
    Ok(())
}

#[test]
fn prefill_algorithm_does_not_change_cpu_results() -> Result<()> {
    assert_eq!(
        KdaPrefillAlgorithm::default(),
        KdaPrefillAlgorithm::Sequential
    );
    let inputs = inputs(10, HF_TEST_SIZES, false)?;
    let (output, state) = run(&inputs)?;
    let [q, k, v, g, beta] = inputs.tokens();
    for algorithm in [
        KdaPrefillAlgorithm::Sequential,
        KdaPrefillAlgorithm::Chunked,
    ] {
        let (algorithm_output, algorithm_state) =
            kda_recurrence_with(algorithm, q, k, v, g, beta, &inputs.state)?;
        assert_identical(&algorithm_output, &output)?;
        assert_identical(&algorithm_state, &state)?;
    }
    Ok(())
}

// ------------------------------------------------------------------ in pool

/// Rows of the test pools; the tests' slots are scattered over them.
const POOL_ROWS: usize = 9;

/// A pool of `rows` random states for `sizes`' heads.
fn random_pool(seed: u64, sizes: Sizes, rows: usize) -> Result<Tensor> {
    let len = rows * sizes.value_heads * sizes.key_dim * sizes.value_dim;
    tensor(
        Rng::new(seed).uniform_vec(len, -0.5, 0.5),
        &[rows, sizes.value_heads, sizes.key_dim, sizes.value_dim],
    )
}

fn run_in_pool(inputs: &RecurrenceInputs, pool: &Tensor, slots: &[u32]) -> Result<Tensor> {
    let algorithm = KdaPrefillAlgorithm::for_len(inputs.q.dims()[1]);
    let [q, k, v, g, beta] = inputs.tokens();
    let pool = StatePool {
        states: pool,
        slots: &Tensor::new(slots, &Device::Cpu)?,
        host_slots: slots,
    };
    kda_recurrence_in_pool_with(algorithm, q, k, v, g, beta, pool)
}

/// Runs `kda_recurrence_in_pool_with` (with the algorithm `kda_recurrence`
/// picks) on a copy of `pool` and checks it against `kda_recurrence` on the
/// gathered rows (a zero state for a [`PAD_SLOT`]): identical outputs, rows
/// `slots` identical to the final states, every other row untouched (bit
/// for bit).
fn check_in_pool(inputs: &RecurrenceInputs, pool: &Tensor, slots: &[u32]) -> Result<()> {
    let state = pool_rows(pool, slots)?;
    let (expected_output, expected_state) = run_from(inputs, &state)?;
    let updated = pool.copy()?;
    let output = run_in_pool(inputs, &updated, slots)?;
    assert_identical(&output, &expected_output)?;
    for (row, &slot) in slots.iter().enumerate() {
        if slot != PAD_SLOT {
            assert_identical(
                &updated.narrow(0, slot as usize, 1)?,
                &expected_state.narrow(0, row, 1)?,
            )?;
        }
    }
    let rows = pool.dims()[0];
    for row in (0..rows).filter(|row| !slots.contains(&(*row as u32))) {
        assert_identical(&updated.narrow(0, row, 1)?, &pool.narrow(0, row, 1)?)?;
    }
    Ok(())
}

#[test]
fn in_pool_matches_recurrence_on_gathered_rows() -> Result<()> {
    for (seed, sizes) in [(20, HF_TEST_SIZES), (21, GROUPED_SIZES)] {
        let slots = [5, 2, 7];
        for seq_len in [1, 4] {
            let sizes = sizes.with_batch(slots.len(), seq_len);
            let pool = random_pool(seed + 100, sizes, POOL_ROWS)?;
            check_in_pool(&inputs(seed, sizes, false)?, &pool, &slots)?;
        }
    }
    Ok(())
}

#[test]
fn in_pool_accepts_any_slot_order_and_the_last_row() -> Result<()> {
    for slots in [vec![8], vec![0, 8], vec![8, 0, 3, 1], vec![]] {
        let sizes = GROUPED_SIZES.with_batch(slots.len(), 2);
        let pool = random_pool(23, sizes, POOL_ROWS)?;
        check_in_pool(&inputs(22, sizes, false)?, &pool, &slots)?;
    }
    Ok(())
}

/// Rows of a batch padded to a graph's size: each starts from a zero state
/// (a fresh sequence's) and writes no row of the pool, wherever it sits.
#[test]
fn pad_rows_start_from_zero_and_write_no_row() -> Result<()> {
    for slots in [
        vec![PAD_SLOT],
        vec![5, PAD_SLOT, PAD_SLOT],
        vec![PAD_SLOT, 8, PAD_SLOT, 0],
    ] {
        for seq_len in [1, 3] {
            let sizes = GROUPED_SIZES.with_batch(slots.len(), seq_len);
            let pool = random_pool(31, sizes, POOL_ROWS)?;
            check_in_pool(&inputs(30, sizes, false)?, &pool, &slots)?;
        }
    }
    assert_eq!(repeated_slot(&[PAD_SLOT, 3, PAD_SLOT]), None);
    assert_eq!(repeated_slot(&[PAD_SLOT, 3, 3]), Some(3));
    Ok(())
}

#[test]
fn in_pool_empty_sequence_keeps_the_pool() -> Result<()> {
    let sizes = GROUPED_SIZES.with_batch(2, 0);
    let pool = random_pool(25, sizes, POOL_ROWS)?;
    let updated = pool.copy()?;
    let output = run_in_pool(&inputs(24, sizes, false)?, &updated, &[4, 1])?;
    assert_eq!(output.dims(), &[2, 0, 4, 3]);
    assert_identical(&updated, &pool)
}

/// The pool is written through its storage: every handle sharing it (a
/// clone, the tensor a view was taken from) sees the new states, and a view
/// at an offset is indexed from its own first row.
#[test]
fn in_pool_writes_through_shared_storage() -> Result<()> {
    let sizes = GROUPED_SIZES.with_batch(2, 1);
    let inputs = inputs(26, sizes, false)?;
    let whole = random_pool(27, sizes, POOL_ROWS + 1)?;
    let original = whole.copy()?;
    let view = whole.narrow(0, 1, POOL_ROWS)?;
    let handle = view.clone();
    let slots = [3, 0];
    let state = pool_rows(&view, &slots)?;
    let (_, expected_state) = run_from(&inputs, &state)?;
    run_in_pool(&inputs, &view, &slots)?;
    assert_identical(&pool_rows(&handle, &slots)?, &expected_state)?;
    assert_identical(&pool_rows(&whole, &[4, 1])?, &expected_state)?;
    for row in [0, 2, 3, 5, 6, 7, 8, 9] {
        assert_identical(&whole.narrow(0, row, 1)?, &original.narrow(0, row, 1)?)?;
    }
    Ok(())
}

/// Decode steps in the pool, one token each, equal one call over all tokens.
#[test]
fn in_pool_decode_steps_equal_one_call() -> Result<()> {
    let whole = inputs(28, HF_TEST_SIZES, false)?;
    let slots = [6, 1];
    let pool = random_pool(29, HF_TEST_SIZES, POOL_ROWS)?;
    let (whole_output, whole_state) = kda_recurrence(
        &whole.q,
        &whole.k,
        &whole.v,
        &whole.g,
        &whole.beta,
        &pool_rows(&pool, &slots)?,
    )?;
    let updated = pool.copy()?;
    let mut outputs = Vec::new();
    for t in 0..HF_TEST_SIZES.seq_len {
        let step = RecurrenceInputs {
            sizes: Sizes {
                seq_len: 1,
                ..HF_TEST_SIZES
            },
            q: whole.q.narrow(1, t, 1)?,
            k: whole.k.narrow(1, t, 1)?,
            v: whole.v.narrow(1, t, 1)?,
            g: whole.g.narrow(1, t, 1)?,
            beta: whole.beta.narrow(1, t, 1)?,
            state: whole.state.clone(),
        };
        outputs.push(run_in_pool(&step, &updated, &slots)?);
    }
    assert_identical(&Tensor::cat(&outputs, 1)?, &whole_output)?;
    assert_identical(&pool_rows(&updated, &slots)?, &whole_state)
}
