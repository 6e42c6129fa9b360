//! BerryLM's reasoning and tool-call parsers through the real server: the
//! trained tiny model's greedy outputs (recorded from the transformers
//! reference) come back as OpenAI `reasoning_content`, `content` and typed
//! `tool_calls`, streamed and not.

use anyhow::{Context, Result};
use berrylm_tests::chat::{
    arguments, assert_call, assert_golden_weather_call, chat_answer, golden_chat_request,
    reasoning, tool_call_message,
};
use berrylm_tests::server::Server;
use berrylm_tests::{Fixture, TempDir};
use serde_json::json;

/// What the model reasons before calling `get_weather` for "What is the
/// weather in Oslo?" (trained-tiny's golden sequence 2).
const WEATHER_REASONING: &str =
    "The user asks about the weather in Oslo. I should call get_weather.";

#[test]
fn reasoning_and_typed_tool_calls_come_back_streamed_and_not() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let server = Server::start(&fixture.model_dir, &["--dtype", "f32"])?;
    let weather = &fixture.facts["sequences"][2];
    let time_without_thinking = &fixture.facts["sequences"][3];

    // Non-streaming: "What is the weather in Oslo?" with tools.
    let (status, response) = server.post(
        "/v1/chat/completions",
        &golden_chat_request(weather, 96, false)?,
    )?;
    let message = tool_call_message(status, &response, WEATHER_REASONING);
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
    let (streamed, finish_reason) = chat_answer(&server, &golden_chat_request(weather, 96, true)?)?;
    assert_eq!(reasoning(&streamed), Some(WEATHER_REASONING), "{streamed}");
    assert_golden_weather_call(&streamed, &finish_reason);

    // Thinking disabled: no reasoning, a get_time call.
    let (message, _) = chat_answer(
        &server,
        &golden_chat_request(time_without_thinking, 96, false)?,
    )?;
    assert!(message["reasoning_content"].is_null(), "{message}");
    assert_call(
        &message["tool_calls"][0],
        "get_time",
        &json!({"city": "Lima"}),
        &message.to_string(),
    );

    // Without tools: reasoning then content, streamed.
    let greeting = &fixture.facts["sequences"][1];
    let (streamed, finish_reason) =
        chat_answer(&server, &golden_chat_request(greeting, 96, true)?)?;
    assert_eq!(finish_reason, "stop", "{streamed}");
    assert_eq!(
        reasoning(&streamed),
        Some("The user greets me."),
        "{streamed}"
    );
    assert_eq!(
        streamed["content"].as_str().map(str::trim),
        Some("Hello! How can I help you today?")
    );
    assert!(streamed["tool_calls"].as_array().is_some_and(Vec::is_empty));

    // Without tools the weather question still makes the model write a call;
    // as vLLM and SGLang serve BerryLM, it stays text: the content is what
    // the model wrote after its reasoning (the raw text `/v1/completions`
    // gives for the prompt the template renders without tools, shaped as the
    // golden sequence 0's), streamed and not, with no `tool_calls`.
    let question = "What is the weather in Oslo?";
    let raw = server.complete(
        &format!("<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n<think>\n"),
        96,
    )?;
    let (raw_reasoning, raw_content) = raw
        .split_once("</think>")
        .with_context(|| format!("no </think> in {raw:?}"))?;
    assert_eq!(raw_reasoning.trim(), WEATHER_REASONING);
    assert!(
        raw_content.contains("<function=get_weather>"),
        "{raw_content:?}"
    );
    for stream in [false, true] {
        let request = json!({
            "model": "default",
            "messages": [{"role": "user", "content": question}],
            "temperature": 0.0,
            "max_tokens": 96,
            "stream": stream,
        });
        let (message, finish_reason) = chat_answer(&server, &request)?;
        assert_eq!(finish_reason, "stop", "{message}");
        assert_eq!(reasoning(&message), Some(WEATHER_REASONING), "{message}");
        assert_eq!(
            message["content"].as_str().map(str::trim),
            Some(raw_content.trim()),
            "{message}"
        );
        assert!(
            message["tool_calls"].as_array().is_some_and(Vec::is_empty),
            "{message}"
        );
    }
    Ok(())
}

/// The official OpenAI Python client (installed by `cargo xtask test` into its
/// venv, `BERRYLM_PYTHON`) against the real server, streamed and not: the
/// golden reasoning, content and typed tool calls; `tool_choice` `none`,
/// `required`, a named function and one the request does not offer (the
/// client's 4xx); `response_format` json_schema and json_object after free
/// reasoning; `logprobs` with `top_logprobs` read through its typed objects.
#[test]
fn the_openai_python_client_gets_reasoning_tool_calls_tool_choice_structured_output_and_logprobs(
) -> Result<()> {
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

/// The tools of an MCP server named by `--mcp-config` (the stdio server
/// `tests/e2e/mcp_weather_server.py`, which offers the golden chats' two
/// tools) reach the model without the request naming them: the model calls
/// `get_weather` for Oslo, as in its golden chat, the host runs the call on
/// the MCP server, and the client gets the model's answer after the result.
#[test]
fn the_model_calls_the_tools_of_an_mcp_server() -> Result<()> {
    let python = std::env::var_os("BERRYLM_PYTHON").unwrap_or_else(|| "python3".into());
    let fixture = Fixture::load("trained-tiny")?;
    let dir = TempDir::new("berrylm-mcp")?;
    let calls = dir.0.join("calls.jsonl");
    let config = dir.0.join("mcp.json");
    let script = berrylm_tests::fixtures_dir().join("../e2e/mcp_weather_server.py");
    std::fs::write(
        &config,
        json!({
            "servers": [{
                "name": "weather",
                "source": {
                    "type": "Process",
                    "command": python.to_string_lossy(),
                    "args": [script.to_string_lossy(), calls.to_string_lossy()],
                },
                "tool_prefix": null,
            }],
            "auto_register_tools": true,
        })
        .to_string(),
    )?;
    let server = Server::start(
        &fixture.model_dir,
        &["--dtype", "f32", "--mcp-config", &config.to_string_lossy()],
    )?;

    let loaded = server.loaded_model()?;
    assert_eq!(loaded["mcp_tools_count"], json!(2), "{loaded}");

    let request = |stream: bool| {
        json!({
            "model": "default",
            "messages": [{"role": "user", "content": "What is the weather in Oslo?"}],
            "temperature": 0,
            "max_tokens": 96,
            "stream": stream,
        })
    };
    let (status, response) = server.post("/v1/chat/completions", &request(false))?;
    assert_eq!(status, 200, "{response}");
    // Streamed: the client sees the first turn's reasoning, then the answer
    // after the result; the tool call itself is not streamed to it.
    let (streamed, finish_reason) = chat_answer(&server, &request(true))?;
    let made: Vec<serde_json::Value> = std::fs::read_to_string(&calls)?
        .lines()
        .map(serde_json::from_str)
        .collect::<serde_json::Result<_>>()?;
    let weather_call = json!({"name": "get_weather", "arguments": {"city": "Oslo"}});
    assert_eq!(
        made,
        [weather_call.clone(), weather_call],
        "{response}\n{streamed}"
    );
    // The answer is the model's after the tool's result (18 degrees and
    // cloudy): the reasoning of its golden chat that has that result.
    let message = &response["choices"][0]["message"];
    assert_eq!(
        reasoning(message),
        Some("The tool says it is 18 degrees and cloudy."),
        "{response}"
    );
    for answer in [message, &streamed] {
        assert!(
            answer["content"]
                .as_str()
                .is_some_and(|content| content.contains("18 degrees and cloudy")),
            "{answer}"
        );
    }
    assert_eq!(finish_reason, "stop", "{streamed}");
    assert_eq!(streamed["tool_calls"], json!([]), "{streamed}");
    Ok(())
}
