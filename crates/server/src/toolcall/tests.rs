//! Per-format parser tests. The inputs are the call syntaxes as each template's own text
//! documents them (Qwen3's "<tool_call>\n{\"name\": ...}\n</tool_call>" instruction,
//! DeepSeek V4's DSML tools header, GLM-4.7's `<arg_key>` line, Gemma 4's
//! `format_argument`), filled in by hand; the expected calls are hand-written JSON.

use serde_json::{json, Value};

use super::*;

fn weather() -> Vec<ToolDef> {
    vec![ToolDef {
        name: "get_weather".into(),
        description: String::new(),
        parameters: json!({"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "zip": {"type": "string"}}}),
    }]
}

fn calls_json(calls: &[ToolCall]) -> Value {
    Value::Array(
        calls
            .iter()
            .map(|c| json!({"name": c.name, "arguments": Value::Object(c.arguments.clone())}))
            .collect(),
    )
}

/// The whole text and every two-piece cut of it give `content` and `calls`.
fn check(format: Format, text: &str, content: &str, calls: Value) {
    let tools = weather();
    let (c, k) = parse_all(format, &tools, text);
    assert_eq!(
        (c.as_str(), calls_json(&k)),
        (content, calls.clone()),
        "{text:?}"
    );
    for i in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
        let mut s = ToolStream::new(format, tools.clone());
        let mut pieces = s.push(&text[..i]);
        pieces.extend(s.push(&text[i..]));
        pieces.extend(s.finish().0);
        let (mut c2, mut k2) = (String::new(), Vec::new());
        for p in pieces {
            match p {
                ToolPiece::Content(t) => c2.push_str(&t),
                ToolPiece::Calls(v) => k2.extend(v),
            }
        }
        assert_eq!(
            (c2.as_str(), calls_json(&k2)),
            (content, calls.clone()),
            "cut {i}"
        );
    }
}

/// A malformed block comes back as content, whole, and no call.
fn malformed(format: Format, text: &str) {
    let (c, k) = parse_all(format, &weather(), text);
    assert!(k.is_empty(), "{text:?} gave {k:?}");
    assert_eq!(c, text);
}

#[test]
fn detect_formats_from_template_sources() {
    assert_eq!(
        Format::detect("{%- set dsml_token = '｜DSML｜' -%}"),
        Format::Dsml
    );
    assert_eq!(
        Format::detect("{{ '<tool_call>' + tc.name }}<arg_key>{{ k }}</arg_key>"),
        Format::Glm
    );
    assert_eq!(
        Format::detect("<tool_call>\\n{\"name\": <function-name>}</tool_call>"),
        Format::Hermes
    );
    assert_eq!(
        Format::detect("{{- '<|tool_call>call:' + function['name'] + '{' -}}"),
        Format::Gemma4
    );
    assert_eq!(Format::detect("<start_of_turn>model"), Format::Json);
}

#[test]
fn hermes_qwen3() {
    let one = json!([{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]);
    check(
        Format::Hermes,
        "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}\n</tool_call>",
        "Let me check.\n",
        one.clone(),
    );
    // Two calls; `arguments` as a JSON string (the OpenAI wire form) is accepted.
    check(
        Format::Hermes,
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Rome\\\"}\"}\n</tool_call>",
        "",
        json!([{"name": "get_weather", "arguments": {"city": "Paris"}},
               {"name": "get_weather", "arguments": {"city": "Rome"}}]),
    );
    // Unclosed at the end but the object is complete: accepted.
    check(
        Format::Hermes,
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}",
        "",
        one,
    );
    // Cut off inside the JSON, a wrong shape, an unknown tool, text after the object.
    malformed(
        Format::Hermes,
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"ci",
    );
    malformed(
        Format::Hermes,
        "<tool_call>\n[\"get_weather\"]\n</tool_call>",
    );
    malformed(
        Format::Hermes,
        "<tool_call>\n{\"name\": \"rm_rf\", \"arguments\": {}}\n</tool_call>",
    );
    malformed(
        Format::Hermes,
        "<tool_call>\n{\"name\": \"get_weather\"} oops </tool_call>",
    );
    // No block: all content, even with a `<` that starts like the opener.
    check(
        Format::Hermes,
        "a < b and <tool",
        "a < b and <tool",
        json!([]),
    );
}

#[test]
fn dsml_deepseek_v4() {
    let text = "I will look it up.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"zip\" string=\"true\">75001</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>";
    check(
        Format::Dsml,
        text,
        "I will look it up.\n\n",
        json!([{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},
               {"name": "get_weather", "arguments": {"zip": "75001"}}]),
    );
    // V3.2's block name; a call with no parameters; the outer block left unclosed.
    check(
        Format::Dsml,
        "<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n</｜DSML｜invoke>\n",
        "",
        json!([{"name": "get_weather", "arguments": {}}]),
    );
    // string="false" that is not JSON; a parameter never closed; an invoke never closed.
    malformed(Format::Dsml, "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"days\" string=\"false\">three</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>");
    malformed(Format::Dsml, "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Par");
    malformed(
        Format::Dsml,
        "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n",
    );
    malformed(Format::Dsml, "<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>");
}

#[test]
fn glm_arg_key_value() {
    // GLM-4.7: one line. `zip` is a string in the schema, so "75001" stays a string;
    // `days` is JSON.
    check(
        Format::Glm,
        "<tool_call>get_weather<arg_key>zip</arg_key><arg_value>75001</arg_value><arg_key>days</arg_key><arg_value>3</arg_value></tool_call>",
        "",
        json!([{"name": "get_weather", "arguments": {"zip": "75001", "days": 3}}]),
    );
    // GLM-4.5/4.6: newlines between the parts; content before the call.
    check(
        Format::Glm,
        "Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New York</arg_value>\n</tool_call>",
        "Checking.\n",
        json!([{"name": "get_weather", "arguments": {"city": "New York"}}]),
    );
    malformed(
        Format::Glm,
        "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Pa",
    );
    malformed(
        Format::Glm,
        "<tool_call>get_weather<arg_key>city</arg_key></tool_call>",
    );
    malformed(
        Format::Glm,
        "<tool_call><arg_key>city</arg_key><arg_value>x</arg_value></tool_call>",
    );
}

#[test]
fn gemma4_call_syntax() {
    check(
        Format::Gemma4,
        "<|tool_call>call:get_weather{city:<|\"|>Paris, FR<|\"|>,days:3,opts:{metric:true,<|\"|>k<|\"|>:null},zip:[<|\"|>a<|\"|>,2.5]}<tool_call|>",
        "",
        json!([{"name": "get_weather", "arguments": {
            "city": "Paris, FR", "days": 3, "opts": {"metric": true, "k": null}, "zip": ["a", 2.5]}}]),
    );
    check(
        Format::Gemma4,
        "Sure.<|tool_call>call:get_weather{}<tool_call|><|tool_call>call:get_weather{days:1}<tool_call|>",
        "Sure.",
        json!([{"name": "get_weather", "arguments": {}},
               {"name": "get_weather", "arguments": {"days": 1}}]),
    );
    malformed(
        Format::Gemma4,
        "<|tool_call>call:get_weather{city:<|\"|>Par",
    );
    malformed(
        Format::Gemma4,
        "<|tool_call>call:get_weather{days:three}<tool_call|>",
    );
    malformed(Format::Gemma4, "<|tool_call>call:get_weather{days:1");
}

#[test]
fn json_fallback() {
    let one = json!([{"name": "get_weather", "arguments": {"city": "Paris"}}]);
    check(
        Format::Json,
        " {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}",
        "",
        one.clone(),
    );
    check(
        Format::Json,
        "```json\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n```",
        "",
        one.clone(),
    );
    check(
        Format::Json,
        "{\"tool_calls\": [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]}",
        "",
        one,
    );
    // Plain answers, JSON that is not a call, a truncated object: content.
    check(
        Format::Json,
        "Paris is sunny {\"name\"}",
        "Paris is sunny {\"name\"}",
        json!([]),
    );
    malformed(Format::Json, "{\"answer\": 4}");
    malformed(
        Format::Json,
        "{\"name\": \"get_weather\", \"arguments\": {\"ci",
    );
}
