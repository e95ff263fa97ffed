//! How JSON written under a constraint is laid out, unless its schema says otherwise (its own
//! `x-guidance` object): on one line, with Python's `json.dumps` separators (`", "` and
//! `": "`), as Qwen's chat template renders tool calls and as models write short JSON.
//!
//! Why not any whitespace, llguidance's default: a model may then spend its whole budget on
//! newlines and spaces between two keys and never finish (vLLM's users meet this as Qwen
//! answers of endless newlines, and turn on `disable_any_whitespace`). One layout, set here,
//! serves both places JSON is constrained: llm-svc's `json_schema` constraints and the
//! `%json` blocks of the gateway's tool-call grammars.

use serde_json::{json, Value};

/// llguidance's JSON options for the layout above.
pub fn json_style() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// `schema` with [`json_style`] where it names no layout of its own (a schema that is not an
/// object is returned as it is, for the compiler to refuse).
pub fn with_json_style(mut schema: Value) -> Value {
    if let Some(obj) = schema.as_object_mut() {
        obj.entry("x-guidance").or_insert_with(json_style);
    }
    schema
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_schemas_own_layout_wins() {
        let own = json!({"type": "object", "x-guidance": {"whitespace_flexible": true}});
        assert_eq!(with_json_style(own.clone()), own);
        let plain = with_json_style(json!({"type": "object"}));
        assert_eq!(plain["x-guidance"], json_style());
        assert_eq!(with_json_style(json!(7)), json!(7));
    }
}
