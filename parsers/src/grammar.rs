//! Grammars (llguidance's Lark syntax) that force or forbid tool calls in
//! BerryLM's format, for the OpenAI `tool_choice`.
//!
//! A forced call is written the way the chat template renders one:
//!
//! ```text
//! <tool_call>
//! <function=get_weather>
//! <parameter=city>
//! Oslo
//! </parameter>
//! <parameter=days>
//! 3
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! `<tool_call>` and `</tool_call>` are special tokens and appear in the
//! grammar as such. Only the offered functions can be named. Each parameter
//! the schema declares appears in declaration order (the required ones
//! always, the others optionally); a parameter whose schema admits only
//! strings takes one line of raw text (or one of its `enum` values), any
//! other takes JSON valid against its schema, written compactly.

use serde_json::{json, Map, Value};

use crate::schema::{admits_only_strings, ToolSchema};

/// The output holds no special token after the reasoning, `<tool_call>`
/// included: text, then the end of the turn (`<|im_end|>`, a special token
/// too, which the grammar names so that the answer can end).
pub const NO_TOOL_CALL_GRAMMAR: &str = "start: TEXT? <|im_end|>\nTEXT: /(?s:.+)/\n";

/// One or more calls, each to one of `tools`, then the end of the turn.
/// `None` without tools.
pub fn required_tool_calls_grammar(tools: &[ToolSchema]) -> Option<String> {
    if tools.is_empty() {
        return None;
    }
    Some(grammar("start: (SEP? call)+ <|im_end|>", tools))
}

/// Exactly one call, to `tool`, then the end of the turn.
pub fn named_tool_call_grammar(tool: &ToolSchema) -> String {
    grammar("start: SEP? call <|im_end|>", std::slice::from_ref(tool))
}

fn grammar(start: &str, tools: &[ToolSchema]) -> String {
    let mut lark = format!("{start}\nSEP: /\\n+/\n");
    let functions = (0..tools.len())
        .map(|index| format!("function_{index}"))
        .collect::<Vec<_>>()
        .join(" | ");
    lark.push_str(&format!(
        "call: <tool_call> \"\\n<function=\" ({functions}) \"</function>\\n\" </tool_call>\n"
    ));
    for (index, tool) in tools.iter().enumerate() {
        lark.push_str(&function_rules(index, tool));
    }
    lark
}

/// `function_I: "NAME>\n" parameter_I_0 parameter_I_1? ...` and the
/// parameters' rules.
fn function_rules(index: usize, tool: &ToolSchema) -> String {
    let properties = tool
        .parameters
        .get("properties")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    let required = tool
        .parameters
        .get("required")
        .and_then(Value::as_array)
        .map(|names| names.iter().filter_map(Value::as_str).collect::<Vec<_>>())
        .unwrap_or_default();
    let definitions = shared_definitions(&tool.parameters);

    let mut body = format!(
        "function_{index}: {}",
        literal(&format!("{}>\n", tool.name))
    );
    let mut rules = String::new();
    for (position, (name, schema)) in properties.iter().enumerate() {
        let rule = format!("parameter_{index}_{position}");
        body.push(' ');
        body.push_str(&rule);
        if !required.contains(&name.as_str()) {
            body.push('?');
        }
        rules.push_str(&format!(
            "{rule}: {} {} \"\\n</parameter>\\n\"\n",
            literal(&format!("<parameter={name}>\n")),
            value_item(schema, &definitions)
        ));
    }
    body.push('\n');
    body.push_str(&rules);
    body
}

/// The `$defs` / `definitions` of the parameters schema, which the schemas
/// of its properties may refer to.
fn shared_definitions(parameters: &Map<String, Value>) -> Map<String, Value> {
    ["$defs", "definitions"]
        .into_iter()
        .filter_map(|key| Some((key.to_owned(), parameters.get(key)?.clone())))
        .collect()
}

/// The grammar item for one parameter value.
fn value_item(schema: &Value, definitions: &Map<String, Value>) -> String {
    if admits_only_strings(schema) {
        let choices = schema
            .get("enum")
            .and_then(Value::as_array)
            .map(|values| values.iter().map(Value::as_str).collect::<Option<Vec<_>>>());
        return match choices {
            Some(Some(choices))
                if !choices.is_empty() && choices.iter().all(|choice| is_one_line(choice)) =>
            {
                let alternatives = choices
                    .iter()
                    .map(|choice| literal(choice))
                    .collect::<Vec<_>>();
                format!("({})", alternatives.join(" | "))
            }
            _ => "/[^<\\n]+/".to_owned(),
        };
    }
    let mut schema = match schema {
        Value::Object(schema) => schema.clone(),
        _ => Map::new(),
    };
    for (key, value) in definitions {
        schema.entry(key.clone()).or_insert_with(|| value.clone());
    }
    schema.insert(
        "x-guidance".to_owned(),
        json!({"whitespace_flexible": false, "lenient": true}),
    );
    format!("%json {}", with_sorted_keys(Value::Object(schema)))
}

/// `value` with every object's keys in sorted order, so that the grammar's
/// text is the same whether or not serde_json keeps insertion order (the
/// host's build enables its `preserve_order`).
fn with_sorted_keys(value: Value) -> Value {
    match value {
        Value::Object(object) => {
            let mut entries: Vec<(String, Value)> = object.into_iter().collect();
            entries.sort_by(|(a, _), (b, _)| a.cmp(b));
            Value::Object(
                entries
                    .into_iter()
                    .map(|(key, value)| (key, with_sorted_keys(value)))
                    .collect(),
            )
        }
        Value::Array(items) => Value::Array(items.into_iter().map(with_sorted_keys).collect()),
        other => other,
    }
}

/// Raw text the tool-call parser reads back unchanged: one line, no tag.
fn is_one_line(text: &str) -> bool {
    !text.is_empty() && !text.contains(['\n', '<'])
}

/// A Lark string literal (Lark reads them as JSON strings).
fn literal(text: &str) -> String {
    Value::String(text.to_owned()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Vec<ToolSchema> {
        ToolSchema::parse_request_tools(&json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer", "minimum": 1},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}
                },
                "required": ["city"]
            }}},
            {"type": "function", "function": {"name": "ping"}}
        ]))
        .unwrap_or_default()
    }

    #[test]
    fn required_offers_every_tool_one_or_more_times() {
        let grammar = required_tool_calls_grammar(&tools()).unwrap_or_default();
        let lines = grammar.lines().collect::<Vec<_>>();
        assert_eq!(
            lines,
            [
                "start: (SEP? call)+ <|im_end|>",
                "SEP: /\\n+/",
                "call: <tool_call> \"\\n<function=\" (function_0 | function_1) \"</function>\\n\" </tool_call>",
                "function_0: \"get_weather>\\n\" parameter_0_0 parameter_0_1? parameter_0_2?",
                "parameter_0_0: \"<parameter=city>\\n\" /[^<\\n]+/ \"\\n</parameter>\\n\"",
                "parameter_0_1: \"<parameter=days>\\n\" %json {\"minimum\":1,\"type\":\"integer\",\"x-guidance\":{\"lenient\":true,\"whitespace_flexible\":false}} \"\\n</parameter>\\n\"",
                "parameter_0_2: \"<parameter=unit>\\n\" (\"celsius\" | \"fahrenheit\") \"\\n</parameter>\\n\"",
                "function_1: \"ping>\\n\"",
            ]
        );
    }

    #[test]
    fn required_without_tools_has_no_grammar() {
        assert_eq!(required_tool_calls_grammar(&[]), None);
    }

    #[test]
    fn named_offers_only_that_tool_once() {
        let tools = tools();
        let grammar = named_tool_call_grammar(&tools[1]);
        assert!(
            grammar.starts_with("start: SEP? call <|im_end|>\n"),
            "{grammar}"
        );
        assert!(grammar.contains("(function_0)"), "{grammar}");
        assert!(grammar.contains("function_0: \"ping>\\n\""), "{grammar}");
        assert!(!grammar.contains("get_weather"), "{grammar}");
    }

    #[test]
    fn property_schemas_keep_the_shared_definitions() {
        let tool = ToolSchema::new(
            "plan",
            json!({
                "type": "object",
                "properties": {"steps": {"type": "array", "items": {"$ref": "#/$defs/step"}}},
                "$defs": {"step": {"type": "integer"}}
            })
            .as_object()
            .cloned()
            .unwrap_or_default(),
        );
        let grammar = named_tool_call_grammar(&tool);
        assert!(
            grammar.contains("%json {\"$defs\":{\"step\":{\"type\":\"integer\"}},\"items\":{\"$ref\":\"#/$defs/step\"},\"type\":\"array\","),
            "{grammar}"
        );
    }
}
