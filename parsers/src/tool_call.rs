//! The tool-call parser on its own: tool calls out of output that holds no
//! reasoning (vLLM's tool parser, which starts in the content state).

use crate::ids::ToolCallIdSource;
use crate::message::parse_message;
use crate::options::ParserOptions;
use crate::schema::ToolSchema;

/// One complete tool call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as a JSON object in text form.
    pub arguments: String,
}

/// Content and tool calls of a complete output.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ExtractedToolCalls {
    /// Text outside the calls; trimmed when there are calls, `None` when
    /// empty.
    pub content: Option<String>,
    pub tool_calls: Vec<ToolCall>,
}

/// Non-streaming tool-call parse of output without reasoning (for example
/// the content returned by [`crate::parse_reasoning`]).
pub fn extract_tool_calls(
    output: &str,
    tools: &[ToolSchema],
    ids: impl ToolCallIdSource,
) -> ExtractedToolCalls {
    let message = parse_message(output, &ParserOptions::new(false, tools.to_vec()), ids);
    ExtractedToolCalls {
        content: message.content,
        tool_calls: message.tool_calls,
    }
}
