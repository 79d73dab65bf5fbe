//! The request side of tool use and structured output.
//!
//! Owns: `tools` / `tool_choice` of both APIs ([`ToolDef`]s, [`Choice`]), the messages a
//! tool-using conversation hands the chat template (OpenAI `tool_calls` / `tool` messages,
//! Anthropic `tool_use` / `tool_result` blocks; arguments as JSON objects, as templates
//! iterate them; for templates that do not describe tools, a system message describing
//! them and calls / results written as text), `response_format` and `grammar`, and which
//! [`Spec`] constrains a request: a forced call (`tool_choice` `required` or a named
//! function) in the template's own syntax with the arguments' JSON schema, a JSON schema,
//! or a grammar. It does not parse the output (`toolcall`, `reasoning`, `shape.rs`) nor
//! compile grammars (`constrain.rs`).

use serde_json::{json, Value};

use crate::constrain::Spec;
use crate::toolcall::{Format, ToolDef};

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Choice {
    Auto,
    /// Tools are not offered to the model and nothing is parsed as a call.
    None,
    /// Exactly one call of any tool (constrained).
    Required,
    /// Exactly one call of this tool (constrained).
    Named(String),
}

/// OpenAI `tool_choice`: `"auto"`, `"none"`, `"required"` or
/// `{"type": "function", "function": {"name": N}}`.
pub fn openai_choice(v: Option<&Value>) -> Result<Choice, String> {
    match v {
        None | Some(Value::Null) => Ok(Choice::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "auto" => Ok(Choice::Auto),
            "none" => Ok(Choice::None),
            "required" => Ok(Choice::Required),
            o => Err(format!(
                "`tool_choice` `{o}` is not one of auto, none, required"
            )),
        },
        Some(o) => match o.pointer("/function/name").and_then(Value::as_str) {
            Some(n) if o.get("type").and_then(Value::as_str) == Some("function") => {
                Ok(Choice::Named(n.to_string()))
            }
            _ => Err(
                "`tool_choice` must be a string or {\"type\": \"function\", \"function\": {\"name\": ...}}"
                    .into(),
            ),
        },
    }
}

/// Anthropic `tool_choice`: `{"type": "auto" | "any" | "none" | "tool", "name"?}`.
pub fn anthropic_choice(v: Option<&Value>) -> Result<Choice, String> {
    let Some(v) = v.filter(|v| !v.is_null()) else {
        return Ok(Choice::Auto);
    };
    match v.get("type").and_then(Value::as_str) {
        Some("auto") => Ok(Choice::Auto),
        Some("none") => Ok(Choice::None),
        Some("any") => Ok(Choice::Required),
        Some("tool") => match v.get("name").and_then(Value::as_str) {
            Some(n) => Ok(Choice::Named(n.to_string())),
            None => Err("`tool_choice` of type `tool` needs a `name`".into()),
        },
        _ => Err("`tool_choice.type` must be auto, any, tool or none".into()),
    }
}

fn tool_def(
    name: Option<&Value>,
    desc: Option<&Value>,
    params: Option<&Value>,
    i: usize,
) -> Result<ToolDef, String> {
    let name = name
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| format!("`tools[{i}]` has no name"))?;
    let parameters = match params {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => {
            return Err(format!(
                "the parameter schema of tool `{name}` is not an object"
            ))
        }
    };
    Ok(ToolDef {
        name: name.to_string(),
        description: desc.and_then(Value::as_str).unwrap_or("").to_string(),
        parameters,
    })
}

/// OpenAI `tools`: `[{"type": "function", "function": {name, description, parameters}}]`.
pub fn openai_tools(tools: &[Value]) -> Result<Vec<ToolDef>, String> {
    let mut out = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(format!("`tools[{i}].type` must be `function`"));
        }
        let f = t
            .get("function")
            .ok_or_else(|| format!("`tools[{i}]` has no `function`"))?;
        out.push(tool_def(
            f.get("name"),
            f.get("description"),
            f.get("parameters"),
            i,
        )?);
    }
    unique(out)
}

/// Anthropic `tools`: `[{name, description, input_schema}]`.
pub fn anthropic_tools(tools: Option<&Value>) -> Result<Vec<ToolDef>, String> {
    let Some(tools) = tools.filter(|v| !v.is_null()) else {
        return Ok(Vec::new());
    };
    let a = tools.as_array().ok_or("`tools` must be a list")?;
    let mut out = Vec::with_capacity(a.len());
    for (i, t) in a.iter().enumerate() {
        out.push(tool_def(
            t.get("name"),
            t.get("description"),
            t.get("input_schema"),
            i,
        )?);
    }
    unique(out)
}

fn unique(defs: Vec<ToolDef>) -> Result<Vec<ToolDef>, String> {
    for (i, d) in defs.iter().enumerate() {
        if defs[..i].iter().any(|e| e.name == d.name) {
            return Err(format!("two tools are named `{}`", d.name));
        }
    }
    Ok(defs)
}

/// Check the choice against the tools.
pub fn check_choice(choice: &Choice, defs: &[ToolDef]) -> Result<(), String> {
    match choice {
        Choice::Required if defs.is_empty() => {
            Err("`tool_choice` asks for a tool call but no `tools` are given".into())
        }
        Choice::Named(n) if !defs.iter().any(|d| &d.name == n) => Err(format!(
            "`tool_choice` names `{n}`, which is not in `tools`"
        )),
        _ => Ok(()),
    }
}

/// The tools as the chat templates take them (OpenAI's shape).
pub fn template_tools(defs: &[ToolDef]) -> Value {
    Value::Array(
        defs.iter()
            .map(|d| {
                json!({"type": "function", "function": {
                    "name": d.name, "description": d.description, "parameters": d.parameters}})
            })
            .collect(),
    )
}

/// The system text describing tools to a model whose template does not (the answer
/// format is the one `toolcall::json` parses).
pub fn fallback_system(defs: &[ToolDef]) -> String {
    let mut s = String::from("You can call these tools (JSON schema of each one's arguments):\n");
    for d in defs {
        s.push_str(
            &json!({"name": d.name, "description": d.description, "parameters": d.parameters})
                .to_string(),
        );
        s.push('\n');
    }
    s.push_str(
        "To call a tool, answer with only a JSON object: {\"name\": <tool name>, \"arguments\": <arguments object>}.",
    );
    s
}

/// `function.arguments` as an object (OpenAI sends a JSON string; templates iterate it).
fn arguments_object(v: &Value) -> Value {
    match v {
        Value::String(s) => match serde_json::from_str::<Value>(s) {
            Ok(o @ Value::Object(_)) => o,
            _ => v.clone(),
        },
        other => other.clone(),
    }
}

/// Messages for the template. Arguments become objects. When the template does not render
/// tools (`native` false): the tools go in the system message, an assistant's calls are
/// written as the JSON the model is asked for, and tool results become user turns.
pub fn template_messages(mut msgs: Vec<Value>, defs: &[ToolDef], native: bool) -> Vec<Value> {
    for m in msgs.iter_mut() {
        if let Some(Value::Array(calls)) = m.get_mut("tool_calls") {
            for c in calls.iter_mut() {
                if let Some(f) = c.get_mut("function") {
                    if let Some(a) = f.get("arguments") {
                        let o = arguments_object(a);
                        f["arguments"] = o;
                    }
                }
            }
        }
    }
    if native {
        return msgs;
    }
    let mut out: Vec<Value> = Vec::with_capacity(msgs.len() + 1);
    if !defs.is_empty() {
        let sys = fallback_system(defs);
        match msgs.first_mut() {
            Some(m) if m["role"] == "system" => {
                let c = m["content"].as_str().unwrap_or("").to_string();
                m["content"] = Value::String(format!("{c}\n\n{sys}"));
            }
            _ => out.push(json!({"role": "system", "content": sys})),
        }
    }
    for m in msgs {
        let role = m["role"].as_str().unwrap_or("").to_string();
        let content = m["content"].as_str().unwrap_or("").to_string();
        match role.as_str() {
            "assistant" if m.get("tool_calls").is_some_and(|c| c.is_array()) => {
                let mut text = content;
                for c in m["tool_calls"].as_array().into_iter().flatten() {
                    let f = &c["function"];
                    if !text.is_empty() {
                        text.push('\n');
                    }
                    text.push_str(
                        &json!({"name": f["name"], "arguments": f["arguments"]}).to_string(),
                    );
                }
                out.push(json!({"role": "assistant", "content": text}));
            }
            "tool" => {
                let text = format!("Tool result: {content}");
                // Consecutive results share one user turn (turns must alternate).
                match out.last_mut() {
                    Some(l) if l["role"] == "user" => {
                        let prev = l["content"].as_str().unwrap_or("").to_string();
                        l["content"] = Value::String(format!("{prev}\n\n{text}"));
                    }
                    _ => out.push(json!({"role": "user", "content": text})),
                }
            }
            _ => out.push(json!({"role": role, "content": content})),
        }
    }
    out
}

/// Anthropic messages (with `tool_use` / `tool_result` blocks) as template messages in
/// OpenAI's shape. `system` first when given.
pub fn anthropic_messages(
    system: Option<String>,
    msgs: &[(String, Value)],
) -> Result<Vec<Value>, String> {
    let mut out = Vec::with_capacity(msgs.len() + 1);
    if let Some(s) = system.filter(|s| !s.is_empty()) {
        out.push(json!({"role": "system", "content": s}));
    }
    for (i, (role, content)) in msgs.iter().enumerate() {
        let blocks = match content {
            Value::String(s) => vec![json!({"type": "text", "text": s})],
            Value::Array(a) => a.clone(),
            _ => return Err(format!("messages[{i}].content must be a string or blocks")),
        };
        let mut text = String::new();
        let mut calls = Vec::new();
        for b in &blocks {
            match b.get("type").and_then(Value::as_str) {
                Some("text") => text.push_str(b.get("text").and_then(Value::as_str).unwrap_or("")),
                Some("tool_use") if role == "assistant" => calls.push(json!({
                    "id": b.get("id").cloned().unwrap_or(Value::Null),
                    "type": "function",
                    "function": {"name": b.get("name").cloned().unwrap_or(Value::Null),
                                 "arguments": b.get("input").cloned().unwrap_or(json!({}))},
                })),
                Some("tool_result") if role == "user" => {
                    let c = match b.get("content") {
                        Some(Value::String(s)) => s.clone(),
                        Some(Value::Array(parts)) => parts
                            .iter()
                            .filter_map(|p| p.get("text").and_then(Value::as_str))
                            .collect::<Vec<_>>()
                            .join(""),
                        _ => String::new(),
                    };
                    out.push(json!({"role": "tool",
                        "tool_call_id": b.get("tool_use_id").cloned().unwrap_or(Value::Null),
                        "content": c}));
                }
                Some(k) => {
                    return Err(format!(
                        "messages[{i}]: content blocks of type `{k}` are not supported here"
                    ))
                }
                None => return Err(format!("messages[{i}]: a content block has no `type`")),
            }
        }
        if role == "assistant" {
            let mut m = json!({"role": "assistant", "content": text});
            if !calls.is_empty() {
                m["tool_calls"] = Value::Array(calls);
            }
            out.push(m);
        } else if !text.is_empty() || !blocks.iter().any(|b| b["type"] == "tool_result") {
            out.push(json!({"role": role, "content": text}));
        }
    }
    Ok(out)
}

/// `response_format` (`text`, `json_object`, `json_schema` with `json_schema.schema`) and
/// `grammar` (GBNF or Lark) as a spec. Both at once is an error.
pub fn output_spec(
    response_format: Option<&Value>,
    grammar: Option<&str>,
) -> Result<Option<Spec>, String> {
    let rf = match response_format.filter(|v| !v.is_null()) {
        None => None,
        Some(v) => match v.get("type").and_then(Value::as_str) {
            Some("text") => None,
            Some("json_object") => Some(Spec::JsonSchema(json!({"type": "object"}))),
            Some("json_schema") => {
                let s = v
                    .pointer("/json_schema/schema")
                    .ok_or("`response_format.json_schema.schema` is missing")?;
                Some(Spec::JsonSchema(s.clone()))
            }
            _ => {
                return Err(
                    "`response_format.type` must be text, json_object or json_schema".into(),
                )
            }
        },
    };
    match (rf, grammar.filter(|g| !g.trim().is_empty())) {
        (Some(_), Some(_)) => Err("give either `response_format` or `grammar`, not both".into()),
        (Some(s), None) => Ok(Some(s)),
        (None, Some(g)) => Ok(Some(Spec::Lark(crate::gbnf::to_lark(g)?))),
        (None, None) => Ok(None),
    }
}

/// A Lark string literal.
fn lit(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

/// The Lark rule body for one forced call of `d` in `format`.
fn call_rule(format: Format, d: &ToolDef) -> String {
    let schema = d.parameters.to_string();
    let props: Vec<(String, Value, bool)> = {
        let req: Vec<&str> = d
            .parameters
            .get("required")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        d.parameters
            .get("properties")
            .and_then(Value::as_object)
            .map(|m| {
                m.iter()
                    .map(|(k, v)| (k.clone(), v.clone(), req.contains(&k.as_str())))
                    .collect()
            })
            .unwrap_or_default()
    };
    let is_string = |v: &Value| {
        v.get("type").and_then(Value::as_str) == Some("string")
            || v.get("enum")
                .and_then(Value::as_array)
                .is_some_and(|e| !e.is_empty() && e.iter().all(Value::is_string))
    };
    // One parameter's markup: strings as text without markup, others as JSON of their schema.
    let param = |open: String, close: &str, v: &Value, opt: bool| {
        let body = if let Some(e) = v
            .get("enum")
            .and_then(Value::as_array)
            .filter(|e| e.iter().all(Value::is_string))
        {
            // Raw text: one of the strings.
            let alts: Vec<String> = e.iter().filter_map(Value::as_str).map(lit).collect();
            format!("({})", alts.join(" | "))
        } else if is_string(v) {
            // Raw text up to the closing tag, within `maxLength` when the schema gives one.
            match v.get("maxLength").and_then(Value::as_u64) {
                Some(m) => format!("/[^<]{{0,{m}}}/"),
                None => "/[^<]*/".to_string(),
            }
        } else {
            format!("%json {v}")
        };
        let p = format!("{open} {body} {}", lit(close));
        if opt {
            format!("({p})?")
        } else {
            p
        }
    };
    match format {
        Format::Hermes => format!(
            "{} %json {} {}",
            lit("<tool_call>\n"),
            call_schema(std::slice::from_ref(d)),
            lit("\n</tool_call>")
        ),
        Format::Json => format!("%json {}", call_schema(std::slice::from_ref(d))),
        Format::Glm => {
            let mut s = lit(&format!("<tool_call>{}", d.name));
            for (k, v, req) in &props {
                s.push(' ');
                s.push_str(&param(
                    lit(&format!("<arg_key>{k}</arg_key><arg_value>")),
                    "</arg_value>",
                    v,
                    !req,
                ));
            }
            s.push(' ');
            s.push_str(&lit("</tool_call>"));
            s
        }
        Format::Dsml => {
            const T: &str = "｜DSML｜";
            let mut s = lit(&format!(
                "<{T}tool_calls>\n<{T}invoke name=\"{}\">\n",
                d.name
            ));
            for (k, v, req) in &props {
                let flag = if is_string(v) { "true" } else { "false" };
                s.push(' ');
                s.push_str(&param(
                    lit(&format!("<{T}parameter name=\"{k}\" string=\"{flag}\">")),
                    &format!("</{T}parameter>\n"),
                    v,
                    !req,
                ));
            }
            s.push(' ');
            s.push_str(&lit(&format!("</{T}invoke>\n</{T}tool_calls>")));
            s
        }
        Format::Gemma4 => {
            // Values are not JSON in Gemma 4's syntax: the call's name is forced and the
            // arguments are left to the model (the parser checks them).
            let _ = schema;
            // Any text without `<` except Gemma's string quote `<|"|>`, then `}<tool_call|>`
            // (one lexeme: the lexer does not backtrack out of a `<` that began a quote).
            format!(
                "{} /([^<]|<\\|\"\\|>)*\\}}<tool_call\\|>/",
                lit(&format!("<|tool_call>call:{}{{", d.name)),
            )
        }
    }
}

/// JSON schema of one `{"name", "arguments"}` object over `defs`.
fn call_schema(defs: &[ToolDef]) -> Value {
    let one = |d: &ToolDef| {
        json!({"type": "object",
               "properties": {"name": {"const": d.name}, "arguments": d.parameters},
               "required": ["name", "arguments"], "additionalProperties": false})
    };
    if defs.len() == 1 {
        one(&defs[0])
    } else {
        json!({"anyOf": defs.iter().map(one).collect::<Vec<_>>()})
    }
}

/// The grammar forcing one call (`Required`: of any tool; `Named`: of that one) in the
/// template's syntax; `reasoning` lets a reasoning block the prompt opened finish first.
pub fn forced_call(
    format: Format,
    defs: &[ToolDef],
    choice: &Choice,
    reasoning: Option<&str>,
) -> Option<Spec> {
    let chosen: Vec<&ToolDef> = match choice {
        Choice::Required => defs.iter().collect(),
        Choice::Named(n) => defs.iter().filter(|d| &d.name == n).collect(),
        _ => return None,
    };
    if chosen.is_empty() {
        return None;
    }
    let mut g = String::new();
    match reasoning {
        // The block ends at the first closing marker (a lazy lexeme), then the call.
        Some(close) => {
            let esc: String = close
                .chars()
                .map(|c| format!("\\x{{{:x}}}", c as u32))
                .collect();
            g.push_str(&format!(
                "start: think /[ \\t\\r\\n]*/ call\nthink[lazy]: /(?s:.*){esc}/\n"
            ));
        }
        None => g.push_str("start: call\n"),
    }
    let alts: Vec<String> = (0..chosen.len()).map(|i| format!("call_{i}")).collect();
    g.push_str(&format!("call: {}\n", alts.join(" | ")));
    for (i, d) in chosen.iter().enumerate() {
        g.push_str(&format!("call_{i}: {}\n", call_rule(format, d)));
    }
    Some(Spec::Lark(g))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices() {
        assert_eq!(openai_choice(None).unwrap(), Choice::Auto);
        assert_eq!(
            openai_choice(Some(&json!("required"))).unwrap(),
            Choice::Required
        );
        assert_eq!(
            openai_choice(Some(
                &json!({"type": "function", "function": {"name": "f"}})
            ))
            .unwrap(),
            Choice::Named("f".into())
        );
        assert!(openai_choice(Some(&json!("always"))).is_err());
        assert_eq!(
            anthropic_choice(Some(&json!({"type": "any"}))).unwrap(),
            Choice::Required
        );
        assert_eq!(
            anthropic_choice(Some(&json!({"type": "tool", "name": "f"}))).unwrap(),
            Choice::Named("f".into())
        );
        let defs = openai_tools(&[json!({"type": "function", "function": {"name": "f"}})]).unwrap();
        assert!(check_choice(&Choice::Named("g".into()), &defs).is_err());
        assert!(check_choice(&Choice::Required, &[]).is_err());
        assert!(openai_tools(&[json!({"type": "function", "function": {}})]).is_err());
    }

    #[test]
    fn fallback_messages_alternate() {
        let defs = openai_tools(&[json!({"type": "function", "function": {"name": "f"}})]).unwrap();
        let msgs = vec![
            json!({"role": "user", "content": "hi"}),
            json!({"role": "assistant", "content": "", "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}]}),
            json!({"role": "tool", "tool_call_id": "1", "content": "r1"}),
            json!({"role": "tool", "tool_call_id": "1", "content": "r2"}),
        ];
        let out = template_messages(msgs, &defs, false);
        let roles: Vec<&str> = out.iter().map(|m| m["role"].as_str().unwrap()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
        assert_eq!(
            out[2]["content"],
            "{\"name\":\"f\",\"arguments\":{\"a\":1}}"
        );
        assert_eq!(out[3]["content"], "Tool result: r1\n\nTool result: r2");
    }

    /// The forced-call grammars accept the calls each template documents (hand-written,
    /// the same strings the parsers' tests read) and refuse wrong names and argument types.
    #[test]
    fn forced_call_grammars_accept_documented_calls() {
        let defs = openai_tools(&[json!({"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                           "required": ["city"]}}})])
        .unwrap();
        let cases = [
            (Format::Hermes, "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\",\"days\":3}}\n</tool_call>",
             "<tool_call>\n{\"name\":\"get_time\",\"arguments\":{\"city\":\"Paris\"}}\n</tool_call>"),
            (Format::Json, "{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}",
             "{\"name\":\"get_weather\",\"arguments\":{\"city\":3}}"),
            (Format::Glm, "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>",
             "<tool_call>get_weather<arg_key>days</arg_key><arg_value>three</arg_value></tool_call>"),
            (Format::Dsml, "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>",
             "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>"),
            (Format::Gemma4, "<|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>,days:3}<tool_call|>", "<|tool_call>call:get_time{}<tool_call|>"),
        ];
        for (format, good, bad) in cases {
            let spec = forced_call(format, &defs, &Choice::Required, None).unwrap();
            assert_eq!(
                crate::constrain::byte_level_accepts(&spec, good),
                Ok(true),
                "{format:?} {spec:?}"
            );
            assert_eq!(
                crate::constrain::byte_level_accepts(&spec, bad),
                Ok(false),
                "{format:?} {bad}"
            );
            // After a reasoning block the prompt opened.
            let spec = forced_call(format, &defs, &Choice::Required, Some("</think>")).unwrap();
            let text = format!("let me see </ think> no</think>\n{good}");
            assert_eq!(
                crate::constrain::byte_level_accepts(&spec, &text),
                Ok(true),
                "{format:?} {spec:?}"
            );
        }
        assert!(forced_call(Format::Json, &defs, &Choice::Auto, None).is_none());
    }

    #[test]
    fn response_formats() {
        assert!(output_spec(Some(&json!({"type": "text"})), None)
            .unwrap()
            .is_none());
        assert!(matches!(
            output_spec(Some(&json!({"type": "json_object"})), None).unwrap(),
            Some(Spec::JsonSchema(_))
        ));
        assert!(output_spec(Some(&json!({"type": "json_schema"})), None).is_err());
        assert!(output_spec(Some(&json!({"type": "json_object"})), Some("start: \"a\"")).is_err());
    }
}
