//! The reasoning parser: splits BerryLM output into the `<think>` reasoning
//! and the content after it, leaving tool-call markup in the content.
//!
//! With thinking enabled the chat template already opened `<think>`, so the
//! output starts inside the reasoning. An explicit `<think>` there is
//! absorbed; `</think>` ends the reasoning, and so does `<tool_call>`, which
//! stays in the content for the tool-call parser. After the reasoning a
//! duplicate `</think>` is dropped. With thinking disabled the output starts
//! in the content: there is no reasoning, a `<think>` is plain text and a
//! `</think>` is dropped. These are vLLM's `berrylm` transitions.

use crate::lexer::{Lexeme, Tag, TagLexer};

/// What a tag means while the output is inside the reasoning.
pub(crate) enum TagInReasoning {
    /// A redundant `<think>`: no output.
    Absorbed,
    /// `</think>`: the reasoning is over.
    EndsReasoning,
    /// `<tool_call>`: the reasoning is over and a tool call begins.
    EndsReasoningWithToolCall,
    /// Any other tag is reasoning text.
    Text,
}

pub(crate) fn tag_in_reasoning(tag: Tag) -> TagInReasoning {
    match tag {
        Tag::ThinkOpen => TagInReasoning::Absorbed,
        Tag::ThinkClose => TagInReasoning::EndsReasoning,
        Tag::ToolCallOpen => TagInReasoning::EndsReasoningWithToolCall,
        _ => TagInReasoning::Text,
    }
}

/// A piece of streamed output from [`ReasoningParser`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReasoningDelta {
    Reasoning(String),
    Content(String),
}

/// Streaming reasoning parser. Feed chunks with [`ReasoningParser::push`] and
/// call [`ReasoningParser::finish`] at the end of the output; tags split
/// across chunks are recognised.
#[derive(Debug)]
pub struct ReasoningParser {
    lexer: TagLexer,
    in_reasoning: bool,
}

impl ReasoningParser {
    pub fn new(thinking_enabled: bool) -> Self {
        Self {
            lexer: TagLexer::default(),
            in_reasoning: thinking_enabled,
        }
    }

    /// Whether the output is still inside the reasoning.
    pub fn in_reasoning(&self) -> bool {
        self.in_reasoning
    }

    pub fn push(&mut self, chunk: &str) -> Vec<ReasoningDelta> {
        let lexemes = self.lexer.push(chunk);
        self.route(lexemes)
    }

    /// Flushes text held back as a possible partial tag.
    pub fn finish(&mut self) -> Vec<ReasoningDelta> {
        let lexemes = self.lexer.finish();
        let deltas = self.route(lexemes);
        self.in_reasoning = false;
        deltas
    }

    fn route(&mut self, lexemes: Vec<Lexeme>) -> Vec<ReasoningDelta> {
        let mut deltas = Vec::new();
        for lexeme in lexemes {
            let text = match lexeme {
                Lexeme::Text(text) => text,
                Lexeme::Tag(tag) if tag.is_turn_marker() => continue,
                Lexeme::Tag(tag) if self.in_reasoning => match tag_in_reasoning(tag) {
                    TagInReasoning::Absorbed => continue,
                    TagInReasoning::EndsReasoning => {
                        self.in_reasoning = false;
                        continue;
                    }
                    TagInReasoning::EndsReasoningWithToolCall => {
                        self.in_reasoning = false;
                        tag.literal().to_owned()
                    }
                    TagInReasoning::Text => tag.literal().to_owned(),
                },
                Lexeme::Tag(Tag::ThinkClose) => continue,
                Lexeme::Tag(tag) => tag.literal().to_owned(),
            };
            let delta = if self.in_reasoning {
                ReasoningDelta::Reasoning(text)
            } else {
                ReasoningDelta::Content(text)
            };
            push_merged(&mut deltas, delta);
        }
        deltas
    }
}

fn push_merged(deltas: &mut Vec<ReasoningDelta>, delta: ReasoningDelta) {
    match (deltas.last_mut(), delta) {
        (Some(ReasoningDelta::Reasoning(last)), ReasoningDelta::Reasoning(text))
        | (Some(ReasoningDelta::Content(last)), ReasoningDelta::Content(text)) => {
            last.push_str(&text)
        }
        (_, delta) => deltas.push(delta),
    }
}

/// Reasoning and content of a complete output; `None` for an empty part.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ReasoningSplit {
    pub reasoning: Option<String>,
    pub content: Option<String>,
}

/// Non-streaming reasoning parse of a complete output.
pub fn parse_reasoning(output: &str, thinking_enabled: bool) -> ReasoningSplit {
    let mut parser = ReasoningParser::new(thinking_enabled);
    let mut deltas = parser.push(output);
    deltas.extend(parser.finish());
    let mut reasoning = String::new();
    let mut content = String::new();
    for delta in deltas {
        match delta {
            ReasoningDelta::Reasoning(text) => reasoning.push_str(&text),
            ReasoningDelta::Content(text) => content.push_str(&text),
        }
    }
    ReasoningSplit {
        reasoning: non_empty(reasoning),
        content: non_empty(content),
    }
}

pub(crate) fn non_empty(text: String) -> Option<String> {
    (!text.is_empty()).then_some(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(reasoning: Option<&str>, content: Option<&str>) -> ReasoningSplit {
        ReasoningSplit {
            reasoning: reasoning.map(str::to_owned),
            content: content.map(str::to_owned),
        }
    }

    /// The deltas of pushing `chunks` into `parser`, in order.
    fn push_all(parser: &mut ReasoningParser, chunks: &[&str]) -> Vec<ReasoningDelta> {
        chunks.iter().flat_map(|chunk| parser.push(chunk)).collect()
    }

    fn reasoning(text: &str) -> ReasoningDelta {
        ReasoningDelta::Reasoning(text.to_owned())
    }

    fn content(text: &str) -> ReasoningDelta {
        ReasoningDelta::Content(text.to_owned())
    }

    #[test]
    fn explicit_think_block() {
        assert_eq!(
            parse_reasoning("<think>Plan the answer.</think>The answer is 42.", true),
            split(Some("Plan the answer."), Some("The answer is 42."))
        );
    }

    #[test]
    fn template_opened_think() {
        assert_eq!(
            parse_reasoning("Plan the answer.</think>The answer is 42.", true),
            split(Some("Plan the answer."), Some("The answer is 42."))
        );
    }

    #[test]
    fn duplicate_think_end_is_dropped() {
        assert_eq!(
            parse_reasoning("Plan.</think></think>The answer is 42.", true),
            split(Some("Plan."), Some("The answer is 42."))
        );
    }

    #[test]
    fn tool_call_ends_reasoning_and_stays_in_content() {
        let call = "<tool_call>\n<function=f>\n</function>\n</tool_call>";
        assert_eq!(
            parse_reasoning(&format!("I need the forecast.{call}"), true),
            split(Some("I need the forecast."), Some(call))
        );
    }

    #[test]
    fn thinking_disabled_gives_everything_as_content() {
        assert_eq!(
            parse_reasoning("The answer is 42.", false),
            split(None, Some("The answer is 42."))
        );
        assert_eq!(
            parse_reasoning("<think>x</think>y", false),
            split(None, Some("<think>xy"))
        );
    }

    #[test]
    fn unfinished_reasoning_is_all_reasoning() {
        assert_eq!(
            parse_reasoning("still thinking <tool", true),
            split(Some("still thinking <tool"), None)
        );
    }

    #[test]
    fn turn_markers_are_dropped() {
        assert_eq!(
            parse_reasoning("a</think>b<|im_end|>", true),
            split(Some("a"), Some("b"))
        );
    }

    #[test]
    fn streaming_with_tags_split_across_chunks() {
        let mut parser = ReasoningParser::new(true);
        let chunks = ["Plan the ", "answer.</th", "ink>The answer", " is 42."];
        let mut deltas = push_all(&mut parser, &chunks);
        assert!(!parser.in_reasoning());
        deltas.extend(parser.finish());
        let expected = [
            reasoning("Plan the "),
            reasoning("answer."),
            content("The answer"),
            content(" is 42."),
        ];
        assert_eq!(deltas, expected);
    }

    #[test]
    fn think_end_and_tool_call_in_one_chunk_do_not_leak_into_reasoning() {
        let mut parser = ReasoningParser::new(true);
        let chunks = [
            "Let me check the forecast.",
            "</think><tool_call>",
            "<function=get_weather>",
        ];
        let mut deltas = push_all(&mut parser, &chunks);
        deltas.extend(parser.finish());
        let expected = [
            reasoning("Let me check the forecast."),
            content("<tool_call>"),
            content("<function=get_weather>"),
        ];
        assert_eq!(deltas, expected);
    }
}
