//! The HTTP surface: router, API-key check, handlers, SSE framing, connection limit.
//!
//! Owns: the routes (`/health`, `/metrics`, `/v1/models`, `/v1/chat/completions`,
//! `/v1/completions`, `/v1/messages`), request validation (body size, prompt tokens,
//! `max_tokens`, the context, the body timeout: 408), admission (503 + `Retry-After` past
//! the queue), the translation of a job's [`Event`]s into OpenAI or Anthropic responses
//! and SSE event sequences. Connections (cap, header and idle timeouts) are `conn`'s. A
//! client that goes away drops the response stream, which closes the job's channel; the
//! worker's `should_stop` sees it and stops generating.

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use sluice_engine::load::Loaded;
use sluice_engine::text::chat::{ChatMessage, ChatTemplate};
use sluice_engine::text::tokenizer::Tokenizer;
use subtle::ConstantTimeEq;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::api::{self, ApiError, Flavor};
use crate::metrics::Gauges;
use crate::scheduler::{Done, Event, Finish, Job, Scheduler, Shared};
use crate::shape::{Out, Shaper};
use crate::toolcall::ToolCall;
use crate::{AppState, Ready};

/// Build the engine around a loaded model: tokenizer, chat template, workers.
pub(crate) fn make_ready(st: &AppState, loaded: Loaded) -> Result<Arc<Ready>, String> {
    let tok = Tokenizer::from_gguf(&loaded.model.gguf)
        .map_err(|e| format!("the model has no usable tokenizer: {e}"))?;
    let template = ChatTemplate::from_gguf(&loaded.model.gguf, &tok);
    let p = st.cfg.session;
    let n_ctx = p.ctx.min(loaded.model.cfg.n_ctx_train).max(1);
    let disk = match &st.cfg.prefix_cache_dir {
        // A device backend's copy of a sequence has no byte form, and a state restored
        // without it would not match the device's: snapshots stay in RAM.
        Some(dir) if loaded.model.device_forward().is_some() => {
            eprintln!(
                "--prefix-cache-dir {}: not used with --gpu (snapshots stay in RAM)",
                dir.display()
            );
            None
        }
        Some(dir) => {
            let id = crate::prefix_disk::model_id(&loaded.model, p.kv_f32);
            let d = crate::prefix_disk::DiskCache::open(dir, st.cfg.prefix_cache_disk, id)?;
            Some(Arc::new(d))
        }
        None => None,
    };
    let shared = Arc::new(Shared {
        disk,
        loaded: Arc::new(loaded),
        tok: Arc::new(tok),
        params: p,
        metrics: st.metrics.clone(),
        prefix: st.prefix.clone(),
        gate: st.cfg.gate.clone(),
    });
    let sched = Scheduler::start(shared.clone(), st.cfg.parallel, st.cfg.queue);
    Ok(Arc::new(Ready {
        shared,
        sched,
        template,
        n_ctx,
        constrainer: std::sync::OnceLock::new(),
    }))
}

pub(crate) fn router(st: Arc<AppState>) -> Router {
    let protected = Router::new()
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/messages", post(messages))
        .route_layer(middleware::from_fn_with_state(st.clone(), auth));
    Router::new()
        .route("/health", get(health))
        .merge(crate::page::routes())
        .merge(protected)
        .fallback(not_found)
        .with_state(st)
}

fn flavor_of(path: &str) -> Flavor {
    if path.starts_with("/v1/messages") {
        Flavor::Anthropic
    } else {
        Flavor::OpenAi
    }
}

async fn not_found(req: Request) -> Response {
    let flavor = flavor_of(req.uri().path());
    ApiError::bad_request(
        flavor,
        format!("no route for {} {}", req.method(), req.uri().path()),
    )
    .status(StatusCode::NOT_FOUND, "invalid_request_error")
    .into_response()
}

/// The presented key: `Authorization: Bearer KEY` or `x-api-key: KEY`.
fn presented_key(h: &HeaderMap) -> Option<&[u8]> {
    if let Some(v) = h.get(header::AUTHORIZATION) {
        let b = v.as_bytes();
        if b.len() > 7 && b[..7].eq_ignore_ascii_case(b"bearer ") {
            return Some(&b[7..]);
        }
    }
    h.get("x-api-key").map(|v| v.as_bytes())
}

async fn auth(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.cfg.api_key {
        let ok = presented_key(req.headers())
            .map(|k| bool::from(k.ct_eq(key.as_bytes())))
            .unwrap_or(false);
        if !ok {
            let flavor = flavor_of(req.uri().path());
            return ApiError::bad_request(flavor, "invalid or missing API key")
                .status(StatusCode::UNAUTHORIZED, "invalid_request_error")
                .code("invalid_api_key")
                .into_response();
        }
    }
    next.run(req).await
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    match st.ready.get() {
        Some(_) => (StatusCode::OK, Json(json!({"status": "ok"}))).into_response(),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            [(header::RETRY_AFTER, "1")],
            Json(json!({"status": "loading"})),
        )
            .into_response(),
    }
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let ready = st.ready.get();
    let (queued, running) = ready
        .map(|r| (r.sched.queued(), r.sched.running()))
        .unwrap_or((0, 0));
    let (pc_bytes, pc_entries, pc_budget) = {
        let pc = st.prefix.lock().unwrap_or_else(|e| e.into_inner());
        (pc.bytes(), pc.len(), pc.budget())
    };
    let g = Gauges {
        queued,
        running,
        parallel: st.cfg.parallel,
        prefix_cache_bytes: pc_bytes,
        prefix_cache_entries: pc_entries,
        prefix_cache_budget: pc_budget,
        prefix_disk: ready
            .and_then(|r| r.shared.disk.as_ref())
            .map(|d| d.gauges()),
        ready: ready.is_some(),
        connections: st.connections.open(),
    };
    let streaming = ready.and_then(|r| r.shared.loaded.streaming.clone());
    let text = st.metrics.render(&g, streaming.as_deref());
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn models(State(st): State<Arc<AppState>>) -> Response {
    Json(json!({
        "object": "list",
        "data": [{
            "id": st.cfg.model_name,
            "object": "model",
            "created": st.created,
            "owned_by": "sluice",
        }]
    }))
    .into_response()
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn new_id(prefix: &str) -> String {
    use std::sync::atomic::AtomicU64;
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    format!("{prefix}{t:x}{n:04x}")
}

/// Read the body within the size limit and the body timeout (all of it, counted from
/// the handler's start, right after the head); past the drain deadline, 503.
async fn read_body(st: &AppState, flavor: Flavor, body: Body) -> Result<Bytes, ApiError> {
    let mut cut = st.cut.subscribe();
    let read = axum::body::to_bytes(body, st.cfg.max_body);
    let limit = st.cfg.body_timeout;
    tokio::select! {
        r = read => r.map_err(|_| {
            ApiError::bad_request(
                flavor,
                format!(
                    "the request body is larger than {} bytes (or unreadable)",
                    st.cfg.max_body
                ),
            )
            .status(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error")
        }),
        _ = tokio::time::sleep(limit) => Err(ApiError::bad_request(
            flavor,
            format!(
                "the request body did not arrive in full within the body timeout ({})",
                secs(limit)
            ),
        )
        .status(StatusCode::REQUEST_TIMEOUT, "invalid_request_error")
        .close()),
        _ = cut.wait_for(|c| *c) => Err(ApiError::overloaded(
            flavor,
            "the server is shutting down (the request body was still arriving)",
            1,
        )
        .close()),
    }
}

/// A duration as the flags write it (`30s`, `500ms`).
fn secs(d: Duration) -> String {
    if d.subsec_millis() == 0 {
        format!("{} s", d.as_secs())
    } else {
        format!("{} ms", d.as_millis())
    }
}

fn ready(st: &AppState, flavor: Flavor) -> Result<Arc<Ready>, ApiError> {
    st.ready
        .get()
        .cloned()
        .ok_or_else(|| ApiError::overloaded(flavor, "the model is still loading", 1))
}

/// What a handler asks the scheduler for.
struct Request2 {
    prompt: Vec<u32>,
    sampler: sluice_engine::sampler::SamplerConfig,
    max_tokens: Option<u64>,
    stop: Vec<String>,
    logprobs: Option<usize>,
    /// Constrained decoding (`plan.rs`).
    constraint: Option<crate::constrain::JobConstraint>,
    /// Control tokens shown as text (`plan.rs`).
    show: Vec<u32>,
}

/// A job admitted and queued: its events, and a flag that stops it when dropped.
struct Running {
    rx: UnboundedReceiver<Event>,
    _cancel: CancelOnDrop,
    prompt_tokens: usize,
}

struct CancelOnDrop(Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// Validate limits, admit (or 503), queue.
fn submit(st: &AppState, ready: &Ready, flavor: Flavor, r: Request2) -> Result<Running, ApiError> {
    let n = r.prompt.len();
    if n == 0 {
        return Err(ApiError::bad_request(flavor, "the prompt is empty"));
    }
    if n >= ready.n_ctx {
        return Err(ApiError::bad_request(
            flavor,
            format!(
                "the prompt has {n} tokens; the context holds {} (and at least one must be generated)",
                ready.n_ctx
            ),
        )
        .code("context_length_exceeded"));
    }
    if n > st.cfg.max_prompt_tokens {
        return Err(ApiError::bad_request(
            flavor,
            format!(
                "the prompt has {n} tokens; this server accepts at most {}",
                st.cfg.max_prompt_tokens
            ),
        )
        .code("context_length_exceeded"));
    }
    let max_tokens = match r.max_tokens {
        Some(0) => {
            return Err(
                ApiError::bad_request(flavor, "`max_tokens` must be at least 1")
                    .param("max_tokens"),
            )
        }
        Some(m) if m > st.cfg.max_tokens as u64 => {
            return Err(ApiError::bad_request(
                flavor,
                format!(
                    "`max_tokens` is {m}; this server allows at most {}",
                    st.cfg.max_tokens
                ),
            )
            .param("max_tokens"))
        }
        Some(m) => m as usize,
        None => st.cfg.max_tokens,
    };
    if r.stop.len() > 16 || r.stop.iter().any(|s| s.len() > 256) {
        return Err(ApiError::bad_request(
            flavor,
            "at most 16 stop strings of at most 256 bytes each",
        )
        .param("stop"));
    }
    let Some(slot) = ready.sched.admit() else {
        st.metrics.rejected.fetch_add(1, Ordering::Relaxed);
        return Err(ApiError::overloaded(
            flavor,
            "all sequences are busy and the queue is full; retry later",
            1,
        ));
    };
    st.metrics
        .prompt_tokens
        .fetch_add(n as u64, Ordering::Relaxed);
    let (tx, rx) = unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    ready.sched.submit(Job {
        prompt: r.prompt,
        sampler: r.sampler,
        max_tokens,
        stop: r.stop.into_iter().filter(|s| !s.is_empty()).collect(),
        cancel: cancel.clone(),
        events: tx,
        admitted: Instant::now(),
        snapshot: st.cfg.prefix_cache > 0 || st.cfg.prefix_cache_dir.is_some(),
        logprobs: r.logprobs,
        constraint: std::sync::Mutex::new(r.constraint),
        show: r.show,
        _slot: slot,
    });
    Ok(Running {
        rx,
        _cancel: CancelOnDrop(cancel),
        prompt_tokens: n,
    })
}

/// Wait for the whole generation: text, logprob entries, the result.
async fn collect(mut run: Running, flavor: Flavor) -> Result<(String, Vec<Value>, Done), ApiError> {
    let mut text = String::new();
    let mut logprobs = Vec::new();
    while let Some(ev) = run.rx.recv().await {
        match ev {
            Event::Started { .. } => {}
            Event::Text(t, lp) => {
                text.push_str(&t);
                logprobs.extend(lp);
            }
            Event::Done(d) => return Ok((text, logprobs, d)),
            Event::Error(e) => return Err(ApiError::internal(flavor, e)),
            Event::Cut(e) => return Err(ApiError::overloaded(flavor, e, 1)),
        }
    }
    Err(ApiError::internal(
        flavor,
        "the generation ended without a result",
    ))
}

fn count_error(st: &AppState, e: &ApiError) {
    if e.status.is_client_error() {
        st.metrics.client_errors.fetch_add(1, Ordering::Relaxed);
    }
}

fn openai_finish(f: &Finish) -> &'static str {
    match f {
        Finish::Length => "length",
        _ => "stop",
    }
}

fn openai_usage(d: &Done) -> Value {
    json!({
        "prompt_tokens": d.prompt_tokens,
        "completion_tokens": d.completion_tokens,
        "total_tokens": d.prompt_tokens + d.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": d.cached_tokens},
    })
}

/// The conversation of a chat request.
fn chat_messages(req: &api::ChatRequest) -> Result<Vec<ChatMessage>, ApiError> {
    if req.messages.is_empty() {
        return Err(ApiError::bad_request(Flavor::OpenAi, "`messages` is empty").param("messages"));
    }
    let mut out = Vec::with_capacity(req.messages.len());
    for m in &req.messages {
        let role = match m.role.as_str() {
            "developer" => "system",
            r @ ("system" | "user" | "assistant" | "tool") => r,
            other => {
                return Err(ApiError::bad_request(
                    Flavor::OpenAi,
                    format!("unknown message role `{other}`"),
                )
                .param("messages"))
            }
        };
        let content = match &m.content {
            Some(c) => c.text(Flavor::OpenAi)?,
            None => String::new(),
        };
        out.push(ChatMessage::new(role, &content));
    }
    Ok(out)
}

fn encode_chat(ready: &Ready, flavor: Flavor, msgs: &[ChatMessage]) -> Result<Vec<u32>, ApiError> {
    ready
        .template
        .encode_prompt(&ready.shared.tok, msgs, true)
        .map_err(|e| ApiError::bad_request(flavor, e.to_string()))
}

/// SSE framing state for one streamed response.
enum Sse {
    Chat {
        id: String,
        model: String,
        created: u64,
        include_usage: bool,
        logprobs: bool,
        /// Reasoning / content / tool calls (`shape.rs`).
        shaper: Shaper,
        /// Tool calls sent so far.
        calls: usize,
    },
    Completion {
        id: String,
        model: String,
        created: u64,
        include_usage: bool,
    },
    Messages {
        id: String,
        model: String,
        input_tokens: usize,
        shaper: Shaper,
        /// The open content block's type (`text` / `thinking`), if one is open.
        open: Option<&'static str>,
        /// Index of the open block, or of the next one.
        index: usize,
        /// `tool_use` blocks sent so far.
        calls: usize,
    },
}

fn data(v: &Value) -> String {
    format!("data: {v}\n\n")
}

fn event(name: &str, v: &Value) -> String {
    format!("event: {name}\ndata: {v}\n\n")
}

/// An OpenAI `tool_calls` entry (`index` is set in stream deltas).
fn openai_call(c: &ToolCall, index: Option<usize>) -> Value {
    let mut v = json!({
        "id": new_id("call_"),
        "type": "function",
        "function": {"name": c.name, "arguments": c.arguments_json()},
    });
    if let Some(i) = index {
        v["index"] = json!(i);
    }
    v
}

/// An Anthropic `tool_use` block.
fn anthropic_tool_use(c: &ToolCall) -> Value {
    json!({"type": "tool_use", "id": new_id("toolu_"), "name": c.name,
           "input": Value::Object(c.arguments.clone())})
}

impl Sse {
    /// Frames sent before the first event (headers go out at once).
    fn opening(&self) -> String {
        match self {
            Sse::Chat {
                id,
                model,
                created,
                include_usage,
                ..
            } => {
                let mut v = json!({
                    "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}],
                });
                if *include_usage {
                    v["usage"] = Value::Null;
                }
                data(&v)
            }
            Sse::Completion { .. } => String::new(),
            Sse::Messages {
                id,
                model,
                input_tokens,
                ..
            } => event(
                "message_start",
                &json!({"type": "message_start", "message": {
                    "id": id, "type": "message", "role": "assistant", "model": model,
                    "content": [], "stop_reason": null, "stop_sequence": null,
                    "usage": {"input_tokens": input_tokens, "output_tokens": 0},
                }}),
            ),
        }
    }

    /// Chat chunks for shaped pieces; logprob entries ride on the first (or on an empty
    /// delta when the text was held back).
    fn chat_frames(&mut self, outs: Vec<Out>, mut lp: Option<Vec<Value>>) -> String {
        let Sse::Chat {
            id,
            model,
            created,
            include_usage,
            logprobs,
            calls,
            ..
        } = self
        else {
            return String::new();
        };
        let mut s = String::new();
        let mut chunk = |delta: Value, lp: Option<Vec<Value>>| {
            let lp = match lp {
                Some(l) if *logprobs => json!({"content": l}),
                _ => Value::Null,
            };
            let mut v = json!({
                "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": null}],
            });
            if *include_usage {
                v["usage"] = Value::Null;
            }
            s.push_str(&data(&v));
        };
        for o in outs {
            let delta = match o {
                Out::Reasoning(t) => json!({"reasoning_content": t}),
                Out::Content(t) => json!({"content": t}),
                Out::Calls(cs) => {
                    let mut list = Vec::new();
                    for c in &cs {
                        list.push(openai_call(c, Some(*calls)));
                        *calls += 1;
                    }
                    json!({"tool_calls": list})
                }
            };
            chunk(delta, lp.take());
        }
        if let Some(l) = lp.filter(|l| !l.is_empty() && *logprobs) {
            chunk(json!({}), Some(l));
        }
        s
    }

    /// Anthropic events for shaped pieces: blocks opened and closed as the kind changes.
    fn message_frames(&mut self, outs: Vec<Out>) -> String {
        let Sse::Messages {
            open, index, calls, ..
        } = self
        else {
            return String::new();
        };
        let mut s = String::new();
        for o in outs {
            let (kind, delta) = match &o {
                Out::Reasoning(t) => ("thinking", json!({"type": "thinking_delta", "thinking": t})),
                Out::Content(t) => ("text", json!({"type": "text_delta", "text": t})),
                Out::Calls(cs) => {
                    if open.take().is_some() {
                        s.push_str(&event(
                            "content_block_stop",
                            &json!({"type": "content_block_stop", "index": *index}),
                        ));
                        *index += 1;
                    }
                    for c in cs {
                        let mut block = anthropic_tool_use(c);
                        block["input"] = json!({});
                        s.push_str(&event("content_block_start", &json!({"type": "content_block_start", "index": *index, "content_block": block})));
                        s.push_str(&event("content_block_delta", &json!({"type": "content_block_delta", "index": *index,
                            "delta": {"type": "input_json_delta", "partial_json": c.arguments_json()}})));
                        s.push_str(&event(
                            "content_block_stop",
                            &json!({"type": "content_block_stop", "index": *index}),
                        ));
                        *index += 1;
                        *calls += 1;
                    }
                    continue;
                }
            };
            if *open != Some(kind) {
                if open.is_some() {
                    s.push_str(&event(
                        "content_block_stop",
                        &json!({"type": "content_block_stop", "index": *index}),
                    ));
                    *index += 1;
                }
                let block = if kind == "thinking" {
                    json!({"type": "thinking", "thinking": "", "signature": ""})
                } else {
                    json!({"type": "text", "text": ""})
                };
                s.push_str(&event("content_block_start", &json!({"type": "content_block_start", "index": *index, "content_block": block})));
                if *index == 0 {
                    s.push_str(&event("ping", &json!({"type": "ping"})));
                }
                *open = Some(kind);
            }
            s.push_str(&event(
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": *index, "delta": delta}),
            ));
        }
        s
    }

    fn text(&mut self, t: &str, lp: Vec<Value>) -> String {
        match self {
            Sse::Chat { shaper, .. } => {
                let outs = shaper.push(t);
                self.chat_frames(outs, Some(lp))
            }
            Sse::Completion {
                id,
                model,
                created,
                include_usage,
            } => {
                let mut v = json!({
                    "id": id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": 0, "text": t, "logprobs": null, "finish_reason": null}],
                });
                if *include_usage {
                    v["usage"] = Value::Null;
                }
                data(&v)
            }
            Sse::Messages { shaper, .. } => {
                let outs = shaper.push(t);
                self.message_frames(outs)
            }
        }
    }

    fn done(&mut self, d: &Done) -> String {
        let mut s = String::new();
        match self {
            Sse::Chat { shaper, .. } => {
                let outs = shaper.finish();
                s.push_str(&self.chat_frames(outs, None));
            }
            Sse::Messages { shaper, .. } => {
                let outs = shaper.finish();
                s.push_str(&self.message_frames(outs));
            }
            Sse::Completion { .. } => {}
        }
        match self {
            Sse::Chat {
                id,
                model,
                created,
                include_usage,
                calls,
                ..
            } => {
                let finish = if *calls > 0 {
                    "tool_calls"
                } else {
                    openai_finish(&d.finish)
                };
                let mut v = json!({
                    "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": 0, "delta": {}, "logprobs": null, "finish_reason": finish}],
                });
                if *include_usage {
                    v["usage"] = Value::Null;
                    s.push_str(&data(&v));
                    s.push_str(&data(&json!({
                        "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [], "usage": openai_usage(d),
                    })));
                } else {
                    s.push_str(&data(&v));
                }
                s.push_str("data: [DONE]\n\n");
                s
            }
            Sse::Completion {
                id,
                model,
                created,
                include_usage,
            } => {
                let mut v = json!({
                    "id": id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": 0, "text": "", "logprobs": null, "finish_reason": openai_finish(&d.finish)}],
                });
                if *include_usage {
                    v["usage"] = Value::Null;
                    s.push_str(&data(&v));
                    s.push_str(&data(&json!({
                        "id": id, "object": "text_completion", "created": created, "model": model,
                        "choices": [], "usage": openai_usage(d),
                    })));
                } else {
                    s.push_str(&data(&v));
                }
                s.push_str("data: [DONE]\n\n");
                s
            }
            Sse::Messages {
                open, index, calls, ..
            } => {
                // An answer with no block at all still has its (empty) text block.
                if open.is_none() && *index == 0 {
                    s.push_str(&event("content_block_start", &json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})));
                    s.push_str(&event("ping", &json!({"type": "ping"})));
                    *open = Some("text");
                }
                if open.take().is_some() {
                    s.push_str(&event(
                        "content_block_stop",
                        &json!({"type": "content_block_stop", "index": *index}),
                    ));
                }
                let (reason, seq) = if *calls > 0 {
                    ("tool_use", Value::Null)
                } else {
                    anthropic_stop(&d.finish)
                };
                s.push_str(&event(
                    "message_delta",
                    &json!({"type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": seq},
                        "usage": {"output_tokens": d.completion_tokens, "input_tokens": d.prompt_tokens,
                                  "cache_read_input_tokens": d.cached_tokens}}),
                ));
                s.push_str(&event("message_stop", &json!({"type": "message_stop"})));
                s
            }
        }
    }

    fn error(&self, msg: &str) -> String {
        match self {
            Sse::Messages { .. } => event(
                "error",
                &json!({"type": "error", "error": {"type": "api_error", "message": msg}}),
            ),
            _ => data(
                &json!({"error": {"message": msg, "type": "server_error", "param": null, "code": null}}),
            ),
        }
    }
}

/// Longest silence on an SSE stream before a keep-alive comment is sent.
const SSE_KEEP_ALIVE: Duration = Duration::from_secs(5);

/// The SSE response for a running job.
fn sse_response(run: Running, sse: Sse) -> Response {
    struct St {
        run: Running,
        sse: Sse,
        opened: bool,
        finished: bool,
    }
    let st = St {
        run,
        sse,
        opened: false,
        finished: false,
    };
    let stream = futures_util::stream::unfold(st, |mut st| async move {
        if st.finished {
            return None;
        }
        if !st.opened {
            st.opened = true;
            let s = st.sse.opening();
            if !s.is_empty() {
                return Some((Ok::<_, Infallible>(Bytes::from(s)), st));
            }
        }
        loop {
            let next = match tokio::time::timeout(SSE_KEEP_ALIVE, st.run.rx.recv()).await {
                Ok(next) => next,
                // Nothing to send for a while (the job waits in the queue, or a token is
                // slow): an SSE comment, which clients skip. Writing it is also how a
                // client that went away is noticed while nothing else is written.
                Err(_) => return Some((Ok(Bytes::from_static(b": keep-alive\n\n")), st)),
            };
            match next {
                Some(Event::Started { .. }) => continue,
                Some(Event::Text(t, lp)) => {
                    let s = st.sse.text(&t, lp);
                    if s.is_empty() {
                        continue; // held back (a possible marker)
                    }
                    return Some((Ok(Bytes::from(s)), st));
                }
                Some(Event::Done(d)) => {
                    st.finished = true;
                    let s = st.sse.done(&d);
                    return Some((Ok(Bytes::from(s)), st));
                }
                Some(Event::Error(e)) | Some(Event::Cut(e)) => {
                    st.finished = true;
                    let s = st.sse.error(&e);
                    return Some((Ok(Bytes::from(s)), st));
                }
                None => {
                    st.finished = true;
                    let s = st.sse.error("the generation ended without a result");
                    return Some((Ok(Bytes::from(s)), st));
                }
            }
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// A handler's result as a response, counting errors in the metrics.
fn respond(st: &AppState, r: Result<Response, ApiError>) -> Response {
    r.unwrap_or_else(|e| {
        count_error(st, &e);
        e.into_response()
    })
}

async fn chat(State(st): State<Arc<AppState>>, body: Body) -> Response {
    st.metrics.requests_chat.fetch_add(1, Ordering::Relaxed);
    respond(&st, chat_inner(&st, body).await)
}

async fn chat_inner(st: &AppState, body: Body) -> Result<Response, ApiError> {
    let f = Flavor::OpenAi;
    let bytes = read_body(st, f, body).await?;
    let req: api::ChatRequest = api::parse(f, &bytes)?;
    req.unsupported()?;
    if req.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad_request(f, "only `n` = 1 is supported").param("n"));
    }
    let ready = ready(st, f)?;
    let msgs = chat_messages(&req)?;
    // Tools, reasoning, constrained decoding: `plan.rs`.
    let plan = crate::plan::chat(&ready, &req, &msgs, || encode_chat(&ready, f, &msgs))?;
    let logprobs = match (req.logprobs, req.top_logprobs) {
        (false, _) => None,
        (true, Some(k)) if k > 20 => {
            return Err(
                ApiError::bad_request(f, "`top_logprobs` must be at most 20").param("top_logprobs"),
            )
        }
        (true, k) => Some(k.unwrap_or(0) as usize),
    };
    let run = submit(
        st,
        &ready,
        f,
        Request2 {
            prompt: plan.prompt,
            sampler: req.sampling.config(f)?,
            max_tokens: req.max_completion_tokens.or(req.max_tokens),
            stop: req.stop.clone().map(|s| s.into_vec()).unwrap_or_default(),
            logprobs,
            constraint: plan.constraint,
            show: plan.show,
        },
    )?;
    let id = new_id("chatcmpl-");
    let model = st.cfg.model_name.clone();
    let created = now_secs();
    if req.stream {
        let include_usage = req.stream_options.as_ref().is_some_and(|o| o.include_usage);
        return Ok(sse_response(
            run,
            Sse::Chat {
                id,
                model,
                created,
                include_usage,
                logprobs: logprobs.is_some(),
                shaper: Shaper::new(plan.shape),
                calls: 0,
            },
        ));
    }
    let (text, lp, d) = collect(run, f).await?;
    let (reasoning, content, calls) = crate::shape::whole(plan.shape, &text);
    let mut message = json!({"role": "assistant", "content": content});
    if !reasoning.is_empty() {
        message["reasoning_content"] = Value::String(reasoning);
    }
    if !calls.is_empty() {
        message["tool_calls"] = Value::Array(calls.iter().map(|c| openai_call(c, None)).collect());
        if message["content"] == "" {
            message["content"] = Value::Null;
        }
    }
    Ok(Json(json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": if logprobs.is_some() { json!({"content": lp}) } else { Value::Null },
            "finish_reason": if calls.is_empty() { openai_finish(&d.finish) } else { "tool_calls" },
        }],
        "usage": openai_usage(&d),
    }))
    .into_response())
}

async fn completions(State(st): State<Arc<AppState>>, body: Body) -> Response {
    st.metrics
        .requests_completions
        .fetch_add(1, Ordering::Relaxed);
    respond(&st, completions_inner(&st, body).await)
}

async fn completions_inner(st: &AppState, body: Body) -> Result<Response, ApiError> {
    let f = Flavor::OpenAi;
    let bytes = read_body(st, f, body).await?;
    let req: api::CompletionRequest = api::parse(f, &bytes)?;
    if req.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad_request(f, "only `n` = 1 is supported").param("n"));
    }
    req.unsupported()?;
    let text = match &req.prompt {
        api::Prompt::One(s) => s.clone(),
        api::Prompt::Many(v) if v.len() == 1 => v[0].clone(),
        api::Prompt::Many(_) => {
            return Err(
                ApiError::bad_request(f, "only one prompt per request is supported")
                    .param("prompt"),
            )
        }
    };
    let ready = ready(st, f)?;
    // As `sluice run --raw`: BOS as the model asks, special-token texts left as text.
    let prompt = ready.shared.tok.encode(&text, true, false);
    let run = submit(
        st,
        &ready,
        f,
        Request2 {
            prompt,
            sampler: req.sampling.config(f)?,
            max_tokens: Some(req.max_tokens.unwrap_or(16)),
            stop: req.stop.clone().map(|s| s.into_vec()).unwrap_or_default(),
            logprobs: None,
            constraint: None,
            show: Vec::new(),
        },
    )?;
    let id = new_id("cmpl-");
    let model = st.cfg.model_name.clone();
    let created = now_secs();
    if req.stream {
        let include_usage = req.stream_options.as_ref().is_some_and(|o| o.include_usage);
        return Ok(sse_response(
            run,
            Sse::Completion {
                id,
                model,
                created,
                include_usage,
            },
        ));
    }
    let (text, _, d) = collect(run, f).await?;
    Ok(Json(json!({
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": openai_finish(&d.finish)}],
        "usage": openai_usage(&d),
    }))
    .into_response())
}

fn anthropic_stop(f: &Finish) -> (&'static str, Value) {
    match f {
        Finish::StopString(s) => ("stop_sequence", Value::String(s.clone())),
        Finish::Length => ("max_tokens", Value::Null),
        _ => ("end_turn", Value::Null),
    }
}

async fn messages(State(st): State<Arc<AppState>>, body: Body) -> Response {
    st.metrics.requests_messages.fetch_add(1, Ordering::Relaxed);
    respond(&st, messages_inner(&st, body).await)
}

async fn messages_inner(st: &AppState, body: Body) -> Result<Response, ApiError> {
    let f = Flavor::Anthropic;
    let bytes = read_body(st, f, body).await?;
    let req: api::MessagesRequest = api::parse(f, &bytes)?;
    req.unsupported()?;
    if req.messages.is_empty() {
        return Err(ApiError::bad_request(f, "`messages` is empty"));
    }
    let mut msgs = Vec::with_capacity(req.messages.len() + 1);
    match &req.system {
        Some(api::System::Text(s)) if !s.is_empty() => msgs.push(ChatMessage::new("system", s)),
        Some(api::System::Blocks(b)) => {
            let s = api::Content::Parts(b.clone()).text(f)?;
            if !s.is_empty() {
                msgs.push(ChatMessage::new("system", &s));
            }
        }
        _ => {}
    }
    let system = msgs.first().map(|m| m.content.clone());
    for m in &req.messages {
        if m.role != "user" && m.role != "assistant" {
            return Err(ApiError::bad_request(
                f,
                format!(
                    "messages: role must be `user` or `assistant`, not `{}`",
                    m.role
                ),
            ));
        }
    }
    let ready = ready(st, f)?;
    // Tools and reasoning: `plan.rs`; the plain conversation as before.
    let plan = crate::plan::messages(&ready, &req, system, || {
        for m in &req.messages {
            msgs.push(ChatMessage::new(&m.role, &m.text(f)?));
        }
        encode_chat(&ready, f, &msgs)
    })?;
    let run = submit(
        st,
        &ready,
        f,
        Request2 {
            prompt: plan.prompt,
            sampler: req.sampling.config(f)?,
            max_tokens: Some(req.max_tokens),
            stop: req.stop_sequences.clone().unwrap_or_default(),
            logprobs: None,
            constraint: plan.constraint,
            show: plan.show,
        },
    )?;
    let id = new_id("msg_");
    let model = st.cfg.model_name.clone();
    if req.stream {
        let input_tokens = run.prompt_tokens;
        return Ok(sse_response(
            run,
            Sse::Messages {
                id,
                model,
                input_tokens,
                shaper: Shaper::new(plan.shape),
                open: None,
                index: 0,
                calls: 0,
            },
        ));
    }
    let (text, _, d) = collect(run, f).await?;
    let (reasoning, content, calls) = crate::shape::whole(plan.shape, &text);
    let mut blocks = Vec::new();
    if !reasoning.is_empty() {
        blocks.push(json!({"type": "thinking", "thinking": reasoning, "signature": ""}));
    }
    if !content.is_empty() || (calls.is_empty() && blocks.is_empty()) {
        blocks.push(json!({"type": "text", "text": content}));
    }
    for c in &calls {
        blocks.push(anthropic_tool_use(c));
    }
    let (reason, seq) = if calls.is_empty() {
        anthropic_stop(&d.finish)
    } else {
        ("tool_use", Value::Null)
    };
    Ok(Json(json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": reason,
        "stop_sequence": seq,
        "usage": {
            "input_tokens": d.prompt_tokens,
            "output_tokens": d.completion_tokens,
            "cache_read_input_tokens": d.cached_tokens,
            "cache_creation_input_tokens": 0,
        },
    }))
    .into_response())
}
