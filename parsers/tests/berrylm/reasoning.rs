//! Reasoning in the full parser (vLLM `TestReasoningNonStreaming` /
//! `TestReasoningStreaming`).

use berrylm_parsers::Delta;

use crate::support::{
    options, parse, stream_deltas, tool_call, untyped_options, WEATHER_ARGUMENTS, WEATHER_CALL,
};

#[test]
fn reasoning_then_content() {
    let parsed = parse(
        "<think>Plan the answer.</think>The answer is 42.",
        &options(true),
    );
    assert_eq!(
        parsed.reasoning_content.as_deref(),
        Some("Plan the answer.")
    );
    assert_eq!(parsed.content.as_deref(), Some("The answer is 42."));
}

#[test]
fn template_opened_think() {
    let parsed = parse("Plan the answer.</think>The answer is 42.", &options(true));
    assert_eq!(
        parsed.reasoning_content.as_deref(),
        Some("Plan the answer.")
    );
    assert_eq!(parsed.content.as_deref(), Some("The answer is 42."));
}

#[test]
fn repeated_think_open_inside_reasoning_is_absorbed() {
    let parsed = parse("<think>a<think>b</think>c", &options(true));
    assert_eq!(parsed.reasoning_content.as_deref(), Some("ab"));
    assert_eq!(parsed.content.as_deref(), Some("c"));
}

#[test]
fn duplicate_think_end_is_dropped() {
    let parsed = parse("Plan.</think></think>The answer is 42.", &options(true));
    assert_eq!(parsed.reasoning_content.as_deref(), Some("Plan."));
    assert_eq!(parsed.content.as_deref(), Some("The answer is 42."));
}

#[test]
fn tool_call_is_an_implicit_end_of_reasoning() {
    let parsed = parse(
        &format!("I need the forecast.{WEATHER_CALL}"),
        &options(true),
    );
    assert_eq!(
        parsed.reasoning_content.as_deref(),
        Some("I need the forecast.")
    );
    assert_eq!(parsed.content, None);
    assert_eq!(
        parsed.tool_calls,
        vec![tool_call(0, "get_weather", WEATHER_ARGUMENTS)]
    );
}

#[test]
fn thinking_disabled_gives_everything_as_content() {
    let parsed = parse("The answer is 42.", &options(false));
    assert_eq!(parsed.reasoning_content, None);
    assert_eq!(parsed.content.as_deref(), Some("The answer is 42."));
}

#[test]
fn thinking_disabled_keeps_think_open_as_text_and_drops_think_end() {
    let parsed = parse("<think>x</think>y", &options(false));
    assert_eq!(parsed.reasoning_content, None);
    assert_eq!(parsed.content.as_deref(), Some("<think>xy"));
}

#[test]
fn other_tags_inside_reasoning_are_reasoning_text() {
    let parsed = parse(
        "compare a > b, then <function=f> or </tool_call></think>ok",
        &untyped_options(true),
    );
    assert_eq!(
        parsed.reasoning_content.as_deref(),
        Some("compare a > b, then <function=f> or </tool_call>")
    );
    assert_eq!(parsed.content.as_deref(), Some("ok"));
    assert!(parsed.tool_calls.is_empty());
}

#[test]
fn whitespace_around_the_reasoning_end_is_kept() {
    let parsed = parse("Plan.\n\n</think>\n\nAnswer", &options(true));
    assert_eq!(parsed.reasoning_content.as_deref(), Some("Plan.\n\n"));
    assert_eq!(parsed.content.as_deref(), Some("\n\nAnswer"));
}

#[test]
fn unfinished_reasoning_is_all_reasoning() {
    let parsed = parse("Still thinking about <tool_", &options(true));
    assert_eq!(
        parsed.reasoning_content.as_deref(),
        Some("Still thinking about <tool_")
    );
    assert_eq!(parsed.content, None);
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
