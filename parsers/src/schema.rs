//! Tool definitions from the request and the schema-driven typing of
//! argument values, after vLLM's `extract_types_from_schema` and
//! `coerce_to_schema_type`.
//!
//! BerryLM writes every argument value as raw text. A value is typed by the
//! JSON schema of its parameter: candidate types are tried in the order
//! null, integer, number, boolean, object, array, string; when none applies
//! the text is read as JSON if it is valid JSON, and kept as a string
//! otherwise. Objects and arrays are then walked with their `properties` /
//! `items` schemas so that nested strings are typed the same way.

use serde_json::{Map, Value};
use thiserror::Error;

/// A malformed entry in the request's `tools` array.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ToolDefinitionError {
    #[error("`tools` must be a JSON array")]
    NotAnArray,
    #[error("tools[{index}] must be a JSON object")]
    NotAnObject { index: usize },
    #[error("tools[{index}] has type {found}, expected \"function\"")]
    UnsupportedType { index: usize, found: String },
    #[error("tools[{index}] has no `function` object")]
    MissingFunction { index: usize },
    #[error("tools[{index}].function has no non-empty string `name`")]
    MissingName { index: usize },
    #[error("tools[{index}].function.parameters (tool `{name}`) must be a JSON object")]
    ParametersNotAnObject { index: usize, name: String },
}

/// One function tool offered to the model: its name and the JSON schema of
/// its parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSchema {
    pub name: String,
    /// The `parameters` JSON schema (an object; `{}` when the request gave
    /// none).
    pub parameters: Map<String, Value>,
}

impl ToolSchema {
    pub fn new(name: impl Into<String>, parameters: Map<String, Value>) -> Self {
        Self {
            name: name.into(),
            parameters,
        }
    }

    /// Reads the OpenAI request `tools` array:
    /// `[{"type": "function", "function": {"name": .., "parameters": {..}}}]`.
    pub fn parse_request_tools(tools: &Value) -> Result<Vec<ToolSchema>, ToolDefinitionError> {
        let entries = tools.as_array().ok_or(ToolDefinitionError::NotAnArray)?;
        entries
            .iter()
            .enumerate()
            .map(|(index, entry)| ToolSchema::parse_request_tool(index, entry))
            .collect()
    }

    fn parse_request_tool(index: usize, entry: &Value) -> Result<ToolSchema, ToolDefinitionError> {
        let entry = entry
            .as_object()
            .ok_or(ToolDefinitionError::NotAnObject { index })?;
        match entry.get("type") {
            Some(Value::String(kind)) if kind == "function" => {}
            other => {
                return Err(ToolDefinitionError::UnsupportedType {
                    index,
                    found: other.map_or_else(|| "(missing)".to_owned(), Value::to_string),
                })
            }
        }
        let function = entry
            .get("function")
            .and_then(Value::as_object)
            .ok_or(ToolDefinitionError::MissingFunction { index })?;
        let name = function
            .get("name")
            .and_then(Value::as_str)
            .filter(|name| !name.is_empty())
            .ok_or(ToolDefinitionError::MissingName { index })?;
        let parameters = match function.get("parameters") {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(parameters)) => parameters.clone(),
            Some(_) => {
                return Err(ToolDefinitionError::ParametersNotAnObject {
                    index,
                    name: name.to_owned(),
                })
            }
        };
        Ok(ToolSchema::new(name, parameters))
    }

    /// The `properties` of the parameters schema, when there are any.
    fn properties(&self) -> Option<&Map<String, Value>> {
        self.parameters
            .get("properties")
            .and_then(Value::as_object)
            .filter(|properties| !properties.is_empty())
    }

    /// Whether an unfinished value of `parameter` may be streamed as it
    /// grows: only when it stays a string whatever text follows, i.e. the
    /// tool has no typed properties at all, or the parameter's schema type is
    /// exactly `string`.
    pub(crate) fn streams_as_text(&self, parameter: &str) -> bool {
        match self.properties() {
            None => true,
            Some(properties) => properties.get(parameter).is_some_and(admits_only_strings),
        }
    }

    /// The typed JSON value of the raw text of `parameter`. Parameters the
    /// schema does not describe stay strings.
    pub(crate) fn argument_value(&self, parameter: &str, text: &str) -> Value {
        match self
            .properties()
            .and_then(|properties| properties.get(parameter))
        {
            Some(schema @ Value::Object(_)) => coerce_text(text, schema),
            _ => Value::String(text.to_owned()),
        }
    }
}

/// Whether `schema` admits strings and nothing else (its values are raw
/// text in a call).
pub(crate) fn admits_only_strings(schema: &Value) -> bool {
    TypeSet::of_schema(schema) == TypeSet::STRING
}

/// The set of JSON types a schema admits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct TypeSet(u8);

impl TypeSet {
    const EMPTY: TypeSet = TypeSet(0);
    const NULL: TypeSet = TypeSet(1);
    const INTEGER: TypeSet = TypeSet(1 << 1);
    const NUMBER: TypeSet = TypeSet(1 << 2);
    const BOOLEAN: TypeSet = TypeSet(1 << 3);
    const OBJECT: TypeSet = TypeSet(1 << 4);
    const ARRAY: TypeSet = TypeSet(1 << 5);
    const STRING: TypeSet = TypeSet(1 << 6);
    /// A type name this crate does not know; it never matches a candidate.
    const UNKNOWN: TypeSet = TypeSet(1 << 7);

    /// The order in which candidate types are tried.
    const CANDIDATES: [TypeSet; 7] = [
        TypeSet::NULL,
        TypeSet::INTEGER,
        TypeSet::NUMBER,
        TypeSet::BOOLEAN,
        TypeSet::OBJECT,
        TypeSet::ARRAY,
        TypeSet::STRING,
    ];

    fn union(self, other: TypeSet) -> TypeSet {
        TypeSet(self.0 | other.0)
    }

    fn contains(self, other: TypeSet) -> bool {
        self.0 & other.0 == other.0
    }

    /// The types named by `type`, implied by `enum` values, and those of the
    /// `anyOf` / `oneOf` / `allOf` alternatives; a schema that names none
    /// admits strings.
    fn of_schema(schema: &Value) -> TypeSet {
        let Some(schema) = schema.as_object() else {
            return TypeSet::STRING;
        };
        let mut types = TypeSet::EMPTY;
        match schema.get("type") {
            Some(Value::String(name)) => types = types.union(TypeSet::named(name)),
            Some(Value::Array(names)) => {
                for name in names.iter().filter_map(Value::as_str) {
                    types = types.union(TypeSet::named(name));
                }
            }
            _ => {}
        }
        if let Some(Value::Array(values)) = schema.get("enum") {
            for value in values {
                types = types.union(TypeSet::of_value(value));
            }
        }
        for keyword in ["anyOf", "oneOf", "allOf"] {
            if let Some(Value::Array(alternatives)) = schema.get(keyword) {
                for alternative in alternatives {
                    types = types.union(TypeSet::of_schema(alternative));
                }
            }
        }
        if types == TypeSet::EMPTY {
            TypeSet::STRING
        } else {
            types
        }
    }

    /// A schema type name, with the aliases vLLM accepts.
    fn named(name: &str) -> TypeSet {
        match name.trim().to_lowercase().as_str() {
            "null" => TypeSet::NULL,
            "integer" | "int" | "int32" | "int64" | "uint" | "uint32" | "uint64" | "long"
            | "short" | "unsigned" => TypeSet::INTEGER,
            "number" | "float" | "float32" | "float64" | "double" => TypeSet::NUMBER,
            "boolean" | "bool" => TypeSet::BOOLEAN,
            "object" | "dict" => TypeSet::OBJECT,
            "array" | "arr" | "list" | "sequence" => TypeSet::ARRAY,
            "string" | "str" | "text" | "varchar" | "char" | "enum" => TypeSet::STRING,
            _ => TypeSet::UNKNOWN,
        }
    }

    fn of_value(value: &Value) -> TypeSet {
        match value {
            Value::Null => TypeSet::NULL,
            Value::Bool(_) => TypeSet::BOOLEAN,
            Value::Number(number) if number.is_i64() || number.is_u64() => TypeSet::INTEGER,
            Value::Number(_) => TypeSet::NUMBER,
            Value::String(_) => TypeSet::STRING,
            Value::Array(_) => TypeSet::ARRAY,
            Value::Object(_) => TypeSet::OBJECT,
        }
    }
}

/// Types raw `text` by `schema`, then types the inside of the result.
fn coerce_text(text: &str, schema: &Value) -> Value {
    let value = coerce_to_types(text, TypeSet::of_schema(schema));
    coerce_nested(value, schema)
}

fn coerce_to_types(text: &str, types: TypeSet) -> Value {
    for candidate in TypeSet::CANDIDATES {
        if !types.contains(candidate) {
            continue;
        }
        let converted = match candidate {
            TypeSet::NULL => (text.to_lowercase() == "null").then_some(Value::Null),
            TypeSet::INTEGER => parse_integer(text),
            TypeSet::NUMBER => parse_number(text),
            TypeSet::BOOLEAN => parse_boolean(text),
            TypeSet::OBJECT | TypeSet::ARRAY => parse_json(text),
            _ => Some(Value::String(text.to_owned())),
        };
        if let Some(value) = converted {
            return value;
        }
    }
    parse_json(text).unwrap_or_else(|| Value::String(text.to_owned()))
}

/// Walks an object or array with the nested `properties` / `items` schema,
/// typing the strings found inside.
fn coerce_nested(value: Value, schema: &Value) -> Value {
    match value {
        Value::Object(mut entries) => {
            if let Some(properties) = schema.get("properties").and_then(Value::as_object) {
                for (key, entry) in entries.iter_mut() {
                    if let Some(entry_schema @ Value::Object(_)) = properties.get(key) {
                        *entry = coerce_entry(std::mem::take(entry), entry_schema);
                    }
                }
            }
            Value::Object(entries)
        }
        Value::Array(mut items) => {
            if let Some(item_schema @ Value::Object(_)) = schema.get("items") {
                for item in items.iter_mut() {
                    *item = coerce_entry(std::mem::take(item), item_schema);
                }
            }
            Value::Array(items)
        }
        other => other,
    }
}

fn coerce_entry(value: Value, schema: &Value) -> Value {
    match value {
        Value::String(text) => coerce_text(&text, schema),
        other => coerce_nested(other, schema),
    }
}

fn parse_integer(text: &str) -> Option<Value> {
    let digits = text.trim();
    digits
        .parse::<i64>()
        .map(Value::from)
        .or_else(|_| digits.parse::<u64>().map(Value::from))
        .ok()
}

/// A finite number; integral values become integers, as vLLM's
/// `val if val != int(val) else int(val)`.
fn parse_number(text: &str) -> Option<Value> {
    let number = text.trim().parse::<f64>().ok().filter(|n| n.is_finite())?;
    // Every integral f64 in this range converts to i64 exactly.
    const I64_RANGE: f64 = 9_223_372_036_854_775_808.0;
    if number.fract() == 0.0 && number.abs() < I64_RANGE {
        Some(Value::from(number as i64))
    } else {
        serde_json::Number::from_f64(number).map(Value::Number)
    }
}

fn parse_boolean(text: &str) -> Option<Value> {
    match text.trim().to_lowercase().as_str() {
        "true" | "1" => Some(Value::Bool(true)),
        "false" | "0" => Some(Value::Bool(false)),
        _ => None,
    }
}

fn parse_json(text: &str) -> Option<Value> {
    serde_json::from_str(text).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tool(parameters: Value) -> ToolSchema {
        match parameters {
            Value::Object(parameters) => ToolSchema::new("t", parameters),
            _ => ToolSchema::new("t", Map::new()),
        }
    }

    fn typed(property: Value, text: &str) -> Value {
        tool(json!({"type": "object", "properties": {"p": property}})).argument_value("p", text)
    }

    #[test]
    fn scalar_types() {
        assert_eq!(typed(json!({"type": "integer"}), "3"), json!(3));
        assert_eq!(typed(json!({"type": "integer"}), " -42 "), json!(-42));
        assert_eq!(typed(json!({"type": "number"}), "2.5"), json!(2.5));
        assert_eq!(typed(json!({"type": "number"}), "4.0"), json!(4));
        assert_eq!(typed(json!({"type": "boolean"}), "True"), json!(true));
        assert_eq!(typed(json!({"type": "boolean"}), "0"), json!(false));
        assert_eq!(typed(json!({"type": "string"}), "007"), json!("007"));
        assert_eq!(typed(json!({"type": "null"}), "NULL"), json!(null));
    }

    #[test]
    fn structured_types() {
        assert_eq!(
            typed(json!({"type": "object"}), r#"{"a": 1}"#),
            json!({"a": 1})
        );
        assert_eq!(typed(json!({"type": "array"}), "[1, 2]"), json!([1, 2]));
    }

    #[test]
    fn type_lists_and_null() {
        let nullable_integer = json!({"type": ["integer", "null"]});
        assert_eq!(typed(nullable_integer.clone(), "null"), json!(null));
        assert_eq!(typed(nullable_integer, "12"), json!(12));
        assert_eq!(
            typed(json!({"type": ["string", "null"]}), "null"),
            json!(null)
        );
        assert_eq!(typed(json!({"type": "string"}), "null"), json!("null"));
        assert_eq!(typed(json!({"type": "integer"}), "null"), json!(null));
    }

    #[test]
    fn failed_conversions_fall_back_to_json_then_string() {
        assert_eq!(typed(json!({"type": "integer"}), "many"), json!("many"));
        assert_eq!(typed(json!({"type": "integer"}), "2.5"), json!(2.5));
        assert_eq!(typed(json!({"type": "boolean"}), "yes"), json!("yes"));
        assert_eq!(typed(json!({"type": "number"}), "nan"), json!("nan"));
        assert_eq!(
            typed(json!({"type": "object"}), "{broken"),
            json!("{broken")
        );
    }

    #[test]
    fn aliases_enums_and_alternatives() {
        assert_eq!(typed(json!({"type": "int"}), "5"), json!(5));
        assert_eq!(typed(json!({"type": " Double "}), "1.5"), json!(1.5));
        assert_eq!(typed(json!({"enum": [1, 2, 3]}), "2"), json!(2));
        assert_eq!(
            typed(
                json!({"anyOf": [{"type": "boolean"}, {"type": "string"}]}),
                "true"
            ),
            json!(true)
        );
        assert_eq!(typed(json!({}), "5"), json!("5"));
        assert_eq!(typed(json!({"type": "mystery"}), "5"), json!(5));
    }

    #[test]
    fn nested_values_are_typed_by_nested_schemas() {
        let schema = json!({
            "type": "object",
            "properties": {
                "count": {"type": "integer"},
                "tags": {"type": "array", "items": {"type": "boolean"}},
                "name": {"type": "string"}
            }
        });
        assert_eq!(
            typed(
                schema,
                r#"{"count": "7", "tags": ["true", 0], "name": "5", "extra": "1"}"#
            ),
            json!({"count": 7, "tags": [true, 0], "name": "5", "extra": "1"})
        );
    }

    #[test]
    fn undescribed_parameters_and_untyped_tools_stay_strings() {
        let typed_tool = tool(json!({"properties": {"p": {"type": "integer"}}}));
        assert_eq!(typed_tool.argument_value("q", "3"), json!("3"));
        assert_eq!(tool(json!({})).argument_value("p", "3"), json!("3"));
    }

    #[test]
    fn streaming_as_text() {
        let typed_tool = tool(json!({"properties": {
            "s": {"type": "string"},
            "n": {"type": "integer"},
            "either": {"type": ["string", "null"]},
            "free": {}
        }}));
        assert!(typed_tool.streams_as_text("s"));
        assert!(typed_tool.streams_as_text("free"));
        assert!(!typed_tool.streams_as_text("n"));
        assert!(!typed_tool.streams_as_text("either"));
        assert!(!typed_tool.streams_as_text("unknown"));
        assert!(tool(json!({})).streams_as_text("anything"));
    }

    #[test]
    fn parses_request_tools() {
        let tools = ToolSchema::parse_request_tools(&json!([
            {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
            {"type": "function", "function": {"name": "b"}}
        ]));
        assert_eq!(
            tools,
            Ok(vec![
                tool_named("a", json!({"type": "object"})),
                tool_named("b", json!({})),
            ])
        );
    }

    fn tool_named(name: &str, parameters: Value) -> ToolSchema {
        ToolSchema {
            name: name.to_owned(),
            ..tool(parameters)
        }
    }

    #[test]
    fn rejects_malformed_request_tools() {
        let parse = |tools: Value| ToolSchema::parse_request_tools(&tools);
        assert_eq!(parse(json!({})), Err(ToolDefinitionError::NotAnArray));
        assert_eq!(
            parse(json!(["x"])),
            Err(ToolDefinitionError::NotAnObject { index: 0 })
        );
        assert_eq!(
            parse(json!([{"type": "web_search"}])),
            Err(ToolDefinitionError::UnsupportedType {
                index: 0,
                found: "\"web_search\"".to_owned()
            })
        );
        assert_eq!(
            parse(json!([{"type": "function"}])),
            Err(ToolDefinitionError::MissingFunction { index: 0 })
        );
        assert_eq!(
            parse(json!([{"type": "function", "function": {"name": ""}}])),
            Err(ToolDefinitionError::MissingName { index: 0 })
        );
        assert_eq!(
            parse(json!([
                {"type": "function", "function": {"name": "ok"}},
                {"type": "function", "function": {"name": "f", "parameters": []}}
            ])),
            Err(ToolDefinitionError::ParametersNotAnObject {
                index: 1,
                name: "f".to_owned()
            })
        );
    }

    #[test]
    fn error_messages_name_the_entry() {
        assert_eq!(
            ToolDefinitionError::MissingName { index: 2 }.to_string(),
            "tools[2].function has no non-empty string `name`"
        );
    }
}
