//! DeepSeek V3.2 / V4 DSML (the V4 template's tools header):
//!
//! ```text
//! <｜DSML｜tool_calls>
//! <｜DSML｜invoke name="$TOOL_NAME">
//! <｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
//! </｜DSML｜invoke>
//! </｜DSML｜tool_calls>
//! ```
//!
//! (V3.2 names the block `function_calls`.) `string="true"` values are taken as is;
//! `string="false"` values are JSON. A block cut off at the end is accepted when every
//! invoke in it closed.

use serde_json::{Map, Value};

use super::{Malformed, ToolCall};

const T: &str = "｜DSML｜";

pub(super) fn parse(block: &str) -> Result<Vec<ToolCall>, Malformed> {
    let b = block.trim();
    let outer = if b.starts_with(&format!("<{T}tool_calls>")) {
        "tool_calls"
    } else if b.starts_with(&format!("<{T}function_calls>")) {
        "function_calls"
    } else {
        return Err(Malformed(format!("expected `<{T}tool_calls>`")));
    };
    let mut rest = &b[T.len() + outer.len() + 2..];
    let close_outer = format!("</{T}{outer}>");
    let open_invoke = format!("<{T}invoke name=\"");
    let close_invoke = format!("</{T}invoke>");
    let open_param = format!("<{T}parameter name=\"");
    let close_param = format!("</{T}parameter>");
    let mut calls = Vec::new();
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            break; // unclosed block, every invoke closed
        }
        if let Some(r) = rest.strip_prefix(close_outer.as_str()) {
            if !r.trim().is_empty() {
                return Err(Malformed(format!("text after `{close_outer}`")));
            }
            break;
        }
        let r = rest
            .strip_prefix(open_invoke.as_str())
            .ok_or_else(|| Malformed(format!("expected `{open_invoke}...\">`")))?;
        let q = r
            .find("\">")
            .ok_or_else(|| Malformed("an invoke name is not closed".into()))?;
        let name = &r[..q];
        let end = r
            .find(close_invoke.as_str())
            .ok_or_else(|| Malformed(format!("the invoke of `{name}` is not closed")))?;
        let mut body = &r[q + 2..end];
        rest = &r[end + close_invoke.len()..];
        let mut args = Map::new();
        loop {
            body = body.trim_start();
            if body.is_empty() {
                break;
            }
            let p = body
                .strip_prefix(open_param.as_str())
                .ok_or_else(|| Malformed(format!("expected a parameter in `{name}`")))?;
            let head_end = p
                .find('>')
                .ok_or_else(|| Malformed("a parameter tag is not closed".into()))?;
            let head = &p[..head_end];
            let (key, attrs) = head
                .split_once('"')
                .ok_or_else(|| Malformed("a parameter name is not closed".into()))?;
            let is_string = match attrs.trim() {
                "string=\"true\"" => true,
                "string=\"false\"" => false,
                other => {
                    return Err(Malformed(format!(
                        "parameter `{key}`: expected string=\"true|false\", found `{other}`"
                    )))
                }
            };
            let vend = p[head_end + 1..]
                .find(close_param.as_str())
                .ok_or_else(|| Malformed(format!("parameter `{key}` is not closed")))?
                + head_end
                + 1;
            let raw = &p[head_end + 1..vend];
            let v = if is_string {
                Value::String(raw.to_string())
            } else {
                serde_json::from_str(raw.trim()).map_err(|e| {
                    Malformed(format!(
                        "parameter `{key}` (string=\"false\") is not JSON: {e}"
                    ))
                })?
            };
            args.insert(key.to_string(), v);
            body = &p[vend + close_param.len()..];
        }
        calls.push(ToolCall {
            name: name.to_string(),
            arguments: args,
        });
    }
    Ok(calls)
}
