//! `sluice serve`: an OpenAI- and Anthropic-compatible HTTP server over the engine.
//!
//! Owns: [`ServerConfig`] (bind address, `--parallel`, queue, prefix-cache budget, API
//! key, limits), [`start`] (bind, answer `/health` with 503 while the model loads on its
//! own thread, then serve; returns a [`RunningServer`] handle) and [`run`] (the CLI's
//! entry: start, wait for SIGINT/SIGTERM, drain). Modules: `routes` (router, auth,
//! handlers, SSE), `conn` (accept loop, connection cap, header/body/idle timeouts, the
//! drain's connection side), `api` (request types, error objects), `scheduler` (worker
//! sequences, bounded queue, the generate loop's hooks), `prefix` (snapshots for prefix
//! reuse), `prefix_disk` (those snapshots on disk, `--prefix-cache-dir`), `page` (the chat
//! page at `/`), `metrics` (Prometheus text); for agents (issue 33): `plan` (what a chat
//! request asks beyond text), `agent` (tools, `tool_choice`, `response_format`, `grammar`),
//! `toolcall` (each template's call syntax), `reasoning` (the `<think>` split), `shape`
//! (an answer as reasoning / content / calls), `constrain` + `gbnf` (llguidance). The CLI
//! only parses flags and calls [`run`].

mod agent;
pub mod api;
mod conn;
pub mod constrain;
mod gbnf;
pub mod metrics;
mod page;
mod plan;
pub mod prefix;
pub mod prefix_disk;
pub mod reasoning;
mod routes;
pub mod scheduler;
mod shape;
pub mod template;
pub mod toolcall;

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use sluice_engine::load::Loaded;
use tokio::net::TcpListener;
use tokio::sync::Notify;

pub use scheduler::SessionParams;

/// Everything `serve` is configured with (the model itself comes from the loader).
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub host: String,
    /// 0 = an ephemeral port (see [`RunningServer::addr`]).
    pub port: u16,
    /// Sequences generating at once.
    pub parallel: usize,
    /// Requests that may wait for a sequence; past that, 503 with `Retry-After`.
    pub queue: usize,
    /// RAM budget of session snapshots kept for prefix reuse (0 = off).
    pub prefix_cache: u64,
    /// Directory where those snapshots are also written, to be found again after a
    /// restart (`--prefix-cache-dir`; None = RAM only).
    pub prefix_cache_dir: Option<std::path::PathBuf>,
    /// Most bytes of snapshot files kept in `prefix_cache_dir`.
    pub prefix_cache_disk: u64,
    pub api_key: Option<String>,
    /// Allow a non-loopback bind without an API key.
    pub insecure_public: bool,
    /// Largest request body in bytes.
    pub max_body: usize,
    /// Most prompt tokens a request may have (also capped by the context).
    pub max_prompt_tokens: usize,
    /// Most tokens a request may ask to generate (and the default when it does not say).
    pub max_tokens: usize,
    /// Connections open at once. At the cap a new connection makes the one idle the
    /// longest close (waiting for its first or next request); only when every one is busy
    /// with a request does it wait to be accepted.
    pub max_connections: usize,
    /// A request's head must arrive within this (from the accept, or from its first byte
    /// on a kept-alive connection); else the connection is closed.
    pub header_timeout: Duration,
    /// A request's body must arrive in full within this after its head; else 408.
    pub body_timeout: Duration,
    /// A kept-alive connection with no request for this long is closed.
    pub idle_timeout: Duration,
    /// Name `/v1/models` reports and responses echo.
    pub model_name: String,
    pub session: SessionParams,
    /// After SIGINT/SIGTERM: how long running requests may take before they are stopped.
    pub drain_timeout: Duration,
    /// Install SIGINT/SIGTERM handlers ([`run`]); tests leave them alone.
    pub handle_signals: bool,
    /// Called once the model is loaded and `/health` answers 200 (the CLI's "loaded"
    /// line), on the loading thread.
    pub on_ready: Option<OnReady>,
    /// Workers wait at this gate before each job while it is closed (tests that need
    /// requests held in the system without timing).
    #[doc(hidden)]
    pub gate: Option<Arc<scheduler::Gate>>,
}

impl ServerConfig {
    /// Defaults for everything but the model.
    pub fn new(model_name: &str, session: SessionParams) -> ServerConfig {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 8080,
            parallel: 1,
            queue: 16,
            prefix_cache: 1 << 30,
            prefix_cache_dir: None,
            prefix_cache_disk: 16 << 30,
            api_key: None,
            insecure_public: false,
            max_body: 4 << 20,
            max_prompt_tokens: usize::MAX,
            max_tokens: 4096,
            max_connections: 256,
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            model_name: model_name.to_string(),
            session,
            drain_timeout: Duration::from_secs(30),
            handle_signals: false,
            on_ready: None,
            gate: None,
        }
    }
}

/// What runs once the server answers: [`ServerConfig::on_ready`].
#[derive(Clone)]
pub struct OnReady(pub Arc<dyn Fn(&Loaded) + Send + Sync>);

impl std::fmt::Debug for OnReady {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OnReady")
    }
}

/// Why the server could not start or stopped with an error.
#[derive(Debug)]
pub struct ServeError(pub String);

impl std::fmt::Display for ServeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ServeError {}

/// Loads the model (on its own thread, while `/health` answers 503).
pub type Loader = Box<dyn FnOnce() -> Result<Loaded, String> + Send + 'static>;

/// A started server.
pub struct RunningServer {
    addr: SocketAddr,
    stop: Arc<Notify>,
    thread: Option<std::thread::JoinHandle<Result<Option<Arc<Loaded>>, ServeError>>>,
}

impl RunningServer {
    /// The bound address (the real port when 0 was asked for).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Begin a graceful shutdown (as SIGTERM does).
    pub fn shutdown(&self) {
        self.stop.notify_one();
    }

    /// Wait until the server has drained and stopped.
    pub fn wait(self) -> Result<(), ServeError> {
        self.wait_engine().map(|_| ())
    }

    /// [`Self::wait`], returning the engine (None if it never loaded) once the workers
    /// have stopped: the caller can report on it (`--stats`) and close its routing trace.
    pub fn wait_engine(mut self) -> Result<Option<Arc<Loaded>>, ServeError> {
        match self.thread.take() {
            Some(t) => t
                .join()
                .unwrap_or_else(|_| Err(ServeError("the server thread panicked".into()))),
            None => Ok(None),
        }
    }
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            self.stop.notify_one();
            let _ = t.join();
        }
    }
}

/// Whether `host` only reaches this machine.
fn is_loopback(host: &str) -> Result<bool, ServeError> {
    use std::net::ToSocketAddrs;
    if let Ok(ip) = host.trim_matches(['[', ']']).parse::<IpAddr>() {
        return Ok(ip.is_loopback());
    }
    let addrs: Vec<SocketAddr> = (host, 0)
        .to_socket_addrs()
        .map_err(|e| ServeError(format!("--host {host}: {e}")))?
        .collect();
    Ok(!addrs.is_empty() && addrs.iter().all(|a| a.ip().is_loopback()))
}

/// Check the configuration (the safe-by-default rules).
fn validate(cfg: &ServerConfig) -> Result<(), ServeError> {
    if cfg.parallel == 0 {
        return Err(ServeError("--parallel must be at least 1".into()));
    }
    if cfg.max_connections == 0 {
        return Err(ServeError("--max-connections must be at least 1".into()));
    }
    for (flag, d) in [
        ("--header-timeout", cfg.header_timeout),
        ("--body-timeout", cfg.body_timeout),
        ("--idle-timeout", cfg.idle_timeout),
    ] {
        if d.is_zero() {
            return Err(ServeError(format!("{flag} must be more than 0")));
        }
    }
    if let Some(k) = &cfg.api_key {
        if k.trim().is_empty() {
            return Err(ServeError("the API key is empty".into()));
        }
        if k.trim() != k {
            return Err(ServeError(
                "the API key starts or ends with whitespace (it would never match a presented key)"
                    .into(),
            ));
        }
    }
    if cfg.api_key.is_none() && !cfg.insecure_public && !is_loopback(&cfg.host)? {
        return Err(ServeError(format!(
            "--host {}: refusing to listen beyond this machine without --api-key or --api-key-file (or say --insecure-public)",
            cfg.host
        )));
    }
    Ok(())
}

/// Bind and start serving on a thread of its own; the model loads in the background.
/// Safe to call from inside another async runtime (the server has its own).
pub fn start(cfg: ServerConfig, loader: Loader) -> Result<RunningServer, ServeError> {
    validate(&cfg)?;
    let host = cfg.host.trim_matches(['[', ']']).to_string();
    let std_listener = std::net::TcpListener::bind((host.as_str(), cfg.port))
        .map_err(|e| ServeError(format!("cannot listen on {}:{}: {e}", cfg.host, cfg.port)))?;
    std_listener
        .set_nonblocking(true)
        .map_err(|e| ServeError(e.to_string()))?;
    let addr = std_listener
        .local_addr()
        .map_err(|e| ServeError(e.to_string()))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("sluice-http")
        .enable_all()
        .build()
        .map_err(|e| ServeError(format!("cannot start the async runtime: {e}")))?;
    let stop = Arc::new(Notify::new());
    let stop2 = stop.clone();
    let thread = std::thread::Builder::new()
        .name("sluice-server".into())
        .spawn(move || {
            let r = rt.block_on(async move {
                let listener = TcpListener::from_std(std_listener)
                    .map_err(|e| ServeError(format!("cannot listen: {e}")))?;
                serve(cfg, listener, loader, stop2).await
            });
            rt.shutdown_timeout(Duration::from_secs(1));
            r
        })
        .map_err(|e| ServeError(format!("cannot start the server thread: {e}")))?;
    Ok(RunningServer {
        addr,
        stop,
        thread: Some(thread),
    })
}

/// The CLI's entry: start, print where, serve until SIGINT/SIGTERM, drain; returns the
/// engine as [`RunningServer::wait_engine`] does.
pub fn run(mut cfg: ServerConfig, loader: Loader) -> Result<Option<Arc<Loaded>>, ServeError> {
    cfg.handle_signals = true;
    let server = start(cfg, loader)?;
    eprintln!("listening on http://{}", server.addr());
    server.wait_engine()
}

/// The loaded engine, once there is one.
pub(crate) struct Ready {
    pub shared: Arc<scheduler::Shared>,
    pub sched: scheduler::Scheduler,
    pub template: sluice_engine::text::chat::ChatTemplate,
    pub n_ctx: usize,
    /// Constrained decoding's vocabulary trie, built at the first request that needs it.
    pub constrainer: OnceLock<Result<Arc<constrain::Constrainer>, String>>,
}

pub(crate) struct AppState {
    pub cfg: ServerConfig,
    pub metrics: Arc<metrics::Metrics>,
    pub ready: OnceLock<Arc<Ready>>,
    pub prefix: Arc<Mutex<prefix::PrefixCache>>,
    pub created: u64,
    /// The open connections (`sluice_connections`).
    pub connections: Arc<conn::Registry>,
    /// Becomes true at the drain deadline: bodies still arriving are answered 503.
    pub cut: tokio::sync::watch::Sender<bool>,
}

async fn signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let term = signal(SignalKind::terminate());
        let int = signal(SignalKind::interrupt());
        match (term, int) {
            (Ok(mut t), Ok(mut i)) => {
                tokio::select! {
                    _ = t.recv() => {}
                    _ = i.recv() => {}
                }
            }
            _ => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

async fn serve(
    cfg: ServerConfig,
    listener: TcpListener,
    loader: Loader,
    stop: Arc<Notify>,
) -> Result<Option<Arc<Loaded>>, ServeError> {
    let state = Arc::new(AppState {
        metrics: Arc::new(metrics::Metrics::default()),
        ready: OnceLock::new(),
        prefix: Arc::new(Mutex::new(prefix::PrefixCache::new(cfg.prefix_cache))),
        connections: Arc::new(conn::Registry::new()),
        cut: tokio::sync::watch::Sender::new(false),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        cfg,
    });
    // Load on a plain thread (a signal during a long load must not wait for it).
    let (load_tx, load_rx) = tokio::sync::oneshot::channel();
    {
        let state = state.clone();
        std::thread::Builder::new()
            .name("sluice-load".into())
            .spawn(move || {
                let r = loader().and_then(|loaded| routes::make_ready(&state, loaded));
                let ok = match r {
                    Ok(ready) => {
                        let loaded = ready.shared.loaded.clone();
                        let _ = state.ready.set(ready);
                        // `/health` answers 200 from here on: say so now, not before.
                        if let Some(f) = &state.cfg.on_ready {
                            (f.0)(&loaded);
                        }
                        Ok(())
                    }
                    Err(e) => Err(e),
                };
                let _ = load_tx.send(ok);
            })
            .map_err(|e| ServeError(format!("cannot start the loading thread: {e}")))?;
    }
    let (fail_tx, mut fail_rx) = tokio::sync::watch::channel(None::<String>);
    tokio::spawn(async move {
        match load_rx.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                let _ = fail_tx.send(Some(e));
            }
            Err(_) => {
                let _ = fail_tx.send(Some("the loading thread died".into()));
            }
        }
    });
    let app = routes::router(state.clone());
    let limits = conn::Limits {
        max_connections: state.cfg.max_connections,
        header_timeout: state.cfg.header_timeout,
        idle_timeout: state.cfg.idle_timeout,
    };
    let (phase_tx, phase_rx) = tokio::sync::watch::channel(conn::Phase::Serve);
    let handle_signals = state.cfg.handle_signals;
    let drain = state.cfg.drain_timeout;
    let state2 = state.clone();
    let (failed_tx, failed_rx) = tokio::sync::oneshot::channel::<String>();
    let shutdown = async move {
        let failed = async {
            loop {
                if let Some(e) = fail_rx.borrow().clone() {
                    return e;
                }
                if fail_rx.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        };
        let sig = async {
            if handle_signals {
                signal().await
            } else {
                std::future::pending::<()>().await
            }
        };
        tokio::select! {
            _ = stop.notified() => {}
            _ = sig => {
                eprintln!("shutting down: draining running requests (a second Ctrl-C or SIGTERM exits at once)");
                // A second signal while the drain waits (on a slow client, a long answer)
                // ends the process now: the user asked twice.
                tokio::spawn(async {
                    signal().await;
                    eprintln!("second signal: exiting without waiting for running requests");
                    std::process::exit(130);
                });
            }
            e = failed => { let _ = failed_tx.send(e); }
        }
        // Stop accepting; idle connections close, busy ones finish.
        phase_tx.send_replace(conn::Phase::Drain);
        // Past the drain deadline, running generations are stopped and bodies still
        // arriving are answered 503; a while later every connection left is dropped.
        tokio::time::sleep(drain).await;
        if let Some(r) = state2.ready.get() {
            r.sched
                .abort
                .store(true, std::sync::atomic::Ordering::SeqCst);
        }
        state2.cut.send_replace(true);
        tokio::time::sleep(conn::FORCE_AFTER_DRAIN).await;
        phase_tx.send_replace(conn::Phase::Force);
    };
    let shutdown = tokio::spawn(shutdown);
    conn::serve_connections(listener, app, state.connections.clone(), limits, phase_rx).await;
    shutdown.abort();
    if let Some(r) = state.ready.get() {
        let r = r.clone();
        let _ = tokio::task::spawn_blocking(move || r.sched.shutdown()).await;
    }
    match failed_rx.await {
        Ok(e) => Err(ServeError(e)),
        Err(_) => Ok(state.ready.get().map(|r| r.shared.loaded.clone())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_key_with_surrounding_whitespace_is_refused() {
        let session = SessionParams {
            ctx: 64,
            kv_f32: false,
            batch: 8,
        };
        let mut cfg = ServerConfig::new("m", session);
        cfg.api_key = Some("abc ".into());
        let e = validate(&cfg).unwrap_err();
        assert!(e.0.contains("whitespace"), "{}", e.0);
        cfg.api_key = Some("abc".into());
        assert!(validate(&cfg).is_ok());
    }
}
