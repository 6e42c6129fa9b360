//! BerryLM's reasoning and tool-call parsers as the host's chat output parser.

use berrylm_parsers::{
    named_tool_call_grammar, parse_message, parse_reasoning, required_tool_calls_grammar,
    BerryLmStreamParser, Delta, ParserOptions, RandomToolCallIds, ReasoningDelta, ReasoningParser,
    ToolSchema, NO_TOOL_CALL_GRAMMAR,
};
use mistralrs_core::plugin_api::{ChatOutputParser, ChatOutputRequest, ParsedOutput};
use mistralrs_core::{CalledFunction, Constraint, ToolCallResponse, ToolCallType, ToolChoice};

/// The chat template opens the reasoning block at the end of the prompt when
/// thinking is enabled; the output then starts inside it.
const THINK_OPEN: &str = "<think>";
/// The special token that ends the reasoning.
const THINK_CLOSE: &str = "</think>";

pub struct BerryLmOutputParser {
    options: ParserOptions,
    stream: Stream,
    saw_tool_call: bool,
    /// The grammar `tool_choice` needs: a forced call, or none.
    tool_choice_grammar: Option<String>,
}

/// How the output is split up.
enum Stream {
    /// Reasoning, content and tool calls.
    WithToolCalls(Box<BerryLmStreamParser>),
    /// No tools offered, or `tool_choice: none`: reasoning and content only;
    /// no call is parsed.
    WithoutToolCalls(ReasoningParser),
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
        let tool_choice_grammar = match request.tool_choice {
            ToolChoice::Auto => None,
            ToolChoice::None if request.tools.is_empty() => None,
            ToolChoice::None => Some(NO_TOOL_CALL_GRAMMAR.to_owned()),
            ToolChoice::Required => required_tool_calls_grammar(&tools),
            ToolChoice::Tool(chosen) => tools
                .iter()
                .find(|tool| tool.name == chosen.function.name)
                .map(named_tool_call_grammar),
        };
        let options = ParserOptions::new(thinking_enabled, tools);
        // As vLLM and SGLang serve BerryLM: calls are parsed only where the
        // request offers tools (its own or an MCP server's) and allows them;
        // otherwise a call the model writes stays in the content as text.
        let stream = if request.tools.is_empty() || matches!(request.tool_choice, ToolChoice::None)
        {
            Stream::WithoutToolCalls(ReasoningParser::new(thinking_enabled))
        } else {
            Stream::WithToolCalls(Box::new(BerryLmStreamParser::new(options.clone())))
        };
        BerryLmOutputParser {
            stream,
            options,
            saw_tool_call: false,
            tool_choice_grammar,
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

/// The reasoning parser's pieces as the full parser's deltas.
fn reasoning_deltas(deltas: Vec<ReasoningDelta>) -> Vec<Delta> {
    deltas
        .into_iter()
        .map(|delta| match delta {
            ReasoningDelta::Reasoning(text) => Delta::Reasoning(text),
            ReasoningDelta::Content(text) => Delta::Content(text),
        })
        .collect()
}

impl ChatOutputParser for BerryLmOutputParser {
    fn push(&mut self, text: &str) -> ParsedOutput {
        let deltas = match &mut self.stream {
            Stream::WithToolCalls(stream) => stream.push(text),
            Stream::WithoutToolCalls(stream) => reasoning_deltas(stream.push(text)),
        };
        self.collect(deltas)
    }

    fn finish(&mut self) -> ParsedOutput {
        let deltas = match &mut self.stream {
            Stream::WithToolCalls(stream) => stream.finish(),
            Stream::WithoutToolCalls(stream) => reasoning_deltas(stream.finish()),
        };
        self.collect(deltas)
    }

    fn parse_complete(&mut self, text: &str) -> ParsedOutput {
        if let Stream::WithoutToolCalls(_) = self.stream {
            let split = parse_reasoning(text, self.options.thinking_enabled);
            return ParsedOutput {
                content: split.content,
                reasoning_content: split.reasoning,
                tool_calls: Vec::new(),
            };
        }
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

    fn tool_choice_constraint(&self) -> Option<Constraint> {
        self.tool_choice_grammar.clone().map(Constraint::Lark)
    }

    fn reasoning_end_token(&self) -> Option<&str> {
        self.options.thinking_enabled.then_some(THINK_CLOSE)
    }
}
