//! Bad requests never take the server down: each gets an HTTP 4xx whose body
//! is OpenAI's error object saying what is wrong (a body the server cannot
//! read and a path or method without a route too), and afterwards the server
//! answers a normal chat completion with exactly the tokens it gave before
//! them.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use anyhow::Result;
use berrylm_tests::server::{assert_client_error_object, Server};
use berrylm_tests::Fixture;

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";

fn start(fixture: &Fixture) -> Result<Server> {
    Server::start(&fixture.model_dir, &["--dtype", "f32"])
}

/// The golden "What is 7 + 5?" conversation, greedy.
fn normal_request(fixture: &Fixture) -> serde_json::Value {
    serde_json::json!({
        "model": "default",
        "messages": fixture.facts["sequences"][0]["messages"],
        "temperature": 0.0,
        "max_tokens": 64,
    })
}

/// The answer's message and token counts (the parts that do not change
/// between identical greedy requests).
fn normal_answer(server: &Server, fixture: &Fixture) -> Result<serde_json::Value> {
    let (status, response) = server.post(CHAT, &normal_request(fixture))?;
    anyhow::ensure!(status == 200, "HTTP {status}: {response}");
    Ok(serde_json::json!({
        "message": response["choices"][0]["message"],
        "finish_reason": response["choices"][0]["finish_reason"],
        "prompt_tokens": response["usage"]["prompt_tokens"],
        "completion_tokens": response["usage"]["completion_tokens"],
    }))
}

/// The server is alive, did not panic and gives the same answer as `before`.
fn assert_still_serving(
    server: &mut Server,
    fixture: &Fixture,
    before: &serde_json::Value,
) -> Result<()> {
    assert!(server.is_running()?, "the server exited:\n{}", server.log());
    assert_eq!(
        &normal_answer(server, fixture)?,
        before,
        "the answer changed after the bad requests"
    );
    let log = server.log();
    assert!(!log.contains("panicked at"), "the server panicked:\n{log}");
    Ok(())
}

fn hello(extra: serde_json::Value) -> String {
    with_fields(
        serde_json::json!({
            "model": "default",
            "messages": [{"role": "user", "content": "Hello!"}],
            "max_tokens": 4,
        }),
        extra,
    )
}

/// `body` with the fields of `extra` added or replaced, as JSON text.
fn with_fields(mut body: serde_json::Value, extra: serde_json::Value) -> String {
    if let (Some(body), Some(extra)) = (body.as_object_mut(), extra.as_object()) {
        body.extend(extra.clone());
    }
    body.to_string()
}

/// The model's vocabulary size (`vocab_size` of its `config.json`).
fn vocab_size(fixture: &Fixture) -> Result<u64> {
    let config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
        fixture.model_dir.join("config.json"),
    )?)?;
    config["vocab_size"]
        .as_u64()
        .ok_or_else(|| anyhow::anyhow!("config.json has no vocab_size"))
}

/// Space-separated digits: at least one token each.
fn digits(words: usize) -> String {
    (0..words)
        .map(|i| ((i * 7) % 10).to_string())
        .collect::<Vec<_>>()
        .join(" ")
}

#[test]
fn bad_requests_get_a_4xx_naming_the_problem_and_the_server_keeps_serving() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let context = fixture.context_length()?;
    let vocab_size = vocab_size(&fixture)?;
    let mut server = start(&fixture)?;
    let before = normal_answer(&server, &fixture)?;

    let function = |function: serde_json::Value| serde_json::json!({"tools": [{"type": "function", "function": function}]});
    let cases: Vec<(&str, String, String)> = vec![
        (
            "malformed JSON",
            r#"{"model":"default","messages":[{"role":"user","content":"hi"}"#.to_string(),
            "JSON".to_string(),
        ),
        (
            "missing messages",
            serde_json::json!({"model": "default", "max_tokens": 4}).to_string(),
            "messages".to_string(),
        ),
        (
            "messages a number",
            serde_json::json!({"model": "default", "messages": 5}).to_string(),
            "messages".to_string(),
        ),
        (
            "max_tokens a string",
            hello(serde_json::json!({"max_tokens": "four"})),
            "max_tokens".to_string(),
        ),
        (
            "a prompt longer than the context",
            hello(serde_json::json!({
                "messages": [{"role": "user", "content": digits(2 * context)}],
            })),
            context.to_string(),
        ),
        (
            "tools not a list",
            hello(serde_json::json!({
                "tools": {"type": "function", "function": {"name": "f", "parameters": {}}},
            })),
            "tools".to_string(),
        ),
        (
            "a tool without a function name",
            hello(function(serde_json::json!({
                "description": "no name",
                "parameters": {"type": "object", "properties": {}},
            }))),
            "name".to_string(),
        ),
        (
            "parameters not an object",
            hello(function(
                serde_json::json!({"name": "get_weather", "parameters": "a city"}),
            )),
            "parameters".to_string(),
        ),
        (
            "more choices than the bound",
            hello(serde_json::json!({"n": 100000})),
            "100000".to_string(),
        ),
        (
            "more alternatives per token than OpenAI's 20",
            hello(serde_json::json!({"logprobs": true, "top_logprobs": 100000})),
            "top_logprobs".to_string(),
        ),
        (
            "more tools than the bound",
            hello(serde_json::json!({
                "tools": (0..129)
                    .map(|i| serde_json::json!({"type": "function", "function": {
                        "name": format!("f{i}"),
                        "parameters": {"type": "object", "properties": {}},
                    }}))
                    .collect::<Vec<_>>(),
            })),
            "129".to_string(),
        ),
        (
            "max_tokens 0 (the host generated a token)",
            hello(serde_json::json!({"max_tokens": 0})),
            "max_tokens".to_string(),
        ),
        (
            "top_p above 1",
            hello(serde_json::json!({"temperature": 1.0, "top_p": 1.5})),
            "top_p".to_string(),
        ),
        (
            "top_p 0",
            hello(serde_json::json!({"temperature": 1.0, "top_p": 0})),
            "top_p".to_string(),
        ),
        (
            "min_p above 1",
            hello(serde_json::json!({"temperature": 1.0, "min_p": 1.5})),
            "min_p".to_string(),
        ),
        (
            "a presence penalty beyond OpenAI's 2",
            hello(serde_json::json!({"presence_penalty": 3})),
            "presence_penalty".to_string(),
        ),
        (
            "a frequency penalty below OpenAI's -2",
            hello(serde_json::json!({"frequency_penalty": -3})),
            "frequency_penalty".to_string(),
        ),
        (
            "a repetition penalty of 0 (the logits divided by 0)",
            hello(serde_json::json!({"temperature": 1.0, "repetition_penalty": 0})),
            "repetition_penalty".to_string(),
        ),
        (
            "a logit bias beyond OpenAI's 100",
            hello(serde_json::json!({"logit_bias": {"5": 150}})),
            "logit_bias".to_string(),
        ),
        (
            "a logit bias for a token the model does not have",
            hello(serde_json::json!({"logit_bias": {vocab_size.to_string(): 1}})),
            format!("{vocab_size} token ids"),
        ),
        (
            "an empty stop string (every answer would end at its first token)",
            hello(serde_json::json!({"stop": ["done", ""]})),
            "stop".to_string(),
        ),
    ];
    for (what, body, names) in &cases {
        server.assert_rejected(CHAT, body, names, what)?;
    }
    assert_still_serving(&mut server, &fixture, &before)
}

/// One bad request on a fresh server, then the normal answer.
fn rejected_alone(what: &str, body: &str, names: &str) -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let mut server = start(&fixture)?;
    let before = normal_answer(&server, &fixture)?;
    server.assert_rejected(CHAT, body, names, what)?;
    assert_still_serving(&mut server, &fixture, &before)
}

/// The plain completions endpoint refuses what the chat endpoint refuses, with
/// a 4xx (mistral.rs 0.8.1 answered an unknown model and an `n` beyond the
/// bound with a 500 there, and served a negative temperature).
#[test]
fn bad_plain_completions_get_a_4xx_naming_the_problem() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let mut server = start(&fixture)?;
    let before = normal_answer(&server, &fixture)?;
    let completion = |extra| {
        let body = serde_json::json!({"model": "default", "prompt": "Hello", "max_tokens": 4});
        with_fields(body, extra)
    };
    let cases = [
        (
            "temperature -1",
            serde_json::json!({"temperature": -1}),
            "temperature",
        ),
        (
            "an unknown model",
            serde_json::json!({"model": "no-such-model"}),
            "no-such-model",
        ),
        (
            "more choices than the bound",
            serde_json::json!({"n": 100000}),
            "100000",
        ),
        (
            "more alternatives per token than 20",
            serde_json::json!({"logprobs": 100}),
            "top_logprobs",
        ),
        (
            "an empty stop string",
            serde_json::json!({"stop": ""}),
            "stop",
        ),
    ];
    for (what, extra, names) in cases {
        server.assert_rejected(COMPLETIONS, &completion(extra), names, what)?;
    }
    assert_still_serving(&mut server, &fixture, &before)
}

/// An embeddings request to the text model is the client's error, a 4xx
/// naming the endpoint (mistral.rs 0.8.1 answered it with a 500, "Received a
/// request incompatible for this model's category").
#[test]
fn an_embeddings_request_to_the_text_model_is_a_client_error() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let mut server = start(&fixture)?;
    let before = normal_answer(&server, &fixture)?;
    server.assert_rejected(
        "/v1/embeddings",
        r#"{"model": "default", "input": "Hello"}"#,
        "/v1/embeddings needs an embedding model",
        "an embeddings request",
    )?;
    assert_still_serving(&mut server, &fixture, &before)
}

#[test]
fn a_negative_temperature_is_rejected() -> Result<()> {
    rejected_alone(
        "temperature -1",
        &hello(serde_json::json!({"temperature": -1})),
        "temperature",
    )
}

#[test]
fn an_unknown_model_name_is_a_client_error() -> Result<()> {
    rejected_alone(
        "an unknown model",
        &hello(serde_json::json!({"model": "no-such-model"})),
        "no-such-model",
    )
}

#[test]
fn empty_messages_are_a_client_error() -> Result<()> {
    rejected_alone(
        "empty messages",
        &hello(serde_json::json!({"messages": []})),
        "messages",
    )
}

#[test]
fn a_user_message_without_content_is_a_client_error() -> Result<()> {
    rejected_alone(
        "a user message without content",
        &hello(serde_json::json!({"messages": [{"role": "user"}]})),
        "content",
    )
}

/// A body declared larger than the server's limit (derived from the model's
/// context) is refused with 413 and OpenAI's error object naming the limit at
/// once, before the server waits for it: the client sends the headers of a
/// 100 MiB body and one byte of it.
#[test]
fn a_body_declared_beyond_the_limit_is_refused_before_it_is_read() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let mut server = start(&fixture)?;
    let before = normal_answer(&server, &fixture)?;
    let mut stream = TcpStream::connect(("127.0.0.1", server.port))?;
    write!(
        stream,
        "POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: 104857600\r\nConnection: close\r\n\r\n{{"
    )?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut reader = BufReader::new(stream);
    let mut status_line = String::new();
    reader.read_line(&mut status_line)?;
    assert!(
        status_line.split_whitespace().nth(1) == Some("413"),
        "expected 413 for a declared 100 MiB body, got {status_line:?}"
    );
    let mut response = String::new();
    reader.read_to_string(&mut response)?;
    let body = response.split_once("\r\n\r\n").map_or("", |(_, body)| body);
    assert_client_error_object(
        body,
        "exceeds the limit",
        "a body declared beyond the limit",
    );
    assert!(
        server.log().contains("Request bodies are limited to"),
        "the server did not log its body limit"
    );
    assert_still_serving(&mut server, &fixture, &before)
}

/// A path without a route and a method the path does not take are answered
/// with OpenAI's error object too, naming the path and the method.
#[test]
fn requests_refused_before_a_handler_get_openai_error_objects() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let mut server = start(&fixture)?;
    let before = normal_answer(&server, &fixture)?;
    server.assert_rejected(
        "/v1/no-such-endpoint",
        "{}",
        "/v1/no-such-endpoint",
        "an unknown path",
    )?;
    let (status, body) = server.get(CHAT)?;
    assert_eq!(status, 405, "GET {CHAT}: {body}");
    assert_client_error_object(
        &body.to_string(),
        "GET /v1/chat/completions",
        "GET on a POST endpoint",
    );
    assert_still_serving(&mut server, &fixture, &before)
}
