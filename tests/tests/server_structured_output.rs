//! Structured output that knows about reasoning, through the real server: when
//! the chat template opens `<think>` (thinking on, its default), a request's
//! grammar (`response_format` json_schema or json_object, `grammar` regex or
//! lark) leaves the reasoning free and constrains what follows `</think>`; with
//! thinking off it constrains from the first token. Streamed and not.

use anyhow::{Context, Result};
use berrylm_tests::chat::{chat_answer, reasoning};
use berrylm_tests::server::Server;
use berrylm_tests::Fixture;
use serde_json::{json, Map, Value};

/// A forecast: a short city name and a number of days from 1 to 9, nothing else.
fn forecast_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 9}
        },
        "required": ["city", "days"],
        "additionalProperties": false
    })
}

/// Checks `content` against [`forecast_schema`] by hand.
fn assert_forecast(content: &Value, context: &str) -> Value {
    let text = content
        .as_str()
        .unwrap_or_else(|| panic!("no content: {context}"));
    let forecast: Value = serde_json::from_str(text)
        .unwrap_or_else(|error| panic!("content is not JSON ({error}): {context}"));
    let object = forecast
        .as_object()
        .unwrap_or_else(|| panic!("content is not an object: {context}"));
    let mut keys = object.keys().map(String::as_str).collect::<Vec<_>>();
    keys.sort_unstable();
    assert_eq!(keys, ["city", "days"], "{context}");
    let city = object["city"].as_str().unwrap_or_default();
    assert!(
        (1..=12).contains(&city.chars().count()),
        "city {city:?}: {context}"
    );
    let days = object["days"].as_i64().unwrap_or_default();
    assert!(
        object["days"].is_i64() && (1..=9).contains(&days),
        "days {}: {context}",
        object["days"]
    );
    forecast
}

fn request(thinking: bool, stream: bool, constraint: &[(&str, Value)]) -> Value {
    let mut request = Map::new();
    request.insert("model".into(), json!("default"));
    request.insert(
        "messages".into(),
        json!([{"role": "user", "content": "What is the weather in Oslo?"}]),
    );
    request.insert("temperature".into(), json!(0.0));
    request.insert("max_tokens".into(), json!(160));
    request.insert("stream".into(), json!(stream));
    if !thinking {
        request.insert("enable_thinking".into(), json!(false));
    }
    for (key, value) in constraint {
        request.insert((*key).to_string(), value.clone());
    }
    Value::Object(request)
}

fn json_schema_format() -> Value {
    json!({"type": "json_schema", "json_schema": {"name": "forecast", "schema": forecast_schema()}})
}

/// The bundled model served in f32, and the reasoning it writes by itself
/// for the question when nothing constrains it.
fn server_and_free_reasoning() -> Result<(Server, String)> {
    let fixture = Fixture::load("trained-tiny")?;
    let server = Server::start(&fixture.model_dir, &["--dtype", "f32"])?;
    let (free, _) = chat_answer(&server, &request(true, false, &[]))?;
    let free_reasoning = reasoning(&free)
        .context("the unconstrained answer has no reasoning")?
        .to_string();
    anyhow::ensure!(!free_reasoning.is_empty(), "{free}");
    Ok((server, free_reasoning))
}

/// The message `server` answers `body` with, checked to keep the free
/// reasoning and to stop, and its description for failures (`what`, then
/// the message).
fn answer_after_free_reasoning(
    server: &Server,
    body: &Value,
    free_reasoning: &str,
    what: &str,
) -> Result<(Value, String)> {
    let (message, finish_reason) = chat_answer(server, body)?;
    let context = format!("{what}: {message}");
    assert_eq!(
        reasoning(&message),
        Some(free_reasoning),
        "the reasoning is not the free one: {context}"
    );
    assert_eq!(finish_reason, "stop", "{context}");
    Ok((message, context))
}

/// With thinking on, `response_format` leaves the free reasoning and the
/// answer after it (checked by `check_answer`, which returns what it read) is
/// the same streamed and not.
fn assert_same_answer_streamed_and_not(
    server: &Server,
    free_reasoning: &str,
    response_format: &Value,
    check_answer: impl Fn(&Value, &str) -> Value,
) -> Result<()> {
    let mut answers = Vec::new();
    for stream in [false, true] {
        let body = request(
            true,
            stream,
            &[("response_format", response_format.clone())],
        );
        let (message, context) = answer_after_free_reasoning(
            server,
            &body,
            free_reasoning,
            &format!("{response_format}, stream {stream}"),
        )?;
        answers.push(check_answer(&message, &context));
    }
    assert_eq!(answers[0], answers[1], "streamed and not differ");
    Ok(())
}

#[test]
fn json_schema_constrains_the_answer_after_free_reasoning() -> Result<()> {
    let (server, free_reasoning) = server_and_free_reasoning()?;

    assert_same_answer_streamed_and_not(
        &server,
        &free_reasoning,
        &json_schema_format(),
        |message, context| assert_forecast(&message["content"], context),
    )?;

    // Thinking off: no reasoning, JSON from the first token.
    for stream in [false, true] {
        let body = request(false, stream, &[("response_format", json_schema_format())]);
        let (message, finish_reason) = chat_answer(&server, &body)?;
        let context = format!("thinking off, stream {stream}: {message}");
        assert!(message["reasoning_content"].is_null(), "{context}");
        assert_eq!(finish_reason, "stop", "{context}");
        assert_forecast(&message["content"], &context);
    }
    Ok(())
}

/// OpenAI's JSON mode: `response_format` `{"type": "json_object"}` constrains
/// the answer to a JSON object (any object), after the free reasoning when
/// thinking is on. mistral.rs 0.8.1 without the seam's json_object edits
/// refused the request: HTTP 422, `response_format.type: unknown variant
/// `json_object`, expected `text` or `json_schema``.
#[test]
fn json_object_constrains_the_answer_to_an_object_after_free_reasoning() -> Result<()> {
    let (server, free_reasoning) = server_and_free_reasoning()?;
    let json_object = json!({"type": "json_object"});

    let json_object_answer = |message: &Value, context: &str| {
        let text = message["content"]
            .as_str()
            .unwrap_or_else(|| panic!("no content: {context}"));
        let answer: Value = serde_json::from_str(text)
            .unwrap_or_else(|error| panic!("content is not JSON ({error}): {context}"));
        assert!(
            answer.is_object(),
            "content is not a JSON object: {context}"
        );
        answer
    };

    assert_same_answer_streamed_and_not(
        &server,
        &free_reasoning,
        &json_object,
        json_object_answer,
    )?;

    // Thinking off: no reasoning, the object from the first token.
    let body = request(false, false, &[("response_format", json_object)]);
    let (message, finish_reason) = chat_answer(&server, &body)?;
    let context = format!("thinking off: {message}");
    assert!(message["reasoning_content"].is_null(), "{context}");
    assert_eq!(finish_reason, "stop", "{context}");
    json_object_answer(&message, &context);
    Ok(())
}

#[test]
fn regex_and_lark_grammars_apply_after_the_reasoning() -> Result<()> {
    let (server, free_reasoning) = server_and_free_reasoning()?;

    let grammars = [
        json!({"type": "regex", "value": "(sunny|cloudy|rainy) in Oslo"}),
        json!({"type": "lark", "value": "start: (\"sunny\" | \"cloudy\" | \"rainy\") \" in Oslo\""}),
    ];
    for grammar in grammars {
        for stream in [false, true] {
            let body = request(true, stream, &[("grammar", grammar.clone())]);
            let what = format!("{grammar}, stream {stream}");
            let (message, context) =
                answer_after_free_reasoning(&server, &body, &free_reasoning, &what)?;
            assert!(
                ["sunny in Oslo", "cloudy in Oslo", "rainy in Oslo"]
                    .contains(&message["content"].as_str().unwrap_or_default()),
                "{context}"
            );
        }
    }
    Ok(())
}
