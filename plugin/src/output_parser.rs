//! BerryLM's reasoning and tool-call parsers as the host's chat output parser.

use berrylm_parsers::{
    parse_message, BerryLmStreamParser, Delta, ParserOptions, RandomToolCallIds, ToolSchema,
};
use mistralrs_core::plugin_api::{ChatOutputParser, ChatOutputRequest, ParsedOutput};
use mistralrs_core::{CalledFunction, ToolCallResponse, ToolCallType};

/// The chat template opens the reasoning block at the end of the prompt when
/// thinking is enabled; the output then starts inside it.
const THINK_OPEN: &str = "<think>";

pub struct BerryLmOutputParser {
    options: ParserOptions,
    stream: BerryLmStreamParser,
    saw_tool_call: bool,
}

impl BerryLmOutputParser {
    /// A parser for one request. Tool definitions that are not valid JSON
    /// schemas fall back to untyped (string) arguments.
    pub fn for_request(request: &ChatOutputRequest<'_>) -> BerryLmOutputParser {
        let thinking_enabled = request.prompt.trim_end().ends_with(THINK_OPEN);
        let tools = match serde_json::to_value(request.tools)
            .map_err(|e| e.to_string())
            .and_then(|tools| ToolSchema::parse_request_tools(&tools).map_err(|e| e.to_string()))
        {
            Ok(tools) => tools,
            Err(error) => {
                tracing::warn!(
                    "berrylm: tool definitions not usable for typing arguments: {error}"
                );
                Vec::new()
            }
        };
        let options = ParserOptions::new(thinking_enabled, tools);
        BerryLmOutputParser {
            stream: BerryLmStreamParser::new(options.clone()),
            options,
            saw_tool_call: false,
        }
    }

    fn collect(&mut self, deltas: Vec<Delta>) -> ParsedOutput {
        let mut parsed = ParsedOutput::default();
        for delta in deltas {
            match delta {
                Delta::Reasoning(text) => parsed
                    .reasoning_content
                    .get_or_insert_with(String::new)
                    .push_str(&text),
                Delta::Content(text) => parsed
                    .content
                    .get_or_insert_with(String::new)
                    .push_str(&text),
                Delta::ToolCallStart { index, id, name } => {
                    self.saw_tool_call = true;
                    parsed
                        .tool_calls
                        .push(tool_call(index, id, name, String::new()));
                }
                Delta::ToolCallArguments { index, fragment } => {
                    match parsed.tool_calls.last_mut() {
                        Some(last) if last.index == index => {
                            last.function.arguments.push_str(&fragment)
                        }
                        _ => parsed.tool_calls.push(tool_call(
                            index,
                            String::new(),
                            String::new(),
                            fragment,
                        )),
                    }
                }
            }
        }
        parsed
    }
}

fn tool_call(index: usize, id: String, name: String, arguments: String) -> ToolCallResponse {
    ToolCallResponse {
        index,
        id,
        tp: ToolCallType::Function,
        function: CalledFunction { name, arguments },
    }
}

impl ChatOutputParser for BerryLmOutputParser {
    fn push(&mut self, text: &str) -> ParsedOutput {
        let deltas = self.stream.push(text);
        self.collect(deltas)
    }

    fn finish(&mut self) -> ParsedOutput {
        let deltas = self.stream.finish();
        self.collect(deltas)
    }

    fn parse_complete(&mut self, text: &str) -> ParsedOutput {
        let message = parse_message(text, &self.options, RandomToolCallIds::default());
        self.saw_tool_call |= !message.tool_calls.is_empty();
        ParsedOutput {
            content: message.content,
            reasoning_content: message.reasoning_content,
            tool_calls: message
                .tool_calls
                .into_iter()
                .enumerate()
                .map(|(index, call)| tool_call(index, call.id, call.name, call.arguments))
                .collect(),
        }
    }

    fn has_tool_calls(&self) -> bool {
        self.saw_tool_call
    }
}
