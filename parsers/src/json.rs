//! JSON text in the layout of Python's `json.dumps(..., ensure_ascii=False)`,
//! which is what vLLM sends as tool-call arguments: `", "` between items,
//! `": "` after keys, non-ASCII characters written as they are.

use serde_json::Value;

/// Appends `value` as JSON text.
pub(crate) fn write_value(value: &Value, out: &mut String) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(flag) => out.push_str(if *flag { "true" } else { "false" }),
        Value::Number(number) => out.push_str(&number.to_string()),
        Value::String(text) => write_string(text, out),
        Value::Array(items) => {
            out.push('[');
            for (position, item) in items.iter().enumerate() {
                if position > 0 {
                    out.push_str(", ");
                }
                write_value(item, out);
            }
            out.push(']');
        }
        Value::Object(entries) => {
            out.push('{');
            for (position, (key, item)) in entries.iter().enumerate() {
                if position > 0 {
                    out.push_str(", ");
                }
                write_string(key, out);
                out.push_str(": ");
                write_value(item, out);
            }
            out.push('}');
        }
    }
}

/// Appends `text` as a quoted JSON string.
pub(crate) fn write_string(text: &str, out: &mut String) {
    out.push('"');
    write_string_body(text, out);
    out.push('"');
}

/// Appends the escaped characters of `text` without the quotes. Escaping is
/// per character, so escaping the pieces of a string one after another gives
/// the escaping of the whole string.
pub(crate) fn write_string_body(text: &str, out: &mut String) {
    for character in text.chars() {
        match character {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            control if u32::from(control) < 0x20 => {
                out.push_str(&format!("\\u{:04x}", u32::from(control)));
            }
            other => out.push(other),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(value: &Value) -> String {
        let mut out = String::new();
        write_value(value, &mut out);
        out
    }

    #[test]
    fn uses_python_separators() {
        assert_eq!(
            render(&json!({"a": [1, 2.5, null], "b": {"c": true}})),
            r#"{"a": [1, 2.5, null], "b": {"c": true}}"#
        );
    }

    #[test]
    fn escapes_like_json_dumps_without_ascii_escaping() {
        assert_eq!(
            render(&json!("q\"\\\n\r\t\u{8}\u{c}\u{1}ё/")),
            r#""q\"\\\n\r\t\b\f\u0001ё/""#
        );
    }

    #[test]
    fn escaped_text_parses_back() {
        let original = "line 1\nline \"2\"\u{1f}\\end";
        let mut out = String::new();
        write_string(original, &mut out);
        assert_eq!(
            serde_json::from_str::<String>(&out).ok().as_deref(),
            Some(original)
        );
    }
}
