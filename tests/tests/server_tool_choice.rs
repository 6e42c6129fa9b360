//! OpenAI `tool_choice` through the real server, streamed and not:
//! `required` and a named function force a call in BerryLM's tool-call XML
//! (after the reasoning when thinking is on) to an offered tool with
//! arguments typed by its schema, even where the trained tiny model would not
//! call that tool by itself; `none` returns no tool calls; a named function
//! the request does not offer, or `required` without tools, is refused.

use anyhow::{Context, Result};
use berrylm_tests::chat::{
    arguments, assert_golden_weather_call, chat_answer, golden_chat_request, reasoning,
};
use berrylm_tests::server::Server;
use berrylm_tests::Fixture;
use serde_json::{json, Value};

const CHAT: &str = "/v1/chat/completions";

/// The golden weather question, which the model answers by reasoning
/// "The user asks about the weather in Oslo. I should call get_weather." and
/// calling `get_weather` (trained-tiny's golden sequence 2).
const WEATHER_REASONING: &str =
    "The user asks about the weather in Oslo. I should call get_weather.";

/// Checks one call against the golden tools' schemas (`get_weather`: a
/// string `city`, required, and an integer `days`; `get_time`: a string
/// `city`, required) and returns its name.
fn assert_typed_call(call: &Value, context: &str) -> String {
    assert!(
        call["id"].as_str().is_some_and(|id| !id.is_empty()),
        "{context}"
    );
    let name = call["name"].as_str().unwrap_or_default().to_string();
    let arguments = arguments(&call["arguments"]);
    let object = arguments
        .as_object()
        .unwrap_or_else(|| panic!("arguments are not a JSON object: {context}"));
    assert!(
        object
            .get("city")
            .and_then(Value::as_str)
            .is_some_and(|city| !city.is_empty()),
        "{context}"
    );
    match name.as_str() {
        "get_weather" => {
            for key in object.keys() {
                assert!(["city", "days"].contains(&key.as_str()), "{context}");
            }
            if let Some(days) = object.get("days") {
                assert!(days.is_i64(), "days is not an integer: {context}");
            }
        }
        "get_time" => assert_eq!(object.len(), 1, "{context}"),
        other => panic!("a call to {other:?}, which is not offered: {context}"),
    }
    name
}

fn with_tool_choice(mut request: Value, tool_choice: Value, stream: bool) -> Value {
    request["tool_choice"] = tool_choice;
    request["stream"] = json!(stream);
    request
}

#[test]
fn required_and_named_force_a_typed_call_to_an_offered_tool() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let server = Server::start(&fixture.model_dir, &["--dtype", "f32"])?;
    let weather = golden_chat_request(&fixture.facts["sequences"][2], 160, false)?;
    let tools = weather["tools"].clone();

    // "Hello!" with tools: by itself the model only greets.
    let mut hello = golden_chat_request(&fixture.facts["sequences"][1], 160, false)?;
    hello["tools"] = tools.clone();
    let (free, finish_reason) = chat_answer(&server, &hello)?;
    assert_eq!(finish_reason, "stop", "{free}");
    assert_eq!(free["tool_calls"], json!([]), "{free}");

    for thinking in [true, false] {
        for stream in [false, true] {
            let mut request = with_tool_choice(hello.clone(), json!("required"), stream);
            if !thinking {
                request["enable_thinking"] = json!(false);
            }
            let (message, finish_reason) = chat_answer(&server, &request)?;
            let context = format!("required, thinking {thinking}, stream {stream}: {message}");
            assert_eq!(finish_reason, "tool_calls", "{context}");
            assert_eq!(
                message["reasoning_content"].is_null(),
                !thinking,
                "{context}"
            );
            let calls = message["tool_calls"].as_array().context("tool_calls")?;
            assert!(!calls.is_empty(), "{context}");
            for call in calls {
                assert_typed_call(call, &context);
            }
        }
    }

    // The weather question names get_time: the model reasons as it would
    // (towards get_weather) and then calls get_time. The time question
    // without thinking names get_weather.
    let time = golden_chat_request(&fixture.facts["sequences"][3], 160, false)?;
    assert_eq!(time["enable_thinking"], json!(false));
    let named_cases = [
        (&weather, "get_time", Some(WEATHER_REASONING)),
        (&time, "get_weather", None),
    ];
    for (request, named, expected_reasoning) in named_cases {
        let tool_choice = json!({"type": "function", "function": {"name": named}});
        for stream in [false, true] {
            let (message, finish_reason) = chat_answer(
                &server,
                &with_tool_choice(request.clone(), tool_choice.clone(), stream),
            )?;
            let context = format!("named {named}, stream {stream}: {message}");
            assert_eq!(finish_reason, "tool_calls", "{context}");
            if let Some(expected) = expected_reasoning {
                assert_eq!(reasoning(&message), Some(expected), "{context}");
            }
            let calls = message["tool_calls"].as_array().context("tool_calls")?;
            assert_eq!(calls.len(), 1, "{context}");
            assert_eq!(assert_typed_call(&calls[0], &context), named);
        }
    }

    // `auto` is the model's own choice: the golden get_weather call.
    let (message, finish_reason) =
        chat_answer(&server, &with_tool_choice(weather, json!("auto"), false))?;
    assert_golden_weather_call(&message, &finish_reason);
    Ok(())
}

#[test]
fn tool_choice_none_returns_no_tool_calls() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let server = Server::start(&fixture.model_dir, &["--dtype", "f32"])?;
    // Questions the model answers with a call by itself (golden sequences 2
    // and 3: thinking on and off).
    for sequence in [2, 3] {
        let golden = golden_chat_request(&fixture.facts["sequences"][sequence], 96, false)?;
        for stream in [false, true] {
            let (message, finish_reason) = chat_answer(
                &server,
                &with_tool_choice(golden.clone(), json!("none"), stream),
            )?;
            let context = format!("sequence {sequence}, stream {stream}: {message}");
            assert_eq!(message["tool_calls"], json!([]), "{context}");
            assert_ne!(finish_reason, "tool_calls", "{context}");
            if sequence == 2 {
                assert_eq!(reasoning(&message), Some(WEATHER_REASONING), "{context}");
            }
        }
    }
    Ok(())
}

#[test]
fn a_tool_choice_the_request_cannot_honour_is_refused_naming_it() -> Result<()> {
    let fixture = Fixture::load("trained-tiny")?;
    let server = Server::start(&fixture.model_dir, &["--dtype", "f32"])?;
    let weather = golden_chat_request(&fixture.facts["sequences"][2], 16, false)?;
    let mut without_tools = weather.clone();
    without_tools
        .as_object_mut()
        .context("request")?
        .remove("tools");
    let get_stock = json!({"type": "function", "function": {"name": "get_stock"}});
    let cases = [
        (weather.clone(), get_stock.clone(), "get_stock"),
        (without_tools.clone(), get_stock, "get_stock"),
        (without_tools, json!("required"), "required"),
    ];
    for (request, tool_choice, named) in cases {
        for stream in [false, true] {
            let body = with_tool_choice(request.clone(), tool_choice.clone(), stream);
            let what = format!("{tool_choice}, stream {stream}");
            server.assert_rejected(CHAT, &body.to_string(), named, &what)?;
        }
    }
    // The server still answers.
    let (status, response) = server.post(CHAT, &weather)?;
    assert_eq!(status, 200, "{response}");
    Ok(())
}
