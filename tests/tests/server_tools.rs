//! BerryLM's reasoning and tool-call parsers through the real server: the
//! trained tiny model's greedy outputs (recorded from the transformers
//! reference) come back as OpenAI `reasoning_content`, `content` and typed
//! `tool_calls`, streamed and not.

use anyhow::Result;
use berrylm_tests::server::Server;
use berrylm_tests::Fixture;
use serde_json::{json, Value};

fn chat_request(sequence: &Value, stream: bool) -> Value {
    let mut request = json!({
        "model": "default",
        "messages": sequence["messages"],
        "temperature": 0.0,
        "max_tokens": 96,
        "stream": stream,
    });
    if let Some(tools) = sequence["tools"].as_array().filter(|t| !t.is_empty()) {
        request["tools"] = Value::Array(tools.clone());
    }
    if sequence["enable_thinking"] == json!(false) {
        request["enable_thinking"] = json!(false);
    }
    request
}

/// The message assembled from streamed chunks: text fields concatenated, tool
/// calls merged by index (id and name from their first delta).
fn assemble(chunks: &[Value]) -> (Value, Option<String>) {
    let mut content = String::new();
    let mut reasoning = String::new();
    let mut calls: Vec<Value> = Vec::new();
    let mut finish_reason = None;
    for chunk in chunks {
        let choice = &chunk["choices"][0];
        if let Some(reason) = choice["finish_reason"].as_str() {
            finish_reason = Some(reason.to_string());
        }
        let delta = &choice["delta"];
        content.push_str(delta["content"].as_str().unwrap_or_default());
        reasoning.push_str(delta["reasoning_content"].as_str().unwrap_or_default());
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            let index = call["index"].as_u64().unwrap_or(0) as usize;
            if calls.len() <= index {
                calls.resize(index + 1, json!({"id": "", "name": "", "arguments": ""}));
            }
            let entry = &mut calls[index];
            for (field, source) in [("id", &call["id"]), ("name", &call["function"]["name"])] {
                if entry[field] == json!("") {
                    if let Some(text) = source.as_str() {
                        entry[field] = json!(text);
                    }
                }
            }
            let arguments = entry["arguments"].as_str().unwrap_or_default().to_string()
                + call["function"]["arguments"].as_str().unwrap_or_default();
            entry["arguments"] = json!(arguments);
        }
    }
    let message = json!({
        "content": if content.trim().is_empty() { Value::Null } else { json!(content) },
        "reasoning_content": if reasoning.is_empty() { Value::Null } else { json!(reasoning) },
        "tool_calls": calls,
    });
    (message, finish_reason)
}

fn arguments(call_arguments: &Value) -> Value {
    serde_json::from_str(call_arguments.as_str().unwrap_or("null")).unwrap_or(Value::Null)
}

#[test]
fn reasoning_and_typed_tool_calls_come_back_streamed_and_not() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let server = Server::start(&fixture.model_dir, &["--dtype", "f32"])?;
    let weather = &fixture.facts["sequences"][2];
    let time_without_thinking = &fixture.facts["sequences"][3];

    // Non-streaming: "What is the weather in Oslo?" with tools.
    let (status, response) = server.post("/v1/chat/completions", &chat_request(weather, false))?;
    assert_eq!(status, 200, "{response}");
    let choice = &response["choices"][0];
    assert_eq!(choice["finish_reason"], json!("tool_calls"), "{response}");
    let message = &choice["message"];
    assert_eq!(
        message["reasoning_content"].as_str().map(str::trim),
        Some("The user asks about the weather in Oslo. I should call get_weather."),
        "{response}"
    );
    assert!(
        message["content"]
            .as_str()
            .unwrap_or_default()
            .trim()
            .is_empty(),
        "{response}"
    );
    let calls = message["tool_calls"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(calls.len(), 1, "{response}");
    assert_eq!(calls[0]["type"], json!("function"));
    assert!(
        calls[0]["id"].as_str().is_some_and(|id| !id.is_empty()),
        "{response}"
    );
    assert_eq!(calls[0]["function"]["name"], json!("get_weather"));
    assert_eq!(
        arguments(&calls[0]["function"]["arguments"]),
        json!({"city": "Oslo"})
    );

    // Streaming: the same message, assembled from deltas.
    let (status, chunks) =
        server.post_stream("/v1/chat/completions", &chat_request(weather, true))?;
    assert_eq!(status, 200);
    let (streamed, finish_reason) = assemble(&chunks);
    assert_eq!(finish_reason.as_deref(), Some("tool_calls"), "{chunks:?}");
    assert_eq!(
        streamed["reasoning_content"].as_str().map(str::trim),
        Some("The user asks about the weather in Oslo. I should call get_weather.")
    );
    assert_eq!(
        streamed["tool_calls"][0]["name"],
        json!("get_weather"),
        "{chunks:?}"
    );
    assert_eq!(
        arguments(&streamed["tool_calls"][0]["arguments"]),
        json!({"city": "Oslo"})
    );

    // Thinking disabled: no reasoning, a get_time call.
    let (status, response) = server.post(
        "/v1/chat/completions",
        &chat_request(time_without_thinking, false),
    )?;
    assert_eq!(status, 200, "{response}");
    let message = &response["choices"][0]["message"];
    assert!(message["reasoning_content"].is_null(), "{response}");
    assert_eq!(
        message["tool_calls"][0]["function"]["name"],
        json!("get_time"),
        "{response}"
    );
    assert_eq!(
        arguments(&message["tool_calls"][0]["function"]["arguments"]),
        json!({"city": "Lima"})
    );

    // Without tools: reasoning then content, streamed.
    let greeting = &fixture.facts["sequences"][1];
    let (status, chunks) =
        server.post_stream("/v1/chat/completions", &chat_request(greeting, true))?;
    assert_eq!(status, 200);
    let (streamed, finish_reason) = assemble(&chunks);
    assert_eq!(finish_reason.as_deref(), Some("stop"), "{chunks:?}");
    assert_eq!(
        streamed["reasoning_content"].as_str().map(str::trim),
        Some("The user greets me.")
    );
    assert_eq!(
        streamed["content"].as_str().map(str::trim),
        Some("Hello! How can I help you today?")
    );
    assert!(streamed["tool_calls"].as_array().is_some_and(Vec::is_empty));
    Ok(())
}

/// The official OpenAI Python client (installed by `cargo xtask test` into its
/// venv, `BERRYLM_PYTHON`) against the real server.
#[test]
fn the_openai_python_client_gets_reasoning_content_and_tool_calls() -> Result<()> {
    let Some(python) = std::env::var_os("BERRYLM_PYTHON") else {
        anyhow::bail!("BERRYLM_PYTHON is not set: run the tests with `cargo xtask test`");
    };
    let fixture = Fixture::load("trained-tiny")?;
    let server = Server::start(&fixture.model_dir, &["--dtype", "f32"])?;
    let script = berrylm_tests::fixtures_dir().join("../e2e/openai_client.py");
    let golden = berrylm_tests::fixtures_dir().join("trained-tiny/golden.json");
    let output = std::process::Command::new(python)
        .arg(script)
        .arg(format!("http://127.0.0.1:{}/v1", server.port))
        .arg(golden)
        .output()?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("all checks passed"), "{stdout}");
    Ok(())
}
