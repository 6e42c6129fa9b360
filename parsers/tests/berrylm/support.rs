//! Shared fixtures.

use berrylm_parsers::{
    parse_message, AssistantMessage, BerryLmStreamParser, Delta, MessageAssembler, ParserOptions,
    SequentialToolCallIds, ToolCall, ToolSchema,
};
use serde_json::json;

pub const WEATHER_CALL: &str = "<tool_call>\n<function=get_weather>\n\
<parameter=city>Tokyo</parameter>\n\
<parameter=days>3</parameter>\n\
</function>\n</tool_call>";

pub const WEATHER_ARGUMENTS: &str = r#"{"city": "Tokyo", "days": 3}"#;

/// The request tools of vLLM's tests plus a tool with several typed
/// parameters.
pub fn request_tools() -> Vec<ToolSchema> {
    let tools = json!([
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather forecast for a city.",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string"},
                        "days": {"type": "integer"}
                    },
                    "required": ["city"]
                }
            }
        },
        {
            "type": "function",
            "function": {
                "name": "configure",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "ratio": {"type": "number"},
                        "enabled": {"type": "boolean"},
                        "limit": {"type": ["integer", "null"]},
                        "options": {
                            "type": "object",
                            "properties": {"depth": {"type": "integer"}}
                        },
                        "tags": {"type": "array", "items": {"type": "string"}},
                        "note": {"type": "string"}
                    }
                }
            }
        }
    ]);
    match ToolSchema::parse_request_tools(&tools) {
        Ok(tools) => tools,
        Err(error) => panic!("fixture tools are valid: {error}"),
    }
}

pub fn options(thinking_enabled: bool) -> ParserOptions {
    ParserOptions::new(thinking_enabled, request_tools())
}

pub fn untyped_options(thinking_enabled: bool) -> ParserOptions {
    ParserOptions::new(thinking_enabled, Vec::new())
}

/// Non-streaming parse with ids `call_000…0`, `call_000…1`, ….
pub fn parse(output: &str, options: &ParserOptions) -> AssistantMessage {
    parse_message(output, options, SequentialToolCallIds::default())
}

/// All deltas of streaming `chunks`, `finish` included.
pub fn stream_deltas(chunks: &[&str], options: &ParserOptions) -> Vec<Delta> {
    let mut parser =
        BerryLmStreamParser::with_id_source(options.clone(), SequentialToolCallIds::default());
    let mut deltas: Vec<Delta> = chunks.iter().flat_map(|chunk| parser.push(chunk)).collect();
    deltas.extend(parser.finish());
    deltas
}

pub fn assemble(deltas: &[Delta]) -> AssistantMessage {
    let mut assembler = MessageAssembler::new();
    for delta in deltas {
        assembler.push(delta);
    }
    assembler.finish()
}

pub fn stream(chunks: &[&str], options: &ParserOptions) -> AssistantMessage {
    assemble(&stream_deltas(chunks, options))
}

pub fn call_id(number: u64) -> String {
    format!("call_{number:024}")
}

pub fn tool_call(number: u64, name: &str, arguments: &str) -> ToolCall {
    ToolCall {
        id: call_id(number),
        name: name.to_owned(),
        arguments: arguments.to_owned(),
    }
}

pub fn message(
    reasoning: Option<&str>,
    content: Option<&str>,
    tool_calls: Vec<ToolCall>,
) -> AssistantMessage {
    AssistantMessage {
        reasoning_content: reasoning.map(str::to_owned),
        content: content.map(str::to_owned),
        tool_calls,
    }
}
