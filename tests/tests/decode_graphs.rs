//! CUDA graphs of decode steps (plugin/src/decode_graph.rs) give the logits
//! of the eager forward bit for bit: the bundled trained model in bf16 under
//! paged attention, a prompt per sequence, then greedy decode steps fed to a
//! driver that runs them eagerly and to one that replays them from graphs,
//! at several batch sizes (each its own graph, up to 256 sequences). A batch
//! between sizes (9, 40, 200) replays the next size's graph with pad rows:
//! its logits stay as close to the eager ones as the same sequences' logits
//! in an eager batch of the graph's size (the rounding of a row depends on
//! the batch it runs in). The steps run past a paged block's end (32
//! tokens), so the block tables change under the graphs.
//!
//! Needs a CUDA device: `test-decode_graphs --ignored` on the GPU machine
//! (BERRYLM_FIXTURES=<repo>/tests/fixtures).

use anyhow::{Context, Result};
use berrylm::driver::Driver;
use berrylm::graph_batches::GraphBatches;
use berrylm_tests::{bundled_model_on_cuda, f32_bits};
use candle_core::{DType, Tensor, D};

/// Prompt tokens per sequence.
const PROMPT: usize = 12;
/// Decode steps: the first runs eagerly (warm-up), the second is captured,
/// the rest replay.
const STEPS: usize = 40;

#[test]
#[ignore = "needs a CUDA device: run with --ignored on the GPU machine"]
fn replayed_decode_steps_equal_the_eager_ones() -> Result<()> {
    // A capture that fails says why (the test then fails on the replays).
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_env_filter("warn")
        .try_init();
    let model = bundled_model_on_cuda()?;
    for batch in [1, 2, 3, 4, 8, 9, 16, 32, 40, 64, 128, 200, 256] {
        compare_at(&model, batch).with_context(|| format!("batch {batch}"))?;
    }
    Ok(())
}

/// Prompts of `rows` sequences (row `r`'s is the same in every batch).
fn prompts(rows: usize, vocab: u32) -> Vec<Vec<u32>> {
    (0..rows as u32)
        .map(|row| {
            (0..PROMPT as u32)
                .map(|i| (row * 131 + i * 17 + 5) % vocab)
                .collect()
        })
        .collect()
}

/// A prompt per sequence then the greedy decode steps of `batch`
/// sequences, eagerly and from graphs (the eager driver's tokens fed to
/// both). At a graph's own size the logits are identical bit for bit.
/// Between sizes the graph of the next size replays with pad rows, and a
/// third driver runs the same sequences eagerly among others in a batch of
/// that size: the rows' rounding depends on the batch they run in (cuBLAS
/// and the MoE's expert groups), and the padded replay may differ from the
/// eager batch by at most [`PADDED_DRIFT`] times what that larger eager
/// batch differs by.
fn compare_at(model: &berrylm::model::BerryLm, batch: usize) -> Result<()> {
    let size = GraphBatches::standard()
        .padded(batch)
        .context("a batch beyond the largest graph")?;
    let prompts = prompts(size, model.config().vocab_size as u32);
    let chunks: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let tokens = PROMPT + STEPS + 1;
    let mut eager = Driver::paged(model, batch, tokens)?;
    let mut graphs =
        Driver::paged(model, batch, tokens)?.with_decode_graphs(GraphBatches::standard())?;
    let mut in_graph_size = (size > batch)
        .then(|| Driver::paged(model, size, tokens))
        .transpose()?;
    let mut logits = eager.step_last(&chunks[..batch])?;
    let mut larger = match &mut in_graph_size {
        Some(driver) => Some(driver.step_last(&chunks)?),
        None => None,
    };
    let mut replayed = graphs.step_last(&chunks[..batch])?;
    let (mut graph_drift, mut batch_drift) = (0f32, 0f32);
    for step in 0..=STEPS {
        match &larger {
            None => assert_eq!(
                f32_bits(&logits)?,
                f32_bits(&replayed)?,
                "batch {batch}, step {step}: the graph's logits differ from the eager ones"
            ),
            Some(larger) => {
                graph_drift = graph_drift.max(largest_difference(&replayed, &logits)?);
                let first_rows = larger.narrow(0, 0, batch)?;
                batch_drift = batch_drift.max(largest_difference(&first_rows, &logits)?);
            }
        }
        if step == STEPS {
            break;
        }
        let mut next: Vec<u32> = logits.argmax(D::Minus1)?.to_vec1()?;
        if let Some(larger) = &larger {
            let others: Vec<u32> = larger.argmax(D::Minus1)?.to_vec1()?;
            next.extend_from_slice(&others[batch..]);
        }
        let rows: Vec<&[u32]> = next.chunks(1).collect();
        logits = eager.step_last(&rows[..batch])?;
        replayed = graphs.step_last(&rows[..batch])?;
        if let Some(driver) = &mut in_graph_size {
            larger = Some(driver.step_last(&rows)?);
        }
    }
    if size > batch {
        println!(
            "batch {batch} padded to {size}: largest logit difference from the eager batch \
             {graph_drift:.4}; of the same sequences in an eager batch of {size}: {batch_drift:.4}"
        );
        assert!(
            graph_drift <= PADDED_DRIFT * batch_drift,
            "batch {batch} padded to {size}: the replayed logits differ from the eager ones by \
             {graph_drift}, more than {PADDED_DRIFT} x the {batch_drift} of an eager batch of {size}"
        );
    }
    assert_eq!(
        graphs.decode_graph_replays(),
        (STEPS - 1) as u64,
        "batch {batch}: every decode step after the first replays a graph"
    );
    assert_eq!(eager.decode_graph_replays(), 0);
    Ok(())
}

/// How much more a padded replay may drift from the eager batch than the
/// same sequences do in an eager batch of the graph's size.
const PADDED_DRIFT: f32 = 3.0;

/// The largest `|a - b|` of two logits tensors.
fn largest_difference(a: &Tensor, b: &Tensor) -> Result<f32> {
    let a = a.to_dtype(DType::F32)?;
    let b = b.to_dtype(DType::F32)?;
    Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}
