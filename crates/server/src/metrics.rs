//! Counters and histograms, rendered in Prometheus text format by `GET /metrics`.
//!
//! Owns: [`Metrics`] (request and token counters, TTFT and per-token latency histograms,
//! prefix-reuse tokens) and the rendering, which adds the queue gauges and the expert tier's
//! counters (hits, misses, evictions, bytes read, delivered GB/s, compute wait) when experts
//! stream. Everything is lock-free atomics; a scrape never blocks generation.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

use sluice_engine::tier::StreamingExperts;

/// A fixed-bucket histogram of seconds (counts kept in microseconds for the sum).
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum_us: AtomicU64,
    count: AtomicU64,
}

const TTFT_BOUNDS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
const TOKEN_BOUNDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
            sum_us: AtomicU64::new(0),
            count: AtomicU64::new(0),
        }
    }

    pub fn observe(&self, secs: f64) {
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            if secs <= *b {
                c.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.sum_us
            .fetch_add((secs.max(0.0) * 1e6) as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            let _ = writeln!(
                out,
                "{name}_bucket{{le=\"{b}\"}} {}",
                c.load(Ordering::Relaxed)
            );
        }
        let n = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {n}");
        let _ = writeln!(
            out,
            "{name}_sum {}",
            self.sum_us.load(Ordering::Relaxed) as f64 * 1e-6
        );
        let _ = writeln!(out, "{name}_count {n}");
    }
}

/// The server's counters.
pub struct Metrics {
    pub requests_chat: AtomicU64,
    pub requests_completions: AtomicU64,
    pub requests_messages: AtomicU64,
    /// Requests refused because the queue was full.
    pub rejected: AtomicU64,
    /// Requests answered with a 4xx error.
    pub client_errors: AtomicU64,
    /// Requests whose client went away before the end.
    pub cancelled: AtomicU64,
    /// Requests that finished generating.
    pub completed: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    /// Prompt tokens restored from a snapshot or kept in a sequence (not recomputed).
    pub prefix_reused_tokens: AtomicU64,
    /// Requests that reused a prefix.
    pub prefix_hits: AtomicU64,
    pub ttft: Histogram,
    pub token_latency: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests_chat: AtomicU64::new(0),
            requests_completions: AtomicU64::new(0),
            requests_messages: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            client_errors: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            completion_tokens: AtomicU64::new(0),
            prefix_reused_tokens: AtomicU64::new(0),
            prefix_hits: AtomicU64::new(0),
            ttft: Histogram::new(TTFT_BOUNDS),
            token_latency: Histogram::new(TOKEN_BOUNDS),
        }
    }
}

/// Gauges read at scrape time.
pub struct Gauges {
    pub queued: usize,
    pub running: usize,
    pub parallel: usize,
    pub prefix_cache_bytes: u64,
    pub prefix_cache_entries: usize,
    pub prefix_cache_budget: u64,
    /// `--prefix-cache-dir`: bytes, this model's files, the bound, files written, loaded.
    pub prefix_disk: Option<[u64; 5]>,
    pub ready: bool,
    /// Connections open now.
    pub connections: usize,
}

fn counter(out: &mut String, name: &str, help: &str, v: u64) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
    );
}

fn gauge(out: &mut String, name: &str, help: &str, v: impl std::fmt::Display) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
}

impl Metrics {
    /// Prometheus text exposition.
    pub fn render(&self, g: &Gauges, streaming: Option<&StreamingExperts>) -> String {
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut out = String::with_capacity(4096);
        let _ = writeln!(
            out,
            "# HELP sluice_requests_total Generation requests received, by endpoint.\n# TYPE sluice_requests_total counter"
        );
        for (ep, a) in [
            ("chat_completions", &self.requests_chat),
            ("completions", &self.requests_completions),
            ("messages", &self.requests_messages),
        ] {
            let _ = writeln!(out, "sluice_requests_total{{endpoint=\"{ep}\"}} {}", ld(a));
        }
        counter(
            &mut out,
            "sluice_requests_rejected_total",
            "Requests refused with 503 because the queue was full.",
            ld(&self.rejected),
        );
        counter(
            &mut out,
            "sluice_requests_client_errors_total",
            "Requests answered with a 4xx error.",
            ld(&self.client_errors),
        );
        counter(
            &mut out,
            "sluice_requests_cancelled_total",
            "Generations stopped because the client went away.",
            ld(&self.cancelled),
        );
        counter(
            &mut out,
            "sluice_requests_completed_total",
            "Generations that ran to their end.",
            ld(&self.completed),
        );
        counter(
            &mut out,
            "sluice_prompt_tokens_total",
            "Prompt tokens of admitted requests (reused ones included).",
            ld(&self.prompt_tokens),
        );
        counter(
            &mut out,
            "sluice_completion_tokens_total",
            "Tokens generated.",
            ld(&self.completion_tokens),
        );
        counter(
            &mut out,
            "sluice_prefix_reused_tokens_total",
            "Prompt tokens not recomputed thanks to prefix reuse.",
            ld(&self.prefix_reused_tokens),
        );
        counter(
            &mut out,
            "sluice_prefix_hits_total",
            "Requests that reused a cached prefix.",
            ld(&self.prefix_hits),
        );
        gauge(
            &mut out,
            "sluice_ready",
            "1 once the model is loaded.",
            g.ready as u8,
        );
        gauge(
            &mut out,
            "sluice_connections",
            "HTTP connections open now.",
            g.connections,
        );
        gauge(
            &mut out,
            "sluice_queue_depth",
            "Requests waiting for a free sequence.",
            g.queued,
        );
        gauge(
            &mut out,
            "sluice_running",
            "Requests generating now.",
            g.running,
        );
        gauge(
            &mut out,
            "sluice_parallel",
            "Sequences that may run at once (--parallel).",
            g.parallel,
        );
        gauge(
            &mut out,
            "sluice_prefix_cache_bytes",
            "Bytes of session snapshots kept for prefix reuse.",
            g.prefix_cache_bytes,
        );
        gauge(
            &mut out,
            "sluice_prefix_cache_budget_bytes",
            "The snapshot budget (--prefix-cache).",
            g.prefix_cache_budget,
        );
        gauge(
            &mut out,
            "sluice_prefix_cache_entries",
            "Session snapshots kept for prefix reuse.",
            g.prefix_cache_entries,
        );
        if let Some([bytes, files, bound, writes, loads]) = g.prefix_disk {
            gauge(
                &mut out,
                "sluice_prefix_disk_bytes",
                "Bytes of snapshot files in --prefix-cache-dir.",
                bytes,
            );
            gauge(
                &mut out,
                "sluice_prefix_disk_bound_bytes",
                "The directory's size bound (--prefix-cache-disk).",
                bound,
            );
            gauge(
                &mut out,
                "sluice_prefix_disk_entries",
                "This model's snapshot files in --prefix-cache-dir.",
                files,
            );
            counter(
                &mut out,
                "sluice_prefix_disk_writes_total",
                "Snapshot files written.",
                writes,
            );
            counter(
                &mut out,
                "sluice_prefix_disk_loads_total",
                "Snapshots restored from files.",
                loads,
            );
        }
        self.ttft.render(
            &mut out,
            "sluice_time_to_first_token_seconds",
            "From admission to the first generated token (queue wait included).",
        );
        self.token_latency.render(
            &mut out,
            "sluice_token_latency_seconds",
            "Time between consecutive generated tokens.",
        );
        if let Some(st) = streaming {
            let cs = st.cache_stats();
            let io = st.io_stats();
            let ss = st.stream_stats();
            counter(
                &mut out,
                "sluice_expert_cache_hits_total",
                "Expert units found in the RAM cache.",
                cs.total.hits,
            );
            counter(
                &mut out,
                "sluice_expert_cache_misses_total",
                "Expert units read from storage.",
                cs.total.misses,
            );
            counter(
                &mut out,
                "sluice_expert_cache_evictions_total",
                "Expert units evicted from the RAM cache.",
                cs.total.evictions,
            );
            gauge(
                &mut out,
                "sluice_expert_cache_budget_bytes",
                "The expert cache's byte budget.",
                cs.budget,
            );
            gauge(
                &mut out,
                "sluice_expert_cache_bytes",
                "Expert bytes cached now.",
                cs.bytes_cached,
            );
            counter(
                &mut out,
                "sluice_expert_bytes_read_total",
                "Bytes read from storage for experts (alignment included).",
                io.bytes_read,
            );
            let _ = writeln!(
                out,
                "# HELP sluice_expert_io_busy_seconds_total Wall time with at least one expert read in flight.\n# TYPE sluice_expert_io_busy_seconds_total counter\nsluice_expert_io_busy_seconds_total {}",
                io.busy_ns as f64 * 1e-9
            );
            let gbps = if io.busy_ns > 0 {
                io.bytes_read as f64 / io.busy_ns as f64
            } else {
                0.0
            };
            gauge(
                &mut out,
                "sluice_expert_read_gbps",
                "Delivered expert read rate while reads were in flight (GB/s).",
                gbps,
            );
            let _ = writeln!(
                out,
                "# HELP sluice_expert_compute_wait_seconds_total Time compute waited for expert reads.\n# TYPE sluice_expert_compute_wait_seconds_total counter\nsluice_expert_compute_wait_seconds_total {}",
                ss.io_wait_ns as f64 * 1e-9
            );
            counter(
                &mut out,
                "sluice_expert_io_errors_total",
                "Expert reads that failed.",
                io.errors,
            );
        }
        out
    }
}
