//! Streaming: deltas, argument fragments, and agreement with the
//! non-streaming parse for fixed chunkings.

use berrylm_parsers::{BerryLmStreamParser, Delta, SequentialToolCallIds};

use crate::support::{
    call_id, options, parse, stream, stream_deltas, untyped_options, WEATHER_ARGUMENTS,
    WEATHER_CALL,
};

fn start(index: usize, name: &str) -> Delta {
    Delta::ToolCallStart {
        index,
        id: call_id(index as u64),
        name: name.to_owned(),
    }
}

fn arguments(index: usize, fragment: &str) -> Delta {
    Delta::ToolCallArguments {
        index,
        fragment: fragment.to_owned(),
    }
}

#[test]
fn basic_tool_streaming_as_vllm() {
    let chunks = [
        "<tool_call>\n",
        "<function=get_weather>\n",
        "<parameter=city>Tok",
        "yo</parameter>\n",
        "<parameter=days>3</parameter>\n",
        "</function>\n",
        "</tool_call>",
    ];
    let deltas = stream_deltas(&chunks, &options(false));
    assert_eq!(
        deltas,
        vec![
            start(0, "get_weather"),
            arguments(0, r#"{"city": "Tok"#),
            arguments(0, "yo"),
            arguments(0, r#"", "days": "#),
            arguments(0, "3}"),
        ]
    );
    assert_eq!(
        stream(&chunks, &options(false)),
        parse(&chunks.concat(), &options(false))
    );
}

#[test]
fn a_typed_value_appears_when_the_next_key_starts() {
    let deltas = stream_deltas(
        &[
            "<function=get_weather>\n<parameter=days>3</parameter>\n",
            "<parameter=city>Os",
            "aka</parameter>\n</function>",
        ],
        &options(false),
    );
    assert_eq!(
        deltas,
        vec![
            start(0, "get_weather"),
            arguments(0, r#"{"days": "#),
            arguments(0, r#"3, "city": "Os"#),
            arguments(0, r#"aka"}"#),
        ]
    );
}

#[test]
fn strings_stream_character_by_character() {
    let text = format!("Plan.</think>{WEATHER_CALL}");
    let mut parser =
        BerryLmStreamParser::with_id_source(options(true), SequentialToolCallIds::default());
    let mut argument_fragments = Vec::new();
    for character in text.chars() {
        for delta in parser.push(&character.to_string()) {
            if let Delta::ToolCallArguments { fragment, .. } = delta {
                argument_fragments.push(fragment);
            }
        }
    }
    for delta in parser.finish() {
        if let Delta::ToolCallArguments { fragment, .. } = delta {
            argument_fragments.push(fragment);
        }
    }
    assert_eq!(
        argument_fragments,
        vec![
            r#"{"city": ""#,
            "T",
            "o",
            "k",
            "y",
            "o",
            r#"", "days": "#,
            "3}"
        ]
    );
    assert_eq!(argument_fragments.concat(), WEATHER_ARGUMENTS);
}

#[test]
fn untyped_values_all_stream() {
    let deltas = stream_deltas(
        &["<function=f>\n<parameter=n>4", "2</parameter>\n</function>"],
        &untyped_options(false),
    );
    assert_eq!(
        deltas,
        vec![
            start(0, "f"),
            arguments(0, r#"{"n": "4"#),
            arguments(0, r#"2"}"#)
        ]
    );
}

#[test]
fn parallel_calls_have_their_own_indexes() {
    let deltas = stream_deltas(&[WEATHER_CALL, "\n", WEATHER_CALL], &options(false));
    assert_eq!(
        deltas,
        vec![
            start(0, "get_weather"),
            arguments(0, WEATHER_ARGUMENTS),
            start(1, "get_weather"),
            arguments(1, WEATHER_ARGUMENTS),
        ]
    );
}

#[test]
fn content_streams_before_the_call() {
    let deltas = stream_deltas(&["Checking the forecast.\n", WEATHER_CALL], &options(false));
    assert_eq!(
        deltas[0],
        Delta::Content("Checking the forecast.\n".to_owned())
    );
    assert_eq!(
        stream(&["Checking the forecast.\n", WEATHER_CALL], &options(false))
            .content
            .as_deref(),
        Some("Checking the forecast.")
    );
}

#[test]
fn whitespace_only_content_waits_for_what_follows() {
    assert_eq!(
        stream_deltas(&["\n\n", "Hello"], &options(false)),
        vec![Delta::Content("\n\nHello".to_owned())]
    );
    assert_eq!(
        stream_deltas(&["\n\n", WEATHER_CALL, "\n"], &options(false)),
        vec![start(0, "get_weather"), arguments(0, WEATHER_ARGUMENTS)]
    );
    assert_eq!(
        stream_deltas(&["Done.</think>", "\n \n"], &options(true)),
        vec![
            Delta::Reasoning("Done.".to_owned()),
            Delta::Content("\n \n".to_owned())
        ]
    );
}

#[test]
fn an_unfinished_call_is_flushed_by_finish() {
    let output = "<tool_call>\n<function=get_weather>\n<parameter=days>2";
    assert_eq!(
        stream_deltas(&[output], &options(false)),
        vec![
            start(0, "get_weather"),
            arguments(0, r#"{"days": "#),
            arguments(0, "2}"),
        ]
    );
}

#[test]
fn every_two_chunk_split_agrees_with_the_whole_parse() {
    let text = format!(
        "<think>Check <the> weather.\n</think>\n\nSure.\n{WEATHER_CALL}\n\
         <tool_call>\n<function=configure>\n<parameter=ratio>\n2.50\n</parameter>\n\
         <parameter=note>\nmulti\nline\n</parameter>\n</function>\n</tool_call>\n"
    );
    for thinking in [true, false] {
        let expected = parse(&text, &options(thinking));
        for (split, _) in text.char_indices() {
            let chunks = [&text[..split], &text[split..]];
            assert_eq!(
                stream(&chunks, &options(thinking)),
                expected,
                "split at {split}"
            );
        }
    }
}

#[test]
fn single_characters_agree_with_the_whole_parse() {
    let text = format!("Plan.</think></think>Intro <b>\n{WEATHER_CALL}<function=broken</function>");
    let chunks: Vec<String> = text.chars().map(String::from).collect();
    let chunk_refs: Vec<&str> = chunks.iter().map(String::as_str).collect();
    assert_eq!(
        stream(&chunk_refs, &options(true)),
        parse(&text, &options(true))
    );
}

#[test]
fn default_parser_gives_random_openai_style_ids() {
    let mut parser = BerryLmStreamParser::new(options(false));
    let mut deltas = parser.push(WEATHER_CALL);
    deltas.extend(parser.finish());
    match deltas.first() {
        Some(Delta::ToolCallStart { id, .. }) => {
            let suffix = id.strip_prefix("call_").unwrap_or_default();
            assert_eq!(suffix.len(), 24);
            assert!(suffix.bytes().all(|b| b.is_ascii_alphanumeric()), "{id}");
        }
        other => panic!("expected a tool-call start, got {other:?}"),
    }
}
