//! `logprobs` through the real server come back in OpenAI's shape and hold the
//! model's natural-log probabilities: the first generated token's value is the
//! log-softmax of the transformers reference's logits at the prompt's last
//! position (the golden conversation's prompt renders to the golden ids).

use anyhow::{Context, Result};
use berrylm_tests::server::Server;
use berrylm_tests::{number, Fixture};
use candle_core::{IndexOp, D};
use serde_json::{json, Value};

const TOP: usize = 3;

fn request(fixture: &Fixture, stream: bool) -> Value {
    json!({
        "model": "default",
        "messages": fixture.facts["sequences"][0]["messages"],
        "temperature": 0.0,
        "max_tokens": 6,
        "logprobs": true,
        "top_logprobs": TOP,
        "stream": stream,
    })
}

/// Checks one `logprobs.content` entry's shape; returns (token, logprob).
fn entry_shape(entry: &Value) -> Result<(String, f64)> {
    let token = entry["token"].as_str().context("`token` is not a string")?;
    let logprob = number(entry, "logprob")?;
    anyhow::ensure!(logprob <= 0.0, "a log-probability above 0: {entry}");
    let top = entry["top_logprobs"]
        .as_array()
        .context("`top_logprobs` is not a list")?;
    anyhow::ensure!(
        top.len() == TOP,
        "{} alternatives, asked {TOP}: {entry}",
        top.len()
    );
    let mut previous = f64::INFINITY;
    for alternative in top {
        let text = alternative["token"]
            .as_str()
            .context("an alternative's `token` is not a string")?;
        let value = number(alternative, "logprob")?;
        let bytes: Vec<u8> = alternative["bytes"]
            .as_array()
            .context("an alternative's `bytes` is not a list")?
            .iter()
            .map(|b| {
                b.as_u64()
                    .map(|b| b as u8)
                    .context("a byte is not an integer")
            })
            .collect::<Result<_>>()?;
        anyhow::ensure!(
            bytes == text.as_bytes(),
            "`bytes` is not the text's UTF-8: {alternative}"
        );
        anyhow::ensure!(
            value <= previous,
            "alternatives not in decreasing order: {entry}"
        );
        previous = value;
    }
    // Greedy decoding chose the most likely token.
    anyhow::ensure!(
        (top[0]["logprob"].as_f64().unwrap_or(f64::NAN) - logprob).abs() < 1e-6,
        "the greedy token is not the most likely alternative: {entry}"
    );
    Ok((token.to_string(), logprob))
}

/// The reference's log-probability of its own greedy next token after the
/// golden prompt.
fn reference_first_logprob(fixture: &Fixture) -> Result<f64> {
    let logits = fixture.tensor("seq0.logits_f32")?;
    let last = logits.i(logits.dim(0)? - 1)?;
    let log_probs = candle_nn::ops::log_softmax(&last, D::Minus1)?;
    let best = last.argmax(D::Minus1)?.to_scalar::<u32>()?;
    Ok(f64::from(log_probs.i(best as usize)?.to_scalar::<f32>()?))
}

#[test]
fn logprobs_are_the_models_in_openai_shape() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let server = Server::start(&fixture.model_dir, &["--dtype", "f32"])?;
    let expected = reference_first_logprob(&fixture)?;

    let (status, response) = server.post("/v1/chat/completions", &request(&fixture, false))?;
    anyhow::ensure!(status == 200, "HTTP {status}: {response}");
    let content = response["choices"][0]["logprobs"]["content"]
        .as_array()
        .context("logprobs.content")?;
    anyhow::ensure!(!content.is_empty(), "no logprobs: {response}");
    let entries = content
        .iter()
        .map(entry_shape)
        .collect::<Result<Vec<_>>>()?;
    let first = entries[0].1;
    assert!(
        (first - expected).abs() < 1e-3,
        "first token's logprob {first}, the reference's log-softmax {expected}"
    );

    // Streamed: the same entries, one chunk at a time.
    let (status, chunks) = server.post_stream("/v1/chat/completions", &request(&fixture, true))?;
    anyhow::ensure!(status == 200, "HTTP {status} for the streamed request");
    let streamed = chunks
        .iter()
        .filter_map(|chunk| chunk["choices"][0]["logprobs"]["content"].as_array())
        .flatten()
        .map(entry_shape)
        .collect::<Result<Vec<_>>>()?;
    let values = |entries: &[(String, f64)]| entries.iter().map(|(_, v)| *v).collect::<Vec<_>>();
    assert_eq!(
        values(&streamed),
        values(&entries),
        "streamed logprobs differ from the response's"
    );
    Ok(())
}

/// `/v1/completions` reports log-probabilities in OpenAI's completions shape
/// (parallel `tokens`, `token_logprobs`, `top_logprobs` as `{text: logprob}`),
/// streamed one token a chunk; the first token's is the reference's.
#[test]
fn completion_logprobs_are_in_openai_completions_shape() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let server = Server::start(&fixture.model_dir, &["--dtype", "f32"])?;
    let expected = reference_first_logprob(&fixture)?;
    let body = |stream: bool| {
        json!({
            "model": "default",
            "prompt": fixture.facts["sequences"][0]["rendered_prompt"],
            "temperature": 0.0,
            "max_tokens": 6,
            "logprobs": TOP,
            "stream": stream,
        })
    };
    let (status, response) = server.post("/v1/completions", &body(false))?;
    anyhow::ensure!(status == 200, "HTTP {status}: {response}");
    let logprobs = &response["choices"][0]["logprobs"];
    let tokens: Vec<&str> = logprobs["tokens"]
        .as_array()
        .context("logprobs.tokens")?
        .iter()
        .map(|token| token.as_str().context("a token is not a string"))
        .collect::<Result<_>>()?;
    let values: Vec<f64> = logprobs["token_logprobs"]
        .as_array()
        .context("logprobs.token_logprobs")?
        .iter()
        .map(|value| value.as_f64().context("a log-probability is not a number"))
        .collect::<Result<_>>()?;
    let alternatives = logprobs["top_logprobs"]
        .as_array()
        .context("logprobs.top_logprobs")?;
    assert_eq!(tokens.len(), 6, "{response}");
    assert_eq!(values.len(), 6, "{response}");
    assert_eq!(alternatives.len(), 6, "{response}");
    assert_eq!(
        tokens.concat(),
        response["choices"][0]["text"].as_str().unwrap_or_default(),
        "the tokens spell the text"
    );
    for ((token, value), top) in tokens.iter().zip(&values).zip(alternatives) {
        let top = top
            .as_object()
            .context("an alternatives entry is not an object")?;
        assert_eq!(top.len(), TOP, "{response}");
        // Greedy: the token is its own most likely alternative.
        let best = top
            .values()
            .filter_map(serde_json::Value::as_f64)
            .fold(f64::NEG_INFINITY, f64::max);
        assert_eq!(
            top.get(*token).and_then(|v| v.as_f64()),
            Some(best),
            "{response}"
        );
        assert!((best - value).abs() < 1e-6, "{response}");
    }
    assert!(
        (values[0] - expected).abs() < 1e-3,
        "first token's logprob {}, the reference's log-softmax {expected}",
        values[0]
    );

    let (status, chunks) = server.post_stream("/v1/completions", &body(true))?;
    anyhow::ensure!(status == 200, "HTTP {status} for the streamed request");
    let streamed: Vec<f64> = chunks
        .iter()
        .filter_map(|chunk| chunk["choices"][0]["logprobs"]["token_logprobs"].as_array())
        .flatten()
        .filter_map(serde_json::Value::as_f64)
        .collect();
    assert_eq!(
        streamed, values,
        "streamed logprobs differ from the response's"
    );
    Ok(())
}
