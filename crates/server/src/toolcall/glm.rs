//! GLM-4.5 .. 5.x (GLM-4.7's template):
//! `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>` (GLM-4.5/4.6
//! put a newline before each `<arg_key>` and the value). The template writes string values
//! as they are and other values as JSON, so a value is a string when the tool's schema
//! says `string` (or the value is not JSON), else its JSON.

use serde_json::{Map, Value};

use super::{Malformed, ToolCall, ToolDef};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

pub(super) fn parse(block: &str, tools: &[ToolDef]) -> Result<Vec<ToolCall>, Malformed> {
    let mut calls = Vec::new();
    let mut rest = block.trim();
    while !rest.is_empty() {
        let r = rest
            .strip_prefix(OPEN)
            .ok_or_else(|| Malformed(format!("expected `{OPEN}`")))?;
        let end = r
            .find(CLOSE)
            .ok_or_else(|| Malformed("a <tool_call> is not closed".into()))?;
        let body = &r[..end];
        rest = r[end + CLOSE.len()..].trim_start();
        let (name, mut kv) = match body.find("<arg_key>") {
            Some(i) => (body[..i].trim(), &body[i..]),
            None => (body.trim(), ""),
        };
        if name.is_empty() || name.contains('<') {
            return Err(Malformed("a call has no function name".into()));
        }
        let def = tools.iter().find(|t| t.name == name);
        let mut args = Map::new();
        loop {
            kv = kv.trim_start();
            if kv.is_empty() {
                break;
            }
            let k = kv
                .strip_prefix("<arg_key>")
                .ok_or_else(|| Malformed(format!("expected <arg_key> in `{name}`")))?;
            let ke = k
                .find("</arg_key>")
                .ok_or_else(|| Malformed("an <arg_key> is not closed".into()))?;
            let key = k[..ke].trim();
            let v = k[ke + "</arg_key>".len()..].trim_start();
            let v = v
                .strip_prefix("<arg_value>")
                .ok_or_else(|| Malformed(format!("<arg_key>{key}</arg_key> has no value")))?;
            let ve = v
                .find("</arg_value>")
                .ok_or_else(|| Malformed(format!("the value of `{key}` is not closed")))?;
            let raw = &v[..ve];
            let wants_string = def.and_then(|d| d.param_type(key)) == Some("string");
            let value = if wants_string {
                Value::String(raw.to_string())
            } else {
                serde_json::from_str(raw.trim()).unwrap_or_else(|_| Value::String(raw.to_string()))
            };
            args.insert(key.to_string(), value);
            kv = &v[ve + "</arg_value>".len()..];
        }
        calls.push(ToolCall {
            name: name.to_string(),
            arguments: args,
        });
    }
    Ok(calls)
}
