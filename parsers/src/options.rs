//! Per-request parser options.

use serde_json::Value;

use crate::schema::{ToolDefinitionError, ToolSchema};

/// What the parser needs to know about the request.
#[derive(Debug, Clone, PartialEq)]
pub struct ParserOptions {
    /// The chat template's `enable_thinking`. When true the prompt ends with
    /// an opened `<think>`, so the output starts inside the reasoning.
    pub thinking_enabled: bool,
    /// The request's function tools; their parameter schemas type the
    /// argument values.
    pub tools: Vec<ToolSchema>,
}

impl Default for ParserOptions {
    /// Thinking enabled (the template's default), no tools.
    fn default() -> Self {
        Self {
            thinking_enabled: true,
            tools: Vec::new(),
        }
    }
}

impl ParserOptions {
    pub fn new(thinking_enabled: bool, tools: Vec<ToolSchema>) -> Self {
        Self {
            thinking_enabled,
            tools,
        }
    }

    /// Options from the request's `tools` value (the OpenAI array, or JSON
    /// `null` when the request has none).
    pub fn from_request_tools(
        thinking_enabled: bool,
        tools: &Value,
    ) -> Result<Self, ToolDefinitionError> {
        let tools = match tools {
            Value::Null => Vec::new(),
            tools => ToolSchema::parse_request_tools(tools)?,
        };
        Ok(Self::new(thinking_enabled, tools))
    }

    /// Position of the first tool called `name`.
    pub(crate) fn tool_position(&self, name: &str) -> Option<usize> {
        self.tools.iter().position(|tool| tool.name == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn default_has_thinking_and_no_tools() {
        assert_eq!(
            ParserOptions::default(),
            ParserOptions::new(true, Vec::new())
        );
    }

    #[test]
    fn from_request_tools() {
        let options = ParserOptions::from_request_tools(
            false,
            &json!([{"type": "function", "function": {"name": "a"}}]),
        );
        assert_eq!(
            options
                .as_ref()
                .map(|o| (o.thinking_enabled, o.tools.len())),
            Ok((false, 1))
        );
        assert_eq!(
            ParserOptions::from_request_tools(true, &Value::Null).map(|o| o.tools.len()),
            Ok(0)
        );
        assert_eq!(
            ParserOptions::from_request_tools(true, &json!("tools")),
            Err(ToolDefinitionError::NotAnArray)
        );
    }

    #[test]
    fn finds_the_first_tool_by_name() {
        let options = ParserOptions::from_request_tools(
            true,
            &json!([
                {"type": "function", "function": {"name": "a"}},
                {"type": "function", "function": {"name": "b"}},
                {"type": "function", "function": {"name": "b"}}
            ]),
        );
        assert_eq!(
            options.map(|o| (o.tool_position("b"), o.tool_position("c"))),
            Ok((Some(1), None))
        );
    }
}
