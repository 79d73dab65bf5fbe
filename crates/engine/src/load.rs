//! Loading a model the way the user asked: compute pool, streaming tier, memory plan.
//!
//! Owns: [`LoadOptions`] (what `run`, `bench`, `perplexity` and `serve` share), the
//! memory plan that checks an expert-cache budget (and resident layers) against what this
//! machine can spare, the minimum-budget check, locking the resident weights in RAM
//! (everything outside the streamable groups, so a table meant to stay on disk is never
//! locked), and [`Loaded`]: the model, its pool and the streaming tier's handle. Messages
//! about what is in effect are returned as [`Loaded::notes`] for the caller to print.
//! Also picks the packed-experts sidecar ([`PackChoice`]), warms the cache from a
//! popularity profile (`--preload-profile`), checks that the KV cache of every sequence
//! the caller will run at once (`serve --parallel`) fits, and attaches the device
//! ([`crate::device`]) last, so every command loads through this one path.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use sluice_io::IoConfig;
use sluice_models::Model;

pub use crate::weights::WeightLoad;
use sluice_tier::{
    open_ple, parse_size, PackFile, PleIo, PleOptions, PleSource, PolicyKind, Profile, SizeSpec,
    StreamConfig, StreamingExperts,
};

use crate::device::{Cuda, Device};
use crate::EngineError;

/// How big the expert cache may be.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Budget {
    /// What this machine can spare after the resident weights and the KV cache, keeping
    /// a reserve of 10% or 1 GiB.
    Auto,
    /// Bytes, or a percentage of the routed-expert bytes.
    Size(SizeSpec),
}

impl std::str::FromStr for Budget {
    type Err = String;
    fn from_str(s: &str) -> Result<Budget, String> {
        if s == "auto" {
            return Ok(Budget::Auto);
        }
        parse_size(s).map(Budget::Size).map_err(|e| e.to_string())
    }
}

/// Whether router lookahead is on when neither `--lookahead` nor `--no-lookahead` is given.
/// Off: on a quiet machine (GLM-5.3-Flash 10-layer cut, cold, 2 threads) decode was
/// 2.54-2.90 tok/s with it against 2.96-3.02 without (README, "Router lookahead").
pub const LOOKAHEAD_DEFAULT: bool = false;

/// Streaming of routed experts from the SSD.
#[derive(Debug, Clone)]
pub struct StreamOptions {
    pub budget: Budget,
    /// The text the user gave for the budget (for messages).
    pub budget_text: String,
    pub policy: PolicyKind,
    /// The first N MoE layers' experts are read at start and never evicted.
    pub resident_layers: usize,
    pub io: IoConfig,
    /// Certain prefetch: read the experts of hash-routed layers (known from the token ids)
    /// before the layers run, for the whole prompt at the start of prefill and for each
    /// token in decode. Never changes a result (`--no-hash-prefetch` turns it off).
    pub hash_prefetch: bool,
    /// Router lookahead (`--lookahead` / `--no-lookahead`): read the experts layer L+1's
    /// router picks from layer L's MoE input while L computes. Never changes a result.
    pub lookahead: bool,
    /// Packed-experts sidecar (`sluice pack`): one read per expert.
    pub pack: PackChoice,
    /// Warm the cache at start from this popularity profile (`cache-sim --write-profile`).
    pub preload_profile: Option<PathBuf>,
}

/// Which packed-experts sidecar to read experts from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum PackChoice {
    /// `MODEL.gguf.slpack` next to the model, if it exists (a mismatched one is refused).
    #[default]
    Auto,
    /// Never: read each matrix from the model file.
    Off,
    /// This file (it must exist and match the model).
    File(PathBuf),
}

/// Everything needed to load a model.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub path: PathBuf,
    /// Compute threads (0 = the number of physical cores).
    pub threads: usize,
    /// Context the caller plans for (the memory plan counts its KV cache).
    pub ctx: usize,
    /// Sequences holding a KV cache at once (`serve --parallel`; 1 elsewhere): the memory
    /// plan counts the KV cache and state of each.
    pub sequences: usize,
    /// Stream routed experts (None = read them through the memory map).
    pub stream: Option<StreamOptions>,
    /// Record every token's routing to this file.
    pub record_routing: Option<PathBuf>,
    /// How a per-layer-embedding row table (qwen4exp's n-gram table) is read.
    pub ple: PleOptions,
    /// Where the model computes (`--gpu`).
    pub device: Device,
    /// How the weights read through the memory map are held on the CPU (`--weight-load`).
    pub weight_load: WeightLoad,
}

/// A loaded model with its compute pool.
pub struct Loaded {
    pub model: Model,
    pub pool: rayon::ThreadPool,
    /// A [`crate::session::Session`] computes in `pool` (others get their own pools).
    pub(crate) pool_leased: std::sync::atomic::AtomicBool,
    pub threads: usize,
    pub load_secs: f64,
    /// The streaming tier, when experts stream (kept for statistics).
    pub streaming: Option<Arc<StreamingExperts>>,
    /// What is in effect, one line each (budget, backend, O_DIRECT as really used, locks).
    pub notes: Vec<String>,
    /// The row-table reader (`--ple-io`), when the model has such a table.
    pub ple: Option<Arc<dyn PleSource>>,
    /// The CUDA backend the model computes on (`--gpu`, when a usable GPU was found).
    pub gpu: Option<Cuda>,
}

/// What this machine can give the expert cache.
#[derive(Debug, Clone, Copy)]
pub struct MemoryPlan {
    pub available: u64,
    /// Bytes of the file outside the streamable groups (what stays resident).
    pub resident: u64,
    /// Experts of `--resident-layers`, pinned outside the budget.
    pub resident_layers: u64,
    /// The KV cache at the planned context plus the fixed state
    /// (`ModelConfig::state_bytes`: recurrent states, attention windows) of every sequence.
    pub kv: u64,
    /// How many sequences `kv` counts.
    pub sequences: usize,
    /// available - resident - resident layers - KV: the most a cache may take.
    pub available_for_cache: u64,
    /// `auto`: that, minus a reserve of 10% or 1 GiB for everything else.
    pub auto_budget: u64,
}

impl MemoryPlan {
    /// MemAvailable minus what the rest of a one-sequence run needs.
    pub fn for_model(
        model: &Model,
        ctx: usize,
        resident_layers: usize,
    ) -> Result<MemoryPlan, EngineError> {
        Self::for_sequences(model, ctx, 1, resident_layers)
    }

    /// MemAvailable minus what the rest of the run needs, with `sequences` KV caches.
    pub fn for_sequences(
        model: &Model,
        ctx: usize,
        sequences: usize,
        resident_layers: usize,
    ) -> Result<MemoryPlan, EngineError> {
        let meminfo = std::fs::read_to_string("/proc/meminfo")
            .map_err(|e| EngineError::Memory(format!("cannot read /proc/meminfo: {e}")))?;
        let avail_kib: u64 = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .ok_or_else(|| EngineError::Memory("no MemAvailable in /proc/meminfo".into()))?;
        let available = avail_kib * 1024;
        let resident = resident_bytes(model);
        let pinned_layers: u64 = model
            .groups
            .experts
            .layers
            .iter()
            .flatten()
            .take(resident_layers)
            .map(|l| l.unit_bytes() * l.n_units as u64)
            .sum();
        // Each sequence: its KV rows for the planned context plus its fixed state.
        let kv = kv_per_sequence(model, ctx).saturating_mul(sequences.max(1) as u64);
        let reserve = (available / 10).max(1 << 30);
        let available_for_cache = available.saturating_sub(resident + pinned_layers + kv);
        Ok(MemoryPlan {
            available,
            resident,
            resident_layers: pinned_layers,
            kv,
            sequences: sequences.max(1),
            available_for_cache,
            auto_budget: available_for_cache.saturating_sub(reserve),
        })
    }

    /// " of N sequences" when the plan counts more than one (for messages).
    fn of_sequences(&self) -> String {
        if self.sequences > 1 {
            format!(" of {} sequences", self.sequences)
        } else {
            String::new()
        }
    }

    /// Refuse a plan whose KV caches alone do not fit: in what MemAvailable leaves after
    /// the resident weights and resident layers when experts stream (those are locked in
    /// RAM), in MemAvailable otherwise (the weights are page cache the KV may displace).
    /// The message says what the sequences need, each and together.
    pub fn check_kv(&self, model: &Model, ctx: usize, streaming: bool) -> Result<(), EngineError> {
        let locked = if streaming {
            self.resident + self.resident_layers
        } else {
            0
        };
        let spare = self.available.saturating_sub(locked);
        if self.kv <= spare {
            return Ok(());
        }
        let positions = ctx.min(model.cfg.n_ctx_train);
        let each = kv_per_sequence(model, ctx);
        let after = if streaming {
            format!(
                " after {} resident weights and {} resident layers",
                human(self.resident),
                human(self.resident_layers)
            )
        } else {
            String::new()
        };
        let (flag, what) = if self.sequences > 1 {
            (
                "--parallel",
                format!(
                    "{}: the KV cache and state of {} sequences of {positions} positions need {} ({} each); this machine has {} available{after}, {} short; lower --parallel or --ctx",
                    self.sequences,
                    self.sequences,
                    human(self.kv),
                    human(each),
                    human(spare),
                    human(self.kv - spare)
                ),
            )
        } else {
            (
                "--ctx",
                format!(
                    "{ctx}: the KV cache and state of {positions} positions need {}; this machine has {} available{after}, {} short; lower --ctx",
                    human(self.kv),
                    human(spare),
                    human(self.kv - spare)
                ),
            )
        };
        Err(EngineError::Option { flag, what })
    }
}

/// One sequence's KV cache at `ctx` positions (capped at the trained context) plus its
/// fixed state.
pub fn kv_per_sequence(model: &Model, ctx: usize) -> u64 {
    let c = &model.cfg;
    c.kv_bytes_per_pos
        .saturating_mul(ctx.min(c.n_ctx_train) as u64)
        .saturating_add(c.state_bytes)
}

/// Bytes of the model file outside the streamable groups.
pub fn resident_bytes(model: &Model) -> u64 {
    model
        .gguf
        .file_size
        .saturating_sub(model.groups.total_bytes())
}

/// The most reader threads `--io-threads` may ask for: reads are IO-bound, so more than
/// the cores can help, but each thread costs a stack and a file descriptor's queue.
pub const MAX_IO_THREADS: usize = 256;
/// The most reads in flight `--io-depth` may ask for (io_uring's ring size).
pub const MAX_IO_DEPTH: usize = 4096;

/// The most compute threads this machine is given: 4 x its logical CPUs (more only adds
/// contention; a typo such as `-t 100000` would hang starting them).
pub fn max_compute_threads() -> usize {
    4 * logical_cpus()
}

fn logical_cpus() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

impl LoadOptions {
    /// Refuse thread counts and queue depths this machine cannot use (before any work).
    pub fn check(&self) -> Result<(), EngineError> {
        let max = max_compute_threads();
        if self.threads > max {
            return Err(EngineError::Option {
                flag: "-t",
                what: format!(
                    "{}: this machine has {} physical cores ({} logical CPUs); at most {max} compute threads (4 x logical CPUs)",
                    self.threads,
                    sluice_models::threads::physical_cores(),
                    logical_cpus()
                ),
            });
        }
        if let Some(s) = &self.stream {
            if s.io.threads > MAX_IO_THREADS {
                return Err(EngineError::Option {
                    flag: "--io-threads",
                    what: format!(
                        "{}: at most {MAX_IO_THREADS} reader threads (this machine has {} logical CPUs)",
                        s.io.threads,
                        logical_cpus()
                    ),
                });
            }
            if s.io.depth > MAX_IO_DEPTH {
                return Err(EngineError::Option {
                    flag: "--io-depth",
                    what: format!("{}: at most {MAX_IO_DEPTH} reads in flight", s.io.depth),
                });
            }
        }
        Ok(())
    }

    /// Load the model, check that the KV caches fit, start the compute pool, set up
    /// streaming and routing traces, then the device.
    pub fn load(&self) -> Result<Loaded, EngineError> {
        self.check()?;
        let t0 = Instant::now();
        let mut model = Model::load(&self.path)?;
        let resident_layers = self.stream.as_ref().map_or(0, |s| s.resident_layers);
        MemoryPlan::for_sequences(&model, self.ctx, self.sequences, resident_layers)?.check_kv(
            &model,
            self.ctx,
            self.stream.is_some(),
        )?;
        let threads = if self.threads == 0 {
            sluice_models::threads::physical_cores()
        } else {
            self.threads
        };
        let pool = sluice_models::threads::compute_pool(threads)
            .map_err(|source| EngineError::Threads { threads, source })?;
        let mut notes = Vec::new();
        let mut ple = None;
        // Row tables read through their own reader, never through the map.
        let mut read_elsewhere = Vec::new();
        for table in model.groups.row_tables.clone() {
            let (src, note) = open_ple(&self.path, &table, &self.ple)?;
            let src: Arc<dyn PleSource> = Arc::from(src);
            if model.set_row_source(&table.name, src.clone()) {
                notes.push(note);
                ple = Some(src);
                read_elsewhere.push(table.range());
            }
        }
        let streaming = match &self.stream {
            None => None,
            Some(s) => Some(self.open_streaming(&mut model, s, &mut notes)?),
        };
        if let Some(path) = &self.record_routing {
            if model.cfg.n_expert == 0 {
                return Err(EngineError::Option {
                    flag: "--record-routing",
                    what: format!("{} has no routed experts", self.path.display()),
                });
            }
            model
                .record_routing(path)
                .map_err(|e| EngineError::Option {
                    flag: "--record-routing",
                    what: e.to_string(),
                })?;
        }
        let mut loaded = Loaded {
            model,
            pool,
            pool_leased: Default::default(),
            threads,
            load_secs: 0.0,
            streaming,
            notes,
            ple,
            gpu: None,
        };
        if let Device::Gpu(g) = &self.device {
            loaded.gpu = crate::device::attach(&mut loaded, g, self.ctx)?;
        }
        // On the GPU the weights are in VRAM: a RAM copy would only cost time and memory.
        if self.weight_load == WeightLoad::Copy && loaded.gpu.is_none() {
            let plan = MemoryPlan::for_sequences(
                &loaded.model,
                self.ctx,
                self.sequences,
                resident_layers,
            )?;
            let note = crate::weights::copy_resident(
                &mut loaded.model,
                loaded.streaming.is_some(),
                &read_elsewhere,
                plan.available,
                plan.kv,
            );
            loaded.notes.push(note);
        }
        loaded.load_secs = t0.elapsed().as_secs_f64();
        Ok(loaded)
    }

    fn open_streaming(
        &self,
        model: &mut Model,
        s: &StreamOptions,
        notes: &mut Vec<String>,
    ) -> Result<Arc<StreamingExperts>, EngineError> {
        let flag = "--expert-cache";
        let size = &s.budget_text;
        if model.cfg.n_expert == 0 || model.groups.experts.is_empty() {
            return Err(EngineError::Option {
                flag,
                what: format!(
                    "{} ({}) has no routed experts to stream",
                    self.path.display(),
                    model.cfg.arch
                ),
            });
        }
        let n_moe = model.groups.experts.layers.iter().flatten().count();
        if s.resident_layers > n_moe {
            return Err(EngineError::Option {
                flag: "--resident-layers",
                what: format!(
                    "{} is more than the model's {n_moe} layers with routed experts",
                    s.resident_layers
                ),
            });
        }
        let total = model.groups.experts.total_bytes();
        let min = StreamingExperts::min_budget(&model.groups.experts, model.cfg.n_expert_used);
        let mut plan =
            MemoryPlan::for_sequences(model, self.ctx, self.sequences, s.resident_layers)?;
        if self.ple.io == PleIo::Ram {
            // A RAM copy of the row tables is resident too (other modes leave them on disk).
            let t: u64 = model
                .groups
                .row_tables
                .iter()
                .map(|r| r.row_bytes * r.n_rows)
                .sum();
            plan.resident += t;
            plan.available_for_cache = plan.available_for_cache.saturating_sub(t);
            plan.auto_budget = plan.auto_budget.saturating_sub(t);
        }
        let budget = match s.budget {
            Budget::Auto => {
                notes.push(format!(
                    "expert cache auto: {} available - {} resident weights - {} resident layers - {} KV + state{} - reserve = {}",
                    human(plan.available),
                    human(plan.resident),
                    human(plan.resident_layers),
                    human(plan.kv),
                    plan.of_sequences(),
                    human(plan.auto_budget)
                ));
                plan.auto_budget
            }
            Budget::Size(spec) => spec.resolve(total),
        };
        // A cache bigger than what the machine can spare would push the resident weights
        // and everything else out of memory (or get the process killed) long before it fills.
        let needs = budget.min(total);
        if s.budget != Budget::Auto && needs > plan.available_for_cache
            || s.budget == Budget::Auto && plan.resident_layers > 0 && needs < min
        {
            return Err(EngineError::Option {
                flag,
                what: format!(
                    "{size}: {} is more than this machine can spare for the cache ({}: {} available - {} resident weights - {} experts of --resident-layers - {} KV + state{}); use `auto`, a smaller size or fewer resident layers",
                    human(needs),
                    human(plan.available_for_cache),
                    human(plan.available),
                    human(plan.resident),
                    human(plan.resident_layers),
                    human(plan.kv),
                    plan.of_sequences()
                ),
            });
        }
        if budget < min {
            // Rounded sizes can read the same ("864.00 KiB is below the minimum 864.00
            // KiB" one byte under): then the budget is said in bytes too.
            let (b, m) = (human(budget), human(min));
            let b = if b == m {
                format!("{b} ({budget} bytes)")
            } else {
                b
            };
            return Err(EngineError::Option {
                flag,
                what: format!(
                    "{size}: {b} is below the minimum {m} ({min} bytes: one layer's top-{} experts must fit at once)",
                    model.cfg.n_expert_used
                ),
            });
        }
        let cfg = StreamConfig {
            budget: budget.min(total.max(min)),
            policy: s.policy,
            resident_layers: s.resident_layers,
            io: s.io.clone(),
        };
        notes.push(lock_resident(model));
        let pack_path = match &s.pack {
            PackChoice::Off => None,
            PackChoice::File(p) => Some(p.clone()),
            PackChoice::Auto => {
                Some(sluice_tier::pack::default_path(&self.path)).filter(|p| p.exists())
            }
        };
        let pack = match &pack_path {
            None => None,
            Some(p) => {
                let pf = PackFile::open(
                    p,
                    &self.path,
                    model.map.bytes(),
                    model.gguf.data_offset,
                    &model.groups.experts,
                )
                .map_err(|e| EngineError::Option {
                    flag: "--pack",
                    what: e.to_string(),
                })?;
                notes.push(format!(
                    "packed experts: {} (one read per expert)",
                    p.display()
                ));
                Some(pf)
            }
        };
        let st = Arc::new(StreamingExperts::open_packed(
            &self.path,
            &model.groups.experts,
            model.cfg.n_expert_used,
            &cfg,
            pack.as_ref(),
        )?);
        st.set_certain_prefetch(s.hash_prefetch);
        st.set_lookahead(s.lookahead);
        if let Some(n) = std::env::var("SLUICE_LOOKAHEAD_MAX_DEMAND")
            .ok()
            .and_then(|v| v.parse().ok())
        {
            st.set_lookahead_max_demand(n);
        }
        if let Some(p) = &s.preload_profile {
            let opt = |what: String| EngineError::Option {
                flag: "--preload-profile",
                what,
            };
            let prof = Profile::read(p).map_err(|e| opt(e.to_string()))?;
            prof.check(p, model.cfg.n_layer as u32, model.cfg.n_expert as u32)
                .map_err(|e| opt(e.to_string()))?;
            let t0 = Instant::now();
            let (n, bytes) = st.preload(&prof)?;
            notes.push(format!(
                "preloaded {n} experts ({}) from {} in {:.2} s",
                human(bytes),
                p.display(),
                t0.elapsed().as_secs_f64()
            ));
        }
        let io = st.io_stats();
        notes.push(format!(
            "expert cache: {} of {} routed-expert bytes ({:.0}%), policy {}, io {}, {}{}",
            human(cfg.budget),
            human(total),
            100.0 * cfg.budget as f64 / total.max(1) as f64,
            cfg.policy.label(),
            st.io_stats_name(),
            if io.direct { "O_DIRECT" } else { "buffered" },
            if s.resident_layers > 0 {
                format!(
                    ", {} resident layers ({} read at start)",
                    s.resident_layers,
                    human(st.resident_read_bytes())
                )
            } else {
                String::new()
            }
        ));
        model.set_expert_source(Box::new(st.clone()));
        Ok(st)
    }
}

/// With streaming on, pin everything outside the streamable groups in RAM (mlock):
/// otherwise the memory the expert cache takes pushes it out of the page cache and every
/// token faults it back in from disk, unseen by the IO statistics. Returns the note.
fn lock_resident(model: &Model) -> String {
    let ranges = model
        .groups
        .resident_ranges(model.gguf.data_offset, model.gguf.file_size);
    let total: u64 = ranges.iter().map(|r| r.end - r.start).sum();
    let t0 = Instant::now();
    for r in &ranges {
        if let Err(e) = model.map.lock(r.start as usize..r.end as usize) {
            return format!(
                "warning: cannot lock the resident weights in RAM ({e}); they stay in the page cache and may be evicted under memory pressure (raise `ulimit -l`)"
            );
        }
    }
    format!(
        "resident weights: {} locked in RAM in {:.2} s",
        human(total),
        t0.elapsed().as_secs_f64()
    )
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
