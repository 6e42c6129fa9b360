//! Splits model output into plain text and the tag strings of the BerryLM
//! grammar, across arbitrary chunk boundaries.
//!
//! A chunk may end in the middle of a tag (`"<tool_"` + `"call>"`). The lexer
//! holds back such a suffix until the next chunk shows whether it completes a
//! tag, so a tag is recognised at the same place however the text is chunked.

/// A terminal of the BerryLM output grammar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tag {
    ThinkOpen,
    ThinkClose,
    ToolCallOpen,
    ToolCallClose,
    FunctionOpen,
    FunctionClose,
    ParameterOpen,
    ParameterClose,
    CloseAngle,
    TurnStart,
    TurnEnd,
    EndOfText,
}

impl Tag {
    const ALL: [Tag; 12] = [
        Tag::ThinkOpen,
        Tag::ThinkClose,
        Tag::ToolCallOpen,
        Tag::ToolCallClose,
        Tag::FunctionOpen,
        Tag::FunctionClose,
        Tag::ParameterOpen,
        Tag::ParameterClose,
        Tag::CloseAngle,
        Tag::TurnStart,
        Tag::TurnEnd,
        Tag::EndOfText,
    ];

    /// The exact text of the tag.
    pub(crate) fn literal(self) -> &'static str {
        match self {
            Tag::ThinkOpen => "<think>",
            Tag::ThinkClose => "</think>",
            Tag::ToolCallOpen => "<tool_call>",
            Tag::ToolCallClose => "</tool_call>",
            Tag::FunctionOpen => "<function=",
            Tag::FunctionClose => "</function>",
            Tag::ParameterOpen => "<parameter=",
            Tag::ParameterClose => "</parameter>",
            Tag::CloseAngle => ">",
            Tag::TurnStart => "<|im_start|>",
            Tag::TurnEnd => "<|im_end|>",
            Tag::EndOfText => "<|endoftext|>",
        }
    }

    /// ChatML special tokens that may leak into the decoded text; they carry
    /// no content and are dropped everywhere (as vLLM drops special tokens
    /// that are not grammar terminals).
    pub(crate) fn is_turn_marker(self) -> bool {
        matches!(self, Tag::TurnStart | Tag::TurnEnd | Tag::EndOfText)
    }

    /// The tag whose text starts `text`, if any. No tag text is a prefix of
    /// another, so at most one matches.
    fn at_start_of(text: &str) -> Option<Tag> {
        Tag::ALL
            .into_iter()
            .find(|tag| text.starts_with(tag.literal()))
    }

    /// Whether `text` is a proper prefix of some tag, so more input could
    /// still complete it.
    fn could_begin_with(text: &str) -> bool {
        Tag::ALL.into_iter().any(|tag| {
            let literal = tag.literal();
            literal.len() > text.len() && literal.starts_with(text)
        })
    }
}

/// One piece of lexed output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Lexeme {
    Text(String),
    Tag(Tag),
}

/// Incremental lexer: feed chunks with [`TagLexer::push`], then
/// [`TagLexer::finish`] once the output is complete.
#[derive(Debug, Default)]
pub(crate) struct TagLexer {
    held_back: String,
}

impl TagLexer {
    pub(crate) fn push(&mut self, chunk: &str) -> Vec<Lexeme> {
        let mut buffer = std::mem::take(&mut self.held_back);
        buffer.push_str(chunk);
        self.scan(&buffer, false)
    }

    pub(crate) fn finish(&mut self) -> Vec<Lexeme> {
        let buffer = std::mem::take(&mut self.held_back);
        self.scan(&buffer, true)
    }

    fn scan(&mut self, buffer: &str, at_end: bool) -> Vec<Lexeme> {
        let mut lexemes = Vec::new();
        let mut text_start = 0;
        let mut pos = 0;
        // Every tag begins with '<' or '>', both ASCII, so these byte
        // positions are always char boundaries.
        while let Some(offset) = buffer[pos..].find(['<', '>']) {
            pos += offset;
            let rest = &buffer[pos..];
            if let Some(tag) = Tag::at_start_of(rest) {
                push_text(&mut lexemes, &buffer[text_start..pos]);
                lexemes.push(Lexeme::Tag(tag));
                pos += tag.literal().len();
                text_start = pos;
            } else if !at_end && Tag::could_begin_with(rest) {
                push_text(&mut lexemes, &buffer[text_start..pos]);
                self.held_back = rest.to_owned();
                return lexemes;
            } else {
                pos += 1;
            }
        }
        push_text(&mut lexemes, &buffer[text_start..]);
        lexemes
    }
}

fn push_text(lexemes: &mut Vec<Lexeme>, text: &str) {
    if !text.is_empty() {
        lexemes.push(Lexeme::Text(text.to_owned()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(s: &str) -> Lexeme {
        Lexeme::Text(s.to_owned())
    }

    fn lex_chunks(chunks: &[&str]) -> Vec<Lexeme> {
        let mut lexer = TagLexer::default();
        let mut lexemes: Vec<Lexeme> = chunks.iter().flat_map(|c| lexer.push(c)).collect();
        lexemes.extend(lexer.finish());
        lexemes
    }

    #[test]
    fn recognises_tags_between_text() {
        assert_eq!(
            lex_chunks(&["a<think>b</think>c"]),
            vec![
                text("a"),
                Lexeme::Tag(Tag::ThinkOpen),
                text("b"),
                Lexeme::Tag(Tag::ThinkClose),
                text("c"),
            ]
        );
    }

    #[test]
    fn holds_back_a_partial_tag_until_the_next_chunk() {
        let mut lexer = TagLexer::default();
        assert_eq!(lexer.push("abc<tool_"), vec![text("abc")]);
        assert_eq!(
            lexer.push("call>x"),
            vec![Lexeme::Tag(Tag::ToolCallOpen), text("x")]
        );
    }

    #[test]
    fn releases_a_partial_tag_that_does_not_complete() {
        let mut lexer = TagLexer::default();
        assert_eq!(lexer.push("<tool_"), vec![]);
        assert_eq!(lexer.push("box"), vec![text("<tool_box")]);
    }

    #[test]
    fn finish_flushes_a_held_back_prefix_as_text() {
        assert_eq!(lex_chunks(&["x</func"]), vec![text("x"), text("</func")]);
    }

    #[test]
    fn close_angle_and_function_header() {
        assert_eq!(
            lex_chunks(&["<function=f", ">1 > 0"]),
            vec![
                Lexeme::Tag(Tag::FunctionOpen),
                text("f"),
                Lexeme::Tag(Tag::CloseAngle),
                text("1 "),
                Lexeme::Tag(Tag::CloseAngle),
                text(" 0"),
            ]
        );
    }

    #[test]
    fn a_stray_angle_bracket_is_text() {
        assert_eq!(
            lex_chunks(&["a < b", "<<think>"]),
            vec![text("a < b"), text("<"), Lexeme::Tag(Tag::ThinkOpen)]
        );
    }

    #[test]
    fn non_ascii_text_survives() {
        assert_eq!(
            lex_chunks(&["привет <", "думаю"]),
            vec![text("привет "), text("<думаю")]
        );
    }
}
