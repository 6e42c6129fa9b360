//! Property tests: chunking never changes the result, and no input panics.

use berrylm_parsers::{
    extract_tool_calls, parse_reasoning, AssistantMessage, ParserOptions, ReasoningDelta,
    ReasoningParser, SequentialToolCallIds,
};
use proptest::prelude::*;
use serde_json::{Map, Value};

use crate::support::{options, parse, request_tools, stream, untyped_options};

/// Loose pieces: every tag, partial tags, words, whitespace and characters
/// that JSON escapes.
const PIECES: &[&str] = &[
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<function=",
    "</function>",
    "<parameter=",
    "</parameter>",
    ">",
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<tool_",
    "</para",
    "<func",
    "<",
    "get_weather",
    "city",
    "Tokyo",
    "3",
    "{",
    "}",
    "\n",
    "\n\n",
    " ",
    "\t",
    "\"",
    "\\",
    "ё",
    "日本",
    "🙂",
    "Plan.",
    "Sure, checking.",
];

const TOOL_NAMES: &[&str] = &[
    "get_weather",
    "configure",
    "write_file",
    "",
    " get_weather ",
];

const PARAMETER_KEYS: &[&str] = &[
    "city", "days", "ratio", "enabled", "limit", "options", "tags", "note", "", " city ",
];

const PARAMETER_VALUES: &[&str] = &[
    "Tokyo",
    "3",
    "-7",
    "2.5",
    "1e3",
    "true",
    "0",
    "null",
    "[\"a\", \"b\"]",
    "{\"depth\": \"2\"}",
    "{broken",
    "multi\nline",
    "\n",
    "",
    "a > b",
    "ё🙂",
    "\"quoted\" \\ back",
    "lots",
];

/// A parameter block, sometimes without its closing tag.
fn parameter() -> impl Strategy<Value = String> {
    (
        prop::sample::select(PARAMETER_KEYS),
        prop::sample::select(PARAMETER_VALUES),
        prop::bool::weighted(0.8),
        any::<bool>(),
    )
        .prop_map(|(key, value, closed, newlines)| {
            let wrap = if newlines { "\n" } else { "" };
            let close = if closed { "</parameter>\n" } else { "" };
            format!("<parameter={key}>{wrap}{value}{wrap}{close}")
        })
}

/// A tool call, sometimes without `<tool_call>` or its closing tags.
fn tool_call_text() -> impl Strategy<Value = String> {
    (
        prop::bool::weighted(0.8),
        prop::sample::select(TOOL_NAMES),
        prop::collection::vec(parameter(), 0..4),
        prop::bool::weighted(0.8),
    )
        .prop_map(|(wrapped, name, parameters, closed)| {
            let mut text = String::new();
            if wrapped {
                text.push_str("<tool_call>\n");
            }
            text.push_str(&format!("<function={name}>\n"));
            text.push_str(&parameters.concat());
            if closed {
                text.push_str("</function>\n");
                if wrapped {
                    text.push_str("</tool_call>");
                }
            }
            text
        })
}

/// BerryLM-like output: tool calls mixed with loose pieces.
fn output_text() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop_oneof![
            3 => prop::sample::select(PIECES).prop_map(str::to_owned),
            2 => tool_call_text(),
        ],
        0..16,
    )
    .prop_map(|pieces| pieces.concat())
}

fn any_text() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<String>(),
        output_text(),
        (output_text(), any::<String>(), output_text()).prop_map(|(a, b, c)| a + &b + &c),
    ]
}

/// Splits `text` at the given char positions (taken modulo the length).
fn chunk(text: &str, cuts: &[usize]) -> Vec<String> {
    let boundaries: Vec<usize> = text.char_indices().map(|(index, _)| index).collect();
    let mut positions: Vec<usize> = cuts
        .iter()
        .filter_map(|cut| boundaries.get(cut % boundaries.len().max(1)).copied())
        .collect();
    positions.push(0);
    positions.push(text.len());
    positions.sort_unstable();
    positions.dedup();
    positions
        .windows(2)
        .map(|pair| text[pair[0]..pair[1]].to_owned())
        .collect()
}

/// Cut positions for [`chunk`] (up to 11, any values).
fn cuts() -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(any::<usize>(), 0..12)
}

/// `stream` of `text` cut into chunks at `cuts` (see [`chunk`]).
fn stream_chunked(text: &str, cuts: &[usize], options: &ParserOptions) -> AssistantMessage {
    let chunks = chunk(text, cuts);
    let chunk_refs: Vec<&str> = chunks.iter().map(String::as_str).collect();
    stream(&chunk_refs, options)
}

fn parser_options(thinking_enabled: bool, typed: bool) -> ParserOptions {
    if typed {
        options(thinking_enabled)
    } else {
        untyped_options(thinking_enabled)
    }
}

/// [`parser_options`] of any `thinking_enabled` and `typed`.
fn any_parser_options() -> impl Strategy<Value = ParserOptions> {
    any::<(bool, bool)>()
        .prop_map(|(thinking_enabled, typed)| parser_options(thinking_enabled, typed))
}

proptest! {
    #[test]
    fn any_chunking_gives_the_non_streaming_result(
        text in output_text(),
        cuts in cuts(),
        options in any_parser_options(),
    ) {
        let expected = parse(&text, &options);
        prop_assert_eq!(stream_chunked(&text, &cuts, &options), expected.clone());
        for call in &expected.tool_calls {
            prop_assert!(
                serde_json::from_str::<Map<String, Value>>(&call.arguments).is_ok(),
                "arguments are a JSON object: {}", call.arguments
            );
        }
    }

    #[test]
    fn reasoning_parser_ignores_chunking(
        text in output_text(),
        cuts in cuts(),
        thinking_enabled in any::<bool>(),
    ) {
        let mut parser = ReasoningParser::new(thinking_enabled);
        let mut reasoning = String::new();
        let mut content = String::new();
        let chunks = chunk(&text, &cuts);
        let mut deltas: Vec<ReasoningDelta> =
            chunks.iter().flat_map(|piece| parser.push(piece)).collect();
        deltas.extend(parser.finish());
        for delta in deltas {
            match delta {
                ReasoningDelta::Reasoning(text) => reasoning.push_str(&text),
                ReasoningDelta::Content(text) => content.push_str(&text),
            }
        }
        let whole = parse_reasoning(&text, thinking_enabled);
        prop_assert_eq!(whole.reasoning.unwrap_or_default(), reasoning);
        prop_assert_eq!(whole.content.unwrap_or_default(), content);
    }

    #[test]
    fn no_input_panics(
        text in any_text(),
        cuts in cuts(),
        options in any_parser_options(),
    ) {
        prop_assert_eq!(stream_chunked(&text, &cuts, &options), parse(&text, &options));
        parse_reasoning(&text, options.thinking_enabled);
        extract_tool_calls(&text, &request_tools(), SequentialToolCallIds::default());
    }

    #[test]
    fn string_values_round_trip(value in "[^<]*", typed in any::<bool>()) {
        let output = format!(
            "<tool_call>\n<function=get_weather>\n<parameter=city>\n{value}\n</parameter>\n\
             </function>\n</tool_call>"
        );
        let parsed = parse(&output, &parser_options(false, typed));
        prop_assert_eq!(parsed.tool_calls.len(), 1);
        let arguments: Map<String, Value> =
            serde_json::from_str(&parsed.tool_calls[0].arguments).unwrap_or_default();
        prop_assert_eq!(arguments.get("city"), Some(&Value::String(value)));
    }
}
