//! The checkpoint's chat template, rendered by the real server, gives exactly
//! the prompts transformers renders (`rendered_prompt` in trained-tiny's
//! golden.json): Python's `tojson` spacing, tool schemas in the client's key
//! order, history tool-call arguments as mappings, history `reasoning_content`.
//! And the model's own reasoning followed by parallel tool calls forced by a
//! grammar (which applies after the reasoning) come back as
//! `reasoning_content` and schema-typed `tool_calls`, streamed and not.

use anyhow::{Context, Result};
use berrylm_tests::chat::{
    arguments, assert_call, chat_answer, function_call_items, golden_chat_request, reasoning,
    responses_answer, tool_call_message,
};
use berrylm_tests::server::Server;
use berrylm_tests::Fixture;
use serde_json::{json, Value};

#[test]
fn the_server_renders_every_golden_prompt_exactly_as_transformers() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let server = Server::start(&fixture.model_dir, &["--dtype", "f32"])?;
    let sequences = fixture.facts["sequences"].as_array().context("sequences")?;
    for sequence in sequences {
        let index = &sequence["index"];
        let (status, response) = server.post(
            "/v1/chat/completions",
            &golden_chat_request(sequence, 1, false)?,
        )?;
        assert_eq!(status, 200, "sequence {index}: {response}");
        let rendered = sequence["rendered_prompt"]
            .as_str()
            .context("rendered_prompt")?;
        let logged = format!("prompt={rendered:?}");
        assert!(
            server.log().contains(&logged),
            "sequence {index}: the server did not render {rendered:?}"
        );
        assert_eq!(
            response["usage"]["prompt_tokens"], sequence["len"],
            "sequence {index}: prompt length in tokens"
        );
    }

    // The conversation with a tool call and its result in the history: the
    // model answers from the tool's output as the reference did.
    let history = &sequences[4];
    let (message, _) = chat_answer(&server, &golden_chat_request(history, 64, false)?)?;
    assert_eq!(
        reasoning(&message),
        Some("The tool says it is 18 degrees and cloudy."),
        "{message}"
    );
    assert_eq!(
        message["content"].as_str().map(str::trim),
        Some("In Paris it is 18 degrees and cloudy."),
        "{message}"
    );
    Ok(())
}

/// Token ids of the special tokens the grammar emits (trained-tiny's tokenizer).
const TOOL_CALL: u32 = 5;
const TOOL_CALL_END: u32 = 6;
const IM_END: u32 = 2;

/// A lark grammar that admits exactly one answer after the reasoning (which
/// a grammar leaves free when the template opened `<think>`): two parallel
/// calls whose values need the schema to be typed.
fn pinned_output_grammar() -> String {
    let call = |name: &str, parameters: &[(&str, &str)]| {
        let mut text = format!("\\n<function={name}>\\n");
        for (key, value) in parameters {
            text.push_str(&format!("<parameter={key}>\\n{value}\\n</parameter>\\n"));
        }
        text.push_str("</function>\\n");
        format!("<[{TOOL_CALL}]> \"{text}\" <[{TOOL_CALL_END}]>")
    };
    format!(
        "start: \"\\n\\n\" {} \"\\n\" {} <[{IM_END}]>",
        call("get_weather", &[("city", "Oslo"), ("days", "3")]),
        call("get_time", &[("city", "Lima")]),
    )
}

fn pinned_request(fixture: &Fixture, stream: bool) -> Value {
    let mut request = free_request(fixture, stream);
    request["grammar"] = json!({"type": "lark", "value": pinned_output_grammar()});
    request
}

fn free_request(fixture: &Fixture, stream: bool) -> Value {
    json!({
        "model": "default",
        "messages": [{"role": "user", "content": "Weather in Oslo for 3 days, and the time in Lima?"}],
        "tools": fixture.facts["sequences"][2]["tools"],
        "temperature": 0.0,
        "max_tokens": 128,
        "stream": stream,
    })
}

#[test]
fn a_pinned_output_gives_reasoning_and_typed_parallel_tool_calls() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let server = Server::start(&fixture.model_dir, &["--dtype", "f32"])?;
    let expected_calls = [
        ("get_weather", json!({"city": "Oslo", "days": 3})),
        ("get_time", json!({"city": "Lima"})),
    ];

    // The reasoning the model writes by itself, which the grammar leaves as is.
    let (status, free) = server.post("/v1/chat/completions", &free_request(&fixture, false))?;
    assert_eq!(status, 200, "{free}");
    let free_reasoning = reasoning(&free["choices"][0]["message"])
        .filter(|text| !text.is_empty())
        .context("the free answer has no reasoning")?
        .to_string();

    let (status, response) =
        server.post("/v1/chat/completions", &pinned_request(&fixture, false))?;
    let message = tool_call_message(status, &response, &free_reasoning);
    let calls = message["tool_calls"].as_array().context("tool_calls")?;
    assert_eq!(calls.len(), expected_calls.len(), "{response}");
    for (call, (name, args)) in calls.iter().zip(&expected_calls) {
        assert_eq!(call["type"], json!("function"));
        assert_eq!(call["function"]["name"], json!(name), "{response}");
        assert_eq!(
            arguments(&call["function"]["arguments"]),
            *args,
            "{response}"
        );
    }

    let (streamed, finish_reason) = chat_answer(&server, &pinned_request(&fixture, true))?;
    let context = streamed.to_string();
    assert_eq!(finish_reason, "tool_calls", "{context}");
    assert_eq!(
        reasoning(&streamed),
        Some(free_reasoning.as_str()),
        "{context}"
    );
    let calls = streamed["tool_calls"].as_array().context("tool_calls")?;
    assert_eq!(calls.len(), expected_calls.len(), "{context}");
    for (call, (name, args)) in calls.iter().zip(&expected_calls) {
        assert_call(call, name, args, &context);
    }
    Ok(())
}

/// `parallel_tool_calls: false` (OpenAI's, which LangChain's and the Agents
/// SDK's tool binding send): an answer that calls two tools (the pinned
/// output) returns its first call only, as vLLM does, through chat
/// completions and the Responses API, streamed and not; without it both.
#[test]
fn parallel_tool_calls_false_returns_the_first_call_only() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let server = Server::start(&fixture.model_dir, &["--dtype", "f32"])?;
    for stream in [false, true] {
        for parallel in [None, Some(false)] {
            let expected: &[&str] = match parallel {
                Some(false) => &["get_weather"],
                _ => &["get_weather", "get_time"],
            };
            let mut chat = pinned_request(&fixture, stream);
            let mut responses = json!({
                "model": "default",
                "input": chat["messages"],
                "tools": chat["tools"],
                "grammar": chat["grammar"],
                "temperature": 0.0,
                "max_output_tokens": 128,
                "stream": stream,
            });
            if let Some(parallel) = parallel {
                chat["parallel_tool_calls"] = json!(parallel);
                responses["parallel_tool_calls"] = json!(parallel);
            }
            let context = format!("stream {stream}, parallel_tool_calls {parallel:?}");

            let (message, finish_reason) = chat_answer(&server, &chat)?;
            assert_eq!(finish_reason, "tool_calls", "{context}: {message}");
            let names: Vec<&str> = message["tool_calls"]
                .as_array()
                .context("tool_calls")?
                .iter()
                .filter_map(|call| call["name"].as_str())
                .collect();
            assert_eq!(names, expected, "{context}: {message}");

            let response = responses_answer(&server, &responses)?;
            let names: Vec<&str> = function_call_items(&response)
                .into_iter()
                .filter_map(|item| item["name"].as_str())
                .collect();
            assert_eq!(names, expected, "{context}: {response}");
        }
    }
    Ok(())
}

/// `chat_template_kwargs: {"enable_thinking": false}` (vLLM's and SGLang's
/// way, which their users send) renders golden sequence 3 as the reference
/// did with thinking disabled, as the top-level `enable_thinking` does; a
/// variable the template is not given, a value that is not a boolean or two
/// that disagree are refused with a 422 naming them, not ignored.
#[test]
fn chat_template_kwargs_disable_thinking_as_the_reference_rendered_it() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let server = Server::start(&fixture.model_dir, &["--dtype", "f32"])?;
    let sequence = &fixture.facts["sequences"][3];
    assert_eq!(sequence["enable_thinking"], json!(false));
    let mut request = golden_chat_request(sequence, 1, false)?;
    request
        .as_object_mut()
        .context("request")?
        .remove("enable_thinking");
    request["chat_template_kwargs"] = json!({"enable_thinking": false});
    let (status, response) = server.post("/v1/chat/completions", &request)?;
    assert_eq!(status, 200, "{response}");
    let rendered = sequence["rendered_prompt"]
        .as_str()
        .context("rendered_prompt")?;
    assert!(
        server.log().contains(&format!("prompt={rendered:?}")),
        "the server did not render {rendered:?}"
    );
    assert_eq!(response["usage"]["prompt_tokens"], sequence["len"]);

    for (kwargs, top_level, named) in [
        (json!({"thinking": false}), None, "`thinking`"),
        (json!({"enable_thinking": "no"}), None, "must be a boolean"),
        (json!({"enable_thinking": false}), Some(true), "disagree"),
    ] {
        let mut refused = request.clone();
        refused["chat_template_kwargs"] = kwargs;
        if let Some(top_level) = top_level {
            refused["enable_thinking"] = json!(top_level);
        }
        server.assert_unprocessable("/v1/chat/completions", &refused, named)?;
    }
    Ok(())
}
