//! Flags and helpers shared by the commands that load a model (run, perplexity, bench,
//! serve).
//!
//! Owns: [`ModelArgs`], the one typed set of loading flags every such command flattens in
//! (model, threads, context, batch, KV precision, [`DeviceArgs`], [`StreamArgs`],
//! [`PleArgs`]), and its translation into the engine's `LoadOptions`
//! ([`ModelArgs::options`]: the combinations that cannot work are refused there, naming the
//! flags, before any work); [`MeasureArgs`] (`--measure`, for the commands that time one
//! decode: run and bench); the input/output path checks; the `--stats` report.

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use sluice_engine::device::{Device, GpuOptions};
use sluice_engine::load::{
    resident_bytes, Budget, LoadOptions, PackChoice, StreamOptions, WeightLoad,
};
use sluice_engine::session::Session;
use sluice_engine::tier::{PleIo, PleOptions, PolicyKind};
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
    /// How the weights every token reads are held on the CPU: `copy` moves them out of
    /// the page cache into RAM with huge pages at load (faster decode; skipped with a note
    /// when they do not fit, and with --gpu), `mmap` reads them through the memory map.
    /// With --measure: mmap.
    #[arg(long = "weight-load", value_name = "HOW", default_value_t = WeightLoad::Copy)]
    pub weight_load: WeightLoad,
    #[command(flatten)]
    pub device: DeviceArgs,
    #[command(flatten)]
    pub stream: StreamArgs,
    #[command(flatten)]
    pub ple: PleArgs,
}

/// Where the model computes. The engine attaches the device while loading, so every
/// command prints the same line about it.
#[derive(clap::Args, Debug, Clone)]
pub struct DeviceArgs {
    /// Run on the GPU (CUDA, found at run time): the whole forward pass for qwen3moe,
    /// gemma3, glm-dsa, deepseek4, qwen4exp and glm5next (a plan past the kernels' limits:
    /// the weight products only), with weights in VRAM.
    /// Without a usable GPU sluice says why in one line and runs on the CPU.
    #[arg(long)]
    pub gpu: bool,
    /// With --gpu: keep routed experts in a VRAM cache of SIZE bytes (e.g. 8G), a hard
    /// budget over the RAM tier (--expert-cache) and the SSD; least recently used evicted.
    /// Without it, experts read through the memory map stay in VRAM once used (while free
    /// VRAM lasts) and streamed ones are copied to the GPU for each use.
    #[arg(long = "gpu-expert-cache", value_name = "SIZE", value_parser = parse_bytes)]
    pub gpu_expert_cache: Option<u64>,
}

impl DeviceArgs {
    /// The engine's device for these flags; `longest`: see [`GpuOptions::longest`].
    fn device(&self, longest: Option<usize>) -> Result<Device> {
        if let Some(b) = self.gpu_expert_cache {
            if !self.gpu {
                anyhow::bail!(
                    "--gpu-expert-cache needs --gpu ({} of VRAM asked for, without a GPU)",
                    human(b)
                );
            }
        }
        Ok(if self.gpu {
            Device::Gpu(GpuOptions {
                expert_cache: self.gpu_expert_cache,
                longest,
            })
        } else {
            Device::Cpu
        })
    }
}

/// `--measure`: honest decode numbers, for the commands that time one decode (run, bench).
#[derive(clap::Args, Debug, Clone)]
pub struct MeasureArgs {
    /// Honest decode numbers: drop the model's expert pages from the page cache at decode
    /// start and every --measure-every tokens, report residency, true storage reads and the
    /// rate corrected for the time spent invalidating.
    #[arg(long)]
    pub measure: bool,
    /// Tokens between page-cache invalidations in --measure mode (0 = only at the start).
    #[arg(
        long = "measure-every",
        value_name = "N",
        default_value_t = 16,
        requires = "measure"
    )]
    pub measure_every: usize,
}

impl MeasureArgs {
    /// `--measure` drops the model's pages from the page cache to measure storage reads:
    /// the weights must then be read through the memory map, not copied into RAM.
    pub fn adjust(&self, model: &mut ModelArgs) {
        if self.measure {
            model.weight_load = WeightLoad::Map;
        }
    }
}

/// `--ple-io`: how a per-layer-embedding row table (qwen4exp's n-gram table) is read.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum PleIoArg {
    /// Read once at load and locked in RAM.
    Ram,
    /// Through the page cache (memory map), with optional row hints.
    Mmap,
    /// Unbuffered (O_DIRECT) reads at queue depth, with a row cache.
    Direct,
}

impl PleIoArg {
    fn from_lib(m: PleIo) -> PleIoArg {
        match m {
            PleIo::Ram => PleIoArg::Ram,
            PleIo::Mmap => PleIoArg::Mmap,
            PleIo::Direct => PleIoArg::Direct,
        }
    }
    fn to_lib(self) -> PleIo {
        match self {
            PleIoArg::Ram => PleIo::Ram,
            PleIoArg::Mmap => PleIo::Mmap,
            PleIoArg::Direct => PleIo::Direct,
        }
    }
}

impl std::fmt::Display for PleIoArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.to_lib().name())
    }
}

fn ple_default() -> PleOptions {
    PleOptions::default()
}

/// Reading a per-layer-embedding row table that stays on disk (qwen4exp). Defaults come
/// from the library (`PleOptions::default()`).
#[derive(clap::Args, Debug, Clone)]
pub struct PleArgs {
    /// How PLE rows are read: ram (locked copy), mmap (page cache), direct (O_DIRECT at depth).
    #[arg(long = "ple-io", value_enum, default_value_t = PleIoArg::from_lib(ple_default().io))]
    pub ple_io: PleIoArg,
    /// mmap mode: no WILLNEED hints for the rows of the next tokens.
    #[arg(long = "no-ple-prefetch")]
    pub no_ple_prefetch: bool,
    /// direct mode: PLE reads in flight.
    #[arg(long = "ple-inflight", value_name = "N", default_value_t = ple_default().inflight)]
    pub ple_inflight: usize,
    /// direct mode: row cache size (e.g. 64M; 0 = off).
    #[arg(long = "ple-row-cache", value_name = "SIZE", value_parser = parse_bytes,
          default_value_t = ple_default().row_cache_bytes)]
    pub ple_row_cache: u64,
}

fn parse_bytes(s: &str) -> std::result::Result<u64, String> {
    sluice_engine::tier::parse_size_bytes(s, None).map_err(|e| e.to_string())
}

/// `--io-inflight`: a byte size, "0" for no cap.
fn parse_inflight(s: &str) -> std::result::Result<usize, String> {
    if s.trim() == "0" {
        return Ok(0);
    }
    let b = parse_bytes(s)?;
    usize::try_from(b).map_err(|_| format!("{s}: too large"))
}

impl PleArgs {
    pub fn options(&self) -> PleOptions {
        PleOptions {
            io: self.ple_io.to_lib(),
            prefetch: !self.no_ple_prefetch,
            inflight: self.ple_inflight.max(1),
            row_cache_bytes: self.ple_row_cache,
        }
    }
}

/// `on` / `off`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnOff {
    On,
    Off,
}

impl OnOff {
    fn from_bool(b: bool) -> OnOff {
        if b {
            OnOff::On
        } else {
            OnOff::Off
        }
    }
}

impl std::fmt::Display for OnOff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if *self == OnOff::On { "on" } else { "off" })
    }
}

fn io_default() -> IoConfig {
    IoConfig::default()
}

/// SSD streaming of routed experts (MoE models). Without --expert-cache the experts are
/// read through the memory map like every other tensor (the OS decides what stays).
/// The flags that shape the streaming tier need --expert-cache (clap refuses them without
/// it, naming it); --stats and --record-routing apply either way.
/// Defaults come from the library (`IoConfig::default()`, `PolicyKind::default()`).
#[derive(clap::Args, Debug, Clone)]
pub struct StreamArgs {
    /// Stream routed experts from the SSD through a RAM cache of SIZE bytes (e.g. 8G,
    /// 512MiB, 25% of the experts, or `auto` = what this machine can spare after the
    /// resident weights and the KV cache, keeping a reserve). A hard budget: cached plus
    /// in-flight expert bytes never exceed it.
    #[arg(long = "expert-cache", value_name = "SIZE", value_parser = parse_budget)]
    pub expert_cache: Option<(Budget, String)>,
    /// Eviction policy: xl (default: next, with each layer's next selection predicted from
    /// its previous set and, for the next 2 layers, from the current token's sets; xl:J for
    /// J layers), next (evict the expert whose next selection is expected farthest, from
    /// rates halving every 64 tokens; next:N sets N), lru, lfu (selection counts halved
    /// every 16 tokens; lfu:N sets N), lru2.
    #[arg(long = "cache-policy", value_name = "POLICY", default_value_t = PolicyKind::default(), requires = "expert_cache")]
    pub cache_policy: PolicyKind,
    /// Pin the first N MoE layers' experts in RAM (read once at start; not counted in
    /// the cache budget, counted in the memory check).
    #[arg(long = "resident-layers", value_name = "N", default_value_t = 0)]
    pub resident_layers: usize,
    /// IO backend for expert reads: uring (falls back to pread if refused), pread, mmap.
    #[arg(long = "io", value_name = "BACKEND", default_value_t = io_default().backend, requires = "expert_cache")]
    pub io: Backend,
    /// O_DIRECT expert reads (bypass the page cache); if the file system refuses, sluice
    /// says so once and reads buffered.
    #[arg(long = "direct-io", value_enum, default_value_t = OnOff::from_bool(io_default().direct), requires = "expert_cache")]
    pub direct_io: OnOff,
    /// Reads in flight for io_uring.
    #[arg(long = "io-depth", value_name = "N", default_value_t = io_default().depth, requires = "expert_cache")]
    pub io_depth: usize,
    /// Bytes in flight for io_uring (K/M/G suffixes, powers of 1024; 0 = only --io-depth
    /// caps it). A small cap makes the disk finish one expert's reads before the next one's,
    /// so computing on the first landed expert overlaps the later reads. Logits are the
    /// same either way.
    #[arg(long = "io-inflight", value_name = "SIZE", value_parser = parse_inflight,
          default_value_t = io_default().inflight_bytes,
          requires = "expert_cache")]
    pub io_inflight: usize,
    /// Reader threads for the pread and mmap backends.
    #[arg(long = "io-threads", value_name = "N", default_value_t = io_default().threads, requires = "expert_cache")]
    pub io_threads: usize,
    /// Leave expert reads at normal IO priority (default: best-effort high priority).
    #[arg(long = "no-io-priority", requires = "expert_cache")]
    pub no_io_priority: bool,
    /// Do not prefetch the experts of hash-routed layers (DeepSeek V4), which follow from
    /// the token ids: by default they are read for the whole prompt at the start of
    /// prefill and for each token before layer 0 runs. For A/B; logits are the same.
    #[arg(long = "no-hash-prefetch", requires = "expert_cache")]
    pub no_hash_prefetch: bool,
    /// Router lookahead (decode): during layer L, apply layer L+1's router to layer L's
    /// MoE input and read the predicted experts while L computes, once L's own reads are
    /// issued, without evicting what the current layer holds. For A/B; logits are the same.
    #[arg(
        long = "lookahead",
        conflicts_with = "no_lookahead",
        requires = "expert_cache"
    )]
    pub lookahead: bool,
    /// Turn router lookahead off (see --lookahead).
    #[arg(long = "no-lookahead", requires = "expert_cache")]
    pub no_lookahead: bool,
    /// Packed-experts sidecar written by `sluice pack` (one aligned read per expert).
    /// Default: MODEL.gguf.slpack next to the model when it exists; a sidecar that does
    /// not match the model is refused.
    #[arg(
        long = "pack",
        value_name = "FILE",
        conflicts_with = "no_pack",
        requires = "expert_cache"
    )]
    pub pack: Option<PathBuf>,
    /// Read experts from the model file even if a packed sidecar is next to it.
    #[arg(long = "no-pack", requires = "expert_cache")]
    pub no_pack: bool,
    /// Warm the expert cache at start from a popularity profile (`sluice cache-sim TRACE
    /// --write-profile FILE`): its most popular experts are read while they fit in the
    /// budget, and the eviction policy starts from its rates.
    #[arg(
        long = "preload-profile",
        value_name = "FILE",
        requires = "expert_cache"
    )]
    pub preload_profile: Option<PathBuf>,
    /// Print cache, IO and stall statistics (per layer too) at the end: of the run, the
    /// benchmark or the evaluation; `serve`: of everything served, after the drain.
    #[arg(long)]
    pub stats: bool,
    /// Write every token's chosen experts to FILE (replay it with `sluice cache-sim`);
    /// `serve`: written at exit, with --parallel 1 (one sequence's routing).
    #[arg(long = "record-routing", value_name = "FILE")]
    pub record_routing: Option<PathBuf>,
}

fn parse_budget(s: &str) -> std::result::Result<(Budget, String), String> {
    s.parse::<Budget>().map(|b| (b, s.to_string()))
}

/// A loaded model with its compute pool (and its device, `gpu`, through the engine's).
pub struct Loaded {
    pub inner: sluice_engine::load::Loaded,
}

impl std::ops::Deref for Loaded {
    type Target = sluice_engine::load::Loaded;
    fn deref(&self) -> &Self::Target {
        &self.inner
    }
}

impl std::ops::DerefMut for Loaded {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.inner
    }
}

impl ModelArgs {
    /// The engine's load options for these flags, for a caller that runs `sequences` at
    /// once (`serve --parallel`; 1 elsewhere) whose sequences never pass `longest` tokens
    /// when that is less than `--ctx` (`bench`: its prompt and generation lengths). Flags
    /// that cannot work together, a model path that is not a regular file and an output
    /// file that cannot be written are refused here, naming them, before any work.
    pub fn options(&self, sequences: usize, longest: Option<usize>) -> Result<LoadOptions> {
        if self.batch == 0 {
            anyhow::bail!("--batch must be at least 1");
        }
        let s = &self.stream;
        if s.resident_layers > 0 && s.expert_cache.is_none() {
            anyhow::bail!(
                "--resident-layers {} needs --expert-cache (without it every expert is read through the memory map)",
                s.resident_layers
            );
        }
        let device = self.device.device(longest)?;
        if let Err(e) = std::fs::metadata(&self.model) {
            if e.kind() == std::io::ErrorKind::NotFound {
                anyhow::bail!("{}: no such file", self.model.display());
            }
            anyhow::bail!("{}: {e}", self.model.display());
        }
        regular_file(&self.model)?;
        if let Some(p) = &s.record_routing {
            check_output_file(p, "--record-routing")?;
        }
        Ok(LoadOptions {
            path: self.model.clone(),
            threads: self.threads,
            ctx: self.ctx,
            sequences,
            stream: s.expert_cache.as_ref().map(|(budget, text)| StreamOptions {
                budget: *budget,
                budget_text: text.clone(),
                policy: s.cache_policy,
                resident_layers: s.resident_layers,
                io: IoConfig {
                    backend: s.io,
                    direct: s.direct_io == OnOff::On,
                    depth: s.io_depth.max(1),
                    inflight_bytes: s.io_inflight,
                    threads: s.io_threads.max(1),
                    high_priority: !s.no_io_priority,
                },
                hash_prefetch: !s.no_hash_prefetch,
                lookahead: if s.no_lookahead {
                    false
                } else {
                    s.lookahead || sluice_engine::load::LOOKAHEAD_DEFAULT
                },
                pack: match (&s.pack, s.no_pack) {
                    (_, true) => PackChoice::Off,
                    (Some(p), _) => PackChoice::File(p.clone()),
                    (None, false) => PackChoice::Auto,
                },
                preload_profile: s.preload_profile.clone(),
            }),
            record_routing: s.record_routing.clone(),
            ple: self.ple.options(),
            device,
            weight_load: self.weight_load,
        })
    }

    pub fn load(&self) -> Result<Loaded> {
        self.load_for(None)
    }

    /// [`Self::load`] for a caller whose sequences never pass `longest` tokens (`bench`),
    /// see [`Self::options`]. Prints the load's notes (what is in effect, the device).
    pub fn load_for(&self, longest: Option<usize>) -> Result<Loaded> {
        let inner = self.options(1, longest)?.load()?;
        for n in &inner.notes {
            eprintln!("{n}");
        }
        Ok(Loaded { inner })
    }
}

/// Whether `e` comes from writing to a stdout whose reader has gone (EPIPE): `main` then
/// exits quietly instead of printing `error: Broken pipe`.
pub fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// Writes `text` to stdout and flushes it, returning the error (`print!` panics when the
/// reader has closed the pipe).
pub fn emit(text: &str) -> std::io::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()
}

/// A command stopped by Ctrl-C (after saying so): `main` exits 130 without another line.
#[derive(Debug)]
pub struct Interrupted;

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("interrupted")
    }
}

impl std::error::Error for Interrupted {}

/// A command ended by SIGTERM or SIGHUP (after finishing what it was writing): `main`
/// exits 143 without another line.
#[derive(Debug)]
pub struct Terminated;

impl std::fmt::Display for Terminated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("terminated")
    }
}

impl std::error::Error for Terminated {}

/// The most `perplexity -f` (and other text inputs) will read: far more than any
/// evaluation corpus, far less than this machine's memory.
pub const MAX_TEXT_BYTES: u64 = 1 << 30;

/// Checks that `path` is a regular file (not a FIFO, device, socket or directory, which
/// could block or never end) and returns its size. Errors name the path and say what it is.
pub fn regular_file(path: &Path) -> Result<u64> {
    let md = std::fs::metadata(path).with_context(|| format!("{}", path.display()))?;
    if !md.is_file() {
        let ft = md.file_type();
        use std::os::unix::fs::FileTypeExt;
        let what = if ft.is_dir() {
            "a directory"
        } else if ft.is_fifo() {
            "a FIFO"
        } else if ft.is_char_device() || ft.is_block_device() {
            "a device"
        } else if ft.is_socket() {
            "a socket"
        } else {
            "a special file"
        };
        anyhow::bail!("{}: not a regular file ({what})", path.display());
    }
    Ok(md.len())
}

/// Checks, before any work, that `path` can be written by the output flag `flag`: an
/// existing regular file (opened for append to prove it), or a new name in an existing
/// directory. Nothing is created.
pub fn check_output_file(path: &Path, flag: &str) -> Result<()> {
    match std::fs::metadata(path) {
        Ok(md) if !md.is_file() => {
            let what = if md.is_dir() {
                "a directory"
            } else {
                "a special file"
            };
            anyhow::bail!(
                "{flag} {}: not a regular file ({what}); give a file name",
                path.display()
            )
        }
        Ok(_) => {
            std::fs::OpenOptions::new()
                .append(true)
                .open(path)
                .with_context(|| format!("{flag} {}: cannot write", path.display()))?;
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let parent = match path.parent() {
                Some(p) if !p.as_os_str().is_empty() => p,
                _ => Path::new("."),
            };
            if !parent.is_dir() {
                anyhow::bail!(
                    "{flag} {}: directory {} does not exist",
                    path.display(),
                    parent.display()
                );
            }
            Ok(())
        }
        Err(e) => anyhow::bail!("{flag} {}: {e}", path.display()),
    }
}

/// Read a UTF-8 text file of at most [`MAX_TEXT_BYTES`]: regular files only, the first
/// invalid byte named.
pub fn read_text_file(path: &Path) -> Result<String> {
    let size = regular_file(path)?;
    if size > MAX_TEXT_BYTES {
        anyhow::bail!(
            "{}: {} is more than the {} sluice reads as text",
            path.display(),
            human(size),
            human(MAX_TEXT_BYTES)
        );
    }
    let mut bytes = Vec::with_capacity(size as usize);
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_TEXT_BYTES + 1).read_to_end(&mut bytes))
        .with_context(|| format!("{}: cannot read", path.display()))?;
    if bytes.len() as u64 > MAX_TEXT_BYTES {
        anyhow::bail!(
            "{}: grew past {} while being read",
            path.display(),
            human(MAX_TEXT_BYTES)
        );
    }
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{}: not UTF-8 text: invalid byte at byte {}",
            path.display(),
            e.utf8_error().valid_up_to()
        )
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

pub use sluice_engine::load::human;

pub use sluice_engine::load::human_with;

impl Loaded {
    /// Start `--measure` for a decode (None when the flag is off).
    pub fn start_measure(&self, args: &MeasureArgs) -> Result<Option<crate::measure::Measure<'_>>> {
        if !args.measure {
            return Ok(None);
        }
        let ranges = crate::measure::expert_ranges(&self.model);
        crate::measure::Measure::start(&self.model.map, ranges, args.measure_every).map(Some)
    }

    /// A new sequence with the context, KV precision and batch the flags ask for.
    pub fn session(&self, args: &ModelArgs) -> Session<'_> {
        Session::new(&self.inner, args.ctx, args.kv_f32, args.batch)
    }

    /// Close the routing trace, if one is being recorded.
    pub fn finish(&mut self) -> Result<()> {
        finish_routing(&mut self.inner)
    }
}

/// Close `l`'s routing trace, if one is being recorded, saying where it was written.
pub fn finish_routing(l: &mut sluice_engine::load::Loaded) -> Result<()> {
    if let Some(p) = l.model.finish_routing()? {
        eprintln!("routing trace written to {}", p.display());
    }
    Ok(())
}

/// `--stats` on the engine's loaded model, for run, bench, perplexity and (after the
/// drain) serve.
pub trait PrintStats {
    /// Print the device's, the PLE reader's and the expert tier's counters since load;
    /// `wall_secs` is the wall time the disk-busy fraction refers to.
    fn print_stats(&self, wall_secs: f64);
}

impl PrintStats for sluice_engine::load::Loaded {
    fn print_stats(&self, wall_secs: f64) {
        if let Some(g) = &self.gpu {
            let s = g.stats();
            if s.forward_calls > 0 {
                eprintln!(
                    "gpu: {} forward passes on the GPU taking {:.2} s",
                    s.forward_calls,
                    s.forward_ns as f64 * 1e-9
                );
            }
            eprintln!(
                "gpu: {} products on the GPU in {} calls taking {:.2} s, {} on the CPU | resident weights {} in {} matrices | copied per use {} | activations {}",
                s.gpu_jobs,
                s.calls,
                s.busy_ns as f64 * 1e-9,
                s.cpu_jobs,
                human(s.resident_bytes),
                s.resident_mats,
                human(s.transient_bytes),
                human(s.act_bytes)
            );
            if s.expert_budget > 0 {
                let lookups = (s.expert_hits + s.expert_misses).max(1);
                eprintln!(
                    "gpu expert cache: budget {} | hits {} misses {} evictions {} hit rate {:.1}% | held {} (peak {}) | uploaded {}",
                    human(s.expert_budget),
                    s.expert_hits,
                    s.expert_misses,
                    s.expert_evictions,
                    100.0 * s.expert_hits as f64 / lookups as f64,
                    human(s.expert_bytes),
                    human(s.expert_peak),
                    human(s.expert_upload_bytes)
                );
            }
            if s.upload_bytes > 0 || s.pinned_ranges > 0 || s.pin_failures > 0 {
                eprintln!(
                    "gpu uploads (copy stream): {} at {:.2} GB/s, {:.1}% from page-locked memory, compute waited {:.2} s for them | host page-locked {} in {} ranges ({} refused, {:.2} s registering)",
                    human(s.upload_bytes),
                    s.upload_gbps(),
                    100.0 * s.upload_pinned_bytes as f64 / s.upload_bytes.max(1) as f64,
                    s.upload_wait_ns as f64 * 1e-9,
                    human(s.pinned_bytes),
                    s.pinned_ranges,
                    s.pin_failures,
                    s.pin_ns as f64 * 1e-9
                );
            }
            if s.staging_bytes > 0 {
                eprintln!(
                    "gpu staging ring: {} page-locked | {} of the uploads staged through it ({:.1}%)",
                    human(s.staging_bytes),
                    human(s.upload_staged_bytes),
                    100.0 * s.upload_staged_bytes as f64 / s.upload_bytes.max(1) as f64
                );
            }
        }
        if let Some(p) = &self.ple {
            let s = p.stats();
            eprintln!(
                "ple ({}): rows {} ({}) | row cache hits {} | reads issued {} ({}) | hints {} | waited {:.3} s",
                p.mode().name(),
                s.rows,
                human(s.bytes),
                s.cache_hits,
                s.reads,
                human(s.read_bytes),
                s.hints,
                s.wait_ns as f64 * 1e-9
            );
            if let Some(io) = s.io {
                eprintln!(
                    "ple io: syscalls {} | effective queue depth {:.1} | O_DIRECT {}",
                    io.tasks,
                    io.effective_queue_depth(),
                    io.direct
                );
            }
            if let Some(b) = s.device_read_bytes {
                eprintln!(
                    "ple device: {} read by the device since load (device-wide)",
                    human(b)
                );
            }
        }
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
        if ss.la_predicted > 0 {
            eprintln!(
                "lookahead (router of layer L+1 on layer L's MoE input): accuracy {:.1}% ({} of {} chosen units predicted) | reads issued {} ({}) | used by their layer {} ({:.1}% of issued) | wasted {} ({}) | already cached or in flight {} | left out: budget {}, disk busy until the layer ran {}",
                100.0 * ss.la_correct as f64 / ss.la_actual.max(1) as f64,
                ss.la_correct,
                ss.la_actual,
                ss.la_issued,
                human(ss.la_bytes),
                ss.la_hit,
                100.0 * ss.la_hit as f64 / ss.la_issued.max(1) as f64,
                ss.la_wasted,
                human(ss.la_wasted_bytes),
                ss.la_present,
                ss.la_skipped,
                ss.la_dropped
            );
        }
        if ss.prefetch_issued + ss.prefetch_present + ss.prefetch_skipped > 0 {
            eprintln!(
                "prefetch (certain, hash-routed layers): issued {} ({}) | hit {} ({:.1}% of issued) | already cached or in flight {} | left out (budget) {}",
                ss.prefetch_issued,
                human(ss.prefetch_bytes),
                ss.prefetch_hit,
                100.0 * ss.prefetch_hit as f64 / ss.prefetch_issued.max(1) as f64,
                ss.prefetch_present,
                ss.prefetch_skipped
            );
        }
        let per_layer_bytes = self.model.groups.experts.unit_bytes_per_layer();
        let expected: u64 = cs
            .per_layer
            .iter()
            .zip(&per_layer_bytes)
            .map(|(s, &b)| s.misses * b)
            .sum::<u64>()
            + st.resident_read_bytes()
            + ss.prefetch_bytes
            + ss.la_bytes
            + ss.reread_bytes;
        eprintln!(
            "reconcile: bytes requested {} = misses x expert bytes + prefetches + lookahead + re-reads {} ({}); read incl. alignment {} (+{:.1}%)",
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
            let resident = resident_bytes(&self.model);
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
