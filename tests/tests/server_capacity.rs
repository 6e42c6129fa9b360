//! Capacity through the real server (CPU, float32, the bundled model, whose
//! context is 4096 tokens): a prompt the context cannot hold is refused at
//! once with a 4xx naming the limit, streamed or not; `max_tokens` past the
//! context ends with `finish_reason: "length"` when the context is full; more
//! requests than `--max-seqs` wait (requests not started holding no recurrent
//! state, no more than `--max-seqs` run a step) and each completes with
//! its answer alone.

use std::thread;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use berrylm_tests::metrics::SLOTS_IN_USE;
use berrylm_tests::server::Server;
use berrylm_tests::Fixture;

const COMPLETIONS: &str = "/v1/completions";
const CHAT: &str = "/v1/chat/completions";

fn start(extra_args: &[&str]) -> Result<(Server, usize)> {
    let fixture = Fixture::load("trained-tiny")?;
    let context = fixture.context_length()?;
    let mut args = vec!["--dtype", "f32"];
    args.extend_from_slice(extra_args);
    Ok((Server::start(&fixture.model_dir, &args)?, context))
}

/// `words` space-separated digits: one token each for the bundled tokenizer
/// (its pre-tokenizer splits every ` d` apart and its vocabulary has them all).
fn digits(seed: usize, words: usize) -> String {
    (0..words)
        .map(|i| ((seed * 7 + i * 3) % 10).to_string())
        .collect::<Vec<_>>()
        .join(" ")
}

fn completion(prompt: &str, max_tokens: usize, stream: bool) -> serde_json::Value {
    serde_json::json!({
        "model": "default",
        "prompt": prompt,
        "temperature": 0.0,
        "max_tokens": max_tokens,
        "stream": stream,
    })
}

/// A completions prompt of exactly `tokens` tokens as the server counts them
/// (calibrated on a short prompt: the tokenizer may add tokens around it).
fn prompt_of(server: &Server, tokens: usize) -> Result<String> {
    let (status, response) = server.post(COMPLETIONS, &completion(&digits(0, 8), 1, false))?;
    ensure!(status == 200, "HTTP {status}: {response}");
    let counted = response["usage"]["prompt_tokens"]
        .as_u64()
        .context("usage.prompt_tokens")? as usize;
    let added = counted.checked_sub(8).context("fewer tokens than words")?;
    Ok(digits(1, tokens - added))
}

/// Posts `body` and asserts a 4xx within 10 seconds whose body names every
/// one of `names`.
fn assert_refused(server: &Server, path: &str, body: &serde_json::Value, names: &[String]) {
    let started = Instant::now();
    let (status, text) = server
        .post_raw(path, &body.to_string())
        .expect("the request could not be sent");
    let elapsed = started.elapsed();
    let what = format!("{path}, stream {}", body["stream"]);
    assert!(
        (400..500).contains(&status),
        "{what}: expected an HTTP 4xx, got {status}: {text}"
    );
    for name in names {
        assert!(
            text.contains(name.as_str()),
            "{what}: HTTP {status} but the body does not name {name}: {text}"
        );
    }
    assert!(
        elapsed < Duration::from_secs(10),
        "{what}: refused after {elapsed:?}"
    );
}

/// Every request, streamed or not, to either endpoint, with a prompt of twice
/// the context is refused naming the prompt's length and the context; so is
/// a prompt of exactly the context (no room left to generate), while one
/// token less completes with one token, stopped by length.
#[test]
fn a_prompt_the_context_cannot_hold_is_refused_at_once_streamed_or_not() -> Result<()> {
    let (server, context) = start(&[])?;
    let too_long = prompt_of(&server, 2 * context)?;
    for stream in [false, true] {
        let names = [(2 * context).to_string(), context.to_string()];
        assert_refused(
            &server,
            COMPLETIONS,
            &completion(&too_long, 16, stream),
            &names,
        );
        let chat = serde_json::json!({
            "model": "default",
            "messages": [{"role": "user", "content": too_long}],
            "max_tokens": 16,
            "stream": stream,
        });
        assert_refused(&server, CHAT, &chat, &[context.to_string()]);
    }

    let full = prompt_of(&server, context)?;
    assert_refused(
        &server,
        COMPLETIONS,
        &completion(&full, 16, false),
        &[context.to_string()],
    );
    let fits = prompt_of(&server, context - 1)?;
    let (status, response) = server.post(COMPLETIONS, &completion(&fits, 16, false))?;
    assert_eq!(status, 200, "{response}");
    assert_eq!(response["usage"]["prompt_tokens"], context - 1);
    assert_eq!(response["usage"]["completion_tokens"], 1, "{response}");
    assert_eq!(response["choices"][0]["finish_reason"], "length");
    Ok(())
}

/// `max_tokens` beyond what the context leaves: the answer fills the context
/// exactly and ends with `length`, streamed or not, with the text the same
/// prompt gives when `max_tokens` asks for just the tokens left.
#[test]
fn max_tokens_past_the_context_ends_with_length_when_the_context_is_full() -> Result<()> {
    let (server, context) = start(&[])?;
    let left = 6;
    let prompt = prompt_of(&server, context - left)?;

    let capped = server.post(COMPLETIONS, &completion(&prompt, left, false))?;
    assert_eq!(capped.0, 200, "{}", capped.1);
    let (status, response) = server.post(COMPLETIONS, &completion(&prompt, 4 * context, false))?;
    assert_eq!(status, 200, "{response}");
    assert_eq!(
        response["choices"][0]["finish_reason"], "length",
        "{response}"
    );
    assert_eq!(response["usage"]["prompt_tokens"], context - left);
    assert_eq!(response["usage"]["completion_tokens"], left, "{response}");
    assert_eq!(
        response["choices"][0]["text"],
        capped.1["choices"][0]["text"]
    );

    let (status, events) =
        server.post_stream(COMPLETIONS, &completion(&prompt, 4 * context, true))?;
    assert_eq!(status, 200);
    let text: String = events
        .iter()
        .filter_map(|event| event["choices"][0]["text"].as_str())
        .collect();
    let reasons: Vec<&str> = events
        .iter()
        .filter_map(|event| event["choices"][0]["finish_reason"].as_str())
        .collect();
    assert_eq!(reasons, ["length"], "{events:#?}");
    assert_eq!(
        text,
        capped.1["choices"][0]["text"].as_str().unwrap_or_default()
    );
    Ok(())
}

/// Eight requests at once over `--max-seqs 2`: the scheduler runs at most two
/// sequences a step (of one length: these prompts all differ, so one), the
/// others wait (`/metrics` shows them waiting), those that have not started
/// holding no recurrent state (fewer slots in use than requests: all eight
/// held one until a sequence took its slot at its first step; the host's
/// length bucketing parks a started sequence among the waiting ones, so the
/// slots are not bounded by `--max-seqs`), and every request completes with
/// the tokens it gives alone.
#[test]
fn more_requests_than_max_seqs_wait_and_complete_with_their_answers_alone() -> Result<()> {
    let (server, _) = start(&["--max-seqs", "2"])?;
    let prompts: Vec<String> = (0..8).map(|i| digits(i, 4 + 3 * i)).collect();
    let alone: Vec<String> = prompts
        .iter()
        .map(|p| server.complete(p, 32))
        .collect::<Result<_>>()?;

    let server = &server;
    let (together, most_waiting, most_slots) = thread::scope(|scope| -> Result<_> {
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| scope.spawn(move || server.complete(p, 32)))
            .collect();
        let (mut most_waiting, mut most_slots) = (0.0_f64, 0.0_f64);
        while !handles.iter().all(|h| h.is_finished()) {
            let metrics = server.metrics()?;
            let value = |name: &str| metrics.get(name).copied().unwrap_or_default();
            most_waiting = most_waiting.max(value("mistralrs:num_requests_waiting"));
            most_slots = most_slots.max(value(SLOTS_IN_USE));
            thread::sleep(Duration::from_millis(10));
        }
        let together = handles
            .into_iter()
            .map(|h| h.join().expect("request thread panicked"))
            .collect::<Result<Vec<_>>>()?;
        Ok((together, most_waiting, most_slots))
    })?;
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a, t, "prompt {i}: the answer differs from the answer alone");
    }
    let largest = server.largest_batch();
    assert!(largest <= 2, "a batch of {largest} with --max-seqs 2");
    assert!(
        most_waiting >= 1.0,
        "/metrics never showed a request waiting (8 requests over --max-seqs 2)"
    );
    assert!(
        most_slots < prompts.len() as f64,
        "{most_slots} recurrent state slots in use for {} requests over --max-seqs 2: \
         requests waiting for their first step held one",
        prompts.len()
    );
    Ok(())
}

/// Eight requests of one prompt length at once over `--max-seqs 2`: when
/// nothing runs, the scheduler starts at most two of them (the host's
/// non-paged scheduler started every waiting request whose prompt had the
/// shortest length, eight in one batch), and each completes with its answer
/// alone.
#[test]
fn requests_of_one_length_over_max_seqs_run_at_most_max_seqs_a_step() -> Result<()> {
    let (server, _) = start(&["--max-seqs", "2"])?;
    let prompts: Vec<String> = (0..8).map(|i| digits(i, 12)).collect();
    let alone: Vec<String> = prompts
        .iter()
        .map(|p| server.complete(p, 16))
        .collect::<Result<_>>()?;
    let together = server.complete_all_at_once(&prompts, 16)?;
    assert_eq!(alone, together, "answers differ from the answers alone");
    let largest = server.largest_batch();
    assert!(largest <= 2, "a batch of {largest} with --max-seqs 2");
    Ok(())
}
