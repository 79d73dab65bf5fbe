//! Flags and helpers shared by the commands that load a model (run, perplexity, bench).

use std::path::PathBuf;
use std::time::Instant;

use std::sync::Arc;

use anyhow::{Context, Result};
use sluice_engine::expert_tier::{parse_size_bytes, PolicyKind};
use sluice_engine::streaming::{StreamConfig, StreamingExperts};
use sluice_engine::Model;
use sluice_io::{Backend, IoConfig};

/// Where the model is and how many threads compute.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// Path to the model (.gguf).
    #[arg(short = 'm', long = "model", value_name = "FILE")]
    pub model: PathBuf,
    /// Compute threads (default: the number of physical cores).
    #[arg(short = 't', long = "threads", value_name = "N", default_value_t = 0)]
    pub threads: usize,
    /// Context size in tokens (capped at the model's trained context).
    #[arg(short = 'c', long = "ctx", value_name = "N", default_value_t = 4096)]
    pub ctx: usize,
    /// Prompt tokens evaluated per forward pass during prefill.
    #[arg(short = 'b', long = "batch", value_name = "N", default_value_t = 256)]
    pub batch: usize,
    /// Keep the KV cache at full f32 precision (default: rounded to f16 like llama.cpp).
    #[arg(long = "kv-f32")]
    pub kv_f32: bool,
    #[command(flatten)]
    pub stream: StreamArgs,
}

/// SSD streaming of routed experts (MoE models). Without --expert-cache the experts are
/// read through the memory map like every other tensor (the OS decides what stays).
#[derive(clap::Args, Debug, Clone)]
pub struct StreamArgs {
    /// Stream routed experts from the SSD through a RAM cache of SIZE bytes (e.g. 8G,
    /// 512MiB, 25% of the experts, or `auto` = what this machine can spare after the
    /// resident weights and the KV cache, keeping a reserve). A hard budget: cached plus
    /// in-flight expert bytes never exceed it.
    #[arg(long = "expert-cache", value_name = "SIZE")]
    pub expert_cache: Option<String>,
    /// Eviction policy: lru, lfu (selection counts halved every 16 tokens; lfu:N sets N), lru2.
    #[arg(long = "cache-policy", default_value = "lfu")]
    pub cache_policy: String,
    /// Pin the first N MoE layers' experts in RAM (read once at start; not counted in
    /// the cache budget).
    #[arg(long = "resident-layers", value_name = "N", default_value_t = 0)]
    pub resident_layers: usize,
    /// IO backend for expert reads: uring (falls back to pread if refused), pread, mmap.
    #[arg(long = "io", default_value = "uring")]
    pub io: String,
    /// O_DIRECT expert reads (bypass the page cache): on or off.
    #[arg(long = "direct-io", default_value = "on", value_parser = ["on", "off"])]
    pub direct_io: String,
    /// Reads in flight for io_uring.
    #[arg(long = "io-depth", value_name = "N", default_value_t = 32)]
    pub io_depth: usize,
    /// Reader threads for the pread and mmap backends.
    #[arg(long = "io-threads", value_name = "N", default_value_t = 8)]
    pub io_threads: usize,
    /// Leave expert reads at normal IO priority (default: best-effort high priority).
    #[arg(long = "no-io-priority")]
    pub no_io_priority: bool,
    /// Print cache, IO and stall statistics (per run and per layer).
    #[arg(long)]
    pub stats: bool,
    /// Honest decode numbers: drop the model's expert pages from the page cache at decode
    /// start and every --measure-every tokens, report residency, true storage reads and the
    /// rate corrected for the time spent invalidating.
    #[arg(long)]
    pub measure: bool,
    /// Tokens between page-cache invalidations in --measure mode (0 = only at the start).
    #[arg(long = "measure-every", value_name = "N", default_value_t = 16)]
    pub measure_every: usize,
    /// Write every token's chosen experts to FILE (replay it with `sluice cache-sim`).
    #[arg(long = "record-routing", value_name = "FILE")]
    pub record_routing: Option<PathBuf>,
}

/// A loaded model with its compute pool.
pub struct Loaded {
    pub model: Model,
    pub pool: rayon::ThreadPool,
    pub load_secs: f64,
    /// The streaming tier, when --expert-cache is on (kept for statistics).
    pub streaming: Option<Arc<StreamingExperts>>,
}

impl ModelArgs {
    pub fn load(&self) -> Result<Loaded> {
        if self.batch == 0 {
            anyhow::bail!("--batch must be at least 1");
        }
        let t0 = Instant::now();
        if !self.model.exists() {
            anyhow::bail!("{}: no such file", self.model.display());
        }
        let mut model = Model::load(&self.model)?;
        let pool = sluice_engine::threads::compute_pool(self.threads)
            .context("cannot start the compute threads")?;
        let streaming = match &self.stream.expert_cache {
            None => None,
            Some(size) => Some(self.open_streaming(&mut model, size)?),
        };
        if let Some(path) = &self.stream.record_routing {
            if model.cfg.n_expert == 0 {
                anyhow::bail!(
                    "--record-routing: {} has no routed experts",
                    self.model.display()
                );
            }
            model.record_routing(path)?;
        }
        Ok(Loaded {
            model,
            pool,
            load_secs: t0.elapsed().as_secs_f64(),
            streaming,
        })
    }

    fn open_streaming(&self, model: &mut Model, size: &str) -> Result<Arc<StreamingExperts>> {
        let s = &self.stream;
        if model.cfg.n_expert == 0 {
            anyhow::bail!(
                "--expert-cache: {} ({}) has no routed experts to stream",
                self.model.display(),
                model.cfg.arch.name()
            );
        }
        let total = StreamingExperts::total_expert_bytes(&model.weights);
        let min = StreamingExperts::min_budget(&model.weights, model.cfg.n_expert_used);
        let spare = spare_memory(model, self.ctx, total)?;
        let budget = if size == "auto" {
            eprintln!(
                "expert cache auto: {} available - {} resident weights - {} KV - reserve = {}",
                human(spare.available),
                human(spare.resident),
                human(spare.kv),
                human(spare.budget)
            );
            spare.budget
        } else {
            parse_size_bytes(size, Some(total))
                .map_err(|e| anyhow::anyhow!("--expert-cache {size}: {e}"))?
        };
        // A cache bigger than what the machine can spare would push the resident weights
        // and everything else out of memory (or get the process killed) long before it fills.
        if size != "auto" && budget.min(total) > spare.available_for_cache {
            anyhow::bail!(
                "--expert-cache {size}: {} is more than this machine can spare for the cache ({}: {} available - {} resident weights - {} KV); use `auto` or a smaller size",
                human(budget.min(total)),
                human(spare.available_for_cache),
                human(spare.available),
                human(spare.resident),
                human(spare.kv)
            );
        }
        if budget < min {
            anyhow::bail!(
                "--expert-cache {size}: {} is below the minimum {} ({} bytes: one layer's top-{} experts must fit at once)",
                human(budget),
                human(min),
                min,
                model.cfg.n_expert_used
            );
        }
        let policy = PolicyKind::from_name(&s.cache_policy)
            .map_err(|e| anyhow::anyhow!("--cache-policy: {e}"))?;
        let backend: Backend =
            s.io.parse()
                .map_err(|e| anyhow::anyhow!("--io {}: {e}", s.io))?;
        let cfg = StreamConfig {
            budget: budget.min(total.max(min)),
            policy,
            resident_layers: s.resident_layers,
            io: IoConfig {
                backend,
                direct: s.direct_io == "on",
                depth: s.io_depth.max(1),
                threads: s.io_threads.max(1),
                high_priority: !s.no_io_priority,
            },
        };
        lock_resident(model);
        if s.resident_layers > 0 {
            eprintln!(
                "reading the experts of {} resident layers...",
                s.resident_layers
            );
        }
        let st = Arc::new(StreamingExperts::open(
            &self.model,
            &model.weights,
            model.cfg.n_expert_used,
            &cfg,
        )?);
        eprintln!(
            "expert cache: {} of {} routed-expert bytes ({:.0}%), policy {}, io {}{}",
            human(cfg.budget),
            human(total),
            100.0 * cfg.budget as f64 / total.max(1) as f64,
            s.cache_policy,
            st.io_stats_name(),
            if cfg.io.direct {
                ", O_DIRECT"
            } else {
                ", buffered"
            }
        );
        model.set_expert_source(Box::new(st.clone()));
        Ok(st)
    }
}

/// With streaming on, pin every non-expert tensor in RAM (mlock): otherwise the memory
/// the expert cache takes pushes them out of the page cache and every token faults them
/// back in from disk, unseen by the IO statistics. If mlock is refused, say so once.
fn lock_resident(model: &Model) {
    let expert_ranges = crate::measure::expert_ranges(&model.weights, model.gguf.file_size);
    let mut ranges: Vec<std::ops::Range<u64>> = Vec::new();
    let mut pos = model.gguf.data_offset;
    let mut experts = expert_ranges.clone();
    experts.sort_by_key(|r| r.start);
    for r in &experts {
        if r.start > pos {
            ranges.push(pos..r.start);
        }
        pos = pos.max(r.end);
    }
    if pos < model.gguf.file_size {
        ranges.push(pos..model.gguf.file_size);
    }
    let total: u64 = ranges.iter().map(|r| r.end - r.start).sum();
    let t0 = std::time::Instant::now();
    for r in &ranges {
        if let Err(e) = model.weights.map.lock(r.start as usize..r.end as usize) {
            eprintln!(
                "warning: cannot lock the resident weights in RAM ({e}); they stay in the page cache and may be evicted under memory pressure (raise `ulimit -l`)"
            );
            return;
        }
    }
    eprintln!(
        "resident weights: {} locked in RAM in {:.2} s",
        human(total),
        t0.elapsed().as_secs_f64()
    );
}

/// Bytes of the model file that are not routed experts (what stays resident when they stream).
fn resident_bytes(model: &Model, total_experts: u64) -> u64 {
    model.gguf.file_size.saturating_sub(total_experts)
}

/// What this machine can give the expert cache.
struct Spare {
    available: u64,
    resident: u64,
    kv: u64,
    /// available - resident - KV: the most a cache may take.
    available_for_cache: u64,
    /// `auto`: that, minus a reserve of 10% or 1 GiB for everything else.
    budget: u64,
}

/// MemAvailable minus what the rest of the run needs (resident weights, the KV cache);
/// `auto` also keeps a reserve of 10% or 1 GiB.
fn spare_memory(model: &Model, ctx: usize, total_experts: u64) -> Result<Spare> {
    let meminfo = std::fs::read_to_string("/proc/meminfo")
        .context("--expert-cache: cannot read /proc/meminfo")?;
    let avail_kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("--expert-cache: no MemAvailable in /proc/meminfo")?;
    let available = avail_kib * 1024;
    let c = &model.cfg;
    let resident = resident_bytes(model, total_experts);
    let kv =
        (c.n_layer * ctx.min(c.n_ctx_train) * c.n_head_kv * (c.head_dim + c.head_dim_v) * 4) as u64;
    let reserve = (available / 10).max(1 << 30);
    let available_for_cache = available.saturating_sub(resident + kv);
    Ok(Spare {
        available,
        resident,
        kv,
        available_for_cache,
        budget: available_for_cache.saturating_sub(reserve),
    })
}

/// This process's peak resident set size (VmHWM), if /proc says.
pub fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// Bytes in binary units, e.g. `1.50 GiB`.
pub fn human(b: u64) -> String {
    human_with(b, 2)
}

/// Bytes in binary units with `decimals` digits after the point (whole bytes below 1 KiB).
pub fn human_with(b: u64, decimals: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.decimals$} {}", UNITS[u])
    }
}

impl Loaded {
    /// Start `--measure` for a decode (None when the flag is off).
    pub fn start_measure(&self, args: &StreamArgs) -> Result<Option<crate::measure::Measure<'_>>> {
        if !args.measure {
            return Ok(None);
        }
        let ranges = crate::measure::expert_ranges(&self.model.weights, self.model.gguf.file_size);
        crate::measure::Measure::start(&self.model.weights.map, ranges, args.measure_every)
            .map(Some)
    }

    /// A KV cache for `n_ctx` positions with the precision the flags ask for.
    pub fn new_kv(&self, n_ctx: usize, f32_kv: bool) -> sluice_engine::kv::KvCache {
        let mut kv = self.model.new_kv(n_ctx);
        kv.set_f16(!f32_kv);
        kv
    }

    /// Close the routing trace, if one is being recorded.
    pub fn finish(&mut self) -> Result<()> {
        if let Some(p) = self.model.finish_routing()? {
            eprintln!("routing trace written to {}", p.display());
        }
        Ok(())
    }

    /// Print streaming statistics; `decode_secs` is the wall time the disk-busy fraction
    /// refers to.
    pub fn print_stats(&self, wall_secs: f64) {
        let Some(st) = &self.streaming else {
            eprintln!("stats: experts are read through the memory map (no --expert-cache): no cache statistics");
            return;
        };
        let cs = st.cache_stats();
        let io = st.io_stats();
        let ss = st.stream_stats();
        let t = &cs.total;
        eprintln!(
            "cache: policy {} budget {} | hits {} misses {} evictions {} hit rate {:.1}% | peak {} | slots allocated {} | resident {}",
            cs.policy,
            human(cs.budget),
            t.hits,
            t.misses,
            t.evictions,
            100.0 * t.hit_rate(),
            human(cs.peak_allocated),
            cs.slot_allocations,
            human(cs.resident_bytes)
        );
        eprintln!("io: {io}");
        let per_layer_bytes = StreamingExperts::expert_bytes_per_layer(&self.model.weights);
        let expected: u64 = cs
            .per_layer
            .iter()
            .zip(&per_layer_bytes)
            .map(|(s, &b)| s.misses * b)
            .sum::<u64>()
            + st.resident_read_bytes();
        eprintln!(
            "reconcile: bytes requested {} = misses x expert bytes {} ({}); read incl. alignment {} (+{:.1}%)",
            io.bytes_requested,
            expected,
            if io.bytes_requested == expected { "ok" } else { "MISMATCH" },
            io.bytes_read,
            100.0 * (io.bytes_read as f64 / io.bytes_requested.max(1) as f64 - 1.0)
        );
        eprintln!(
            "compute: waited for IO {:.3} s ({:.0}% of {:.2} s) | experts computed while reads were in flight {} | disk busy {:.0}% of that time",
            ss.io_wait_ns as f64 * 1e-9,
            100.0 * ss.io_wait_ns as f64 * 1e-9 / wall_secs.max(1e-9),
            wall_secs,
            ss.overlapped,
            100.0 * (io.busy_ns as f64 * 1e-9 / wall_secs.max(1e-9)).min(1.0)
        );
        if let Some(hwm) = peak_rss() {
            let resident = resident_bytes(
                &self.model,
                StreamingExperts::total_expert_bytes(&self.model.weights),
            );
            let promise = resident + cs.budget;
            eprintln!(
                "memory: peak RSS {} | resident weights {} + cache budget {} = {} (+ KV and buffers); peak cache slots {}",
                human(hwm),
                human(resident),
                human(cs.budget),
                human(promise),
                human(cs.peak_allocated)
            );
        }
        eprintln!("per layer: layer hits misses evictions hit%");
        for (l, s) in cs.per_layer.iter().enumerate() {
            if s.requests() > 0 {
                eprintln!(
                    "  {l:3} {:8} {:8} {:8} {:5.1}",
                    s.hits,
                    s.misses,
                    s.evictions,
                    100.0 * s.hit_rate()
                );
            }
        }
    }
}
