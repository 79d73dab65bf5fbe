//! `sluice bench`: prompt-processing and decode speed, measured like llama-bench.
//!
//! pp: evaluate N prompt tokens (in --batch chunks) from an empty cache.
//! tg: from an empty cache, decode N tokens one at a time.
//! Tokens are pseudo-random ids (BOS first), as llama-bench does, different for every run
//! but the same from one invocation to the next; each test repeats `-r` times after one
//! warm-up and reports the median and spread.
//!
//! `--replay-routing TRACE`: the experts every token uses come from a recorded routing trace
//! (`--record-routing`) instead of the router, batch after batch through the trace from its
//! first token (wrapping at its end), on a file of the same routing geometry (`sluice
//! synth`): the whole streaming path runs on a real model's access pattern. An IO benchmark
//! only: the start-up line, the table and the CSV's `routing` column say so.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use sluice_engine::Logits;

use sluice_engine::session::Session;

use crate::common::{Loaded, MeasureArgs, ModelArgs, PrintStats};

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub measure: MeasureArgs,
    /// Prompt tokens for the prompt-processing test (0 = skip).
    #[arg(short = 'p', long = "prompt-tokens", default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Tokens for the decode test (0 = skip).
    #[arg(short = 'n', long = "gen-tokens", default_value_t = 128)]
    pub gen_tokens: usize,
    /// Repetitions of each test (after one warm-up run).
    #[arg(short = 'r', long = "repetitions", default_value_t = 5)]
    pub repetitions: usize,
    /// Skip the warm-up run.
    #[arg(long)]
    pub no_warmup: bool,
    /// Append one CSV row per test to FILE (header written when the file is new).
    #[arg(long, value_name = "FILE")]
    pub csv: Option<PathBuf>,
    /// Take every token's experts from this routing trace (`--record-routing`) instead of
    /// the router: an IO benchmark of a real access pattern on a file of the same routing
    /// geometry (layers, experts, top-k; expert sizes may differ, e.g. a `sluice synth`
    /// file), the trace's tokens in order, wrapping at its end. No logits are claimed.
    #[arg(long = "replay-routing", value_name = "TRACE")]
    pub replay_routing: Option<PathBuf>,
}

struct Row {
    test: String,
    tokens: usize,
    samples: Vec<f64>,
    /// Streaming counters over the measured repetitions (not the warm-up).
    stream: Option<StreamDelta>,
    /// GPU counters over the same repetitions (`--gpu` with a GPU found).
    gpu: Option<GpuDelta>,
}

/// What the GPU backend did during one test's measured repetitions: VRAM expert-tier
/// lookups and hits, and weight uploads on the copy stream (bytes, copy time).
#[derive(Debug, Default, Clone, Copy)]
struct GpuDelta {
    hits: u64,
    lookups: u64,
    upload_bytes: u64,
    upload_ns: u64,
}

impl GpuDelta {
    fn snapshot(l: &Loaded) -> Option<GpuDelta> {
        let s = l.gpu.as_ref()?.stats();
        Some(GpuDelta {
            hits: s.expert_hits,
            lookups: s.expert_hits + s.expert_misses,
            upload_bytes: s.upload_bytes,
            upload_ns: s.upload_ns,
        })
    }
    fn since(self, b: GpuDelta) -> GpuDelta {
        GpuDelta {
            hits: self.hits - b.hits,
            lookups: self.lookups - b.lookups,
            upload_bytes: self.upload_bytes - b.upload_bytes,
            upload_ns: self.upload_ns - b.upload_ns,
        }
    }
    /// VRAM-tier hit rate (0 without lookups: no `--gpu-expert-cache`).
    fn hit_rate(&self) -> f64 {
        self.hits as f64 / self.lookups.max(1) as f64
    }
    fn gbps(&self) -> f64 {
        self.upload_bytes as f64 / self.upload_ns.max(1) as f64
    }
}

/// What the expert tier did during one test's measured repetitions.
#[derive(Default, Clone, Copy)]
struct StreamDelta {
    hits: u64,
    misses: u64,
    bytes_read: u64,
    busy_ns: u64,
    io_wait_ns: u64,
    wall_ns: u64,
    /// Router lookahead: predicted units the layer chose, units asked after a prediction,
    /// speculative reads, those used by their layer, bytes read and not used.
    la_correct: u64,
    la_actual: u64,
    la_issued: u64,
    la_hit: u64,
    la_wasted_bytes: u64,
}

impl StreamDelta {
    fn snapshot(l: &Loaded, wall_ns: u64) -> Option<StreamDelta> {
        let st = l.streaming.as_ref()?;
        let (c, io, s) = (st.cache_stats(), st.io_stats(), st.stream_stats());
        Some(StreamDelta {
            hits: c.total.hits,
            misses: c.total.misses,
            bytes_read: io.bytes_read,
            busy_ns: io.busy_ns,
            io_wait_ns: s.io_wait_ns,
            wall_ns,
            la_correct: s.la_correct,
            la_actual: s.la_actual,
            la_issued: s.la_issued,
            la_hit: s.la_hit,
            la_wasted_bytes: s.la_wasted_bytes,
        })
    }
    fn since(self, before: StreamDelta) -> StreamDelta {
        StreamDelta {
            hits: self.hits - before.hits,
            misses: self.misses - before.misses,
            bytes_read: self.bytes_read - before.bytes_read,
            busy_ns: self.busy_ns - before.busy_ns,
            io_wait_ns: self.io_wait_ns - before.io_wait_ns,
            wall_ns: self.wall_ns - before.wall_ns,
            la_correct: self.la_correct - before.la_correct,
            la_actual: self.la_actual - before.la_actual,
            la_issued: self.la_issued - before.la_issued,
            la_hit: self.la_hit - before.la_hit,
            la_wasted_bytes: self.la_wasted_bytes - before.la_wasted_bytes,
        }
    }
    /// Share of the units layers chose that lookahead had predicted (0 without lookahead).
    fn la_accuracy(&self) -> f64 {
        self.la_correct as f64 / self.la_actual.max(1) as f64
    }
    fn hit_rate(&self) -> f64 {
        self.hits as f64 / (self.hits + self.misses).max(1) as f64
    }
    fn gbps(&self) -> f64 {
        self.bytes_read as f64 / self.busy_ns.max(1) as f64
    }
    fn busy(&self) -> f64 {
        (self.busy_ns as f64 / self.wall_ns.max(1) as f64).min(1.0)
    }
    fn wait(&self) -> f64 {
        self.io_wait_ns as f64 / self.wall_ns.max(1) as f64
    }
}

impl Row {
    fn median(&self) -> f64 {
        let mut s = self.samples.clone();
        s.sort_by(|a, b| a.total_cmp(b));
        let n = s.len();
        if n % 2 == 1 {
            s[n / 2]
        } else {
            (s[n / 2 - 1] + s[n / 2]) / 2.0
        }
    }
    fn stddev(&self) -> f64 {
        let n = self.samples.len() as f64;
        let mean = self.samples.iter().sum::<f64>() / n;
        (self.samples.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0)).sqrt()
    }
}

/// Deterministic token stream (SplitMix64) so every run sees the same ids.
fn tokens(n: usize, n_vocab: usize, bos: Option<u32>, seed: u64) -> Vec<u32> {
    let mut state = seed;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        if i == 0 {
            if let Some(b) = bos {
                out.push(b);
                continue;
            }
        }
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        out.push((z % n_vocab as u64) as u32);
    }
    out
}

/// A fresh sequence sized for `n` tokens, with the flags' KV precision and batch.
fn session<'l>(l: &'l Loaded, args: &ModelArgs, n: usize) -> Session<'l> {
    Session::new(l, n, args.kv_f32, args.batch)
}

fn run_pp(l: &Loaded, toks: &[u32], args: &ModelArgs) -> Result<f64> {
    let mut s = session(l, args, toks.len());
    let t0 = Instant::now();
    s.prefill(toks, Logits::Last)?;
    Ok(toks.len() as f64 / t0.elapsed().as_secs_f64())
}

/// Decode test. With `--measure`, the expert pages are dropped at the start and every N
/// tokens, and the rate returned is corrected for the invalidation time (the report says
/// both; when the drop had no effect, the raw rate, and the report says why).
fn run_tg(l: &Loaded, toks: &[u32], args: &BenchArgs) -> Result<f64> {
    let mut s = session(l, &args.model, toks.len());
    let mut measure = l.start_measure(&args.measure)?;
    let t0 = Instant::now();
    for &t in toks {
        s.step(t)?;
        if let Some(m) = measure.as_mut() {
            m.token()?;
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    match measure {
        Some(m) => {
            let report = m.finish(toks.len(), secs);
            report.print();
            Ok(report.rate())
        }
        None => Ok(toks.len() as f64 / secs),
    }
}

/// `--replay-routing`'s trace, read and checked for its format, after refusing the flags it
/// cannot go with.
fn read_replay_trace(args: &BenchArgs) -> Result<Option<sluice_engine::tier::RoutingTrace>> {
    let Some(p) = &args.replay_routing else {
        return Ok(None);
    };
    if args.model.device.gpu {
        bail!(
            "--replay-routing {}: not with --gpu (the GPU's forward pass routes on the device)",
            p.display()
        );
    }
    if args.model.stream.lookahead {
        bail!(
            "--replay-routing {}: not with --lookahead (the prediction would come from this file's router, not the trace's model)",
            p.display()
        );
    }
    let trace = sluice_engine::tier::RoutingTrace::read(p)
        .with_context(|| format!("--replay-routing {}", p.display()))?;
    Ok(Some(trace))
}

/// Replace the model's routing by `trace` (its geometry checked against the model's), say
/// so on stderr, and return the CSV's `routing` value (`replay:FILE`).
fn attach_replay(
    l: &mut Loaded,
    p: &std::path::Path,
    trace: sluice_engine::tier::RoutingTrace,
) -> Result<String> {
    let geometry = l.model.routing_geometry();
    let r = l
        .model
        .replay_routing(trace, p)
        .with_context(|| format!("--replay-routing {}", p.display()))?;
    let h = &r.trace().header;
    eprintln!(
        "routing replayed from {} ({} tokens of {}, {}): an IO benchmark, experts come from the trace, not the router; no logits are claimed",
        p.display(),
        r.trace().n_tokens(),
        h.model,
        geometry
    );
    Ok(format!(
        "replay:{}",
        p.file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .replace(',', "_")
    ))
}

pub fn main(mut args: BenchArgs) -> Result<()> {
    if args.repetitions == 0 {
        anyhow::bail!("--repetitions must be at least 1");
    }
    if let Some(p) = &args.csv {
        crate::common::check_output_file(p, "--csv")?;
    }
    // A trace is read (and its format checked) before the model loads; its geometry is
    // checked against the model's after.
    let trace = read_replay_trace(&args)?;
    // Every bench sequence is one test's length (`session`), not --ctx.
    let longest = args.prompt_tokens.max(args.gen_tokens).max(1);
    args.measure.adjust(&mut args.model);
    let mut l = args.model.load_for(Some(longest))?;
    let routing = match (&args.replay_routing, trace) {
        (Some(p), Some(trace)) => attach_replay(&mut l, p, trace)?,
        _ => "router".to_string(),
    };
    let cfg = &l.model.cfg;
    let bos = l
        .model
        .gguf
        .get_u64("tokenizer.ggml.bos_token_id")
        .ok()
        .map(|b| b as u32);
    let threads = l.pool.current_num_threads();
    // The expert cache's slot memory is faulted in by a background thread at load; a
    // timed run that starts before it is done pays for zeroing those pages (load work,
    // like llama-bench's model load, which it does not time either).
    if let Some(st) = &l.streaming {
        let t0 = Instant::now();
        st.wait_slots_ready();
        let waited = t0.elapsed().as_secs_f64();
        if waited >= 0.05 {
            eprintln!("expert cache slot memory ready after {waited:.2} s more (not timed)");
        }
    }
    let mut rows = Vec::new();
    let bench_start = Instant::now();
    let tests: Vec<(&str, usize)> = [("pp", args.prompt_tokens), ("tg", args.gen_tokens)]
        .into_iter()
        .filter(|&(_, n)| n > 0)
        .collect();
    for (kind, n) in tests {
        if n > cfg.n_ctx_train {
            anyhow::bail!(
                "{kind}{n}: more tokens than the model's context ({})",
                cfg.n_ctx_train
            );
        }
        // Every run (warm-up included) gets its own token ids, as llama-bench's unseeded
        // rand() stream does: repeating the same ids would repeat the same expert routing
        // and make an expert cache look perfect.
        let seed_base: u64 = if kind == "pp" { 1_000 } else { 2_000 };
        let run = |l: &Loaded, rep: u64| {
            let toks = tokens(n, cfg.n_vocab, bos, seed_base + rep);
            if kind == "pp" {
                run_pp(l, &toks, &args.model)
            } else {
                run_tg(l, &toks, &args)
            }
        };
        if !args.no_warmup {
            eprint!("{kind}{n}: warm-up... ");
            run(&l, 0)?;
        }
        let mut samples = Vec::new();
        let t0 = Instant::now();
        let before = StreamDelta::snapshot(&l, 0);
        let gpu_before = GpuDelta::snapshot(&l);
        for r in 0..args.repetitions {
            eprint!("\r{kind}{n}: run {}/{}   ", r + 1, args.repetitions);
            samples.push(run(&l, 1 + r as u64)?);
        }
        eprintln!();
        let wall = t0.elapsed().as_nanos() as u64;
        let stream = match (StreamDelta::snapshot(&l, wall), before) {
            (Some(a), Some(b)) => Some(a.since(b)),
            _ => None,
        };
        let gpu = match (GpuDelta::snapshot(&l), gpu_before) {
            (Some(a), Some(b)) => Some(a.since(b)),
            _ => None,
        };
        rows.push(Row {
            test: format!("{kind}{n}"),
            tokens: n,
            samples,
            stream,
            gpu,
        });
    }
    println!(
        "| model | arch | threads | test | t/s (median) | stddev | runs |\n|---|---|---:|---|---:|---:|---:|"
    );
    let name = args
        .model
        .model
        .file_name()
        .map(|s| s.to_string_lossy().to_string())
        .unwrap_or_default();
    for r in &rows {
        println!(
            "| {} | {} | {} | {} | {:.2} | {:.2} | {} |",
            name,
            cfg.arch,
            threads,
            r.test,
            r.median(),
            r.stddev(),
            r.samples.len()
        );
    }
    if let Some(r) = l.model.routing_replay() {
        let n = r.trace().n_tokens() as u64;
        println!(
            "routing: replayed from {} ({} trace tokens used, the trace has {n}{}; IO benchmark, no logits claimed)",
            r.path().display(),
            r.tokens_replayed(),
            if r.tokens_replayed() > n {
                ", wrapped to its start"
            } else {
                ""
            }
        );
    }
    for r in &rows {
        if let Some(d) = &r.stream {
            eprintln!(
                "{}: expert hit rate {:.1}% ({} misses), read {:.2} GB at {:.2} GB/s delivered, disk busy {:.0}%, compute waited for IO {:.0}%",
                r.test,
                100.0 * d.hit_rate(),
                d.misses,
                d.bytes_read as f64 * 1e-9,
                d.gbps(),
                100.0 * d.busy(),
                100.0 * d.wait()
            );
            if d.la_actual > 0 {
                eprintln!(
                    "{}: lookahead accuracy {:.1}%, reads issued {}, used by their layer {}, wasted {:.2} GB",
                    r.test,
                    100.0 * d.la_accuracy(),
                    d.la_issued,
                    d.la_hit,
                    d.la_wasted_bytes as f64 * 1e-9
                );
            }
        }
    }
    for r in &rows {
        // Only when the VRAM expert tier was asked or weights were uploaded during the run.
        if let Some(g) = r
            .gpu
            .as_ref()
            .filter(|g| g.lookups > 0 || g.upload_bytes > 0)
        {
            eprintln!(
                "{}: gpu expert hit rate {:.1}% ({} lookups), uploaded {:.2} GB at {:.2} GB/s",
                r.test,
                100.0 * g.hit_rate(),
                g.lookups,
                g.upload_bytes as f64 * 1e-9,
                g.gbps()
            );
        }
    }
    if args.model.stream.stats {
        l.print_stats(bench_start.elapsed().as_secs_f64());
    }
    if let Some(path) = &args.csv {
        let new = !path.exists();
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("{}: cannot open for append", path.display()))?;
        if new {
            writeln!(
                f,
                "model,arch,threads,batch,test,tokens,median_tps,stddev_tps,samples,expert_cache,\
                 hit_rate,misses,bytes_read,read_gbps,disk_busy,io_wait,gpu,gpu_hit_rate,\
                 gpu_upload_bytes,gpu_upload_gbps,la_accuracy,la_issued,la_useful,la_wasted_bytes,routing"
            )?;
        }
        for r in &rows {
            let samples: Vec<String> = r.samples.iter().map(|s| format!("{s:.3}")).collect();
            let d = r.stream.unwrap_or_default();
            let cache = args
                .model
                .stream
                .expert_cache
                .as_ref()
                .map_or_else(|| "mmap".to_string(), |(_, text)| text.clone());
            let gd = r.gpu.unwrap_or_default();
            writeln!(
                f,
                "{},{},{},{},{},{},{:.3},{:.3},{},{},{:.4},{},{},{:.3},{:.3},{:.3},{},{:.4},{},{:.3},{:.4},{},{},{},{}",
                name,
                cfg.arch,
                threads,
                args.model.batch,
                r.test,
                r.tokens,
                r.median(),
                r.stddev(),
                samples.join(";"),
                cache,
                d.hit_rate(),
                d.misses,
                d.bytes_read,
                d.gbps(),
                d.busy(),
                d.wait(),
                if r.gpu.is_some() { "on" } else { "off" },
                gd.hit_rate(),
                gd.upload_bytes,
                gd.gbps(),
                d.la_accuracy(),
                d.la_issued,
                d.la_hit,
                d.la_wasted_bytes,
                routing
            )?;
        }
    }
    l.finish()
}
