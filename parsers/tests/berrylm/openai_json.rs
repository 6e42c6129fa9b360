//! OpenAI-shaped JSON output.

use berrylm_parsers::Delta;
use serde_json::json;

use crate::support::{message, options, parse, tool_call, WEATHER_CALL};

fn to_json<T: serde::Serialize>(value: &T) -> serde_json::Value {
    serde_json::to_value(value).unwrap_or_default()
}

#[test]
fn message_with_reasoning_and_tool_calls() {
    let parsed = parse(&format!("Plan.</think>{WEATHER_CALL}"), &options(true));
    assert_eq!(
        to_json(&parsed),
        json!({
            "role": "assistant",
            "content": null,
            "reasoning_content": "Plan.",
            "tool_calls": [{
                "id": "call_000000000000000000000000",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": "{\"city\": \"Tokyo\", \"days\": 3}"
                }
            }]
        })
    );
}

#[test]
fn plain_message_leaves_out_absent_parts() {
    assert_eq!(
        to_json(&message(None, Some("Hi."), Vec::new())),
        json!({"role": "assistant", "content": "Hi."})
    );
    assert_eq!(
        to_json(&message(None, None, Vec::new())),
        json!({"role": "assistant", "content": null})
    );
}

#[test]
fn tool_call_shape() {
    assert_eq!(
        to_json(&tool_call(1, "f", "{}")),
        json!({
            "id": "call_000000000000000000000001",
            "type": "function",
            "function": {"name": "f", "arguments": "{}"}
        })
    );
}

#[test]
fn delta_shapes() {
    assert_eq!(
        to_json(&Delta::Reasoning("r".to_owned())),
        json!({"reasoning_content": "r"})
    );
    assert_eq!(
        to_json(&Delta::Content("c".to_owned())),
        json!({"content": "c"})
    );
    assert_eq!(
        to_json(&Delta::ToolCallStart {
            index: 0,
            id: "call_x".to_owned(),
            name: "f".to_owned(),
        }),
        json!({"tool_calls": [{
            "index": 0,
            "id": "call_x",
            "type": "function",
            "function": {"name": "f", "arguments": ""}
        }]})
    );
    assert_eq!(
        to_json(&Delta::ToolCallArguments {
            index: 2,
            fragment: "{\"a".to_owned(),
        }),
        json!({"tool_calls": [{"index": 2, "function": {"arguments": "{\"a"}}]})
    );
}
