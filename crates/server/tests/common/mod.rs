//! Start the server in-process on an ephemeral loopback port with a tiny model, and talk
//! to it over HTTP with reqwest. Every wait is bounded.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use sluice_engine::load::{Budget, LoadOptions, PackChoice, StreamOptions};
use sluice_engine::sampler::{Sampler, SamplerConfig};
use sluice_engine::session::{GenerateOptions, Hooks, Session};
use sluice_engine::text::chat::{ChatMessage, ChatTemplate};
use sluice_engine::text::tokenizer::Tokenizer;
use sluice_engine::tier::{PolicyKind, SizeSpec};
use sluice_io::IoConfig;
use sluice_server::scheduler::Gate;
use sluice_server::{RunningServer, ServerConfig, SessionParams};

pub const TIMEOUT: Duration = Duration::from_secs(120);

pub fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3moe/a-q8_0.gguf")
}

pub fn params() -> SessionParams {
    SessionParams {
        ctx: 256,
        kv_f32: false,
        batch: 256,
    }
}

/// Load options for the fixture: resident, or streaming experts at a small budget.
pub fn options(path: &Path, stream: bool) -> LoadOptions {
    LoadOptions {
        path: path.to_path_buf(),
        threads: 1,
        ctx: 256,
        stream: stream.then(|| StreamOptions {
            budget: Budget::Size(SizeSpec::Percent(50.0)),
            budget_text: "50%".into(),
            policy: PolicyKind::Lru,
            resident_layers: 0,
            io: IoConfig {
                backend: sluice_io::Backend::Pread,
                direct: false,
                depth: 4,
                inflight_bytes: 0,
                threads: 2,
                high_priority: false,
            },
            hash_prefetch: true,
            lookahead: true,
            pack: PackChoice::Off,
            preload_profile: None,
        }),
        record_routing: None,
        ple: Default::default(),
        sequences: 1,
        device: Default::default(),
        weight_load: Default::default(),
    }
}

pub fn config() -> ServerConfig {
    let mut c = ServerConfig::new("tiny", params());
    c.port = 0;
    c.max_tokens = 64;
    c
}

/// Start on 127.0.0.1:0 and wait until /health says ready.
pub async fn start(cfg: ServerConfig, path: PathBuf, stream: bool) -> Server {
    start_ctx(cfg, path, stream, params().ctx).await
}

/// [`start`] with a context of `ctx` tokens (prompts with tool definitions are long).
pub async fn start_ctx(mut cfg: ServerConfig, path: PathBuf, stream: bool, ctx: usize) -> Server {
    let mut opts = options(&path, stream);
    opts.ctx = ctx;
    cfg.session.ctx = ctx;
    let srv = sluice_server::start(
        cfg,
        Box::new(move || opts.load().map_err(|e| e.to_string())),
    )
    .expect("server starts");
    let base = format!("http://{}", srv.addr());
    let client = reqwest::Client::builder().timeout(TIMEOUT).build().unwrap();
    let t0 = Instant::now();
    loop {
        if let Ok(r) = client.get(format!("{base}/health")).send().await {
            if r.status() == 200 {
                break;
            }
            assert_eq!(r.status(), 503, "health while loading");
        }
        assert!(t0.elapsed() < TIMEOUT, "server not ready in time");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Server {
        srv: Some(srv),
        base,
        client,
    }
}

pub struct Server {
    pub srv: Option<RunningServer>,
    pub base: String,
    pub client: reqwest::Client,
}

impl Server {
    pub fn url(&self, p: &str) -> String {
        format!("{}{p}", self.base)
    }

    pub async fn post(&self, p: &str, body: &Value) -> (u16, Value) {
        let r = self
            .client
            .post(self.url(p))
            .json(body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let v: Value = r.json().await.unwrap();
        (status, v)
    }

    /// POST and read the SSE events as (event name, data) pairs.
    pub async fn post_sse(&self, p: &str, body: &Value) -> Vec<(String, String)> {
        let r = self
            .client
            .post(self.url(p))
            .json(body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(
            r.headers()["content-type"].to_str().unwrap(),
            "text/event-stream"
        );
        let text = r.text().await.unwrap();
        parse_sse(&text)
    }

    pub async fn metrics(&self) -> String {
        self.client
            .get(self.url("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// A metric's value (first line starting with `name ` ).
    pub async fn metric(&self, name: &str) -> f64 {
        let m = self.metrics().await;
        metric_in(&m, name)
    }

    /// Open HTTP connections as the server counts them, read so that the test's own
    /// clients do not move the number: through a client that keeps no idle connection
    /// (its request's own connection is the one it adds), the least of a few reads (a
    /// connection it closed a moment ago may not be reaped yet). `self.client`'s pool may
    /// grow between reads, so counts through it are not comparable.
    pub async fn connections(&self) -> f64 {
        let probe = reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .timeout(TIMEOUT)
            .build()
            .unwrap();
        let mut least = f64::MAX;
        for _ in 0..5 {
            let m = probe.get(self.url("/metrics")).send().await.unwrap();
            least = least.min(metric_in(&m.text().await.unwrap(), "sluice_connections"));
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        least
    }

    /// Wait (bounded) until fewer than `n` connections are open ([`Self::connections`]).
    pub async fn wait_connections_below(&self, n: f64) {
        let t0 = Instant::now();
        loop {
            let v = self.connections().await;
            if v < n {
                return;
            }
            assert!(
                t0.elapsed() < TIMEOUT,
                "sluice_connections never fell below {n} (last {v})"
            );
        }
    }

    /// Wait (bounded) until `cond(metric value)` holds.
    pub async fn wait_metric(&self, name: &str, cond: impl Fn(f64) -> bool) {
        let t0 = Instant::now();
        loop {
            let v = self.metric(name).await;
            if cond(v) {
                return;
            }
            assert!(
                t0.elapsed() < TIMEOUT,
                "{name} never reached the expected value (last {v})"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    pub fn stop(&mut self) {
        if let Some(s) = self.srv.take() {
            s.shutdown();
            s.wait().unwrap();
        }
    }
}

pub fn metric_in(m: &str, name: &str) -> f64 {
    m.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no metric {name} in\n{m}"))
        .trim()
        .parse()
        .unwrap()
}

pub fn parse_sse(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for block in text.split("\n\n") {
        if block.trim().is_empty() {
            continue;
        }
        let mut ev = String::new();
        let mut data = String::new();
        for line in block.lines() {
            if let Some(e) = line.strip_prefix("event: ") {
                ev = e.to_string();
            } else if let Some(d) = line.strip_prefix("data: ") {
                data.push_str(d);
            }
        }
        out.push((ev, data));
    }
    out
}

/// Greedy reference computed directly with the engine (what `sluice run --temp 0` does):
/// a fresh sequence, the same tokens, stop at an end-of-generation token.
pub fn reference(path: &Path, prompt: &[u32], max_tokens: usize) -> String {
    struct Eog<'a>(&'a Tokenizer);
    impl Hooks for Eog<'_> {
        fn is_end(&mut self, id: u32) -> bool {
            self.0.is_eog(id)
        }
    }
    let loaded = options(path, false).load().unwrap();
    let tok = Tokenizer::from_gguf(&loaded.model.gguf).unwrap();
    let mut s = Session::new(&loaded, 256, false, 256);
    let mut sampler = Sampler::new(SamplerConfig::greedy());
    let g = s
        .generate(
            prompt,
            &mut sampler,
            &GenerateOptions {
                max_tokens,
                all_logits: false,
            },
            &mut Eog(&tok),
        )
        .unwrap();
    tok.decode(&g.tokens)
}

pub fn tokenizer(path: &Path) -> Tokenizer {
    let f = sluice_engine::models::Model::load(path).unwrap();
    Tokenizer::from_gguf(&f.gguf).unwrap()
}

pub fn chat_tokens(path: &Path, msgs: &[(&str, &str)]) -> Vec<u32> {
    let f = sluice_engine::models::Model::load(path).unwrap();
    let tok = Tokenizer::from_gguf(&f.gguf).unwrap();
    let t = ChatTemplate::from_gguf(&f.gguf, &tok);
    let msgs: Vec<ChatMessage> = msgs.iter().map(|(r, c)| ChatMessage::new(r, c)).collect();
    t.encode_prompt(&tok, &msgs, true).unwrap()
}

pub fn gate() -> Arc<Gate> {
    Arc::new(Gate::default())
}
