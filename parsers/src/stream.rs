//! The streaming BerryLM parser: reasoning, content and tool calls in one
//! pass, following vLLM's `berrylm` grammar.
//!
//! States and transitions (tags not listed are text of the current state;
//! ChatML turn markers are dropped everywhere):
//!
//! | state      | tag             | next       | effect                         |
//! |------------|-----------------|------------|--------------------------------|
//! | reasoning  | `<think>`       | reasoning  | absorbed                       |
//! | reasoning  | `</think>`      | content    | reasoning ends                 |
//! | reasoning  | `<tool_call>`   | preamble   | reasoning ends, call begins    |
//! | content    | `</think>`      | content    | dropped (duplicate)            |
//! | content    | `<tool_call>`   | preamble   | call begins                    |
//! | content    | `<function=`    | name       | call begins (no `<tool_call>`) |
//! | preamble   | `<function=`    | name       |                                |
//! | preamble   | `</tool_call>`  | content    | empty call, nothing emitted    |
//! | name       | `>`             | arguments  | call starts if the name is set |
//! | name, args | `</function>`   | between    | call ends                      |
//! | between    | `</tool_call>`  | content    |                                |
//! | between    | `<tool_call>`   | preamble   | next call begins               |
//! | between    | `<function=`    | name       | next call begins               |
//!
//! Text in the preamble and between calls is dropped. Content that is only
//! whitespace is held back until non-whitespace content follows; it is
//! dropped when a tool call starts first, as vLLM drops whitespace-only
//! content around tool calls.

use crate::arguments::{ArgumentBuilder, BodyPiece};
use crate::ids::{RandomToolCallIds, ToolCallIdSource};
use crate::lexer::{Lexeme, Tag, TagLexer};
use crate::options::ParserOptions;
use crate::reasoning::{tag_in_reasoning, TagInReasoning};

/// A piece of streamed assistant output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delta {
    /// Reasoning text.
    Reasoning(String),
    /// Content text.
    Content(String),
    /// A tool call begins; its arguments follow as fragments.
    ToolCallStart {
        index: usize,
        id: String,
        name: String,
    },
    /// The next piece of the arguments JSON of call `index`. The fragments of
    /// a call concatenate to its complete arguments JSON object.
    ToolCallArguments { index: usize, fragment: String },
}

#[derive(Debug)]
enum State {
    Reasoning,
    Content,
    ToolPreamble,
    ToolName(String),
    /// `None` when the call has no name and is ignored.
    ToolArguments(Option<ActiveCall>),
    BetweenToolCalls,
}

/// A tool call whose start has been emitted.
#[derive(Debug)]
struct ActiveCall {
    index: usize,
    /// Position of the called function in the request's tools.
    tool: Option<usize>,
    arguments: ArgumentBuilder,
}

/// Streaming parser for one BerryLM completion. Feed the decoded text with
/// [`BerryLmStreamParser::push`] in chunks of any size, then call
/// [`BerryLmStreamParser::finish`]. A tag split across chunks is held back
/// until it is complete.
#[derive(Debug)]
pub struct BerryLmStreamParser<I: ToolCallIdSource = RandomToolCallIds> {
    options: ParserOptions,
    ids: I,
    lexer: TagLexer,
    state: State,
    content: ContentGate,
    calls_started: usize,
}

impl BerryLmStreamParser<RandomToolCallIds> {
    /// A parser that gives tool calls random ids.
    pub fn new(options: ParserOptions) -> Self {
        Self::with_id_source(options, RandomToolCallIds::default())
    }
}

impl<I: ToolCallIdSource> BerryLmStreamParser<I> {
    pub fn with_id_source(options: ParserOptions, ids: I) -> Self {
        let state = if options.thinking_enabled {
            State::Reasoning
        } else {
            State::Content
        };
        Self {
            options,
            ids,
            lexer: TagLexer::default(),
            state,
            content: ContentGate::default(),
            calls_started: 0,
        }
    }

    /// Parses the next chunk of output.
    pub fn push(&mut self, chunk: &str) -> Vec<Delta> {
        let lexemes = self.lexer.push(chunk);
        let mut deltas = Vec::new();
        for lexeme in lexemes {
            self.step(lexeme, &mut deltas);
        }
        deltas
    }

    /// Ends the output: flushes held-back text, closes an unfinished tool
    /// call (its arguments as far as they go) and releases held whitespace
    /// when no tool call was made.
    pub fn finish(&mut self) -> Vec<Delta> {
        let mut deltas = Vec::new();
        for lexeme in self.lexer.finish() {
            self.step(lexeme, &mut deltas);
        }
        match std::mem::replace(&mut self.state, State::Content) {
            State::ToolName(name) => {
                let call = self.start_call(&name, &mut deltas);
                self.end_call(call, &mut deltas);
            }
            State::ToolArguments(call) => self.end_call(call, &mut deltas),
            _ => {}
        }
        self.content.finish(self.calls_started > 0, &mut deltas);
        deltas
    }

    fn step(&mut self, lexeme: Lexeme, deltas: &mut Vec<Delta>) {
        let state = std::mem::replace(&mut self.state, State::Content);
        self.state = match lexeme {
            Lexeme::Text(text) => self.on_text(state, &text, deltas),
            Lexeme::Tag(tag) if tag.is_turn_marker() => state,
            Lexeme::Tag(tag) => self.on_tag(state, tag, deltas),
        };
    }

    fn on_text(&mut self, state: State, text: &str, deltas: &mut Vec<Delta>) -> State {
        match state {
            State::Reasoning => push_delta(deltas, Delta::Reasoning(text.to_owned())),
            State::Content => self.content.pass(text, deltas),
            State::ToolName(mut name) => {
                name.push_str(text);
                return State::ToolName(name);
            }
            State::ToolArguments(Some(call)) => {
                return self.feed_arguments(call, BodyPiece::Text(text), deltas)
            }
            State::ToolPreamble | State::ToolArguments(None) | State::BetweenToolCalls => {}
        }
        state
    }

    fn on_tag(&mut self, state: State, tag: Tag, deltas: &mut Vec<Delta>) -> State {
        match (state, tag) {
            (State::Reasoning, tag) => match tag_in_reasoning(tag) {
                TagInReasoning::Absorbed => State::Reasoning,
                TagInReasoning::EndsReasoning => State::Content,
                TagInReasoning::EndsReasoningWithToolCall => State::ToolPreamble,
                TagInReasoning::Text => self.on_text(State::Reasoning, tag.literal(), deltas),
            },
            (State::Content, Tag::ThinkClose) => State::Content,
            (State::Content | State::BetweenToolCalls, Tag::ToolCallOpen) => State::ToolPreamble,
            (State::Content | State::ToolPreamble | State::BetweenToolCalls, Tag::FunctionOpen) => {
                State::ToolName(String::new())
            }
            (State::ToolPreamble | State::BetweenToolCalls, Tag::ToolCallClose) => State::Content,
            (State::ToolName(name), Tag::CloseAngle) => {
                State::ToolArguments(self.start_call(&name, deltas))
            }
            (State::ToolName(name), Tag::FunctionClose) => {
                let call = self.start_call(&name, deltas);
                self.end_call(call, deltas);
                State::BetweenToolCalls
            }
            (State::ToolArguments(call), Tag::FunctionClose) => {
                self.end_call(call, deltas);
                State::BetweenToolCalls
            }
            (State::ToolArguments(Some(call)), Tag::ParameterOpen) => {
                self.feed_arguments(call, BodyPiece::ParameterOpen, deltas)
            }
            (State::ToolArguments(Some(call)), Tag::ParameterClose) => {
                self.feed_arguments(call, BodyPiece::ParameterClose, deltas)
            }
            (state, tag) => self.on_text(state, tag.literal(), deltas),
        }
    }

    /// Starts a call once its name is complete. A call without a name is
    /// ignored.
    fn start_call(&mut self, name: &str, deltas: &mut Vec<Delta>) -> Option<ActiveCall> {
        let name = name.trim();
        if name.is_empty() {
            return None;
        }
        let index = self.calls_started;
        self.calls_started += 1;
        self.content.drop_held();
        deltas.push(Delta::ToolCallStart {
            index,
            id: self.ids.next_id(),
            name: name.to_owned(),
        });
        Some(ActiveCall {
            index,
            tool: self.options.tool_position(name),
            arguments: ArgumentBuilder::new(),
        })
    }

    fn feed_arguments(
        &mut self,
        mut call: ActiveCall,
        piece: BodyPiece<'_>,
        deltas: &mut Vec<Delta>,
    ) -> State {
        let tool = call
            .tool
            .and_then(|position| self.options.tools.get(position));
        call.arguments.push(piece, tool);
        let fragment = call.arguments.take_fragment();
        push_delta(
            deltas,
            Delta::ToolCallArguments {
                index: call.index,
                fragment,
            },
        );
        State::ToolArguments(Some(call))
    }

    fn end_call(&mut self, call: Option<ActiveCall>, deltas: &mut Vec<Delta>) {
        if let Some(mut call) = call {
            let tool = call
                .tool
                .and_then(|position| self.options.tools.get(position));
            let fragment = call.arguments.finish(tool);
            push_delta(
                deltas,
                Delta::ToolCallArguments {
                    index: call.index,
                    fragment,
                },
            );
        }
    }
}

/// Appends `delta`, merging it into the previous delta of the same kind and
/// dropping empty text.
fn push_delta(deltas: &mut Vec<Delta>, delta: Delta) {
    match (deltas.last_mut(), delta) {
        (_, Delta::Reasoning(text) | Delta::Content(text)) if text.is_empty() => {}
        (_, Delta::ToolCallArguments { fragment, .. }) if fragment.is_empty() => {}
        (Some(Delta::Reasoning(last)), Delta::Reasoning(text))
        | (Some(Delta::Content(last)), Delta::Content(text)) => last.push_str(&text),
        (
            Some(Delta::ToolCallArguments {
                index: last_index,
                fragment: last,
            }),
            Delta::ToolCallArguments { index, fragment },
        ) if *last_index == index => last.push_str(&fragment),
        (_, delta) => deltas.push(delta),
    }
}

/// Holds back content that is only whitespace until it is known whether
/// real content or a tool call comes next.
#[derive(Debug, Default)]
struct ContentGate {
    held_whitespace: String,
    open: bool,
}

impl ContentGate {
    fn pass(&mut self, text: &str, deltas: &mut Vec<Delta>) {
        if self.open {
            push_delta(deltas, Delta::Content(text.to_owned()));
            return;
        }
        self.held_whitespace.push_str(text);
        if !self.held_whitespace.trim().is_empty() {
            self.open = true;
            let text = std::mem::take(&mut self.held_whitespace);
            push_delta(deltas, Delta::Content(text));
        }
    }

    fn drop_held(&mut self) {
        self.held_whitespace.clear();
    }

    fn finish(&mut self, tool_calls_made: bool, deltas: &mut Vec<Delta>) {
        let held = std::mem::take(&mut self.held_whitespace);
        if !tool_calls_made {
            push_delta(deltas, Delta::Content(held));
        }
    }
}
