//! The HTTP API against a tiny qwen3moe fixture: shapes of responses and SSE sequences,
//! greedy text equal to the engine's own generation, errors, auth, 503 past the queue,
//! prefix reuse, concurrency, cancellation and graceful shutdown.

mod common;

use common::*;
use serde_json::{json, Value};

fn chat_body(msgs: &[(&str, &str)], max_tokens: u64) -> Value {
    let m: Vec<Value> = msgs
        .iter()
        .map(|(r, c)| json!({"role": r, "content": c}))
        .collect();
    json!({"model": "tiny", "messages": m, "max_tokens": max_tokens, "temperature": 0})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_and_chat() {
    let path = fixture();
    let mut s = start(config(), path.clone(), false).await;
    let (st, v) = (
        s.client
            .get(s.url("/v1/models"))
            .send()
            .await
            .unwrap()
            .status(),
        s.client
            .get(s.url("/v1/models"))
            .send()
            .await
            .unwrap()
            .json::<Value>()
            .await
            .unwrap(),
    );
    assert_eq!(st, 200);
    assert_eq!(v["data"][0]["id"], "tiny");

    let msgs = [("system", "Be brief."), ("user", "Hello there")];
    let (st, v) = s.post("/v1/chat/completions", &chat_body(&msgs, 24)).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let prompt = chat_tokens(&path, &msgs);
    assert_eq!(v["usage"]["prompt_tokens"], prompt.len());
    let n = v["usage"]["completion_tokens"].as_u64().unwrap();
    assert_eq!(
        v["usage"]["total_tokens"].as_u64().unwrap(),
        prompt.len() as u64 + n
    );
    let fr = v["choices"][0]["finish_reason"].as_str().unwrap();
    assert!(
        fr == "length" && n == 24 || fr == "stop" && n < 24,
        "{fr} {n}"
    );
    // Greedy text equals the engine's own greedy generation for the same tokens.
    assert_eq!(text, reference(&path, &prompt, 24));

    // Streamed: same text, usage chunk at the end when asked, then [DONE].
    let mut body = chat_body(&msgs, 24);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let ev = s.post_sse("/v1/chat/completions", &body).await;
    assert_eq!(ev.last().unwrap().1, "[DONE]");
    let chunks: Vec<Value> = ev[..ev.len() - 1]
        .iter()
        .map(|(_, d)| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, text);
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"].as_array().unwrap().len(), 0);
    assert_eq!(usage["usage"]["completion_tokens"], n);
    let fin = &chunks[chunks.len() - 2];
    assert_eq!(fin["choices"][0]["finish_reason"], fr);
    s.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_plain_and_streamed() {
    let path = fixture();
    let mut s = start(config(), path.clone(), false).await;
    let prompt_text = "The quick brown fox";
    let body = json!({"prompt": prompt_text, "max_tokens": 20, "temperature": 0});
    let (st, v) = s.post("/v1/completions", &body).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    let text = v["choices"][0]["text"].as_str().unwrap().to_string();
    let tok = tokenizer(&path);
    let prompt = tok.encode(prompt_text, true, false);
    assert_eq!(v["usage"]["prompt_tokens"], prompt.len());
    assert_eq!(text, reference(&path, &prompt, 20));

    let mut b = body.clone();
    b["stream"] = json!(true);
    let ev = s.post_sse("/v1/completions", &b).await;
    assert_eq!(ev.last().unwrap().1, "[DONE]");
    let streamed: String = ev[..ev.len() - 1]
        .iter()
        .map(|(_, d)| serde_json::from_str::<Value>(d).unwrap())
        .filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_string))
        .collect();
    assert_eq!(streamed, text);

    // A stop string cuts the text before it, in both modes.
    if let Some(cut) = text.get(4..7).filter(|c| !c.trim().is_empty()) {
        let pos = text.find(cut).unwrap();
        let mut b = body.clone();
        b["stop"] = json!([cut]);
        let (_, v) = s.post("/v1/completions", &b).await;
        assert_eq!(v["choices"][0]["text"], text[..pos]);
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        b["stream"] = json!(true);
        let ev = s.post_sse("/v1/completions", &b).await;
        let streamed: String = ev[..ev.len() - 1]
            .iter()
            .map(|(_, d)| serde_json::from_str::<Value>(d).unwrap())
            .filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_string))
            .collect();
        assert_eq!(streamed, text[..pos]);
    }
    s.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn anthropic_messages() {
    let path = fixture();
    let mut s = start(config(), path.clone(), false).await;
    let body = json!({
        "model": "tiny", "max_tokens": 16, "temperature": 0, "system": "Be brief.",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}],
    });
    let (st, v) = s.post("/v1/messages", &body).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["type"], "message");
    assert_eq!(v["role"], "assistant");
    let text = v["content"][0]["text"].as_str().unwrap().to_string();
    let prompt = chat_tokens(&path, &[("system", "Be brief."), ("user", "Hello there")]);
    assert_eq!(v["usage"]["input_tokens"], prompt.len());
    assert_eq!(text, reference(&path, &prompt, 16));
    let reason = v["stop_reason"].as_str().unwrap();
    assert!(["end_turn", "max_tokens"].contains(&reason));

    let mut b = body.clone();
    b["stream"] = json!(true);
    let ev = s.post_sse("/v1/messages", &b).await;
    let names: Vec<&str> = ev.iter().map(|(e, _)| e.as_str()).collect();
    assert_eq!(
        &names[..3],
        &["message_start", "content_block_start", "ping"]
    );
    assert_eq!(
        &names[names.len() - 3..],
        &["content_block_stop", "message_delta", "message_stop"]
    );
    assert!(names[3..names.len() - 3]
        .iter()
        .all(|n| *n == "content_block_delta"));
    let mut streamed = String::new();
    for (e, d) in &ev {
        let v: Value = serde_json::from_str(d).unwrap();
        assert_eq!(v["type"], e.as_str());
        if e == "content_block_delta" {
            streamed.push_str(v["delta"]["text"].as_str().unwrap());
        }
        if e == "message_delta" {
            assert_eq!(v["delta"]["stop_reason"], reason);
        }
    }
    assert_eq!(streamed, text);
    s.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_4xx_objects() {
    let mut cfg = config();
    cfg.max_body = 4096;
    let mut s = start(cfg, fixture(), false).await;
    let raw = |p: &'static str, b: &'static str| {
        let c = s.client.clone();
        let url = s.url(p);
        async move {
            let r = c
                .post(url)
                .header("content-type", "application/json")
                .body(b)
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let (st, v) = raw("/v1/chat/completions", "{not json").await;
    assert_eq!(st, 400);
    assert_eq!(v["error"]["type"], "invalid_request_error");
    let (st, _) = raw("/v1/chat/completions", r#"{"messages": "hi"}"#).await;
    assert_eq!(st, 400);
    let (st, _) = raw(
        "/v1/chat/completions",
        r#"{"messages": [{"role":"user","content":"x"}], "temperature": "hot"}"#,
    )
    .await;
    assert_eq!(st, 400);
    let (st, _) = raw("/v1/chat/completions", r#"{"messages": []}"#).await;
    assert_eq!(st, 400);
    let (st, _) = raw("/v1/chat/completions", "").await;
    assert_eq!(st, 400);
    let (st, v) = raw(
        "/v1/chat/completions",
        r#"{"messages": [{"role":"user","content":"x"}], "max_tokens": 100000}"#,
    )
    .await;
    assert_eq!(st, 400);
    assert_eq!(v["error"]["param"], "max_tokens");
    let (st, v) = raw(
        "/v1/messages",
        r#"{"messages": [{"role":"user","content":"x"}]}"#,
    )
    .await;
    assert_eq!(st, 400, "max_tokens is required: {v}");
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    let (st, v) = raw("/v1/completions", r#"{"prompt": 42}"#).await;
    assert_eq!(st, 400, "{v}");
    // A prompt longer than the context.
    let long = "word ".repeat(600);
    let (st, v) = s
        .post("/v1/completions", &json!({"prompt": long, "max_tokens": 1}))
        .await;
    assert_eq!(st, 400, "{v}");
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    // Body over the limit.
    let big = format!(r#"{{"prompt": "{}"}}"#, "a".repeat(8192));
    let r = s
        .client
        .post(s.url("/v1/completions"))
        .body(big)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    assert!(r.json::<Value>().await.unwrap()["error"]["message"].is_string());
    let r = s.client.get(s.url("/nope")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    assert!(s.metric("sluice_requests_client_errors_total").await >= 9.0);
    // The server is still fine.
    let (st, _) = s
        .post(
            "/v1/completions",
            &json!({"prompt": "a b", "max_tokens": 2}),
        )
        .await;
    assert_eq!(st, 200);
    s.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_required() {
    let mut cfg = config();
    cfg.api_key = Some("s3cret".into());
    let mut s = start(cfg, fixture(), false).await;
    let body = json!({"prompt": "a b", "max_tokens": 2});
    let r = s
        .client
        .post(s.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = s
        .client
        .post(s.url("/v1/completions"))
        .bearer_auth("wrong")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = s
        .client
        .post(s.url("/v1/completions"))
        .bearer_auth("s3cret")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = s
        .client
        .post(s.url("/v1/messages"))
        .header("x-api-key", "s3cret")
        .json(&json!({"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = s.client.get(s.url("/metrics")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    // Health stays open (load balancers probe it).
    let r = s.client.get(s.url("/health")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    s.stop();
}

#[test]
fn refuses_public_bind_without_key() {
    let mut cfg = config();
    cfg.host = "0.0.0.0".into();
    let opts = options(&fixture(), false);
    let e = sluice_server::start(
        cfg,
        Box::new(move || opts.load().map_err(|e| e.to_string())),
    )
    .err()
    .expect("refused");
    assert!(e.to_string().contains("--insecure-public"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_full_is_503_with_retry_after() {
    let g = gate();
    let mut cfg = config();
    cfg.parallel = 1;
    cfg.queue = 1;
    cfg.gate = Some(g.clone());
    let mut s = start(cfg, fixture(), false).await;
    g.close();
    let body = json!({"prompt": "a b c", "max_tokens": 4, "temperature": 0});
    let (c1, c2) = (s.client.clone(), s.client.clone());
    let (u1, u2) = (s.url("/v1/completions"), s.url("/v1/completions"));
    let (b1, b2) = (body.clone(), body.clone());
    let a = tokio::spawn(async move { c1.post(u1).json(&b1).send().await.unwrap().status() });
    s.wait_metric("sluice_running", |v| v == 1.0).await;
    let b = tokio::spawn(async move { c2.post(u2).json(&b2).send().await.unwrap().status() });
    s.wait_metric("sluice_queue_depth", |v| v == 1.0).await;
    // Running 1 + queued 1 = parallel + queue: the next one is refused.
    let r = s
        .client
        .post(s.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "1");
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"].is_string());
    assert_eq!(s.metric("sluice_requests_rejected_total").await, 1.0);
    g.open();
    assert_eq!(a.await.unwrap(), 200);
    assert_eq!(b.await.unwrap(), 200);
    s.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_greedy_equals_alone_streaming_tier() {
    let path = fixture();
    let mut cfg = config();
    cfg.parallel = 4;
    let mut s = start(cfg, path.clone(), true).await;
    let prompts = [
        "The quick brown fox",
        "Once upon a time",
        "In a hole in the ground",
        "It was a bright cold day",
        "Call me Ishmael",
        "All happy families",
    ];
    let body = |p: &str| json!({"prompt": p, "max_tokens": 24, "temperature": 0});
    let mut alone = Vec::new();
    for p in prompts {
        let (st, v) = s.post("/v1/completions", &body(p)).await;
        assert_eq!(st, 200);
        alone.push(v["choices"][0]["text"].as_str().unwrap().to_string());
    }
    let tok = tokenizer(&path);
    for (p, a) in prompts.iter().zip(&alone) {
        assert_eq!(*a, reference(&path, &tok.encode(p, true, false), 24), "{p}");
    }
    for _round in 0..2 {
        let mut tasks = Vec::new();
        for p in prompts {
            let c = s.client.clone();
            let u = s.url("/v1/completions");
            let b = body(p);
            tasks.push(tokio::spawn(async move {
                let v: Value = c
                    .post(u)
                    .json(&b)
                    .send()
                    .await
                    .unwrap()
                    .json()
                    .await
                    .unwrap();
                v["choices"][0]["text"].as_str().unwrap().to_string()
            }));
        }
        for (t, a) in tasks.into_iter().zip(&alone) {
            assert_eq!(t.await.unwrap(), *a);
        }
    }
    let m = s.metrics().await;
    assert!(
        metric_in(&m, "sluice_expert_cache_misses_total") > 0.0,
        "{m}"
    );
    assert!(metric_in(&m, "sluice_expert_bytes_read_total") > 0.0);
    metric_in(&m, "sluice_expert_compute_wait_seconds_total");
    assert!(metric_in(&m, "sluice_time_to_first_token_seconds_count") >= 18.0);
    assert!(metric_in(&m, "sluice_completion_tokens_total") > 0.0);
    s.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_reuse_across_turns() {
    let path = fixture();
    let mut cfg = config();
    cfg.parallel = 1;
    let mut s = start(cfg, path.clone(), false).await;
    let turn1 = [
        ("system", "You are a helpful assistant."),
        ("user", "Tell me a story about a fox"),
    ];
    let (_, v1) = s.post("/v1/chat/completions", &chat_body(&turn1, 8)).await;
    assert_eq!(v1["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let reply = v1["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    // Something unrelated in between: the worker's own sequence no longer holds turn 1,
    // so reuse must come from the snapshot.
    let (_, _) = s
        .post(
            "/v1/completions",
            &json!({"prompt": "zebra zebra", "max_tokens": 4}),
        )
        .await;
    let turn2 = [
        turn1[0],
        turn1[1],
        ("assistant", reply.as_str()),
        ("user", "And then?"),
    ];
    let (_, v2) = s.post("/v1/chat/completions", &chat_body(&turn2, 8)).await;
    let p1 = v1["usage"]["prompt_tokens"].as_u64().unwrap();
    let cached = v2["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached >= p1 - 1, "cached {cached} of turn 1's {p1}");
    // Same greedy text as computing everything afresh.
    let prompt2 = chat_tokens(&path, &turn2);
    assert_eq!(
        v2["choices"][0]["message"]["content"].as_str().unwrap(),
        reference(&path, &prompt2, 8)
    );
    let m = s.metrics().await;
    assert!(metric_in(&m, "sluice_prefix_reused_tokens_total") >= cached as f64);
    assert!(metric_in(&m, "sluice_prefix_cache_entries") >= 1.0);
    s.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_cancels_generation() {
    struct OpenOnDrop(std::sync::Arc<sluice_server::scheduler::Gate>);
    impl Drop for OpenOnDrop {
        fn drop(&mut self) {
            self.0.open();
        }
    }
    let g = gate();
    let mut cfg = config();
    cfg.parallel = 1;
    cfg.max_tokens = 200;
    cfg.gate = Some(g.clone());
    let mut s = start(cfg, fixture(), false).await;
    // Declared after `s`, so dropped before it: a failed assertion opens the gate instead
    // of leaving the server's worker blocked there while the server shuts down (a hang).
    let _open_on_exit = OpenOnDrop(g.clone());
    g.close();
    let body = json!({"prompt": "a b c", "max_tokens": 200, "temperature": 0, "stream": true});
    // Its own client, so that dropping the response closes its own connection.
    let other = reqwest::Client::builder().timeout(TIMEOUT).build().unwrap();
    let r = other
        .post(s.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    s.wait_metric("sluice_running", |v| v == 1.0).await;
    let open = s.connections().await;
    drop(r);
    drop(other);
    // The server notices the closed connection (and drops the response stream).
    s.wait_connections_below(open).await;
    g.open();
    s.wait_metric("sluice_running", |v| v == 0.0).await;
    assert_eq!(s.metric("sluice_requests_cancelled_total").await, 1.0);
    assert!(s.metric("sluice_completion_tokens_total").await < 200.0);
    s.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_drains() {
    let g = gate();
    let mut cfg = config();
    cfg.gate = Some(g.clone());
    let mut s = start(cfg, fixture(), false).await;
    g.close();
    let c = s.client.clone();
    let u = s.url("/v1/completions");
    let t = tokio::spawn(async move {
        let body = json!({"prompt": "a b c", "max_tokens": 8, "temperature": 0, "stream": true});
        let r = c.post(u).json(&body).send().await.unwrap();
        r.text().await.unwrap()
    });
    s.wait_metric("sluice_running", |v| v == 1.0).await;
    let srv = s.srv.take().unwrap();
    srv.shutdown();
    g.open();
    let text = t.await.unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    srv.wait().unwrap();
    assert!(s.client.get(s.url("/health")).send().await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_503_while_loading() {
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let opts = options(&fixture(), false);
    let srv = sluice_server::start(
        config(),
        Box::new(move || {
            // Loading waits until the test says so.
            let _ = rx.recv_timeout(TIMEOUT);
            opts.load().map_err(|e| e.to_string())
        }),
    )
    .unwrap();
    let base = format!("http://{}", srv.addr());
    let c = reqwest::Client::builder().timeout(TIMEOUT).build().unwrap();
    let r = c.get(format!("{base}/health")).send().await.unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "1");
    let r = c
        .post(format!("{base}/v1/chat/completions"))
        .json(&json!({"messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    assert!(r.headers().contains_key("retry-after"));
    let r = c
        .post(format!("{base}/v1/messages"))
        .json(&json!({"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(
        r.json::<Value>().await.unwrap()["error"]["type"],
        "overloaded_error"
    );
    tx.send(()).unwrap();
    let mut s = Server {
        srv: Some(srv),
        base,
        client: c,
    };
    s.wait_metric("sluice_ready", |v| v == 1.0).await;
    let r = s.client.get(s.url("/health")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    s.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_failure_stops_the_server() {
    let srv =
        sluice_server::start(config(), Box::new(|| Err("no such model".to_string()))).unwrap();
    let e = srv.wait().unwrap_err();
    assert!(e.to_string().contains("no such model"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tools_pass_through() {
    let path = fixture();
    let mut s = start(config(), path.clone(), false).await;
    // The fixture's template (built-in ChatML) does not describe tools: they are described
    // in a system message, the assistant's call is written as the JSON object the model is
    // asked for, and the tool result becomes a user turn (issue 33; before, the tools were
    // dropped). The expected conversation is written out by hand here.
    let body = json!({
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
        "max_tokens": 4, "temperature": 0});
    let (st, v) = s.post("/v1/chat/completions", &body).await;
    assert_eq!(st, 200, "{v}");
    let system = "You can call these tools (JSON schema of each one's arguments):\n\
        {\"name\":\"get_weather\",\"description\":\"\",\"parameters\":{\"type\":\"object\"}}\n\
        To call a tool, answer with only a JSON object: {\"name\": <tool name>, \"arguments\": <arguments object>}.";
    let expected = chat_tokens(
        &path,
        &[
            ("system", system),
            ("user", "weather?"),
            ("assistant", "{\"name\":\"get_weather\",\"arguments\":{}}"),
            ("user", "Tool result: sunny"),
        ],
    );
    assert_eq!(v["usage"]["prompt_tokens"], expected.len());
    s.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_cancels_non_streamed_generation() {
    let g = gate();
    let mut cfg = config();
    cfg.parallel = 1;
    cfg.max_tokens = 200;
    cfg.gate = Some(g.clone());
    let mut s = start(cfg, fixture(), false).await;
    g.close();
    let other = reqwest::Client::builder().timeout(TIMEOUT).build().unwrap();
    let u = s.url("/v1/completions");
    let body = json!({"prompt": "a b c", "max_tokens": 200, "temperature": 0});
    let task = tokio::spawn(async move { other.post(u).json(&body).send().await });
    s.wait_metric("sluice_running", |v| v == 1.0).await;
    let open = s.connections().await;
    task.abort();
    let _ = task.await;
    s.wait_connections_below(open).await;
    g.open();
    s.wait_metric("sluice_running", |v| v == 0.0).await;
    assert_eq!(s.metric("sluice_requests_cancelled_total").await, 1.0);
    assert_eq!(s.metric("sluice_completion_tokens_total").await, 0.0);
    s.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_logprobs() {
    let mut s = start(config(), fixture(), false).await;
    let mut body = chat_body(&[("user", "Hello there")], 12);
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(3);
    let (st, v) = s.post("/v1/chat/completions", &body).await;
    assert_eq!(st, 200, "{v}");
    let lp = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(
        lp.len() as u64,
        v["usage"]["completion_tokens"].as_u64().unwrap()
    );
    for e in lp {
        let l = e["logprob"].as_f64().unwrap();
        assert!(l <= 0.0);
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(top[0]["token"], e["token"]);
        assert_eq!(top[0]["logprob"], e["logprob"]);
        assert!(top[0]["logprob"].as_f64() >= top[1]["logprob"].as_f64());
    }
    body["stream"] = json!(true);
    let ev = s.post_sse("/v1/chat/completions", &body).await;
    let n: usize = ev[..ev.len() - 1]
        .iter()
        .map(|(_, d)| serde_json::from_str::<Value>(d).unwrap())
        .filter_map(|c| {
            c["choices"][0]["logprobs"]["content"]
                .as_array()
                .map(|a| a.len())
        })
        .sum();
    assert_eq!(n, lp.len());
    body["top_logprobs"] = json!(21);
    let (st, _) = s.post("/v1/chat/completions", &body).await;
    assert_eq!(st, 400);
    s.stop();
}
