//! `sluice serve`: flags -> `sluice_server::ServerConfig`, then the server library runs.

use anyhow::{Context, Result};
use sluice_engine::tier::parse_size_bytes;
use sluice_server::{ServerConfig, SessionParams};

use crate::common::{ModelArgs, PrintStats};

/// Serve the model over HTTP: OpenAI-compatible `/v1/chat/completions`, `/v1/completions`,
/// `/v1/models`, Anthropic-compatible `/v1/messages`, `/health`, `/metrics`.
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on (loopback by default; anything else needs --api-key or
    /// --insecure-public).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 = any free port, printed at start).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Sequences generating at once (each holds its own KV cache).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub parallel: usize,
    /// Requests that may wait for a free sequence; past that, 503 with Retry-After.
    #[arg(long = "queue", value_name = "N", default_value_t = 16)]
    pub queue: usize,
    /// RAM budget for session snapshots kept for prefix reuse (e.g. 1G, 512MiB; 0 = off).
    #[arg(long = "prefix-cache", value_name = "SIZE", default_value = "1GiB")]
    pub prefix_cache: String,
    /// Also write those snapshots to files in DIR (created if missing), keyed by the model
    /// file and the prompt tokens, so a restarted server reuses them. Damaged or foreign
    /// files are ignored with one line on stderr.
    #[arg(long = "prefix-cache-dir", value_name = "DIR")]
    pub prefix_cache_dir: Option<std::path::PathBuf>,
    /// Most bytes of snapshot files kept in --prefix-cache-dir (least recently used
    /// removed first; e.g. 16GiB).
    #[arg(
        long = "prefix-cache-disk",
        value_name = "SIZE",
        default_value = "16GiB"
    )]
    pub prefix_cache_disk: String,
    /// Require this API key (`Authorization: Bearer KEY` or `x-api-key: KEY`).
    #[arg(long = "api-key", value_name = "KEY", conflicts_with = "api_key_file")]
    pub api_key: Option<String>,
    /// Read the API key from FILE (first line).
    #[arg(long = "api-key-file", value_name = "FILE")]
    pub api_key_file: Option<std::path::PathBuf>,
    /// Allow listening beyond loopback without an API key.
    #[arg(long = "insecure-public")]
    pub insecure_public: bool,
    /// Largest request body (bytes, e.g. 4MiB).
    #[arg(long = "max-body", value_name = "SIZE", default_value = "4MiB")]
    pub max_body: String,
    /// Most prompt tokens per request (default: the context).
    #[arg(long = "max-prompt-tokens", value_name = "N")]
    pub max_prompt_tokens: Option<usize>,
    /// Most tokens a request may generate (also the default when it does not say).
    #[arg(long = "max-tokens", value_name = "N", default_value_t = 4096)]
    pub max_tokens: usize,
    /// Connections open at once. At the cap, a new connection closes the one idle the
    /// longest (waiting for its first or next request); it waits only while every
    /// connection is busy with a request.
    #[arg(long = "max-connections", value_name = "N", default_value_t = 256)]
    pub max_connections: usize,
    /// A request's headers must arrive within this (from the connection's accept, or from
    /// the first byte of a next request); else the connection is closed (e.g. 10s, 500ms).
    #[arg(long = "header-timeout", value_name = "DURATION", default_value = "10s", value_parser = parse_timeout)]
    pub header_timeout: std::time::Duration,
    /// A request's body must arrive in full within this after its headers; else 408.
    #[arg(long = "body-timeout", value_name = "DURATION", default_value = "30s", value_parser = parse_timeout)]
    pub body_timeout: std::time::Duration,
    /// A kept-alive connection without a request for this long is closed.
    #[arg(long = "idle-timeout", value_name = "DURATION", default_value = "60s", value_parser = parse_timeout)]
    pub idle_timeout: std::time::Duration,
    /// Name reported by /v1/models (default: the file name without .gguf).
    #[arg(long = "alias", value_name = "NAME")]
    pub alias: Option<String>,
    /// Seconds running requests may take after SIGINT/SIGTERM before they are stopped.
    #[arg(long = "drain-timeout", value_name = "SECS", default_value_t = 30)]
    pub drain_timeout: u64,
}

/// A timeout flag's value: `10s`, `500ms`, `2m`, or plain seconds (`30`); more than 0.
fn parse_timeout(s: &str) -> Result<std::time::Duration, String> {
    let t = s.trim();
    let (num, unit) = match t.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => t.split_at(i),
        None => (t, "s"),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| "expected a duration such as 10s, 500ms or 2m".to_string())?;
    let d = match unit {
        "ms" => std::time::Duration::from_millis(n),
        "s" => std::time::Duration::from_secs(n),
        "m" => std::time::Duration::from_secs(n.saturating_mul(60)),
        _ => return Err("expected a duration such as 10s, 500ms or 2m".into()),
    };
    if d.is_zero() {
        return Err("must be more than 0".into());
    }
    Ok(d)
}

/// Most sequences `--parallel` accepts: each owns a KV cache and a scheduler slot, so a
/// count past this is a typo, not a plan (it used to panic in the loader thread).
pub const MAX_PARALLEL: usize = 1024;

/// Refuse counts that cannot mean anything, before the model is loaded.
fn check_limits(args: &ServeArgs) -> Result<()> {
    if args.model.ctx == 0 {
        anyhow::bail!("--ctx 0: the context must hold at least 1 token");
    }
    if args.max_tokens == 0 {
        anyhow::bail!("--max-tokens 0: a request must be allowed at least 1 token");
    }
    if args.parallel == 0 || args.parallel > MAX_PARALLEL {
        anyhow::bail!(
            "--parallel {}: must be between 1 and {MAX_PARALLEL}",
            args.parallel
        );
    }
    Ok(())
}

pub fn main(args: ServeArgs) -> Result<()> {
    let size = |flag: &str, s: &str| -> Result<u64> {
        parse_size_bytes(s, None).map_err(|e| anyhow::anyhow!("{flag} {s}: {e}"))
    };
    let api_key = match (&args.api_key, &args.api_key_file) {
        (Some(k), _) => Some(k.clone()),
        (None, Some(f)) => {
            let text = std::fs::read_to_string(f)
                .with_context(|| format!("--api-key-file {}: cannot read", f.display()))?;
            Some(
                key_from_file(&text)
                    .map_err(|why| anyhow::anyhow!("--api-key-file {}: {why}", f.display()))?,
            )
        }
        (None, None) => None,
    };
    check_limits(&args)?;
    if args.parallel > 1 {
        if let Some(p) = &args.model.stream.record_routing {
            anyhow::bail!(
                "--record-routing {} needs --parallel 1 (a trace is one sequence's routing; --parallel {} interleaves several)",
                p.display(),
                args.parallel
            );
        }
    }
    // The same load path as run, bench and perplexity (flags checked, device attached by
    // the engine); the memory plan counts the KV cache of every sequence.
    let opts = args.model.options(args.parallel, None)?;
    let name = args.alias.clone().unwrap_or_else(|| {
        args.model
            .model
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "sluice".into())
    });
    let session = SessionParams {
        ctx: args.model.ctx,
        kv_f32: args.model.kv_f32,
        batch: args.model.batch,
    };
    let mut cfg = ServerConfig::new(&name, session);
    cfg.host = args.host.clone();
    cfg.port = args.port;
    cfg.parallel = args.parallel;
    cfg.queue = args.queue;
    cfg.prefix_cache = size("--prefix-cache", &args.prefix_cache)?;
    cfg.prefix_cache_dir = args.prefix_cache_dir.clone();
    cfg.prefix_cache_disk = size("--prefix-cache-disk", &args.prefix_cache_disk)?;
    if cfg.prefix_cache_dir.is_some() && cfg.prefix_cache_disk == 0 {
        anyhow::bail!("--prefix-cache-disk 0: the directory must be allowed some bytes");
    }
    cfg.api_key = api_key;
    cfg.insecure_public = args.insecure_public;
    cfg.max_body = size("--max-body", &args.max_body)? as usize;
    if cfg.max_body == 0 {
        anyhow::bail!("--max-body {}: must be at least 1 byte", args.max_body);
    }
    cfg.max_prompt_tokens = args.max_prompt_tokens.unwrap_or(usize::MAX);
    cfg.max_tokens = args.max_tokens;
    cfg.max_connections = args.max_connections;
    cfg.header_timeout = args.header_timeout;
    cfg.body_timeout = args.body_timeout;
    cfg.idle_timeout = args.idle_timeout;
    cfg.drain_timeout = std::time::Duration::from_secs(args.drain_timeout);
    let path = args.model.model.display().to_string();
    let loader: sluice_server::Loader = Box::new(move || {
        let loaded = opts.load().map_err(|e| e.to_string())?;
        for n in &loaded.notes {
            eprintln!("{n}");
        }
        Ok(loaded)
    });
    // Printed once `/health` answers 200, not when the file is loaded.
    cfg.on_ready = Some(sluice_server::OnReady(std::sync::Arc::new(move |loaded| {
        eprintln!(
            "loaded {path} ({}, {} layers) in {:.2} s, {} threads",
            loaded.model.cfg.arch,
            loaded.model.cfg.n_layer,
            loaded.load_secs,
            loaded.pool.current_num_threads()
        );
    })));
    let t0 = std::time::Instant::now();
    let loaded = sluice_server::run(cfg, loader)?;
    // After the drain: what --stats and --record-routing promise, over everything served.
    if let Some(loaded) = loaded {
        if args.model.stream.stats {
            eprintln!("stats: everything served since start");
            loaded.print_stats(t0.elapsed().as_secs_f64());
        }
        if args.model.stream.record_routing.is_some() {
            match std::sync::Arc::try_unwrap(loaded) {
                Ok(mut l) => crate::common::finish_routing(&mut l)?,
                Err(_) => anyhow::bail!(
                    "--record-routing: the trace was not written (a sequence still held the model at exit)"
                ),
            }
        }
    }
    Ok(())
}

/// The key an `--api-key-file` holds: its first line, without surrounding whitespace (a
/// trailing newline is normal). Says what is wrong otherwise: an empty file, or an empty
/// first line before other text (the key must be on the first line).
fn key_from_file(text: &str) -> Result<String, String> {
    if text.trim().is_empty() {
        return Err("the file is empty".into());
    }
    let first = text.lines().next().unwrap_or("").trim();
    if first.is_empty() {
        return Err("the first line is empty (the key must be on the first line)".into());
    }
    Ok(first.to_string())
}

#[cfg(test)]
mod tests {
    use super::{key_from_file, parse_timeout};
    use std::time::Duration;

    #[test]
    fn timeouts_parse_with_units_and_refuse_zero() {
        assert_eq!(parse_timeout("10s").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_timeout("30").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_timeout("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_timeout("2m").unwrap(), Duration::from_secs(120));
        assert!(parse_timeout("0s").unwrap_err().contains("more than 0"));
        assert!(parse_timeout("0").is_err());
        assert!(parse_timeout("10h").is_err());
        assert!(parse_timeout("-1s").is_err());
        assert!(parse_timeout("").is_err());
    }

    #[test]
    fn key_file_first_line_empty_is_named() {
        assert_eq!(key_from_file("abc\n").unwrap(), "abc");
        assert_eq!(key_from_file("  abc  \nignored\n").unwrap(), "abc");
        assert_eq!(key_from_file("").unwrap_err(), "the file is empty");
        assert_eq!(key_from_file(" \n\n").unwrap_err(), "the file is empty");
        let e = key_from_file("\nabc\n").unwrap_err();
        assert!(e.contains("first line is empty"), "{e}");
    }
}
