//! Tool calls (vLLM `TestToolCalls`), with thinking disabled so that the
//! output starts in the content, as vLLM's tool parser does.

use berrylm_parsers::{
    extract_tool_calls, parse_reasoning, ExtractedToolCalls, ParserOptions, SequentialToolCallIds,
};
use serde_json::{json, Value};

use crate::support::{
    message, options, parse, request_tools, tool_call, untyped_options, WEATHER_ARGUMENTS,
    WEATHER_CALL,
};

fn arguments_of(options: &ParserOptions, output: &str) -> Vec<Value> {
    parse(output, options)
        .tool_calls
        .iter()
        .map(|call| serde_json::from_str(&call.arguments).unwrap_or(Value::Null))
        .collect()
}

/// Asserts that `output`, parsed without tool schemas, holds one call whose
/// arguments are `expected`.
fn assert_untyped_arguments(output: &str, expected: Value) {
    assert_eq!(
        arguments_of(&untyped_options(false), output),
        vec![expected]
    );
}

/// Asserts that `output` (thinking disabled) parses to the content `content`
/// alone.
fn assert_content_only(output: &str, content: &str) {
    assert_eq!(
        parse(output, &options(false)),
        message(None, Some(content), Vec::new())
    );
}

#[test]
fn single_call_with_typed_arguments() {
    let parsed = parse(WEATHER_CALL, &options(false));
    assert_eq!(
        parsed,
        message(
            None,
            None,
            vec![tool_call(0, "get_weather", WEATHER_ARGUMENTS)]
        )
    );
    assert_eq!(
        arguments_of(&options(false), WEATHER_CALL),
        vec![json!({"city": "Tokyo", "days": 3})]
    );
}

#[test]
fn content_before_the_call_is_kept() {
    let parsed = parse(
        &format!("Checking the forecast.\n{WEATHER_CALL}"),
        &options(false),
    );
    assert_eq!(parsed.content.as_deref(), Some("Checking the forecast."));
    assert_eq!(parsed.tool_calls.len(), 1);
}

#[test]
fn no_call() {
    assert_content_only("Just an answer.", "Just an answer.");
}

#[test]
fn parallel_calls() {
    let output = format!(
        "{WEATHER_CALL}\n<tool_call>\n<function=get_weather>\n\
         <parameter=city>Osaka</parameter>\n</function>\n</tool_call>"
    );
    let parsed = parse(&output, &options(false));
    assert_eq!(
        parsed.tool_calls,
        vec![
            tool_call(0, "get_weather", WEATHER_ARGUMENTS),
            tool_call(1, "get_weather", r#"{"city": "Osaka"}"#),
        ]
    );
    assert_eq!(parsed.content, None);
}

#[test]
fn consecutive_functions_without_tool_call_close() {
    let parsed = parse(
        "<tool_call>\n<function=a>\n</function>\n<function=b>\n</function>",
        &untyped_options(false),
    );
    assert_eq!(
        parsed.tool_calls,
        vec![tool_call(0, "a", "{}"), tool_call(1, "b", "{}")]
    );
}

#[test]
fn multi_line_value() {
    let output = "<tool_call>\n<function=write_file>\n\
                  <parameter=path>/tmp/x.py</parameter>\n\
                  <parameter=content>\nline 1\nline 2\n</parameter>\n\
                  </function>\n</tool_call>";
    assert_untyped_arguments(
        output,
        json!({"path": "/tmp/x.py", "content": "line 1\nline 2"}),
    );
}

#[test]
fn only_one_newline_is_stripped_on_each_side() {
    let output = "<function=f>\n<parameter=text>\n\n  x  \n\n</parameter>\n</function>";
    assert_untyped_arguments(output, json!({"text": "\n  x  \n"}));
}

#[test]
fn malformed_function_header_does_not_drop_siblings() {
    let output = format!("<tool_call>\n<function=broken</function>\n</tool_call>{WEATHER_CALL}");
    let parsed = parse(&output, &options(false));
    assert_eq!(
        parsed.tool_calls,
        vec![
            tool_call(0, "broken", "{}"),
            tool_call(1, "get_weather", WEATHER_ARGUMENTS),
        ]
    );
}

#[test]
fn nameless_calls_are_ignored() {
    let output = format!("<tool_call>\n<function=>\n<parameter=x>1</parameter>\n</function>\n</tool_call>\n<tool_call></tool_call>{WEATHER_CALL}");
    assert_eq!(
        parse(&output, &options(false)).tool_calls,
        vec![tool_call(0, "get_weather", WEATHER_ARGUMENTS)]
    );
}

#[test]
fn function_without_tool_call_starts_a_call() {
    let parsed = parse(
        "Sure.\n<function=get_weather>\n<parameter=city>Paris</parameter>\n</function>",
        &options(false),
    );
    assert_eq!(
        parsed,
        message(
            None,
            Some("Sure."),
            vec![tool_call(0, "get_weather", r#"{"city": "Paris"}"#)]
        )
    );
}

#[test]
fn parameters_closed_by_the_next_parameter_and_by_function_end() {
    let output = "<tool_call>\n<function=get_weather>\n<parameter=days>\n5\n\
                  <parameter=city>\nRome\n</function>\n</tool_call>";
    assert_eq!(
        parse(output, &options(false)).tool_calls,
        vec![tool_call(
            0,
            "get_weather",
            r#"{"days": 5, "city": "Rome"}"#
        )]
    );
}

#[test]
fn arguments_are_typed_by_the_schema() {
    let output = "<tool_call>\n<function=configure>\n\
                  <parameter=ratio>0.5</parameter>\n\
                  <parameter=enabled>true</parameter>\n\
                  <parameter=limit>null</parameter>\n\
                  <parameter=options>{\"depth\": \"2\"}</parameter>\n\
                  <parameter=tags>[\"a\", \"b\"]</parameter>\n\
                  <parameter=note>42</parameter>\n\
                  </function>\n</tool_call>";
    assert_eq!(
        parse(output, &options(false)).tool_calls,
        vec![tool_call(
            0,
            "configure",
            r#"{"ratio": 0.5, "enabled": true, "limit": null, "options": {"depth": 2}, "tags": ["a", "b"], "note": "42"}"#
        )]
    );
}

#[test]
fn failed_conversions_stay_strings() {
    let output = "<function=configure>\n<parameter=enabled>maybe</parameter>\n\
                  <parameter=limit>lots</parameter>\n<parameter=ratio>1.0</parameter>\n</function>";
    assert_eq!(
        parse(output, &options(false)).tool_calls,
        vec![tool_call(
            0,
            "configure",
            r#"{"enabled": "maybe", "limit": "lots", "ratio": 1}"#
        )]
    );
}

#[test]
fn unknown_tools_and_parameters_give_strings() {
    let output = "<function=get_weather>\n<parameter=units>3</parameter>\n</function>\
                  <function=other>\n<parameter=days>3</parameter>\n</function>";
    assert_eq!(
        parse(output, &options(false)).tool_calls,
        vec![
            tool_call(0, "get_weather", r#"{"units": "3"}"#),
            tool_call(1, "other", r#"{"days": "3"}"#),
        ]
    );
}

#[test]
fn tags_and_symbols_inside_values_are_kept() {
    let output = "<function=run>\n<parameter=code>\nif a > b:\n    print(\"<think>\", '\\\\')\n</parameter>\n</function>";
    assert_untyped_arguments(
        output,
        json!({"code": "if a > b:\n    print(\"<think>\", '\\\\')"}),
    );
}

#[test]
fn text_around_calls() {
    let output = format!(" \n{WEATHER_CALL}\n\nDone.\n");
    assert_eq!(
        parse(&output, &options(false)).content.as_deref(),
        Some("Done.")
    );
    let only_whitespace = format!("\n{WEATHER_CALL}\n");
    assert_eq!(parse(&only_whitespace, &options(false)).content, None);
    let noise = "<tool_call>noise<function=f>\n</function>noise</tool_call>";
    assert_eq!(
        parse(noise, &untyped_options(false)),
        message(None, None, vec![tool_call(0, "f", "{}")])
    );
}

#[test]
fn unfinished_calls_are_closed_at_the_end_of_the_output() {
    assert_eq!(
        parse(
            "<tool_call>\n<function=get_weather>\n<parameter=city>Tok",
            &options(false)
        )
        .tool_calls,
        vec![tool_call(0, "get_weather", r#"{"city": "Tok"}"#)]
    );
    assert_eq!(
        parse("<tool_call>\n<function=get_wea", &options(false)).tool_calls,
        vec![tool_call(0, "get_wea", "{}")]
    );
}

#[test]
fn turn_markers_are_dropped() {
    assert_content_only("Answer.<|im_end|>", "Answer.");
}

#[test]
fn extract_tool_calls_parses_content() {
    let extracted = extract_tool_calls(
        &format!("Checking.</think>\n{WEATHER_CALL}"),
        &request_tools(),
        SequentialToolCallIds::default(),
    );
    assert_eq!(
        extracted,
        ExtractedToolCalls {
            content: Some("Checking.".to_owned()),
            tool_calls: vec![tool_call(0, "get_weather", WEATHER_ARGUMENTS)],
        }
    );
}

#[test]
fn end_to_end_reasoning_then_tool_parser() {
    let split = parse_reasoning(
        &format!("<think>Plan the call.</think>{WEATHER_CALL}"),
        true,
    );
    assert_eq!(split.reasoning.as_deref(), Some("Plan the call."));
    let remaining = split.content.unwrap_or_default();
    let extracted = extract_tool_calls(
        &remaining,
        &request_tools(),
        SequentialToolCallIds::default(),
    );
    assert_eq!(
        extracted.tool_calls,
        vec![tool_call(0, "get_weather", WEATHER_ARGUMENTS)]
    );
}

#[test]
fn ids_come_from_the_injected_source() {
    let mut counter = 100;
    struct Counter<'a>(&'a mut u32);
    impl berrylm_parsers::ToolCallIdSource for Counter<'_> {
        fn next_id(&mut self) -> String {
            *self.0 += 1;
            format!("id-{}", self.0)
        }
    }
    let parsed = berrylm_parsers::parse_message(
        &format!("{WEATHER_CALL}{WEATHER_CALL}"),
        &options(false),
        Counter(&mut counter),
    );
    let ids: Vec<&str> = parsed
        .tool_calls
        .iter()
        .map(|call| call.id.as_str())
        .collect();
    assert_eq!(ids, vec!["id-101", "id-102"]);
}
