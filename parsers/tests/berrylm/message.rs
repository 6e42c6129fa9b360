//! Assembling deltas into the message.

use berrylm_parsers::{Delta, MessageAssembler};

use crate::support::{message, tool_call};

fn assemble(deltas: Vec<Delta>) -> berrylm_parsers::AssistantMessage {
    let mut assembler = MessageAssembler::new();
    for delta in &deltas {
        assembler.push(delta);
    }
    assembler.finish()
}

#[test]
fn concatenates_text_and_argument_fragments() {
    let assembled = assemble(vec![
        Delta::Reasoning("a".to_owned()),
        Delta::Reasoning("b".to_owned()),
        Delta::Content(" c ".to_owned()),
        Delta::ToolCallStart {
            index: 0,
            id: crate::support::call_id(0),
            name: "f".to_owned(),
        },
        Delta::ToolCallArguments {
            index: 0,
            fragment: "{".to_owned(),
        },
        Delta::ToolCallArguments {
            index: 0,
            fragment: "}".to_owned(),
        },
    ]);
    assert_eq!(
        assembled,
        message(Some("ab"), Some("c"), vec![tool_call(0, "f", "{}")])
    );
}

#[test]
fn content_is_trimmed_only_when_tools_are_called() {
    assert_eq!(
        assemble(vec![Delta::Content(" c ".to_owned())]),
        message(None, Some(" c "), Vec::new())
    );
    assert_eq!(assemble(Vec::new()), message(None, None, Vec::new()));
}

#[test]
fn fragments_for_an_unknown_call_are_ignored() {
    assert_eq!(
        assemble(vec![Delta::ToolCallArguments {
            index: 3,
            fragment: "{}".to_owned(),
        }]),
        message(None, None, Vec::new())
    );
}
