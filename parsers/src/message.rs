//! The assembled assistant message, built from stream deltas or by parsing
//! a complete output.

use crate::ids::ToolCallIdSource;
use crate::options::ParserOptions;
use crate::reasoning::non_empty;
use crate::stream::{BerryLmStreamParser, Delta};
use crate::tool_call::ToolCall;

/// The assistant message of one completion.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AssistantMessage {
    pub reasoning_content: Option<String>,
    pub content: Option<String>,
    pub tool_calls: Vec<ToolCall>,
}

/// Collects stream deltas into an [`AssistantMessage`]: text is
/// concatenated, argument fragments are appended to their call.
#[derive(Debug, Default)]
pub struct MessageAssembler {
    reasoning: String,
    content: String,
    tool_calls: Vec<ToolCall>,
}

impl MessageAssembler {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn push(&mut self, delta: &Delta) {
        match delta {
            Delta::Reasoning(text) => self.reasoning.push_str(text),
            Delta::Content(text) => self.content.push_str(text),
            Delta::ToolCallStart { id, name, .. } => self.tool_calls.push(ToolCall {
                id: id.clone(),
                name: name.clone(),
                arguments: String::new(),
            }),
            Delta::ToolCallArguments { index, fragment } => {
                if let Some(call) = self.tool_calls.get_mut(*index) {
                    call.arguments.push_str(fragment);
                }
            }
        }
    }

    /// The message, with vLLM's final touches: empty parts become `None`,
    /// and the content is trimmed when tools were called.
    pub fn finish(self) -> AssistantMessage {
        let content = if self.tool_calls.is_empty() {
            self.content
        } else {
            self.content.trim().to_owned()
        };
        AssistantMessage {
            reasoning_content: non_empty(self.reasoning),
            content: non_empty(content),
            tool_calls: self.tool_calls,
        }
    }
}

/// Non-streaming parse of a complete output: the same as streaming it in
/// one chunk and assembling the deltas.
pub fn parse_message(
    output: &str,
    options: &ParserOptions,
    ids: impl ToolCallIdSource,
) -> AssistantMessage {
    let mut parser = BerryLmStreamParser::with_id_source(options.clone(), ids);
    let mut assembler = MessageAssembler::new();
    for delta in parser.push(output).iter().chain(&parser.finish()) {
        assembler.push(delta);
    }
    assembler.finish()
}
