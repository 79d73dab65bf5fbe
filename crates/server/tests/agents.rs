//! Tool calls, structured output and the reasoning split over HTTP (issue 33), on the tiny
//! qwen3moe fixture (built-in ChatML) and, for tool calls, the tiny DeepSeek V4 fixture
//! (V4's own template: tools in its system prompt, calls in DSML). The fixtures' text is
//! random, so everything checked here is forced
//! by constrained decoding and checked against hand-written expectations: the grammar's
//! exact output split into reasoning and content, JSON that must have the schema's fields
//! and types, a forced call whose arguments must match its parameter schema. Streamed and
//! whole answers must agree.

mod common;

use common::*;
use serde_json::{json, Value};

fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

/// Concatenate a streamed chat's deltas: (reasoning, content, tool calls, finish reason).
fn chat_stream(ev: &[(String, String)]) -> (String, String, Vec<Value>, String) {
    assert_eq!(ev.last().unwrap().1, "[DONE]");
    let (mut r, mut c, mut calls, mut finish) =
        (String::new(), String::new(), Vec::new(), String::new());
    for (_, d) in &ev[..ev.len() - 1] {
        let v: Value = serde_json::from_str(d).unwrap();
        let ch = &v["choices"][0];
        if let Some(t) = ch["delta"]["reasoning_content"].as_str() {
            r.push_str(t);
        }
        if let Some(t) = ch["delta"]["content"].as_str() {
            c.push_str(t);
        }
        if let Some(a) = ch["delta"]["tool_calls"].as_array() {
            calls.extend(a.iter().cloned());
        }
        if let Some(f) = ch["finish_reason"].as_str() {
            finish = f.to_string();
        }
    }
    (r, c, calls, finish)
}

/// A grammar forces `<think>...</think>` then an answer: the split puts each where it
/// belongs, in both APIs, streamed and not (the expected texts are the grammar's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasoning_split_of_a_forced_answer() {
    let mut s = start(config(), fixture(), false).await;
    let grammar = "root ::= \"<think>\" \"\\nweigh it\\n\" \"</think>\" \"\\n\\nforty-two\"";
    let body =
        json!({"messages": user("think"), "max_tokens": 40, "temperature": 0, "grammar": grammar});
    let (st, v) = s.post("/v1/chat/completions", &body).await;
    assert_eq!(st, 200, "{v}");
    let m = &v["choices"][0]["message"];
    assert_eq!(m["reasoning_content"], "weigh it");
    assert_eq!(m["content"], "forty-two");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    let mut b = body.clone();
    b["stream"] = json!(true);
    let (r, c, calls, finish) = chat_stream(&s.post_sse("/v1/chat/completions", &b).await);
    assert_eq!(
        (r.as_str(), c.as_str(), calls.len(), finish.as_str()),
        ("weigh it", "forty-two", 0, "stop")
    );

    // Anthropic (`grammar` is accepted there too): a thinking block, then a text block.
    let ab =
        json!({"max_tokens": 40, "temperature": 0, "messages": user("think"), "grammar": grammar});
    let (st, v) = s.post("/v1/messages", &ab).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        v["content"],
        json!([{"type": "thinking", "thinking": "weigh it", "signature": ""},
               {"type": "text", "text": "forty-two"}])
    );
    let mut b = ab.clone();
    b["stream"] = json!(true);
    let ev = s.post_sse("/v1/messages", &b).await;
    let (mut blocks, mut names) = (Vec::<Value>::new(), Vec::new());
    for (e, d) in &ev {
        let v: Value = serde_json::from_str(d).unwrap();
        names.push(e.clone());
        match e.as_str() {
            "content_block_start" => {
                assert_eq!(v["index"], blocks.len());
                blocks.push(v["content_block"].clone());
            }
            "content_block_delta" => {
                let i = v["index"].as_u64().unwrap() as usize;
                let d = &v["delta"];
                match d["type"].as_str().unwrap() {
                    "thinking_delta" => {
                        let t = format!(
                            "{}{}",
                            blocks[i]["thinking"].as_str().unwrap(),
                            d["thinking"].as_str().unwrap()
                        );
                        blocks[i]["thinking"] = json!(t);
                    }
                    "text_delta" => {
                        let t = format!(
                            "{}{}",
                            blocks[i]["text"].as_str().unwrap(),
                            d["text"].as_str().unwrap()
                        );
                        blocks[i]["text"] = json!(t);
                    }
                    other => panic!("{other}"),
                }
            }
            _ => {}
        }
    }
    assert_eq!(Value::Array(blocks), v["content"]);
    assert_eq!(
        &names[..3],
        &["message_start", "content_block_start", "ping"]
    );
    assert_eq!(
        &names[names.len() - 3..],
        &["content_block_stop", "message_delta", "message_stop"]
    );

    // Cut inside the block by max_tokens: the unclosed block is reasoning, never content.
    // The token texts (logprobs) of the whole answer say where the cut falls: after the
    // first token that reaches past "<think>\nw", before "</think>" starts.
    let mut lpb = body.clone();
    lpb["logprobs"] = json!(true);
    let (st, v) = s.post("/v1/chat/completions", &lpb).await;
    assert_eq!(st, 200, "{v}");
    let mut at = String::new();
    let mut k = 0;
    for e in v["choices"][0]["logprobs"]["content"].as_array().unwrap() {
        at.push_str(e["token"].as_str().unwrap());
        k += 1;
        if at.len() > "<think>\nw".len() {
            break;
        }
    }
    assert!(!at.contains("</"), "{at:?}");
    let mut cut = body.clone();
    cut["max_tokens"] = json!(k);
    let (st, v) = s.post("/v1/chat/completions", &cut).await;
    assert_eq!(st, 200, "{v}");
    let m = &v["choices"][0]["message"];
    assert_eq!(m["content"], "", "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(
        m["reasoning_content"],
        at.trim_start_matches("<think>\n").trim_end_matches('\n'),
        "{v}"
    );
    s.stop();
}

/// `response_format` `json_schema`: the answer parses and has the schema's fields and types.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_schema_output_has_the_schema() {
    let mut s = start(config(), fixture(), false).await;
    let schema = json!({"type": "object", "properties": {
        "n": {"type": "integer"}, "color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
        "required": ["n", "color", "ok"], "additionalProperties": false});
    let body = json!({"messages": user("json please"), "max_tokens": 60, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "t", "strict": true, "schema": schema}}});
    let (st, v) = s.post("/v1/chat/completions", &body).await;
    assert_eq!(st, 200, "{v}");
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let o: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    let keys: Vec<&String> = o.as_object().unwrap().keys().collect();
    assert_eq!(keys.len(), 3, "{o}");
    assert!(o["n"].is_i64() || o["n"].is_u64(), "{o}");
    assert!(o["color"] == "red" || o["color"] == "green", "{o}");
    assert!(o["ok"].is_boolean(), "{o}");
    // Streamed: the same text (greedy, same mask).
    let mut b = body.clone();
    b["stream"] = json!(true);
    let (_, c, _, _) = chat_stream(&s.post_sse("/v1/chat/completions", &b).await);
    assert_eq!(c, text);
    // json_object: an object.
    let body = json!({"messages": user("json"), "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_object"}});
    let (st, v) = s.post("/v1/chat/completions", &body).await;
    assert_eq!(st, 200, "{v}");
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    if v["choices"][0]["finish_reason"] == "stop" {
        assert!(
            serde_json::from_str::<Value>(text).unwrap().is_object(),
            "{text}"
        );
    } else {
        assert!(text.starts_with('{'), "{text}");
    }
    s.stop();
}

/// Schemas and grammars that cannot be compiled are a 400 naming the field and problem.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_schemas_and_grammars_are_400() {
    let mut s = start(config(), fixture(), false).await;
    let cases = [
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}}),
            "response_format",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
            "schema",
        ),
        (
            json!({"response_format": {"type": "yaml"}}),
            "response_format",
        ),
        (json!({"grammar": "root ::= \"abc"}), "unclosed string"),
        (json!({"grammar": "root ::= undefined-rule"}), "grammar"),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}),
            "`g`",
        ),
    ];
    let mut wrong = Vec::new();
    for (extra, want) in cases {
        let mut body = json!({"messages": user("x"), "max_tokens": 4});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (st, v) = s.post("/v1/chat/completions", &body).await;
        let msg = v["error"]["message"].as_str().unwrap_or("");
        if st != 400 || !msg.contains(want) {
            wrong.push(format!("{body}: {st} {v}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    s.stop();
}

fn weather_tool() -> Value {
    json!({"type": "function", "function": {"name": "w",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city", "days"], "additionalProperties": false}}})
}

/// Arguments hold to get_weather's schema (checked field by field).
fn check_weather_args(args: &Value) {
    let o = args.as_object().unwrap_or_else(|| panic!("{args}"));
    assert_eq!(o.len(), 2, "{args}");
    assert!(o["city"].is_string(), "{args}");
    let d = o["days"].as_i64().unwrap_or_else(|| panic!("{args}"));
    assert!((1..=7).contains(&d), "{args}");
}

/// `tool_choice: required` (and a named function) forces one call whose arguments match
/// the schema; streamed and whole give the same call; finish_reason `tool_calls`. The
/// Anthropic API answers a `tool_use` block with `stop_reason: tool_use`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forced_tool_call_matches_the_schema() {
    // The tiny DeepSeek V4 fixture: its file carries V4's own template (tools rendered
    // natively, calls in DSML), and a context long enough for the tools header.
    let ds4 = fixture()
        .parent()
        .unwrap()
        .join("../deepseek4/b-mxfp4.gguf");
    let mut cfg = config();
    cfg.max_tokens = 600; // the random model spells the DSML markup a byte at a time
    let mut s = start_ctx(cfg, ds4, false, 2048).await;
    for choice in [
        json!("required"),
        json!({"type": "function", "function": {"name": "w"}}),
    ] {
        let body = json!({"messages": user("Paris?"), "max_tokens": 600, "temperature": 0,
            "tools": [weather_tool()], "tool_choice": choice});
        let (st, v) = s.post("/v1/chat/completions", &body).await;
        assert_eq!(st, 200, "{v}");
        let ch = &v["choices"][0];
        assert_eq!(ch["finish_reason"], "tool_calls", "{v}");
        let calls = ch["message"]["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0]["type"], "function");
        assert_eq!(calls[0]["function"]["name"], "w");
        let args: Value =
            serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
        check_weather_args(&args);

        let mut b = body.clone();
        b["stream"] = json!(true);
        let (_, c, scalls, finish) = chat_stream(&s.post_sse("/v1/chat/completions", &b).await);
        assert_eq!((c.as_str(), finish.as_str()), ("", "tool_calls"));
        assert_eq!(scalls.len(), 1);
        assert_eq!(scalls[0]["index"], 0);
        assert_eq!(scalls[0]["function"], calls[0]["function"]);
    }

    // Anthropic: the same tool in its shape, `any`.
    let body = json!({"max_tokens": 600, "temperature": 0, "messages": user("Paris?"),
        "tools": [{"name": "w",
                   "input_schema": weather_tool()["function"]["parameters"]}],
        "tool_choice": {"type": "any"}});
    let (st, v) = s.post("/v1/messages", &body).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["stop_reason"], "tool_use");
    let blocks = v["content"].as_array().unwrap();
    let tu: Vec<&Value> = blocks.iter().filter(|b| b["type"] == "tool_use").collect();
    assert_eq!(tu.len(), 1, "{v}");
    assert_eq!(tu[0]["name"], "w");
    check_weather_args(&tu[0]["input"]);
    let mut b = body.clone();
    b["stream"] = json!(true);
    let ev = s.post_sse("/v1/messages", &b).await;
    let mut json_text = String::new();
    let mut stop = Value::Null;
    for (e, d) in &ev {
        let v: Value = serde_json::from_str(d).unwrap();
        if e == "content_block_delta" && v["delta"]["type"] == "input_json_delta" {
            json_text.push_str(v["delta"]["partial_json"].as_str().unwrap());
        }
        if e == "message_delta" {
            stop = v["delta"]["stop_reason"].clone();
        }
    }
    assert_eq!(stop, "tool_use");
    assert_eq!(
        serde_json::from_str::<Value>(&json_text).unwrap(),
        tu[0]["input"]
    );

    // A tool result goes back in (Anthropic `tool_result`, OpenAI `tool` message) and the
    // conversation goes on.
    let body = json!({"max_tokens": 4, "temperature": 0, "messages": [
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Paris", "days": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}],
        "tools": body["tools"]});
    let (st, v) = s.post("/v1/messages", &body).await;
    assert_eq!(st, 200, "{v}");
    // tool_choice none: the tools are not offered and nothing is parsed.
    let body = json!({"messages": user("weather?"), "max_tokens": 8, "temperature": 0,
        "tools": [weather_tool()], "tool_choice": "none"});
    let (st, v) = s.post("/v1/chat/completions", &body).await;
    assert_eq!(st, 200, "{v}");
    assert!(
        v["choices"][0]["message"].get("tool_calls").is_none(),
        "{v}"
    );
    s.stop();
}
