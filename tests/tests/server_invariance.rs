//! Serving invariance through the real server, float32 on the CPU, greedy:
//! concurrent requests give exactly the tokens each gives alone (including
//! same-length prompts the scheduler batches), a repeated prompt gives the
//! cold-run tokens with prefix caching on, and a long request is not disturbed
//! by others starting, finishing or being cancelled around it.

use std::thread;

use anyhow::Result;
use berrylm_tests::fixtures_dir;
use berrylm_tests::server::Server;

/// Prompts of space-separated digits for the trained-tiny fixture: prompts
/// with the same number of digits tokenize to the same length.
fn prompt(seed: usize, words: usize) -> String {
    (0..words)
        .map(|i| ((seed * 7 + i * 3) % 10).to_string())
        .collect::<Vec<_>>()
        .join(" ")
}

fn complete(server: &Server, prompt: &str, max_tokens: usize) -> Result<String> {
    let request = serde_json::json!({
        "model": "default",
        "prompt": prompt,
        "temperature": 0.0,
        "max_tokens": max_tokens,
    });
    let (status, response) = server.post("/v1/completions", &request)?;
    anyhow::ensure!(status == 200, "HTTP {status}: {response}");
    Ok(response["choices"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string())
}

fn start() -> Result<Server> {
    Server::start(
        &fixtures_dir().join("trained-tiny/model"),
        &["--dtype", "f32"],
    )
}

/// Largest batch the model ran, from its debug log.
fn largest_batch(log: &str) -> usize {
    log.lines()
        .filter_map(|line| line.split("berrylm forward: ").nth(1))
        .filter_map(|rest| rest.split_whitespace().next()?.parse().ok())
        .max()
        .unwrap_or(0)
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
        .map(|p| complete(&server, p, 24))
        .collect::<Result<_>>()?;

    let together: Vec<String> = thread::scope(|scope| {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| scope.spawn(|| complete(&server, p, 24)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("request thread panicked"))
            .collect::<Result<Vec<_>>>()
    })?;
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(
            a, t,
            "prompt {i}: concurrent output differs from the output alone"
        );
    }
    let batch = largest_batch(&server.log());
    assert!(
        batch > 1,
        "the scheduler never batched sequences (largest batch {batch})"
    );
    Ok(())
}

#[test]
fn a_repeated_prompt_gives_the_cold_run_tokens_with_prefix_caching() -> Result<()> {
    let server = start()?;
    let text = prompt(3, 12);
    let cold = complete(&server, &text, 20)?;
    for repeat in 0..3 {
        assert_eq!(complete(&server, &text, 20)?, cold, "repeat {repeat}");
    }
    // A shorter prefix of a finished request, and a longer prompt through it.
    let shorter = prompt(3, 8);
    let shorter_cold = {
        let fresh = start()?;
        complete(&fresh, &shorter, 20)?
    };
    assert_eq!(complete(&server, &shorter, 20)?, shorter_cold);
    Ok(())
}

#[test]
fn a_long_request_is_not_disturbed_by_requests_around_it() -> Result<()> {
    let server = start()?;
    let long_prompt = prompt(42, 10);
    let alone = complete(&server, &long_prompt, 160)?;

    // A reference, so that the spawned closures copy it rather than move the server.
    let server = &server;
    let disturbed = thread::scope(|scope| -> Result<String> {
        let long = scope.spawn(|| complete(&server, &long_prompt, 160));
        for round in 0..6 {
            let short = prompt(100 + round, 4 + round);
            scope.spawn(move || complete(&server, &short, 8));
            let streaming = serde_json::json!({
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
