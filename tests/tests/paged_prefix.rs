//! A prompt after a prefix-cache hit under paged attention (its first
//! positions' keys and values already in the paged blocks) gives the logits
//! of the same prompt continued over the contiguous cache, bit for bit: the
//! bundled trained model in bf16, a batch of sequences fed a prompt and then
//! further chunks of several tokens, as the host feeds a prompt whose prefix
//! it found cached. Both attend with the tiled kernel over the
//! same keys and values (the paged ones gathered from the blocks).
//!
//! Needs a CUDA device: `test-paged_prefix --ignored` on the GPU machine
//! (BERRYLM_FIXTURES=<repo>/tests/fixtures).

use anyhow::Result;
use berrylm::driver::Driver;
use berrylm_tests::{bundled_model_on_cuda, f32_bits};

/// Tokens of each step: the prompt, then chunks of several tokens after it
/// (the first across a paged block's end, 32 tokens), as the host feeds the
/// rest of a prompt whose first positions it found cached. (A chunk of one
/// token is a decode step to the paged driver, whose attention kernel sums
/// in another order than the contiguous cache's.)
const CHUNKS: [usize; 4] = [40, 24, 37, 64];

#[test]
#[ignore = "needs a CUDA device: run with --ignored on the GPU machine"]
fn prompts_after_a_prefix_hit_equal_the_contiguous_continuation() -> Result<()> {
    let model = bundled_model_on_cuda()?;
    let sequences = 3;
    let vocab = model.config().vocab_size as u32;
    let total: usize = CHUNKS.iter().sum();
    let ids: Vec<Vec<u32>> = (0..sequences as u32)
        .map(|row| {
            (0..total as u32)
                .map(|i| (row * 211 + i * 37 + 11) % vocab)
                .collect()
        })
        .collect();
    let mut paged = Driver::paged(&model, sequences, total)?;
    let mut contiguous = Driver::new(&model, sequences)?;
    let mut start = 0;
    for (step, len) in CHUNKS.into_iter().enumerate() {
        let chunks: Vec<&[u32]> = ids.iter().map(|row| &row[start..start + len]).collect();
        let from_blocks = paged.step(&chunks, None)?;
        let from_cache = contiguous.step(&chunks, None)?;
        assert_eq!(
            f32_bits(&from_blocks)?,
            f32_bits(&from_cache)?,
            "step {step} ({len} tokens after {start}): the paged logits differ from the \
             contiguous ones"
        );
        start += len;
    }
    Ok(())
}
