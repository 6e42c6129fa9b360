//! OpenAI chat-completion JSON shapes for the parser's output: the complete
//! assistant message and the `delta` object of a streamed chunk.

use serde::{Serialize, Serializer};

use crate::message::AssistantMessage;
use crate::stream::Delta;
use crate::tool_call::ToolCall;

#[derive(Serialize)]
struct MessageJson<'a> {
    role: &'static str,
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<&'a str>,
    #[serde(skip_serializing_if = "<[_]>::is_empty")]
    tool_calls: &'a [ToolCall],
}

#[derive(Serialize)]
struct ToolCallJson<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    function: FunctionJson<'a>,
}

#[derive(Serialize)]
struct FunctionJson<'a> {
    name: &'a str,
    arguments: &'a str,
}

#[derive(Serialize)]
struct DeltaJson<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_calls: Option<[DeltaToolCallJson<'a>; 1]>,
}

#[derive(Serialize)]
struct DeltaToolCallJson<'a> {
    index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<&'a str>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    kind: Option<&'static str>,
    function: DeltaFunctionJson<'a>,
}

#[derive(Serialize)]
struct DeltaFunctionJson<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
    arguments: &'a str,
}

/// `{"role": "assistant", "content": .., "reasoning_content": ..,
/// "tool_calls": [..]}`; `content` is `null` when absent,
/// `reasoning_content` and `tool_calls` are left out when absent.
impl Serialize for AssistantMessage {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        MessageJson {
            role: "assistant",
            content: self.content.as_deref(),
            reasoning_content: self.reasoning_content.as_deref(),
            tool_calls: &self.tool_calls,
        }
        .serialize(serializer)
    }
}

/// `{"id": .., "type": "function", "function": {"name": .., "arguments": ..}}`.
impl Serialize for ToolCall {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        ToolCallJson {
            id: &self.id,
            kind: "function",
            function: FunctionJson {
                name: &self.name,
                arguments: &self.arguments,
            },
        }
        .serialize(serializer)
    }
}

/// The `delta` object of a chat-completion chunk: `{"reasoning_content": ..}`,
/// `{"content": ..}`, or `{"tool_calls": [{"index": .., ..}]}` where a call's
/// first delta carries its id, type and name.
impl Serialize for Delta {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut json = DeltaJson {
            reasoning_content: None,
            content: None,
            tool_calls: None,
        };
        match self {
            Delta::Reasoning(text) => json.reasoning_content = Some(text),
            Delta::Content(text) => json.content = Some(text),
            Delta::ToolCallStart { index, id, name } => {
                json.tool_calls = Some([DeltaToolCallJson {
                    index: *index,
                    id: Some(id),
                    kind: Some("function"),
                    function: DeltaFunctionJson {
                        name: Some(name),
                        arguments: "",
                    },
                }]);
            }
            Delta::ToolCallArguments { index, fragment } => {
                json.tool_calls = Some([DeltaToolCallJson {
                    index: *index,
                    id: None,
                    kind: None,
                    function: DeltaFunctionJson {
                        name: None,
                        arguments: fragment,
                    },
                }]);
            }
        }
        json.serialize(serializer)
    }
}
