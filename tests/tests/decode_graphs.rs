//! CUDA graphs of decode steps (plugin/src/decode_graph.rs) give the logits
//! of the eager forward bit for bit: the bundled trained model in bf16 under
//! paged attention, a prompt per sequence, then greedy decode steps fed to a
//! driver that runs them eagerly and to one that replays them from graphs,
//! at several batch sizes (each its own graph, up to 256 sequences); a batch
//! size the server does not capture (9) runs eagerly in both. The steps run
//! past a paged block's end (32 tokens), so the block tables change under
//! the graphs.
//!
//! Needs a CUDA device: `test-decode_graphs --ignored` on the GPU machine
//! (BERRYLM_FIXTURES=<repo>/tests/fixtures).

use anyhow::{Context, Result};
use berrylm::driver::{load_checkpoint, Driver};
use berrylm::graph_batches::GraphBatches;
use berrylm_tests::fixtures_dir;
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
    let device = berrylm::device::open_cuda(0)?;
    let model = load_checkpoint(
        &fixtures_dir().join("trained-tiny").join("model"),
        DType::BF16,
        &device,
    )?;
    for batch in [1, 2, 3, 4, 8, 9, 16, 32, 64, 128, 256] {
        compare_at(&model, batch).with_context(|| format!("batch {batch}"))?;
    }
    Ok(())
}

/// A prompt per sequence then the greedy decode steps, eagerly and from
/// graphs, at `batch` sequences.
fn compare_at(model: &berrylm::model::BerryLm, batch: usize) -> Result<()> {
    let vocab = model.config().vocab_size as u32;
    let prompts: Vec<Vec<u32>> = (0..batch as u32)
        .map(|row| {
            (0..PROMPT as u32)
                .map(|i| (row * 131 + i * 17 + 5) % vocab)
                .collect()
        })
        .collect();
    let chunks: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
    let tokens = PROMPT + STEPS + 1;
    let mut eager = Driver::paged(model, batch, tokens)?;
    let mut graphs =
        Driver::paged(model, batch, tokens)?.with_decode_graphs(GraphBatches::standard())?;
    let mut logits = eager.step_last(&chunks)?;
    assert_eq!(bits(&logits)?, bits(&graphs.step_last(&chunks)?)?);
    for step in 0..STEPS {
        let next: Vec<u32> = logits.argmax(D::Minus1)?.to_vec1()?;
        let rows: Vec<&[u32]> = next.chunks(1).collect();
        logits = eager.step_last(&rows)?;
        let replayed = graphs.step_last(&rows)?;
        assert_eq!(
            bits(&logits)?,
            bits(&replayed)?,
            "batch {batch}, decode step {step}: the graph's logits differ from the eager ones"
        );
    }
    let replays = if GraphBatches::standard().contains(batch) {
        STEPS - 1
    } else {
        0
    };
    assert_eq!(
        graphs.decode_graph_replays(),
        replays as u64,
        "batch {batch}: every decode step after the first replays a graph, at the sizes captured"
    );
    assert_eq!(eager.decode_graph_replays(), 0);
    Ok(())
}

/// The logits' values as bits, for an exact comparison.
fn bits(logits: &Tensor) -> Result<Vec<u32>> {
    Ok(logits
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?
        .into_iter()
        .map(f32::to_bits)
        .collect())
}
