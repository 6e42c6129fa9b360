//! Turns the body of one `<function=NAME>` block into its arguments JSON
//! object, incrementally.
//!
//! The body is a run of `<parameter=KEY>VALUE</parameter>` blocks. A value
//! loses exactly one leading and one trailing newline. A parameter is also
//! closed by the next `<parameter=` and, leniently, by the end of the call.
//! Text outside parameter blocks is ignored; a repeated key keeps its first
//! value; a parameter with an empty key is ignored.
//!
//! The JSON object is written as the body arrives, and only text that can no
//! longer change is written (vLLM's "safe prefix"): the key of a parameter
//! appears as soon as its header is complete; a value whose schema type is
//! exactly `string` (or any value when the tool has no typed parameters)
//! streams character by character, without its closing quote; any other
//! value appears once it is complete and the next key starts, or when the
//! call ends and the rest, `}` included, is written. Everything written is
//! therefore a prefix of the final arguments string.

use crate::json;
use crate::schema::ToolSchema;

/// One piece of a function body, as the grammar machine sees it.
#[derive(Debug, Clone, Copy)]
pub(crate) enum BodyPiece<'a> {
    /// Text, including the text of tags that mean nothing inside a body.
    Text(&'a str),
    ParameterOpen,
    ParameterClose,
}

/// Where the builder is within the body.
#[derive(Debug)]
enum Cursor {
    /// Between parameter blocks.
    Outside,
    /// After `<parameter=`, reading the key up to the first `>`.
    Key(String),
    /// Inside a value.
    Value(OpenValue),
}

#[derive(Debug)]
struct OpenValue {
    key: String,
    raw: String,
    output: ValueOutput,
}

/// How the open value reaches the JSON text.
#[derive(Debug, Clone, Copy)]
enum ValueOutput {
    /// Repeated or empty key: the value is dropped.
    Dropped,
    /// Written when complete.
    WhenComplete,
    /// Written as it grows; `written_up_to` is the byte offset in the raw
    /// value reached so far.
    Streaming { written_up_to: usize },
}

/// Builds the arguments JSON of one call.
#[derive(Debug)]
pub(crate) struct ArgumentBuilder {
    cursor: Cursor,
    keys: Vec<String>,
    /// The JSON text settled so far; only ever appended to.
    json: String,
    /// The settled text of the last complete value that is still withheld
    /// (its closing quote, for a streamed string).
    withheld: String,
    /// How much of `json` has been handed out as fragments.
    handed_out: usize,
}

impl ArgumentBuilder {
    pub(crate) fn new() -> Self {
        Self {
            cursor: Cursor::Outside,
            keys: Vec::new(),
            json: String::new(),
            withheld: String::new(),
            handed_out: 0,
        }
    }

    /// Feeds the next piece of the body. `tool` is the schema of the called
    /// function, when the request defines it.
    pub(crate) fn push(&mut self, piece: BodyPiece<'_>, tool: Option<&ToolSchema>) {
        let cursor = std::mem::replace(&mut self.cursor, Cursor::Outside);
        self.cursor = match (cursor, piece) {
            (Cursor::Outside, BodyPiece::ParameterOpen) => Cursor::Key(String::new()),
            (Cursor::Outside, _) => Cursor::Outside,
            (Cursor::Key(key), piece) => self.read_key(key, piece, tool),
            (Cursor::Value(mut value), BodyPiece::Text(text)) => {
                value.raw.push_str(text);
                self.write_streamed(&mut value);
                Cursor::Value(value)
            }
            (Cursor::Value(value), BodyPiece::ParameterOpen) => {
                self.complete(value, tool);
                Cursor::Key(String::new())
            }
            (Cursor::Value(value), BodyPiece::ParameterClose) => {
                self.complete(value, tool);
                Cursor::Outside
            }
        };
    }

    /// Ends the call: closes an open value and the object. Returns the last
    /// fragment.
    pub(crate) fn finish(&mut self, tool: Option<&ToolSchema>) -> String {
        if let Cursor::Value(value) = std::mem::replace(&mut self.cursor, Cursor::Outside) {
            self.complete(value, tool);
        }
        if self.json.is_empty() {
            self.json.push('{');
        }
        let withheld = std::mem::take(&mut self.withheld);
        self.json.push_str(&withheld);
        self.json.push('}');
        self.take_fragment()
    }

    /// The JSON text settled since the last call.
    pub(crate) fn take_fragment(&mut self) -> String {
        let fragment = self.json[self.handed_out..].to_owned();
        self.handed_out = self.json.len();
        fragment
    }

    /// The key runs to the first `>`, whatever comes before it (vLLM's
    /// `<parameter=([^>]*)>`).
    fn read_key(
        &mut self,
        mut key: String,
        piece: BodyPiece<'_>,
        tool: Option<&ToolSchema>,
    ) -> Cursor {
        let text = match piece {
            BodyPiece::Text(text) => text,
            BodyPiece::ParameterOpen => "<parameter=",
            BodyPiece::ParameterClose => "</parameter>",
        };
        match text.split_once('>') {
            None => {
                key.push_str(text);
                Cursor::Key(key)
            }
            Some((end_of_key, start_of_value)) => {
                key.push_str(end_of_key);
                let mut value = self.open_value(key.trim().to_owned(), tool);
                value.raw.push_str(start_of_value);
                self.write_streamed(&mut value);
                Cursor::Value(value)
            }
        }
    }

    fn open_value(&mut self, key: String, tool: Option<&ToolSchema>) -> OpenValue {
        if key.is_empty() || self.keys.contains(&key) {
            return OpenValue {
                key,
                raw: String::new(),
                output: ValueOutput::Dropped,
            };
        }
        if self.json.is_empty() {
            self.json.push('{');
        } else {
            let withheld = std::mem::take(&mut self.withheld);
            self.json.push_str(&withheld);
            self.json.push_str(", ");
        }
        json::write_string(&key, &mut self.json);
        self.json.push_str(": ");
        let output = if tool.is_none_or(|tool| tool.streams_as_text(&key)) {
            self.json.push('"');
            ValueOutput::Streaming { written_up_to: 0 }
        } else {
            ValueOutput::WhenComplete
        };
        self.keys.push(key.clone());
        OpenValue {
            key,
            raw: String::new(),
            output,
        }
    }

    fn complete(&mut self, mut value: OpenValue, tool: Option<&ToolSchema>) {
        match value.output {
            ValueOutput::Dropped => {}
            ValueOutput::Streaming { .. } => {
                self.write_streamed(&mut value);
                self.withheld = "\"".to_owned();
            }
            ValueOutput::WhenComplete => {
                let (start, end) = trimmed_range(&value.raw);
                let text = &value.raw[start..end];
                let typed = tool.map_or_else(
                    || serde_json::Value::String(text.to_owned()),
                    |tool| tool.argument_value(&value.key, text),
                );
                let mut rendered = String::new();
                json::write_value(&typed, &mut rendered);
                self.withheld = rendered;
            }
        }
    }

    /// Writes the part of a streaming value that can no longer change.
    fn write_streamed(&mut self, value: &mut OpenValue) {
        if let ValueOutput::Streaming { written_up_to } = &mut value.output {
            let (start, end) = trimmed_range(&value.raw);
            let from = (*written_up_to).max(start);
            if from < end {
                json::write_string_body(&value.raw[from..end], &mut self.json);
                *written_up_to = end;
            }
        }
    }
}

/// The byte range of `raw` without one leading and one trailing newline.
/// While the value is incomplete this also keeps back a trailing newline
/// that may turn out to be the one removed.
fn trimmed_range(raw: &str) -> (usize, usize) {
    let start = usize::from(raw.starts_with('\n'));
    let end = raw.len() - usize::from(raw.ends_with('\n'));
    (start, end.max(start))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn weather_tool() -> ToolSchema {
        let parameters = json!({"type": "object", "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"}
        }});
        match parameters {
            Value::Object(parameters) => ToolSchema::new("get_weather", parameters),
            _ => unreachable!("a JSON object literal"),
        }
    }

    /// Feeds `pieces` and returns the fragment handed out after each one,
    /// then the final fragment.
    fn fragments(pieces: &[BodyPiece<'_>], tool: Option<&ToolSchema>) -> Vec<String> {
        let mut builder = ArgumentBuilder::new();
        let mut out: Vec<String> = pieces
            .iter()
            .map(|piece| {
                builder.push(*piece, tool);
                builder.take_fragment()
            })
            .collect();
        out.push(builder.finish(tool));
        out
    }

    fn final_json(body: &[BodyPiece<'_>], tool: Option<&ToolSchema>) -> String {
        fragments(body, tool).concat()
    }

    use BodyPiece::{ParameterClose as Close, ParameterOpen as Open, Text};

    #[test]
    fn streams_strings_and_withholds_typed_values() {
        let tool = weather_tool();
        let out = fragments(
            &[
                Open,
                Text("city>Tok"),
                Text("yo"),
                Close,
                Text("\n"),
                Open,
                Text("days>3"),
                Close,
            ],
            Some(&tool),
        );
        assert_eq!(
            out,
            vec![
                "",
                "{\"city\": \"Tok",
                "yo",
                "",
                "",
                "",
                "\", \"days\": ",
                "",
                "3}",
            ]
        );
    }

    #[test]
    fn multi_line_value_loses_one_newline_each_side() {
        let body = [Open, Text("content>\n\nline 1\nline 2\n\n"), Close];
        assert_eq!(
            final_json(&body, None),
            r#"{"content": "\nline 1\nline 2\n"}"#
        );
    }

    #[test]
    fn a_trailing_newline_is_held_until_more_text_arrives() {
        let mut builder = ArgumentBuilder::new();
        builder.push(Open, None);
        builder.push(Text("v>a\n"), None);
        assert_eq!(builder.take_fragment(), "{\"v\": \"a");
        builder.push(Text("b"), None);
        assert_eq!(builder.take_fragment(), "\\nb");
    }

    #[test]
    fn next_parameter_and_end_of_call_close_a_value() {
        let tool = weather_tool();
        let body = [Open, Text("days>4\n"), Open, Text("city>Oslo\n")];
        assert_eq!(
            final_json(&body, Some(&tool)),
            r#"{"days": 4, "city": "Oslo"}"#
        );
    }

    #[test]
    fn repeated_and_empty_keys_are_ignored() {
        let body = [
            Open,
            Text("a>1"),
            Close,
            Open,
            Text(" >x"),
            Close,
            Open,
            Text("a>2"),
            Close,
        ];
        assert_eq!(final_json(&body, None), r#"{"a": "1"}"#);
    }

    #[test]
    fn text_outside_parameters_is_ignored_and_no_parameters_give_an_empty_object() {
        assert_eq!(final_json(&[Text("\nnoise>\n"), Close], None), "{}");
    }

    #[test]
    fn key_runs_to_the_first_angle_bracket() {
        let body = [Open, Text("a"), Open, Text("b>v"), Close];
        assert_eq!(final_json(&body, None), r#"{"a<parameter=b": "v"}"#);
    }

    #[test]
    fn unknown_parameter_of_a_typed_tool_is_a_withheld_string() {
        let tool = weather_tool();
        let out = fragments(&[Open, Text("note>5"), Close], Some(&tool));
        assert_eq!(out, vec!["", "{\"note\": ", "", "\"5\"}"]);
    }
}
