//! Structured outputs: what a request asks its answer to keep to, as the grammar llm-svc
//! enforces (`pb::Constraint`: a JSON schema, a regular expression or a Lark grammar).
//!
//! The HTTP API reads OpenAI's `response_format` (`text`, `json_object`, `json_schema`) and
//! vLLM's `structured_outputs` (`json`, `regex`, `choice`, `grammar`) with its older
//! `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`; the gRPC API carries
//! the same as `ChatRequest.output_format`. Each becomes one [`OutputFormat`] here, and one
//! `Constraint` on the way to llm-svc, which compiles it (a schema llguidance cannot compile is
//! INVALID_ARGUMENT there, and a 400 with the reason here). A request that asks for two at
//! once is refused naming both. Tool calls that must happen (`tool_choice`) are a grammar too,
//! built in [`crate::tools`].

use serde_json::{Map, Value};
use vlm_proto::pb;

use crate::gateway_error::GatewayError;

/// What the answer must keep to, as a request asked it.
#[derive(Clone, Debug, PartialEq)]
pub enum OutputFormat {
    /// One JSON value this schema (a JSON object) validates.
    JsonSchema(Value),
    /// Text the whole of which matches this regular expression.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A grammar in llguidance's Lark dialect.
    Lark(String),
}

impl OutputFormat {
    /// The grammar llm-svc is sent.
    pub fn constraint(&self) -> pb::Constraint {
        use pb::constraint::Grammar;
        let grammar = match self {
            OutputFormat::JsonSchema(schema) => Grammar::JsonSchema(schema.to_string()),
            OutputFormat::Regex(r) => Grammar::Regex(r.clone()),
            OutputFormat::Choice(choices) => Grammar::Lark(choice_grammar(choices)),
            OutputFormat::Lark(g) => Grammar::Lark(g.clone()),
        };
        pb::Constraint {
            grammar: Some(grammar),
            after_token: None,
        }
    }

    /// Checks what llm-svc would otherwise find later or not at all: a schema that is not a
    /// JSON object, an empty pattern, grammar or choice list.
    fn check(self, field: &str) -> Result<Self, GatewayError> {
        let bad = |why: &str| Err(GatewayError::Invalid(format!("`{field}` {why}")));
        match &self {
            OutputFormat::JsonSchema(schema) if !schema.is_object() => {
                bad(&format!("must be a JSON schema (an object), got {schema}"))
            }
            OutputFormat::Regex(r) if r.is_empty() => bad("is an empty regular expression"),
            OutputFormat::Lark(g) if g.trim().is_empty() => bad("is an empty grammar"),
            OutputFormat::Choice(c) if c.is_empty() => bad("lists no choices"),
            _ => Ok(self),
        }
    }
}

/// A string as a Lark literal: JSON's string syntax, which llguidance's Lark lexer reads,
/// less the raw DEL character that its lexer refuses and JSON leaves unescaped.
pub fn lark_string(s: &str) -> String {
    serde_json::to_string(s)
        .expect("a string serializes")
        .replace('\u{7f}', "\\u007f")
}

/// The grammar of "exactly one of `choices`": `start: "a" | "b"`.
pub fn choice_grammar(choices: &[String]) -> String {
    let alternatives: Vec<String> = choices.iter().map(|c| lark_string(c)).collect();
    format!("start: {}\n", alternatives.join(" | "))
}

/// The public gRPC API's `ChatRequest.output_format` (unset: free text).
pub fn from_pb(f: Option<&pb::OutputFormat>) -> Result<Option<OutputFormat>, GatewayError> {
    use pb::output_format::Format;
    let Some(format) = f.and_then(|f| f.format.as_ref()) else {
        return Ok(None);
    };
    let (field, format) = match format {
        Format::JsonSchema(text) => (
            "output_format.json_schema",
            json_schema_value(&Value::String(text.clone()), "output_format.json_schema")?,
        ),
        Format::Regex(r) => ("output_format.regex", OutputFormat::Regex(r.clone())),
        Format::Choice(c) => (
            "output_format.choice",
            OutputFormat::Choice(c.choices.clone()),
        ),
        Format::Lark(g) => ("output_format.lark", OutputFormat::Lark(g.clone())),
    };
    format.check(field).map(Some)
}

/// The structured-output fields of an HTTP request as sent, any of them absent or null.
#[derive(Debug, Default)]
pub struct RequestedFormats {
    pub response_format: Option<Value>,
    pub structured_outputs: Option<Value>,
    pub guided_json: Option<Value>,
    pub guided_regex: Option<Value>,
    pub guided_choice: Option<Value>,
    pub guided_grammar: Option<Value>,
}

/// The one output format the fields ask for, if any; two at once is a 400 naming both.
pub fn output_format(r: &RequestedFormats) -> Result<Option<OutputFormat>, GatewayError> {
    let mut asked: Vec<(String, OutputFormat)> = Vec::new();
    if let Some(v) = present(&r.response_format) {
        if let Some(f) = response_format(v)? {
            asked.push(("response_format".into(), f));
        }
    }
    if let Some(v) = present(&r.structured_outputs) {
        let Value::Object(o) = v else {
            return Err(GatewayError::Invalid(format!(
                "`structured_outputs` must be an object, got {v}"
            )));
        };
        for (key, value) in o {
            if value.is_null() {
                continue;
            }
            let field = format!("structured_outputs.{key}");
            let format = match key.as_str() {
                "json" => json_schema_value(value, &field)?,
                "regex" => OutputFormat::Regex(string(value, &field)?),
                "choice" => OutputFormat::Choice(strings(value, &field)?),
                "grammar" => OutputFormat::Lark(string(value, &field)?),
                // Options of the backend or the whitespace, not formats: nothing to do here.
                "disable_fallback" | "disable_any_whitespace" | "disable_additional_properties"
                | "whitespace_pattern" | "backend" => continue,
                other => {
                    return Err(GatewayError::Invalid(format!(
                        "`structured_outputs.{other}` is not supported: this server reads json, regex, choice and grammar"
                    )))
                }
            };
            asked.push((field, format));
        }
    }
    let legacy = [
        ("guided_json", &r.guided_json),
        ("guided_regex", &r.guided_regex),
        ("guided_choice", &r.guided_choice),
        ("guided_grammar", &r.guided_grammar),
    ];
    for (field, value) in legacy {
        let Some(value) = present(value) else {
            continue;
        };
        let format = match field {
            "guided_json" => json_schema_value(value, field)?,
            "guided_regex" => OutputFormat::Regex(string(value, field)?),
            "guided_choice" => OutputFormat::Choice(strings(value, field)?),
            _ => OutputFormat::Lark(string(value, field)?),
        };
        asked.push((field.into(), format));
    }
    match asked.len() {
        0 => Ok(None),
        1 => {
            let (field, format) = asked.pop().expect("one");
            format.check(&field).map(Some)
        }
        _ => Err(GatewayError::Invalid(format!(
            "`{}` and `{}` both constrain the answer; send one",
            asked[0].0, asked[1].0
        ))),
    }
}

fn present(v: &Option<Value>) -> Option<&Value> {
    v.as_ref().filter(|v| !v.is_null())
}

/// OpenAI's `response_format`: `text` asks for nothing, `json_object` for any object,
/// `json_schema` for `json_schema.schema` (`name` and `strict` change nothing here: the
/// grammar is always strict).
fn response_format(v: &Value) -> Result<Option<OutputFormat>, GatewayError> {
    let kind = v.get("type").and_then(Value::as_str);
    match kind {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(OutputFormat::JsonSchema(
            serde_json::json!({"type": "object"}),
        ))),
        Some("json_schema") => {
            let Some(spec) = v.get("json_schema").filter(|s| s.is_object()) else {
                return Err(GatewayError::Invalid(
                    "`response_format.json_schema` must be an object with the `schema`".into(),
                ));
            };
            // OpenAI's field is `schema`; vLLM also reads `json_schema.json_schema`.
            let schema = spec
                .get("schema")
                .or_else(|| spec.get("json_schema"))
                .cloned()
                // No schema: any JSON object, as OpenAI's docs have it for a name alone.
                .unwrap_or_else(|| serde_json::json!({"type": "object"}));
            Ok(Some(OutputFormat::JsonSchema(schema)))
        }
        _ => Err(GatewayError::Invalid(format!(
            "`response_format.type` must be text, json_object or json_schema, got {}",
            v.get("type").unwrap_or(&Value::Null)
        ))),
    }
}

/// A schema given as an object, or as JSON text (vLLM accepts both).
fn json_schema_value(v: &Value, field: &str) -> Result<OutputFormat, GatewayError> {
    match v {
        Value::String(text) => serde_json::from_str::<Map<String, Value>>(text)
            .map(|o| OutputFormat::JsonSchema(Value::Object(o)))
            .map_err(|e| {
                GatewayError::Invalid(format!("`{field}` is not a JSON schema object: {e}"))
            }),
        other => Ok(OutputFormat::JsonSchema(other.clone())),
    }
}

fn string(v: &Value, field: &str) -> Result<String, GatewayError> {
    v.as_str()
        .map(str::to_string)
        .ok_or_else(|| GatewayError::Invalid(format!("`{field}` must be a string, got {v}")))
}

fn strings(v: &Value, field: &str) -> Result<Vec<String>, GatewayError> {
    v.as_array()
        .and_then(|a| a.iter().map(|s| s.as_str().map(str::to_string)).collect())
        .ok_or_else(|| {
            GatewayError::Invalid(format!("`{field}` must be a list of strings, got {v}"))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use pb::constraint::Grammar;
    use serde_json::json;

    fn formats(fields: Value) -> Result<Option<OutputFormat>, GatewayError> {
        let get = |k: &str| fields.get(k).cloned();
        output_format(&RequestedFormats {
            response_format: get("response_format"),
            structured_outputs: get("structured_outputs"),
            guided_json: get("guided_json"),
            guided_regex: get("guided_regex"),
            guided_choice: get("guided_choice"),
            guided_grammar: get("guided_grammar"),
        })
    }

    fn grammar(fields: Value) -> Grammar {
        formats(fields)
            .unwrap()
            .expect("a format")
            .constraint()
            .grammar
            .unwrap()
    }

    #[test]
    fn each_way_of_asking_becomes_one_constraint() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        assert_eq!(
            grammar(json!({"response_format": {"type": "json_object"}})),
            Grammar::JsonSchema(r#"{"type":"object"}"#.into())
        );
        let named = json!({"response_format": {"type": "json_schema",
            "json_schema": {"name": "n", "schema": schema, "strict": true}}});
        assert_eq!(grammar(named), Grammar::JsonSchema(schema.to_string()));
        assert_eq!(
            grammar(json!({"structured_outputs": {"json": schema}})),
            Grammar::JsonSchema(schema.to_string())
        );
        assert_eq!(
            grammar(json!({"guided_json": schema.to_string()})),
            Grammar::JsonSchema(schema.to_string())
        );
        for fields in [
            json!({"structured_outputs": {"regex": "[0-9]+"}}),
            json!({"guided_regex": "[0-9]+"}),
        ] {
            assert_eq!(grammar(fields), Grammar::Regex("[0-9]+".into()));
        }
        for fields in [
            json!({"structured_outputs": {"choice": ["yes", "no"]}}),
            json!({"guided_choice": ["yes", "no"]}),
        ] {
            assert_eq!(
                grammar(fields),
                Grammar::Lark("start: \"yes\" | \"no\"\n".into())
            );
        }
        let lark = "start: \"a\"+";
        for fields in [
            json!({"structured_outputs": {"grammar": lark}}),
            json!({"guided_grammar": lark}),
        ] {
            assert_eq!(grammar(fields), Grammar::Lark(lark.into()));
        }
        // Asking for nothing.
        for fields in [
            json!({}),
            json!({"response_format": {"type": "text"}}),
            json!({"response_format": null, "guided_json": null}),
            json!({"structured_outputs": {"backend": "auto", "json": null}}),
        ] {
            assert_eq!(formats(fields.clone()).unwrap(), None, "{fields}");
        }
    }

    #[test]
    fn two_formats_or_a_malformed_one_are_a_400_naming_the_field() {
        for (fields, names) in [
            (
                json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}),
                &["`response_format`", "`guided_regex`"][..],
            ),
            (
                json!({"structured_outputs": {"regex": "a", "choice": ["b"]}}),
                &["`structured_outputs.regex`", "`structured_outputs.choice`"],
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}}),
                &["`response_format`", "JSON schema (an object)"],
            ),
            (
                json!({"response_format": {"type": "xml"}}),
                &["`response_format.type`"],
            ),
            (
                json!({"response_format": {"type": "json_schema"}}),
                &["`response_format.json_schema`"],
            ),
            (json!({"guided_json": "{not json"}), &["`guided_json`"]),
            (
                json!({"guided_choice": []}),
                &["`guided_choice`", "no choices"],
            ),
            (json!({"guided_choice": [1]}), &["`guided_choice`"]),
            (json!({"guided_regex": ""}), &["`guided_regex`"]),
            (
                json!({"structured_outputs": {"structural_tag": "x"}}),
                &["`structured_outputs.structural_tag`"],
            ),
            (
                json!({"structured_outputs": "json"}),
                &["`structured_outputs`"],
            ),
        ] {
            let e = formats(fields.clone()).unwrap_err();
            assert_eq!(e.http_status(), 400, "{fields}");
            for name in names {
                assert!(e.to_string().contains(name), "{fields}: {e}");
            }
        }
    }

    #[test]
    fn choices_are_escaped_as_lark_reads_strings() {
        let choices = vec![
            "say \"hi\"".to_string(),
            "back\\slash\nnew line".into(),
            "del\u{7f}".into(),
            "ünï".into(),
        ];
        assert_eq!(
            choice_grammar(&choices),
            "start: \"say \\\"hi\\\"\" | \"back\\\\slash\\nnew line\" | \"del\\u007f\" | \"ünï\"\n"
        );
        // Every literal reads back as JSON to the choice it came from.
        for c in &choices {
            assert_eq!(&serde_json::from_str::<String>(&lark_string(c)).unwrap(), c);
        }
    }
}
