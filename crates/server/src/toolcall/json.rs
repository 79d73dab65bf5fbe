//! The fallback for templates that do not describe tools (Gemma 3, ChatML, ...): the
//! answer is one JSON object `{"name": N, "arguments": {...}}` (or a list of them, or
//! `{"tool_calls": [...]}` as llama.cpp's generic format writes), optionally inside a
//! Markdown ```json fence. `arguments` may be an object or a JSON string of one
//! (OpenAI's wire form); `parameters` is accepted for `arguments` as some models write it.

use serde_json::Value;

use super::{Malformed, ToolCall};

/// A call from a `{"name", "arguments"}` object.
pub(super) fn call_from_object(v: &Value) -> Result<ToolCall, Malformed> {
    let o = v
        .as_object()
        .ok_or_else(|| Malformed("a call is not a JSON object".into()))?;
    let name = o
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| Malformed("a call has no string `name`".into()))?;
    let args = match o.get("arguments").or_else(|| o.get("parameters")) {
        None | Some(Value::Null) => serde_json::Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(Value::Object(m)) => m,
            _ => {
                return Err(Malformed(format!(
                    "the arguments of `{name}` are not a JSON object"
                )))
            }
        },
        Some(_) => {
            return Err(Malformed(format!(
                "the arguments of `{name}` are not a JSON object"
            )))
        }
    };
    Ok(ToolCall {
        name: name.to_string(),
        arguments: args,
    })
}

pub(super) fn parse(block: &str) -> Result<Vec<ToolCall>, Malformed> {
    let mut t = block.trim();
    if let Some(r) = t.strip_prefix("```") {
        let r = r.strip_prefix("json").unwrap_or(r);
        t = r
            .trim()
            .strip_suffix("```")
            .ok_or_else(|| Malformed("an unclosed ``` fence".into()))?
            .trim();
    }
    let v: Value = serde_json::from_str(t).map_err(|e| Malformed(format!("JSON: {e}")))?;
    match &v {
        Value::Array(a) => a.iter().map(call_from_object).collect(),
        Value::Object(o) if o.contains_key("tool_calls") => match &o["tool_calls"] {
            Value::Array(a) => a.iter().map(call_from_object).collect(),
            _ => Err(Malformed("`tool_calls` is not a list".into())),
        },
        Value::Object(o) if o.contains_key("tool_call") => {
            call_from_object(&o["tool_call"]).map(|c| vec![c])
        }
        _ => call_from_object(&v).map(|c| vec![c]),
    }
}
