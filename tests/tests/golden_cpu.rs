//! The model against the transformers reference on every golden fixture, in
//! float32 on the CPU: one-shot prefill (logits and per-layer hidden states),
//! prefill-then-decode, chunked prefill, and batching.

use anyhow::Result;
use berrylm::model::BerryLm;
use berrylm_tests::{max_abs, max_abs_diff, Driver, Fixture, FIXTURES};
use candle_core::{DType, IndexOp, Tensor};

/// Logit bound the reference's own float32 noise supports (golden/README.md).
const LOGIT_BOUND: f32 = 1e-3;

fn assert_logits_close(
    fixture: &Fixture,
    what: &str,
    ours: &Tensor,
    reference: &Tensor,
) -> Result<()> {
    let diff = max_abs_diff(ours, reference)?;
    assert!(
        diff <= LOGIT_BOUND,
        "{}: {what}: max |logit diff| {diff} > {LOGIT_BOUND}",
        fixture.name
    );
    Ok(())
}

/// Runs `check` on every golden sequence of every fixture with the fixture,
/// its float32 model, the sequence's index, its input ids and the
/// reference's float32 logits.
fn for_each_sequence(
    mut check: impl FnMut(&Fixture, &BerryLm, usize, &[u32], &Tensor) -> Result<()>,
) -> Result<()> {
    for name in FIXTURES {
        let fixture = Fixture::load(name)?;
        let model = fixture.model(DType::F32)?;
        for seq in 0..fixture.num_sequences() {
            let ids = fixture.ids(&format!("seq{seq}.input_ids"))?;
            let reference = fixture.tensor(&format!("seq{seq}.logits_f32"))?;
            check(&fixture, &model, seq, &ids, reference)?;
        }
    }
    Ok(())
}

#[test]
fn one_shot_prefill_matches_reference_logits_and_hidden_states() -> Result<()> {
    for_each_sequence(|fixture, model, seq, ids, reference| {
        let mut driver = Driver::new(model, 1)?;
        let mut layers = Vec::new();
        let logits = driver.step(&[ids], Some(&mut layers))?.squeeze(0)?;
        assert_logits_close(fixture, &format!("seq{seq} prefill"), &logits, reference)?;

        if let Ok(hidden) = fixture.tensor(&format!("seq{seq}.hidden_states_f32")) {
            let num_layers = layers.len();
            // Index j (1..L-1) is the output of layer j-1; the last index is
            // after the final norm, which we compare through the logits.
            for j in 1..num_layers {
                let expected = hidden.i(j)?;
                let ours = layers[j - 1].squeeze(0)?;
                let bound = 1e-3 * max_abs(&expected)?.max(1.0);
                let diff = max_abs_diff(&ours, &expected)?;
                assert!(
                    diff <= bound,
                    "{}: seq{seq} hidden state {j}: max diff {diff} > {bound}",
                    fixture.name
                );
            }
        }
        Ok(())
    })
}

#[test]
fn prefill_then_decode_matches_reference() -> Result<()> {
    for_each_sequence(|fixture, model, seq, ids, reference| {
        let len = ids.len();
        let mut splits = vec![1, len.saturating_sub(1), len / 2];
        splits.retain(|k| *k >= 1 && *k < len);
        splits.dedup();
        for k in splits {
            let mut driver = Driver::new(model, 1)?;
            let sizes = std::iter::once(k).chain(std::iter::repeat(1));
            let logits = driver.run_chunked(ids, sizes)?;
            assert_logits_close(
                fixture,
                &format!("seq{seq} prefill {k} then decode"),
                &logits,
                reference,
            )?;
        }
        Ok(())
    })
}

#[test]
fn chunked_prefill_matches_reference() -> Result<()> {
    for_each_sequence(|fixture, model, seq, ids, reference| {
        // Chunks shorter than, equal to and longer than the conv kernel.
        for chunk in [2, 3, 5, 16] {
            if chunk >= ids.len() {
                continue;
            }
            let mut driver = Driver::new(model, 1)?;
            let logits = driver.run_chunked(ids, std::iter::repeat(chunk))?;
            assert_logits_close(
                fixture,
                &format!("seq{seq} chunks of {chunk}"),
                &logits,
                reference,
            )?;
        }
        Ok(())
    })
}

#[test]
fn greedy_decode_with_cache_matches_reference_steps() -> Result<()> {
    for name in FIXTURES {
        let fixture = Fixture::load(name)?;
        let model = fixture.model(DType::F32)?;
        let prompt = fixture.ids("gen.prompt_ids")?;
        let expected = fixture.ids("gen.output_ids")?;
        let step_logits = fixture.tensor("gen.step_logits_f32")?;
        let mut driver = Driver::new(&model, 1)?;
        let mut logits = driver.step(&[&prompt], None)?.squeeze(0)?;
        let mut last = logits.i(logits.dim(0)? - 1)?;
        for (step, expected_token) in expected.iter().enumerate() {
            let diff = max_abs_diff(&last, &step_logits.i(step)?)?;
            assert!(
                diff <= LOGIT_BOUND,
                "{name}: generation step {step}: max diff {diff}"
            );
            let token = last.argmax(0)?.to_scalar::<u32>()?;
            assert_eq!(token, *expected_token, "{name}: generation step {step}");
            logits = driver.step(&[&[token]], None)?.squeeze(0)?;
            last = logits.i(0)?;
        }
    }
    Ok(())
}

#[test]
fn batched_sequences_match_each_alone() -> Result<()> {
    let fixture = Fixture::load("small-hybrid")?;
    let model = fixture.model(DType::F32)?;
    let first = fixture.ids("seq3.input_ids")?;
    let second: Vec<u32> = first.iter().rev().copied().collect();
    let (prompt_len, decode_len) = (24, first.len() - 24);

    let mut together = Driver::new(&model, 2)?;
    let prefill = together.step(&[&first[..prompt_len], &second[..prompt_len]], None)?;
    let mut batched = [vec![prefill.i(0)?], vec![prefill.i(1)?]];
    for t in prompt_len..prompt_len + decode_len {
        let step = together.step(&[&first[t..t + 1], &second[t..t + 1]], None)?;
        batched[0].push(step.i(0)?);
        batched[1].push(step.i(1)?);
    }
    for (row, ids) in [&first, &second].into_iter().enumerate() {
        let mut alone = Driver::new(&model, 1)?;
        let sizes = std::iter::once(prompt_len).chain(std::iter::repeat(1));
        let expected = alone.run_chunked(ids, sizes)?;
        let ours = Tensor::cat(&batched[row], 0)?;
        let diff = max_abs_diff(&ours, &expected)?;
        assert!(diff <= 1e-4, "row {row}: batched vs alone max diff {diff}");
    }
    Ok(())
}

#[test]
fn alternative_layout_matches_small_hybrid_reference() -> Result<()> {
    let reference = Fixture::load("small-hybrid")?;
    let alt = Fixture::load("small-hybrid-alt-layout")?;
    let model = alt.model(DType::F32)?;
    for seq in 0..reference.num_sequences() {
        let ids = reference.ids(&format!("seq{seq}.input_ids"))?;
        let logits = Driver::new(&model, 1)?.step(&[&ids], None)?.squeeze(0)?;
        let expected = reference.tensor(&format!("seq{seq}.logits_f32"))?;
        assert_logits_close(
            &alt,
            &format!("seq{seq} (alt layout vs small-hybrid)"),
            &logits,
            expected,
        )?;
    }
    Ok(())
}
