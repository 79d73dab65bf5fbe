//! Qwen 2.5/3 and Hermes: each call is `<tool_call>\n{"name": N, "arguments": {...}}\n</tool_call>`
//! (Qwen3's template: "return a json object with function name and arguments within
//! <tool_call></tool_call> XML tags"). Several calls follow each other, separated by
//! whitespace. A last block whose closing tag never came is accepted when its JSON object
//! is complete (generation stopped right after it); anything else is malformed.

use super::{json::call_from_object, Malformed, ToolCall};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

pub(super) fn parse(block: &str) -> Result<Vec<ToolCall>, Malformed> {
    let mut calls = Vec::new();
    let mut rest = block.trim();
    while !rest.is_empty() {
        let Some(after) = rest.strip_prefix(OPEN) else {
            return Err(Malformed(format!(
                "expected `{OPEN}`, found `{}`",
                rest.chars().take(20).collect::<String>()
            )));
        };
        let mut de = serde_json::Deserializer::from_str(after).into_iter::<serde_json::Value>();
        let v = match de.next() {
            Some(Ok(v)) => v,
            Some(Err(e)) => return Err(Malformed(format!("the call's JSON: {e}"))),
            None => return Err(Malformed("an empty <tool_call>".into())),
        };
        calls.push(call_from_object(&v)?);
        let tail = after[de.byte_offset()..].trim_start();
        rest = match tail.strip_prefix(CLOSE) {
            Some(r) => r.trim_start(),
            // Unclosed: fine only at the very end.
            None if tail.is_empty() => "",
            None => {
                return Err(Malformed(format!(
                    "expected `{CLOSE}` after the call's JSON"
                )))
            }
        };
    }
    Ok(calls)
}
