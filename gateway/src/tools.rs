//! Tools a request offers the model (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`)
//! and the grammar that makes it call them.
//!
//! Qwen's checkpoints call tools in the Hermes format: their chat template lists the tools'
//! signatures in the system turn, and the model answers
//! `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` ([`crate::output`] reads
//! those blocks back into OpenAI's `tool_calls`). What `tool_choice` does:
//! - `none`: the tools are still rendered (the model knows them, as vLLM does it) but the
//!   answer is not searched for calls: any `<tool_call>` text stays content.
//! - `auto` (the default when tools are given): free generation, calls read out afterwards.
//! - `required`, or one function by name: a grammar ([`tool_call_grammar`]) lets the model
//!   answer with nothing but calls, each naming an offered tool (the named one) with
//!   arguments its `parameters` schema validates, so even a weak model returns a valid call.
//!   With `parallel_tool_calls: false` the grammar allows one call; under `auto` the flag
//!   changes nothing (the model's own calls are all read).

use serde_json::{json, Value};

use crate::gateway_error::GatewayError;
use crate::structured::lark_string;

/// A function the model may call.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    pub name: String,
    /// The tool as the request sent it (`{"type": "function", "function": {...}}`), as the
    /// chat template renders it.
    pub spec: Value,
    /// The JSON schema of its arguments (`{"type": "object"}` when the tool gives none).
    pub parameters: Value,
}

/// What the model is asked to do with the tools.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum ToolChoice {
    /// Do not look for calls in the answer.
    None,
    /// Call tools or answer, as the model likes.
    #[default]
    Auto,
    /// Answer with calls only.
    Required,
    /// Answer with calls of this function only.
    Function(String),
}

/// The tools part of a request.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ToolRequest {
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    /// More than one call in an answer (OpenAI's default: true).
    pub parallel: bool,
}

impl ToolRequest {
    /// Whether the answer is read for calls.
    pub fn parses_calls(&self) -> bool {
        !self.tools.is_empty() && self.choice != ToolChoice::None
    }

    /// Whether the answer must be calls (a grammar enforces it).
    pub fn forces_calls(&self) -> bool {
        !self.tools.is_empty()
            && matches!(self.choice, ToolChoice::Required | ToolChoice::Function(_))
    }

    /// The tools' specs as the chat template takes them (empty: no tools section).
    pub fn template_tools(&self) -> Vec<Value> {
        self.tools.iter().map(|t| t.spec.clone()).collect()
    }
}

/// Reads OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` (each absent or null as
/// left out). A `tool_choice` naming no offered tool, or asking for calls with no tools, is a
/// 400 naming it.
pub fn read_tools(
    tools: Option<&Value>,
    choice: Option<&Value>,
    parallel: Option<bool>,
) -> Result<ToolRequest, GatewayError> {
    let bad = |m: String| Err(GatewayError::Invalid(m));
    let tools: Vec<Tool> = match tools.filter(|v| !v.is_null()) {
        None => Vec::new(),
        Some(Value::Array(list)) => list
            .iter()
            .enumerate()
            .map(|(i, t)| read_tool(t, i))
            .collect::<Result<_, _>>()?,
        Some(other) => return bad(format!("`tools` must be a list, got {other}")),
    };
    for (i, t) in tools.iter().enumerate() {
        if tools[..i].iter().any(|u| u.name == t.name) {
            return bad(format!("`tools` names the function {:?} twice", t.name));
        }
    }
    let choice = match choice.filter(|v| !v.is_null()) {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return bad(format!(
                    "`tool_choice` must be none, auto, required or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {other:?}"
                ))
            }
        },
        Some(v) => {
            let Some(name) = v.pointer("/function/name").and_then(Value::as_str) else {
                return bad(format!(
                    "`tool_choice` must be none, auto, required or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {v}"
                ));
            };
            if !tools.iter().any(|t| t.name == name) {
                return bad(format!(
                    "`tool_choice` names the function {name:?}, which `tools` does not offer"
                ));
            }
            ToolChoice::Function(name.to_string())
        }
    };
    if tools.is_empty() && choice == ToolChoice::Required {
        return bad("`tool_choice` is required, but `tools` offers none".into());
    }
    Ok(ToolRequest {
        tools,
        choice,
        parallel: parallel.unwrap_or(true),
    })
}

fn read_tool(t: &Value, i: usize) -> Result<Tool, GatewayError> {
    let at = format!("tools[{i}]");
    if t.get("type").and_then(Value::as_str) != Some("function") {
        return Err(GatewayError::Invalid(format!(
            "`{at}.type` must be function, got {}",
            t.get("type").unwrap_or(&Value::Null)
        )));
    }
    let function = t
        .get("function")
        .filter(|f| f.is_object())
        .ok_or_else(|| GatewayError::Invalid(format!("`{at}.function` must be an object")))?;
    let name = function
        .get("name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| GatewayError::Invalid(format!("`{at}.function.name` is missing")))?;
    let parameters = match function.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object"}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(other) => {
            return Err(GatewayError::Invalid(format!(
                "`{at}.function.parameters` must be a JSON schema (an object), got {other}"
            )))
        }
    };
    Ok(Tool {
        name: name.to_string(),
        spec: t.clone(),
        parameters,
    })
}

/// How a tool-call tag is written in a grammar: the token's id where the vocabulary has the
/// tag as one added token (Qwen's `<tool_call>` is 151657), else its text.
#[derive(Clone, Debug, PartialEq)]
pub enum Tag {
    Token(u32),
    Text(&'static str),
}

impl Tag {
    fn lark(&self) -> String {
        match self {
            Tag::Token(id) => format!("<[{id}]>"),
            Tag::Text(t) => lark_string(t),
        }
    }
}

pub const TOOL_CALL_OPEN: &str = "<tool_call>";
pub const TOOL_CALL_CLOSE: &str = "</tool_call>";

/// The Lark grammar (llguidance's dialect) of an answer made of calls only, for a request
/// that forces them ([`ToolRequest::forces_calls`]; `None` otherwise): each call the Hermes
/// block, its JSON an object whose `name` is an allowed tool's and whose `arguments` that
/// tool's `parameters` validate (an `anyOf` over the tools); calls separated by a newline,
/// one only unless the request allows parallel calls.
pub fn tool_call_grammar(req: &ToolRequest, open: &Tag, close: &Tag) -> Option<String> {
    if !req.forces_calls() {
        return None;
    }
    let allowed: Vec<&Tool> = match &req.choice {
        ToolChoice::Function(name) => req.tools.iter().filter(|t| &t.name == name).collect(),
        _ => req.tools.iter().collect(),
    };
    // A tool's own definitions (`$defs`, or the older `definitions`) move to the root of the
    // call schema, where its `$ref`s ("#/$defs/...") must find them once `parameters` sits
    // under `arguments`; each tool's are renamed apart, as several tools may share a name.
    let mut defs = serde_json::Map::new();
    let mut call_schema = |i: usize, t: &Tool| {
        let mut parameters = t.parameters.clone();
        for (key, prefix) in [
            ("$defs", format!("tool{i}_")),
            ("definitions", format!("tool{i}_definitions_")),
        ] {
            if let Some(Value::Object(own)) = parameters.as_object_mut().and_then(|p| p.remove(key))
            {
                for (name, def) in own {
                    let mut def = def;
                    rename_refs(&mut def, key, &prefix);
                    defs.insert(format!("{prefix}{name}"), def);
                }
                rename_refs(&mut parameters, key, &prefix);
            }
        }
        json!({
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": false,
        })
    };
    let mut schema = match allowed.as_slice() {
        [one] => call_schema(0, one),
        many => {
            json!({"anyOf": many.iter().enumerate().map(|(i, t)| call_schema(i, t)).collect::<Vec<_>>()})
        }
    };
    if !defs.is_empty() {
        schema["$defs"] = Value::Object(defs);
    }
    // Laid out as the template renders calls (json.dumps's separators, one line), never with
    // endless whitespace.
    let schema = vlm_proto::constraint::with_json_style(schema);
    let start = if req.parallel {
        "start: call (\"\\n\" call)*"
    } else {
        "start: call"
    };
    Some(format!(
        "{start}\ncall: tool_open \"\\n\" arguments \"\\n\" tool_close\ntool_open: {}\ntool_close: {}\narguments: %json {schema}\n",
        open.lark(),
        close.lark()
    ))
}

/// Points every `$ref` to `#/{key}/NAME` in `v` at `#/$defs/{prefix}NAME`.
fn rename_refs(v: &mut Value, key: &str, prefix: &str) {
    match v {
        Value::Object(o) => {
            for (k, x) in o.iter_mut() {
                match x {
                    Value::String(r) if k == "$ref" => {
                        if let Some(name) = r.strip_prefix(&format!("#/{key}/")) {
                            *r = format!("#/$defs/{prefix}{name}");
                        }
                    }
                    _ => rename_refs(x, key, prefix),
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(|x| rename_refs(x, key, prefix)),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "description": "now",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                "required": ["city"]}}})
    }

    fn clock() -> Value {
        json!({"type": "function", "function": {"name": "time \"now\""}})
    }

    #[test]
    fn reads_tools_and_each_tool_choice() {
        let tools = json!([weather(), clock()]);
        let req = read_tools(Some(&tools), None, None).unwrap();
        assert_eq!(req.choice, ToolChoice::Auto);
        assert!(req.parallel && req.parses_calls() && !req.forces_calls());
        assert_eq!(req.tools[1].parameters, json!({"type": "object"}));
        assert_eq!(req.template_tools(), vec![weather(), clock()]);
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let req = read_tools(Some(&tools), Some(&named), Some(false)).unwrap();
        assert_eq!(req.choice, ToolChoice::Function("get_weather".into()));
        assert!(!req.parallel && req.forces_calls());
        let req = read_tools(Some(&tools), Some(&json!("none")), None).unwrap();
        assert!(!req.parses_calls() && !req.forces_calls());
        // No tools: nothing to parse whatever the choice (but `required` is the client's error).
        let req = read_tools(None, Some(&json!("auto")), None).unwrap();
        assert!(!req.parses_calls());
    }

    #[test]
    fn an_unknown_name_or_a_malformed_tool_is_a_400_naming_it() {
        let tools = json!([weather()]);
        for (tools, choice, names) in [
            (
                tools.clone(),
                json!({"type": "function", "function": {"name": "get_time"}}),
                &["`tool_choice`", "\"get_time\""][..],
            ),
            (tools.clone(), json!("sometimes"), &["`tool_choice`"]),
            (
                tools.clone(),
                json!({"type": "function"}),
                &["`tool_choice`"],
            ),
            (json!([]), json!("required"), &["`tool_choice`", "`tools`"]),
            (
                json!([{"type": "retrieval"}]),
                json!("auto"),
                &["`tools[0].type`"],
            ),
            (
                json!([{"type": "function"}]),
                json!("auto"),
                &["`tools[0].function`"],
            ),
            (
                json!([{"type": "function", "function": {"description": "x"}}]),
                json!("auto"),
                &["`tools[0].function.name`"],
            ),
            (
                json!([{"type": "function", "function": {"name": "f", "parameters": "{}"}}]),
                json!("auto"),
                &["`tools[0].function.parameters`"],
            ),
            (json!([weather(), weather()]), json!("auto"), &["twice"]),
            (json!({"a": 1}), json!("auto"), &["`tools` must be a list"]),
        ] {
            let e = read_tools(Some(&tools), Some(&choice), None).unwrap_err();
            assert_eq!(e.http_status(), 400);
            for name in names {
                assert!(e.to_string().contains(name), "{tools} {choice}: {e}");
            }
        }
    }

    #[test]
    fn a_tools_own_definitions_move_to_the_root_renamed_apart() {
        let pose = |name: &str| {
            json!({"type": "function", "function": {"name": name, "parameters": {
                "type": "object", "properties": {"at": {"$ref": "#/$defs/point"},
                    "via": {"type": "array", "items": {"$ref": "#/definitions/point"}}},
                "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}}}},
                "definitions": {"point": {"$ref": "#/definitions/other"},
                                "other": {"type": "integer"}}}}})
        };
        let tools = json!([pose("a"), pose("b")]);
        let required = read_tools(Some(&tools), Some(&json!("required")), None).unwrap();
        let g = tool_call_grammar(&required, &Tag::Token(1), &Tag::Token(2)).unwrap();
        let line = g.lines().find(|l| l.starts_with("arguments: ")).unwrap();
        let schema: Value =
            serde_json::from_str(line.strip_prefix("arguments: %json ").unwrap()).unwrap();
        let args = &schema["anyOf"][1]["properties"]["arguments"];
        assert_eq!(args["properties"]["at"]["$ref"], "#/$defs/tool1_point");
        assert_eq!(
            args["properties"]["via"]["items"]["$ref"],
            "#/$defs/tool1_definitions_point"
        );
        assert!(args.get("$defs").is_none() && args.get("definitions").is_none());
        let defs = &schema["$defs"];
        assert_eq!(defs["tool0_point"]["properties"]["x"]["type"], "integer");
        assert_eq!(defs["tool1_definitions_other"], json!({"type": "integer"}));
        assert_eq!(
            defs["tool0_definitions_point"]["$ref"],
            "#/$defs/tool0_definitions_other"
        );
    }

    #[test]
    fn the_grammar_names_special_tokens_by_id_and_escapes_the_rest() {
        let tools = json!([weather(), clock()]);
        let auto = read_tools(Some(&tools), None, None).unwrap();
        assert_eq!(
            tool_call_grammar(&auto, &Tag::Token(1), &Tag::Token(2)),
            None
        );

        let required = read_tools(Some(&tools), Some(&json!("required")), None).unwrap();
        let g = tool_call_grammar(&required, &Tag::Token(151657), &Tag::Token(151658)).unwrap();
        let lines: Vec<&str> = g.lines().collect();
        assert_eq!(lines[0], "start: call (\"\\n\" call)*");
        assert_eq!(
            lines[1],
            "call: tool_open \"\\n\" arguments \"\\n\" tool_close"
        );
        assert_eq!(lines[2], "tool_open: <[151657]>");
        assert_eq!(lines[3], "tool_close: <[151658]>");
        let schema: Value =
            serde_json::from_str(lines[4].strip_prefix("arguments: %json ").unwrap()).unwrap();
        let names: Vec<&Value> = schema["anyOf"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| &s["properties"]["name"]["const"])
            .collect();
        assert_eq!(names, [&json!("get_weather"), &json!("time \"now\"")]);
        assert_eq!(
            schema["anyOf"][0]["properties"]["arguments"],
            weather()["function"]["parameters"]
        );

        let named = json!({"type": "function", "function": {"name": "time \"now\""}});
        let one = read_tools(Some(&tools), Some(&named), Some(false)).unwrap();
        let open = Tag::Text(TOOL_CALL_OPEN);
        let close = Tag::Text(TOOL_CALL_CLOSE);
        let g = tool_call_grammar(&one, &open, &close).unwrap();
        let lines: Vec<&str> = g.lines().collect();
        assert_eq!(lines[0], "start: call");
        assert_eq!(lines[2], "tool_open: \"<tool_call>\"");
        assert_eq!(lines[3], "tool_close: \"</tool_call>\"");
        let schema: Value =
            serde_json::from_str(lines[4].strip_prefix("arguments: %json ").unwrap()).unwrap();
        assert_eq!(schema["properties"]["name"]["const"], "time \"now\"");
        assert_eq!(schema["required"], json!(["name", "arguments"]));
    }
}
