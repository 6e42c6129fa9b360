use berrylm_kernels::{
    causal_conv1d, causal_conv1d_split, causal_conv1d_split_in_pool, Result, StatePool, PAD_SLOT,
};
use candle_core::{DType, Device, Tensor};

use crate::common::{
    assert_close, assert_identical, assert_rejects, f32_values, f64_values, pool_rows, silu,
    tensor, Rng,
};

const BATCH: usize = 2;
const CHANNELS: usize = 3;
const KERNEL: usize = 4;

struct ConvInputs {
    seq_len: usize,
    x: Tensor,
    weight: Tensor,
    state: Tensor,
}

/// Random `x` `[batch, seq_len, C]` and `weight` `[C, K]`, drawn from `rng`
/// in that order.
fn random_x_and_weight(rng: &mut Rng, batch: usize, seq_len: usize) -> Result<(Tensor, Tensor)> {
    let x = tensor(
        rng.uniform_vec(batch * seq_len * CHANNELS, -2.0, 2.0),
        &[batch, seq_len, CHANNELS],
    )?;
    let weight = tensor(
        rng.uniform_vec(CHANNELS * KERNEL, -1.0, 1.0),
        &[CHANNELS, KERNEL],
    )?;
    Ok((x, weight))
}

fn inputs(seed: u64, seq_len: usize, fresh: bool) -> Result<ConvInputs> {
    let mut rng = Rng::new(seed);
    let (x, weight) = random_x_and_weight(&mut rng, BATCH, seq_len)?;
    let state_values = if fresh {
        vec![0.0; BATCH * CHANNELS * KERNEL]
    } else {
        rng.uniform_vec(BATCH * CHANNELS * KERNEL, -2.0, 2.0)
    };
    let state = tensor(state_values, &[BATCH, CHANNELS, KERNEL])?;
    Ok(ConvInputs {
        seq_len,
        x,
        weight,
        state,
    })
}

/// Output and new state in `f64`, from the convolution written with time lags:
/// `pre[t] = sum_i weight[K-1-i] * stream[t-i]`, where negative times read the
/// state (`stream[-m] = state[K-m]`).
fn reference(inputs: &ConvInputs) -> Result<(Vec<f64>, Vec<f64>)> {
    let seq_len = inputs.seq_len;
    let x = f64_values(&inputs.x)?;
    let weight = f64_values(&inputs.weight)?;
    let state = f64_values(&inputs.state)?;
    let stream = |b: usize, c: usize, time: isize| -> f64 {
        if time >= 0 {
            x[(b * seq_len + time as usize) * CHANNELS + c]
        } else {
            state[(b * CHANNELS + c) * KERNEL + (KERNEL as isize + time) as usize]
        }
    };
    let mut output = vec![0.0; BATCH * seq_len * CHANNELS];
    let mut new_state = vec![0.0; BATCH * CHANNELS * KERNEL];
    for b in 0..BATCH {
        for c in 0..CHANNELS {
            for t in 0..seq_len {
                let pre: f64 = (0..KERNEL)
                    .map(|lag| {
                        weight[c * KERNEL + KERNEL - 1 - lag]
                            * stream(b, c, t as isize - lag as isize)
                    })
                    .sum();
                output[(b * seq_len + t) * CHANNELS + c] = silu(pre);
            }
            for column in 0..KERNEL {
                let time = seq_len as isize - KERNEL as isize + column as isize;
                new_state[(b * CHANNELS + c) * KERNEL + column] = stream(b, c, time);
            }
        }
    }
    Ok((output, new_state))
}

fn check_against_reference(inputs: &ConvInputs) -> Result<()> {
    let (output, new_state) = causal_conv1d(&inputs.x, &inputs.weight, &inputs.state)?;
    let (expected_output, expected_state) = reference(inputs)?;
    assert_eq!(output.dims(), &[BATCH, inputs.seq_len, CHANNELS]);
    assert_eq!(new_state.dims(), &[BATCH, CHANNELS, KERNEL]);
    assert_close(&f32_values(&output)?, &expected_output, 1e-6, 1e-5);
    assert_close(&f32_values(&new_state)?, &expected_state, 0.0, 0.0);
    Ok(())
}

#[test]
fn fresh_sequence_matches_reference() -> Result<()> {
    for seq_len in [1, 3, 9] {
        check_against_reference(&inputs(10 + seq_len as u64, seq_len, true)?)?;
    }
    Ok(())
}

#[test]
fn carried_state_matches_reference() -> Result<()> {
    for seq_len in [1, 2, 7] {
        check_against_reference(&inputs(20 + seq_len as u64, seq_len, false)?)?;
    }
    Ok(())
}

#[test]
fn first_state_column_does_not_affect_output() -> Result<()> {
    let inputs = inputs(30, 5, false)?;
    let first_column_changed = inputs.state.slice_assign(
        &[0..BATCH, 0..CHANNELS, 0..1],
        &Tensor::full(100f32, (BATCH, CHANNELS, 1), &candle_core::Device::Cpu)?,
    )?;
    let (output, _) = causal_conv1d(&inputs.x, &inputs.weight, &inputs.state)?;
    let (output_changed, _) = causal_conv1d(&inputs.x, &inputs.weight, &first_column_changed)?;
    assert_identical(&output, &output_changed)
}

#[test]
fn chunks_with_carried_state_equal_one_call() -> Result<()> {
    let seq_len = 9;
    let inputs = inputs(40, seq_len, false)?;
    let (whole_output, whole_state) = causal_conv1d(&inputs.x, &inputs.weight, &inputs.state)?;
    for chunk_lengths in [vec![1, 2, 1, 4, 1], vec![1; 9], vec![5, 4], vec![3, 3, 3]] {
        let mut state = inputs.state.clone();
        let mut outputs = Vec::new();
        let mut start = 0;
        for length in chunk_lengths {
            let chunk = inputs.x.narrow(1, start, length)?;
            let (output, next_state) = causal_conv1d(&chunk, &inputs.weight, &state)?;
            outputs.push(output);
            state = next_state;
            start += length;
        }
        assert_eq!(start, seq_len);
        assert_identical(&Tensor::cat(&outputs, 1)?, &whole_output)?;
        assert_identical(&state, &whole_state)?;
    }
    Ok(())
}

#[test]
fn bf16_is_within_bf16_tolerance_of_f32() -> Result<()> {
    let inputs = inputs(50, 6, false)?;
    let (f32_output, f32_state) = causal_conv1d(&inputs.x, &inputs.weight, &inputs.state)?;
    let x = inputs.x.to_dtype(DType::BF16)?;
    let weight = inputs.weight.to_dtype(DType::BF16)?;
    let state = inputs.state.to_dtype(DType::BF16)?;
    let (output, new_state) = causal_conv1d(&x, &weight, &state)?;
    assert_eq!(output.dtype(), DType::BF16);
    assert_eq!(new_state.dtype(), DType::BF16);
    assert_close(&f32_values(&output)?, &f64_values(&f32_output)?, 2e-2, 2e-2);
    assert_close(
        &f32_values(&new_state)?,
        &f64_values(&f32_state)?,
        0.0,
        1e-2,
    );
    Ok(())
}

#[test]
fn state_keeps_its_own_dtype() -> Result<()> {
    let inputs = inputs(60, 3, false)?;
    let x = inputs.x.to_dtype(DType::BF16)?;
    let (output, new_state) = causal_conv1d(&x, &inputs.weight, &inputs.state)?;
    assert_eq!(output.dtype(), DType::BF16);
    assert_eq!(new_state.dtype(), DType::F32);
    let expected_state = Tensor::cat(
        &[
            inputs.state.narrow(2, 3, 1)?,
            x.to_dtype(DType::F32)?.transpose(1, 2)?,
        ],
        2,
    )?;
    assert_identical(&new_state, &expected_state.contiguous()?)
}

/// The PyTorch chain in bf16: the taps accumulated in `f32` in tap order,
/// rounded to bf16, then SiLU in `f32` rounded to bf16.
#[test]
fn bf16_rounds_like_the_reference_chain() -> Result<()> {
    let seq_len = 6;
    let inputs = inputs(70, seq_len, false)?;
    let x = inputs.x.to_dtype(DType::BF16)?;
    let weight = inputs.weight.to_dtype(DType::BF16)?;
    let state = inputs.state.to_dtype(DType::BF16)?;
    let history = Tensor::cat(&[&state, &x.transpose(1, 2)?], 2)?.to_dtype(DType::F32)?;
    let taps = weight.to_dtype(DType::F32)?;
    let mut pre_activation = Tensor::zeros((BATCH, CHANNELS, seq_len), DType::F32, x.device())?;
    for tap in 0..KERNEL {
        let window = history.narrow(2, tap + 1, seq_len)?;
        let tap_weight = taps.narrow(1, tap, 1)?.unsqueeze(0)?;
        pre_activation = (pre_activation + window.broadcast_mul(&tap_weight)?)?;
    }
    let expected = pre_activation
        .to_dtype(DType::BF16)?
        .to_dtype(DType::F32)?
        .silu()?
        .to_dtype(DType::BF16)?
        .transpose(1, 2)?
        .contiguous()?;
    let (output, _) = causal_conv1d(&x, &weight, &state)?;
    assert_identical(&output, &expected)
}

/// The split outputs are the columns of the unsplit output, bit for bit, and
/// the state is the same.
#[test]
fn split_outputs_are_the_unsplit_columns() -> Result<()> {
    let inputs = inputs(40, 5, false)?;
    let (output, new_state) = causal_conv1d(&inputs.x, &inputs.weight, &inputs.state)?;
    for widths in [vec![CHANNELS], vec![1, 2], vec![1, 1, 1]] {
        let (parts, split_state) =
            causal_conv1d_split(&inputs.x, &inputs.weight, &inputs.state, &widths)?;
        assert_eq!(parts.len(), widths.len());
        let mut start = 0;
        for (part, &width) in parts.iter().zip(&widths) {
            assert!(part.is_contiguous());
            assert_identical(part, &output.narrow(2, start, width)?)?;
            start += width;
        }
        assert_identical(&split_state, &new_state)?;
    }
    Ok(())
}

#[test]
fn split_rejects_widths_that_do_not_cover_the_channels() -> Result<()> {
    let inputs = inputs(41, 2, true)?;
    for widths in [vec![], vec![1, 1], vec![2, 2], vec![3, 0], vec![1; 5]] {
        let result = causal_conv1d_split(&inputs.x, &inputs.weight, &inputs.state, &widths);
        assert_rejects(result, "causal_conv1d", "widths");
    }
    Ok(())
}

/// Rows of the in-pool tests' pool.
const POOL_ROWS: usize = 7;

/// The in-pool convolution equals `causal_conv1d_split` on the gathered rows
/// bit for bit: the outputs, and the new states written to the rows of the
/// scattered, out-of-order slots; every other row is untouched. The pool is
/// a view at an offset of a larger tensor, through which the writes (and
/// the untouched rows around the view) are checked.
#[test]
fn in_pool_equals_split_on_gathered_rows() -> Result<()> {
    let host_slots = [5u32, 1, 3];
    let batch = host_slots.len();
    let slots = Tensor::new(&host_slots, &Device::Cpu)?;
    let widths = [1, 2];
    let mut seed = 80;
    for seq_len in [1, 3, 9] {
        for x_dtype in [DType::F32, DType::BF16] {
            seed += 1;
            let what = format!("T={seq_len} x={x_dtype:?}");
            let mut rng = Rng::new(seed);
            let (x, weight) = random_x_and_weight(&mut rng, batch, seq_len)?;
            let x = x.to_dtype(x_dtype)?;
            // One row before and after the pool's view.
            let backing = tensor(
                rng.uniform_vec((POOL_ROWS + 2) * CHANNELS * KERNEL, -2.0, 2.0),
                &[POOL_ROWS + 2, CHANNELS, KERNEL],
            )?;
            let original = backing.copy()?;
            let pool = backing.narrow(0, 1, POOL_ROWS)?;
            let (expected, expected_state) =
                causal_conv1d_split(&x, &weight, &pool_rows(&pool, &host_slots)?, &widths)?;

            let outputs = causal_conv1d_split_in_pool(
                &x,
                &weight,
                StatePool {
                    states: &pool,
                    slots: &slots,
                    host_slots: &host_slots,
                },
                &widths,
            )?;

            assert_eq!(outputs.len(), widths.len(), "{what}");
            for (output, expected) in outputs.iter().zip(&expected) {
                assert!(output.is_contiguous(), "{what}");
                assert_identical(output, expected)?;
            }
            let backing_slots = host_slots.map(|slot| slot + 1);
            assert_identical(&pool_rows(&backing, &backing_slots)?, &expected_state)?;
            let others: Vec<u32> = (0..(POOL_ROWS + 2) as u32)
                .filter(|row| !backing_slots.contains(row))
                .collect();
            assert_identical(
                &pool_rows(&backing, &others)?,
                &pool_rows(&original, &others)?,
            )?;
        }
    }
    Ok(())
}

/// Pad rows ([`PAD_SLOT`]) convolve from a zero state (a fresh
/// sequence's) and write no row of the pool; the real rows beside them are
/// unaffected.
#[test]
fn pad_rows_start_from_zero_and_write_no_row() -> Result<()> {
    let host_slots = [PAD_SLOT, 4, PAD_SLOT, 0];
    let batch = host_slots.len();
    let widths = [2, 1];
    for seq_len in [1, 5] {
        let mut rng = Rng::new(100 + seq_len as u64);
        let (x, weight) = random_x_and_weight(&mut rng, batch, seq_len)?;
        let pool = tensor(
            rng.uniform_vec(POOL_ROWS * CHANNELS * KERNEL, -2.0, 2.0),
            &[POOL_ROWS, CHANNELS, KERNEL],
        )?;
        let original = pool.copy()?;
        let zero = Tensor::zeros((1, CHANNELS, KERNEL), DType::F32, &Device::Cpu)?;
        let start = Tensor::cat(
            &[
                zero.clone(),
                pool.narrow(0, 4, 1)?,
                zero,
                pool.narrow(0, 0, 1)?,
            ],
            0,
        )?;
        let (expected, expected_state) = causal_conv1d_split(&x, &weight, &start, &widths)?;

        let outputs = causal_conv1d_split_in_pool(
            &x,
            &weight,
            StatePool {
                states: &pool,
                slots: &Tensor::new(&host_slots, &Device::Cpu)?,
                host_slots: &host_slots,
            },
            &widths,
        )?;

        for (output, expected) in outputs.iter().zip(&expected) {
            assert_identical(output, expected)?;
        }
        assert_identical(
            &pool_rows(&pool, &[4, 0])?,
            &pool_rows(&expected_state, &[1, 3])?,
        )?;
        let others = [1, 2, 3, 5, 6];
        assert_identical(&pool_rows(&pool, &others)?, &pool_rows(&original, &others)?)?;
    }
    Ok(())
}

/// Slots out of range, duplicated, of the wrong count or disagreeing with
/// `host_slots`, and pools of the wrong shape or layout are rejected naming
/// the argument, and leave the pool unchanged.
#[test]
fn in_pool_rejects_bad_slots_and_pools() -> Result<()> {
    let inputs = inputs(90, 2, false)?;
    let pool = Tensor::ones((4, CHANNELS, KERNEL), DType::F32, &Device::Cpu)?;
    let run = |pool: &Tensor, slots: &Tensor, host_slots: &[u32]| {
        causal_conv1d_split_in_pool(
            &inputs.x,
            &inputs.weight,
            StatePool {
                states: pool,
                slots,
                host_slots,
            },
            &[CHANNELS],
        )
    };
    let slots = |values: &[u32]| Tensor::new(values, &Device::Cpu);
    for (slot_values, host_slots, arg) in [
        // Out of range.
        (vec![4, 1], vec![4, 1], "host_slots"),
        (vec![PAD_SLOT - 1, 1], vec![PAD_SLOT - 1, 1], "host_slots"),
        // Duplicated.
        (vec![2, 2], vec![2, 2], "host_slots"),
        // Too few host slots.
        (vec![0, 1], vec![0], "host_slots"),
        // Too many host slots.
        (vec![0, 1], vec![0, 1, 2], "host_slots"),
        // Too many slots.
        (vec![0, 1, 2], vec![0, 1], "slots"),
        // Slots disagreeing with the host slots.
        (vec![0, 1], vec![1, 0], "slots"),
    ] {
        let result = run(&pool, &slots(&slot_values)?, &host_slots);
        assert_rejects(result, "causal_conv1d", arg);
    }
    let good = slots(&[0, 1])?;
    let f32_slots = good.to_dtype(DType::F32)?;
    let too_few_columns = pool.narrow(2, 0, KERNEL - 1)?;
    let too_few_channels = pool.narrow(1, 0, CHANNELS - 1)?;
    let transposed =
        Tensor::ones((4, KERNEL, CHANNELS), DType::F32, &Device::Cpu)?.transpose(1, 2)?;
    for (pool, slots, arg) in [
        (&pool, &f32_slots, "slots"),
        (&too_few_columns, &good, "pool"),
        (&too_few_channels, &good, "pool"),
        (&transposed, &good, "pool"),
    ] {
        assert_rejects(run(pool, slots, &[0, 1]), "causal_conv1d", arg);
    }
    assert_eq!(
        pool.flatten_all()?.to_vec1::<f32>()?,
        vec![1.0; 4 * CHANNELS * KERNEL]
    );
    Ok(())
}
