//! Serving invariance through the real server, float32 on the CPU, greedy:
//! concurrent requests give exactly the tokens each gives alone (including
//! same-length prompts the scheduler batches), a repeated prompt gives the
//! cold-run tokens with prefix caching on, a conversation that extends an
//! earlier finished one hits the prefix cache and gives the cold-run tokens,
//! so does a prompt one token past a cached one,
//! and a long request is not disturbed by others starting, finishing or being
//! cancelled around it.

use std::thread;

use anyhow::Result;
use berrylm_tests::chat::{follow_up_messages, greedy_chat_message};
use berrylm_tests::fixtures_dir;
use berrylm_tests::server::Server;
use serde_json::json;

/// Prompts of space-separated digits for the trained-tiny fixture: prompts
/// with the same number of digits tokenize to the same length.
fn prompt(seed: usize, words: usize) -> String {
    (0..words)
        .map(|i| ((seed * 7 + i * 3) % 10).to_string())
        .collect::<Vec<_>>()
        .join(" ")
}

fn start() -> Result<Server> {
    Server::start(
        &fixtures_dir().join("trained-tiny/model"),
        &["--dtype", "f32"],
    )
}

#[test]
fn concurrent_requests_give_the_tokens_each_gives_alone() -> Result<()> {
    let server = start()?;
    // 16 prompts: 8 distinct lengths, and 8 of one length (batched together).
    let prompts: Vec<String> = (0..16)
        .map(|i| {
            if i < 8 {
                prompt(i, 3 + 2 * i)
            } else {
                prompt(i, 6)
            }
        })
        .collect();
    let alone: Vec<String> = prompts
        .iter()
        .map(|p| server.complete(p, 24))
        .collect::<Result<_>>()?;

    let together = server.complete_all_at_once(&prompts, 24)?;
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(
            a, t,
            "prompt {i}: concurrent output differs from the output alone"
        );
    }
    let batch = server.largest_batch();
    assert!(
        batch > 1,
        "the scheduler never batched sequences (largest batch {batch})"
    );
    Ok(())
}

#[test]
fn a_repeated_prompt_gives_the_cold_run_tokens_with_prefix_caching() -> Result<()> {
    let server = start()?;
    // A short prompt, and one of several paged-attention blocks (32 tokens).
    for text in [prompt(3, 12), prompt(9, 90)] {
        let cold = server.complete(&text, 20)?;
        for repeat in 0..3 {
            assert_eq!(server.complete(&text, 20)?, cold, "repeat {repeat}");
        }
    }
    // A shorter prefix of a finished request, and a longer prompt through it.
    let shorter = prompt(3, 8);
    let shorter_cold = {
        let fresh = start()?;
        fresh.complete(&shorter, 20)?
    };
    assert_eq!(server.complete(&shorter, 20)?, shorter_cold);
    Ok(())
}

/// A prompt one token longer than a finished one: the prefix cache holds all of
/// it but the last token (under paged attention two whole 32-token blocks and
/// the recurrent state captured after them), so its prompt step runs a single
/// token at position 64.
#[test]
fn a_prompt_one_token_past_a_cached_one_gives_the_cold_run_tokens() -> Result<()> {
    let server = start()?;
    let response = server.completion(&prompt(5, 64), 1)?;
    assert_eq!(response["usage"]["prompt_tokens"], 64, "{response}");

    let extended = prompt(5, 65);
    let warm = server.complete(&extended, 20)?;
    assert!(
        server
            .log()
            .contains("berrylm forward: 1 sequences x 1 tokens at positions [64]"),
        "the extended prompt did not run as one token after a prefix hit"
    );
    let cold = {
        let fresh = start()?;
        fresh.complete(&extended, 20)?
    };
    assert_eq!(warm, cold);
    Ok(())
}

#[test]
fn a_long_request_is_not_disturbed_by_requests_around_it() -> Result<()> {
    let server = start()?;
    let long_prompt = prompt(42, 10);
    let alone = server.complete(&long_prompt, 160)?;

    // A reference, so that the spawned closures copy it rather than move the server.
    let server = &server;
    let disturbed = thread::scope(|scope| -> Result<String> {
        let long = scope.spawn(|| server.complete(&long_prompt, 160));
        for round in 0..6 {
            let short = prompt(100 + round, 4 + round);
            scope.spawn(move || server.complete(&short, 8));
            let streaming = json!({
                "model": "default",
                "prompt": prompt(200 + round, 5),
                "temperature": 0.0,
                "max_tokens": 64,
                "stream": true,
            });
            server.abandon_stream("/v1/completions", &streaming)?;
        }
        long.join().expect("long request thread panicked")
    })?;
    assert_eq!(disturbed, alone);
    Ok(())
}

#[test]
fn a_conversation_extending_a_finished_one_hits_the_cache_and_gives_the_cold_run_tokens(
) -> Result<()> {
    let question = "What is 7 + 5?";
    let server = start()?;
    let answer = greedy_chat_message(&server, &json!([{"role": "user", "content": question}]))?;
    let follow_up = follow_up_messages(question, &answer, "Hello!");
    assert!(
        server.prompt_forwards_after_a_cache_hit().is_empty(),
        "a prefix hit before any conversation was extended"
    );
    let warm = greedy_chat_message(&server, &follow_up)?;
    let hits = server.prompt_forwards_after_a_cache_hit();
    assert!(
        !hits.is_empty(),
        "the extended conversation did not hit the prefix cache"
    );
    let cold = {
        let fresh = start()?;
        greedy_chat_message(&fresh, &follow_up)?
    };
    assert_eq!(warm, cold, "prefix hit {hits:?}");
    Ok(())
}
