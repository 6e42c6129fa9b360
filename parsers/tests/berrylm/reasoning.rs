//! Reasoning in the full parser (vLLM `TestReasoningNonStreaming` /
//! `TestReasoningStreaming`).

use berrylm_parsers::{AssistantMessage, Delta, ParserOptions};

use crate::support::{
    options, parse, stream_deltas, tool_call, untyped_options, WEATHER_ARGUMENTS, WEATHER_CALL,
};

/// Parses `output` and asserts its reasoning and content; returns the
/// message for further checks.
fn assert_reasoning_and_content(
    output: &str,
    options: &ParserOptions,
    reasoning: Option<&str>,
    content: Option<&str>,
) -> AssistantMessage {
    let parsed = parse(output, options);
    assert_eq!(parsed.reasoning_content.as_deref(), reasoning);
    assert_eq!(parsed.content.as_deref(), content);
    parsed
}

#[test]
fn reasoning_then_content() {
    assert_reasoning_and_content(
        "<think>Plan the answer.</think>The answer is 42.",
        &options(true),
        Some("Plan the answer."),
        Some("The answer is 42."),
    );
}

#[test]
fn template_opened_think() {
    assert_reasoning_and_content(
        "Plan the answer.</think>The answer is 42.",
        &options(true),
        Some("Plan the answer."),
        Some("The answer is 42."),
    );
}

#[test]
fn repeated_think_open_inside_reasoning_is_absorbed() {
    assert_reasoning_and_content(
        "<think>a<think>b</think>c",
        &options(true),
        Some("ab"),
        Some("c"),
    );
}

#[test]
fn duplicate_think_end_is_dropped() {
    assert_reasoning_and_content(
        "Plan.</think></think>The answer is 42.",
        &options(true),
        Some("Plan."),
        Some("The answer is 42."),
    );
}

#[test]
fn tool_call_is_an_implicit_end_of_reasoning() {
    let parsed = assert_reasoning_and_content(
        &format!("I need the forecast.{WEATHER_CALL}"),
        &options(true),
        Some("I need the forecast."),
        None,
    );
    assert_eq!(
        parsed.tool_calls,
        vec![tool_call(0, "get_weather", WEATHER_ARGUMENTS)]
    );
}

#[test]
fn thinking_disabled_gives_everything_as_content() {
    assert_reasoning_and_content(
        "The answer is 42.",
        &options(false),
        None,
        Some("The answer is 42."),
    );
}

#[test]
fn thinking_disabled_keeps_think_open_as_text_and_drops_think_end() {
    assert_reasoning_and_content(
        "<think>x</think>y",
        &options(false),
        None,
        Some("<think>xy"),
    );
}

#[test]
fn other_tags_inside_reasoning_are_reasoning_text() {
    let parsed = assert_reasoning_and_content(
        "compare a > b, then <function=f> or </tool_call></think>ok",
        &untyped_options(true),
        Some("compare a > b, then <function=f> or </tool_call>"),
        Some("ok"),
    );
    assert!(parsed.tool_calls.is_empty());
}

#[test]
fn whitespace_around_the_reasoning_end_is_kept() {
    assert_reasoning_and_content(
        "Plan.\n\n</think>\n\nAnswer",
        &options(true),
        Some("Plan.\n\n"),
        Some("\n\nAnswer"),
    );
}

#[test]
fn unfinished_reasoning_is_all_reasoning() {
    assert_reasoning_and_content(
        "Still thinking about <tool_",
        &options(true),
        Some("Still thinking about <tool_"),
        None,
    );
}

#[test]
fn streaming_reasoning_then_content() {
    let deltas = stream_deltas(
        &["Plan the ", "answer.", "</think>", "The answer", " is 42."],
        &options(true),
    );
    assert_eq!(
        deltas,
        vec![
            Delta::Reasoning("Plan the ".to_owned()),
            Delta::Reasoning("answer.".to_owned()),
            Delta::Content("The answer".to_owned()),
            Delta::Content(" is 42.".to_owned()),
        ]
    );
}

#[test]
fn think_end_and_tool_call_in_one_chunk_do_not_leak_into_reasoning() {
    let deltas = stream_deltas(
        &[
            "Let me check the forecast.",
            "</think><tool_call>",
            "<function=get_weather>",
        ],
        &options(true),
    );
    assert_eq!(
        deltas,
        vec![
            Delta::Reasoning("Let me check the forecast.".to_owned()),
            Delta::ToolCallStart {
                index: 0,
                id: crate::support::call_id(0),
                name: "get_weather".to_owned(),
            },
            Delta::ToolCallArguments {
                index: 0,
                fragment: "{}".to_owned(),
            },
        ]
    );
}
