//! Output parsers for BerryLM: the `<think>` reasoning parser and the
//! Qwen3-Coder-style XML tool-call parser, streaming and non-streaming.
//! The behaviour follows vLLM's `berrylm` parser.
//!
//! ```text
//! Plan the call.</think>
//! <tool_call>
//! <function=get_weather>
//! <parameter=city>Tokyo</parameter>
//! <parameter=days>3</parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! With thinking enabled the output starts inside the reasoning (the chat
//! template opened `<think>`). Argument values are raw text typed by the
//! request's tool JSON schema, so the call above has the arguments
//! `{"city": "Tokyo", "days": 3}` when `days` is an integer.
//!
//! * [`BerryLmStreamParser`] turns text chunks into [`Delta`]s;
//!   [`MessageAssembler`] collects them into an [`AssistantMessage`].
//! * [`parse_message`] parses a complete output in one go.
//! * [`ReasoningParser`] / [`parse_reasoning`] and [`extract_tool_calls`]
//!   are the two parsers on their own.
//! * [`AssistantMessage`] and [`Delta`] serialize to OpenAI chat-completion
//!   JSON.

mod arguments;
mod grammar;
mod ids;
mod json;
mod lexer;
mod message;
mod openai;
mod options;
mod reasoning;
mod schema;
mod stream;
mod tool_call;

pub use grammar::{named_tool_call_grammar, required_tool_calls_grammar, NO_TOOL_CALL_GRAMMAR};
pub use ids::{RandomToolCallIds, SequentialToolCallIds, ToolCallIdSource};
pub use message::{parse_message, AssistantMessage, MessageAssembler};
pub use options::ParserOptions;
pub use reasoning::{parse_reasoning, ReasoningDelta, ReasoningParser, ReasoningSplit};
pub use schema::{ToolDefinitionError, ToolSchema};
pub use stream::{BerryLmStreamParser, Delta};
pub use tool_call::{extract_tool_calls, ExtractedToolCalls, ToolCall};
