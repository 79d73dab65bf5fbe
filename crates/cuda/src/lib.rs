//! The CUDA compute backend.
//!
//! Owns: [`Cuda`], an implementation of `sluice_models::compute::Compute` on one NVIDIA
//! GPU. The driver (libcuda) and NVRTC (libnvrtc) are loaded at run time (cudarc with
//! dynamic loading), so the binary builds and runs without CUDA and [`Cuda::new`] says why
//! when there is none. The kernels (`kernels.cu`) are CUDA C compiled by NVRTC for the
//! device's architecture once per process.
//!
//! Weights: a weight slice that lies inside the model's memory map (immutable file bytes)
//! is uploaded to VRAM on first use and stays there, keyed by its host address and length,
//! while the resident bytes stay under a budget (free VRAM at start minus a reserve); any
//! other slice (a streamed expert in a RAM cache slot, whose address is reused for other
//! experts) or one past the budget is copied to a scratch buffer for each use.
//!
//! Host memory: [`Cuda::pin_host`] (and the [`SlotMemory`] hook, through which the RAM
//! expert tier hands over its slot buffers) page-locks host ranges with
//! `cuMemHostRegister`, so copies out of them run at pinned speed (~55 GB/s on an H200
//! against 5-8 GB/s pageable) and are truly asynchronous; a range the driver refuses stays
//! pageable (counted, the first error kept for `--stats`).
//!
//! Uploads: weights that are not yet in VRAM for a call (VRAM expert-cache misses, weights
//! copied per use) are copied on their own stream; the call's other products (cache hits,
//! resident weights) are launched first on the compute stream, which waits on the copy
//! stream's event only before the products that need the uploaded bytes. Every job's
//! result is computed the same way whichever launch it is in, so this never changes bits.
//! Both streams are idle again before a call returns (the copies read the caller's slices).
//!
//! Products: a warp-per-row matvec over groups of 8 tokens, so a token's result does not
//! depend on the batch (prompt chunking never changes logits, as on the CPU); a 64x64-tiled
//! matmul for prefill is there behind `SLUICE_CUDA_TILED=1`. Both dequantize on the fly (the
//! `FORMATS` list: F32, F16, BF16, the Q*_0/_1, K-quants, IQ4_NL/XS, MXFP4, IQ2_XXS/XS and
//! IQ3_XXS, the block layouts of `sluice_kernels::reference`) and keep activations in f32, so results differ from the
//! CPU path (Q8-quantized activations) by rounding. Other weight types and shapes the
//! kernels do not take (columns not a multiple of 32) run on the CPU backend.
//! With only this backend, everything else of a forward pass (attention, norms, routing)
//! stays on the CPU; [`forward::GpuDecoder`] runs the whole pass on the GPU instead for
//! architectures that describe themselves as a `sluice_models::plan::DecoderPlan`.

mod blocks;
pub mod forward;
mod kernels;
pub mod launch;
mod lru;
pub mod staging;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::{CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr};
use cudarc::nvrtc::{CompileOptions, Ptx};
use sluice_kernels::{GgmlType, KernelError};
use sluice_models::compute::{Compute, Cpu, LinearJob, UnitKey};
use sluice_tier::SlotMemory;

use crate::launch::{MvJob, MvLaunch};

/// The kernels' CUDA C source, without the lookup tables [`kernel_source`] puts first.
const KERNEL_BODY: &str = concat!(
    include_str!("kernels.cu"),
    include_str!("forward.cu"),
    include_str!("qwen4exp.cu"),
    include_str!("glm5next.cu")
);

/// The whole CUDA C source NVRTC compiles: the formats' lookup tables, written from
/// `sluice_kernels`' own (one copy of every grid in the project), then the kernels.
pub fn kernel_source() -> String {
    use sluice_kernels::formats::{KVALUES_IQ4NL, KVALUES_MXFP4};
    use sluice_kernels::iq::grids::{IQ2XS_GRID, IQ2XXS_GRID, IQ3XXS_GRID, KSIGNS};
    fn table<T: std::fmt::Display>(ty: &str, name: &str, suffix: &str, v: &[T]) -> String {
        let body: Vec<String> = v.iter().map(|x| format!("{x}{suffix}")).collect();
        format!(
            "__device__ const {ty} {name}[{}] = {{{}}};\n",
            v.len(),
            body.join(",")
        )
    }
    // C's own type names: the kernels' typedefs (u8, u64, ...) come after the tables.
    let mut s = table("signed char", "kvalues_iq4nl", "", &KVALUES_IQ4NL);
    s += &table("signed char", "kvalues_mxfp4", "", &KVALUES_MXFP4);
    s += &table("unsigned char", "ksigns_iq2xs", "", &KSIGNS);
    s += &table("unsigned long long", "iq2xxs_grid", "ull", &IQ2XXS_GRID);
    s += &table("unsigned long long", "iq2xs_grid", "ull", &IQ2XS_GRID);
    s += &table("unsigned int", "iq3xxs_grid", "u", &IQ3XXS_GRID);
    s + KERNEL_BODY
}

/// Tokens per group of the matvec kernel (its `MV_MAX_N`).
pub const MATVEC_MAX_N: usize = 8;

/// The largest grid y / z dimension.
const MAX_GRID_Y: usize = 65535;

/// VRAM kept free for scratch buffers and the driver when sizing the resident budget.
const VRAM_RESERVE: u64 = 1 << 30;

/// Why the CUDA backend is not available.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no CUDA driver (libcuda.so could not be loaded)")]
    NoDriver,
    #[error("no NVRTC (libnvrtc.so.13/.12/.11 could not be loaded; put the CUDA toolkit's lib64 on LD_LIBRARY_PATH or set CUDA_HOME)")]
    NoNvrtc,
    #[error("no CUDA device: {0}")]
    NoDevice(String),
    #[error("CUDA driver: {0}")]
    Driver(String),
    #[error("NVRTC could not compile the kernels: {0}")]
    Compile(String),
}

fn drv(e: cudarc::driver::DriverError) -> CudaError {
    CudaError::Driver(e.to_string())
}

fn dev_err(what: &str, e: cudarc::driver::DriverError) -> KernelError {
    KernelError::Device(format!("cuda {what}: {e}"))
}

/// Weight formats with GPU kernels, as (type, kernel suffix).
pub const FORMATS: [(GgmlType, &str); 19] = [
    (GgmlType::F32, "f32"),
    (GgmlType::F16, "f16"),
    (GgmlType::BF16, "bf16"),
    (GgmlType::Q8_0, "q8_0"),
    (GgmlType::Q5_0, "q5_0"),
    (GgmlType::Q4_K, "q4_k"),
    (GgmlType::Q6_K, "q6_k"),
    (GgmlType::Q4_0, "q4_0"),
    (GgmlType::Q4_1, "q4_1"),
    (GgmlType::Q5_1, "q5_1"),
    (GgmlType::IQ4_NL, "iq4_nl"),
    (GgmlType::MXFP4, "mxfp4"),
    (GgmlType::Q2_K, "q2_k"),
    (GgmlType::Q3_K, "q3_k"),
    (GgmlType::Q5_K, "q5_k"),
    (GgmlType::IQ4_XS, "iq4_xs"),
    (GgmlType::IQ2_XXS, "iq2_xxs"),
    (GgmlType::IQ2_XS, "iq2_xs"),
    (GgmlType::IQ3_XXS, "iq3_xxs"),
];

/// Whether the GPU kernels take `ty`.
pub fn is_supported(ty: GgmlType) -> bool {
    FORMATS.iter().any(|f| f.0 == ty)
}

/// The `FORMATS` entry whose kernels take rows of `cols` elements of `ty` (None: no kernel
/// for the type, or rows that are not whole groups of 32 elements / whole blocks).
pub(crate) fn kernel_format(ty: GgmlType, cols: usize) -> Option<usize> {
    let fi = FORMATS.iter().position(|f| f.0 == ty)?;
    (cols.is_multiple_of(32) && ty.row_bytes(cols as u64).is_some()).then_some(fi)
}

/// Counters of one backend since it was made.
#[derive(Debug, Default, Clone, Copy)]
pub struct CudaStats {
    /// Products run on the GPU / handed to the CPU backend.
    pub gpu_jobs: u64,
    pub cpu_jobs: u64,
    /// Weight bytes now resident in VRAM, and how many matrices.
    pub resident_bytes: u64,
    pub resident_mats: u64,
    /// Weight bytes copied per use (streamed experts, past the budget).
    pub transient_bytes: u64,
    /// Activation bytes up and result bytes down.
    pub act_bytes: u64,
    /// Grouped calls that reached the GPU, and the wall time spent in them (copies,
    /// kernels, waiting for the results).
    pub calls: u64,
    pub busy_ns: u64,
    /// Whole forward passes run by [`forward::GpuDecoder`] and their wall time.
    pub forward_calls: u64,
    pub forward_ns: u64,
    /// The VRAM expert cache (`set_expert_cache`): budget (0 = off), bytes held now and at
    /// most, hits, misses, evictions, bytes uploaded on misses and the time the uploads took.
    pub expert_budget: u64,
    pub expert_bytes: u64,
    pub expert_peak: u64,
    pub expert_hits: u64,
    pub expert_misses: u64,
    pub expert_evictions: u64,
    pub expert_upload_bytes: u64,
    /// Weight bytes copied on the copy stream (expert-cache misses and weights copied per
    /// use), the copy stream's time for them (CUDA events), and how many of those bytes
    /// came from page-locked host memory.
    pub upload_bytes: u64,
    pub upload_ns: u64,
    pub upload_pinned_bytes: u64,
    /// Of those, bytes that went through the whole forward pass's page-locked staging ring
    /// (`staging`: copied there from pageable memory first), and the ring's page-locked
    /// bytes (0 until a miss needed it).
    pub upload_staged_bytes: u64,
    pub staging_bytes: u64,
    /// GPU time the compute stream waited for uploads after the products that needed none
    /// (CUDA events: from the end of those products to the end of the uploads).
    pub upload_wait_ns: u64,
    /// Host memory page-locked now (`pin_host`, the RAM tier's slots) in how many ranges,
    /// ranges the driver refused, and the time spent registering.
    pub pinned_bytes: u64,
    pub pinned_ranges: u64,
    pub pin_failures: u64,
    pub pin_ns: u64,
}

impl CudaStats {
    /// Copy-stream upload rate in GB/s (0 when nothing was uploaded).
    pub fn upload_gbps(&self) -> f64 {
        if self.upload_ns == 0 {
            return 0.0;
        }
        self.upload_bytes as f64 / self.upload_ns as f64
    }

    /// Hits / lookups of the VRAM expert cache (0 when it was not asked).
    pub fn expert_hit_rate(&self) -> f64 {
        let n = self.expert_hits + self.expert_misses;
        if n == 0 {
            return 0.0;
        }
        self.expert_hits as f64 / n as f64
    }
}

/// Host ranges page-locked with the driver: start address -> length.
#[derive(Default)]
struct HostPins {
    ranges: BTreeMap<usize, usize>,
    bytes: u64,
    failures: u64,
    ns: u64,
    /// The first registration error, for `--stats`.
    first_error: Option<String>,
}

impl HostPins {
    /// Whether `[p, p + len)` lies inside one page-locked range.
    fn covers(&self, p: usize, len: usize) -> bool {
        self.ranges
            .range(..=p)
            .next_back()
            .is_some_and(|(&a, &l)| p + len <= a + l)
    }
}

/// Routed-expert matrices kept in VRAM by identity, least recently used evicted first:
/// (buffer, upload pending in the call in progress).
type ExpertCache = lru::Lru<UnitKey, (CudaSlice<u8>, bool)>;

struct Inner {
    resident: HashMap<(usize, usize), CudaSlice<u8>>,
    budget: u64,
    x: Option<CudaSlice<f32>>,
    y: Option<CudaSlice<f32>>,
    w: Option<CudaSlice<u8>>,
    /// The matvec job table.
    d: Option<CudaSlice<u8>>,
    /// Timing events around a call's uploads on the copy stream (the end one is also what
    /// the compute stream waits on).
    up_start: CudaEvent,
    up_end: CudaEvent,
    /// Recorded on the compute stream where it starts waiting for the uploads.
    ready_done: CudaEvent,
    experts: Option<ExpertCache>,
    /// Host staging: every input of a call in one upload, every result in one download.
    hx: Vec<f32>,
    hy: Vec<f32>,
    stats: CudaStats,
}

/// One GPU as a compute backend (see the module header). Clones share the device, its
/// resident weights and its counters (keep one for statistics, give one to the model).
#[derive(Clone)]
pub struct Cuda {
    d: Arc<Device>,
}

struct Device {
    ctx: Arc<CudaContext>,
    /// Kernels, activations and results.
    stream: Arc<CudaStream>,
    /// Weight uploads that a call's products wait for (see the module header).
    copy: Arc<CudaStream>,
    host: Mutex<HostPins>,
    /// (matvec, matmul) per entry of `FORMATS`.
    funcs: Vec<(CudaFunction, CudaFunction)>,
    /// Every kernel of the source (the whole-forward ones are loaded from it by name).
    module: Arc<cudarc::driver::CudaModule>,
    device: String,
    /// `SLUICE_CUDA_TILED=1`: the tiled kernel for more than MATVEC_MAX_N tokens (faster
    /// prefill, but a token's bits then depend on the batch it came in).
    tiled: bool,
    /// Tensor-core products in the whole forward pass (`mvt_*`, sm_80 or newer).
    mma: Mma,
    /// Host address range whose bytes never change (the model's memory map).
    stable: (usize, usize),
    inner: Mutex<Inner>,
}

/// When the whole forward pass multiplies quantized and F16 weights on tensor cores
/// (`SLUICE_CUDA_MMA`): f16 operands, f32 sums, a faster prefill.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mma {
    /// Every call (the default): a token's logits have the same bits whatever chunk of the
    /// prompt it came in.
    Always,
    /// Calls of more than 8 tokens only (`prefill`): decode keeps the f32 kernels (faster
    /// for one token), so prompt logits depend on the chunk size (8 or fewer tokens, or
    /// more).
    Prefill,
    /// Never (`0`; also on GPUs older than sm_80).
    Never,
}

impl Mma {
    fn from_env() -> Mma {
        match std::env::var("SLUICE_CUDA_MMA").as_deref() {
            Ok("0") => Mma::Never,
            Ok("prefill") => Mma::Prefill,
            _ => Mma::Always,
        }
    }
}

/// Places NVRTC is looked for when the loader's search path does not have it.
fn nvrtc_dirs() -> Vec<String> {
    let mut dirs = Vec::new();
    // A directory holding libnvrtc itself (e.g. the nvidia-cuda-nvrtc wheel's, as
    // tools/get-nvrtc.sh prints it).
    if let Ok(v) = std::env::var("SLUICE_NVRTC_DIR") {
        dirs.push(v);
    }
    for var in ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"] {
        if let Ok(v) = std::env::var(var) {
            dirs.push(format!("{v}/lib64"));
            dirs.push(format!("{v}/lib"));
        }
    }
    dirs.push("/usr/local/cuda/lib64".into());
    dirs.push("/usr/local/cuda/targets/x86_64-linux/lib".into());
    dirs
}

/// Make libnvrtc loadable by its plain name: if the loader cannot find it, load it once
/// from a CUDA toolkit directory (a library already loaded is found by its soname).
fn ensure_nvrtc() -> Result<(), CudaError> {
    // SAFETY: is_culib_present only tries to dlopen libnvrtc under its known names.
    if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Ok(());
    }
    for dir in nvrtc_dirs() {
        for v in ["13", "12", "11"] {
            let p = format!("{dir}/libnvrtc.so.{v}");
            if !std::path::Path::new(&p).exists() {
                continue;
            }
            // SAFETY: loading NVRTC runs its initialisers, which have no preconditions.
            if let Ok(lib) = unsafe { libloading::Library::new(&p) } {
                // Kept for the life of the process so cudarc's dlopen by soname finds it.
                std::mem::forget(lib);
                // SAFETY: as above.
                if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
                    return Ok(());
                }
            }
        }
    }
    Err(CudaError::NoNvrtc)
}

/// The kernels' PTX for `arch` (e.g. `compute_90`), compiled once per process.
fn ptx_for(arch: &str) -> Result<String, CudaError> {
    static PTX: OnceLock<Mutex<HashMap<String, String>>> = OnceLock::new();
    let cache = PTX.get_or_init(|| Mutex::new(HashMap::new()));
    let mut c = cache.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(p) = c.get(arch) {
        return Ok(p.clone());
    }
    let opts = CompileOptions {
        options: vec![format!("--gpu-architecture={arch}")],
        name: Some("sluice_kernels.cu".into()),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(kernel_source(), opts)
        .map_err(|e| CudaError::Compile(format!("{e:?}")))?
        .to_src();
    c.insert(arch.to_string(), ptx.clone());
    Ok(ptx)
}

/// Compile the kernels for `arch` (e.g. `compute_90`) with NVRTC and return the PTX; needs
/// NVRTC but no GPU (a check of the kernel source on a machine without one).
pub fn compile_kernels(arch: &str) -> Result<String, CudaError> {
    ensure_nvrtc()?;
    ptx_for(arch)
}

impl Cuda {
    /// Open GPU 0, compile the kernels, and treat `stable` (the model's mapped bytes) as
    /// weights that may stay resident in VRAM. Errors say why CUDA is not usable here.
    pub fn new(stable: &[u8]) -> Result<Cuda, CudaError> {
        // cudarc panics when a library or symbol is missing: check first, and turn any
        // panic left into an error.
        // SAFETY: is_culib_present only tries to dlopen libcuda under its known names.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(CudaError::NoDriver);
        }
        ensure_nvrtc()?;
        let range = (stable.as_ptr() as usize, stable.len());
        let hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let r = std::panic::catch_unwind(|| Device::open(range));
        std::panic::set_hook(hook);
        match r {
            Ok(r) => r.map(|d| Cuda { d: Arc::new(d) }),
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "unknown".into());
                Err(CudaError::Driver(msg))
            }
        }
    }

    /// Device name and compute capability.
    pub fn device(&self) -> &str {
        &self.d.device
    }

    /// When the whole forward pass multiplies on tensor cores, in words (`SLUICE_CUDA_MMA`).
    pub fn tensor_cores(&self) -> &'static str {
        match self.d.mma {
            Mma::Always => "tensor cores (f16 operands, f32 sums)",
            Mma::Prefill => {
                "tensor cores for calls of more than 8 tokens (SLUICE_CUDA_MMA=prefill)"
            }
            Mma::Never => "f32 kernels, no tensor cores",
        }
    }

    /// Limit the weight bytes kept resident in VRAM (default: free VRAM at start - 1 GiB).
    pub fn set_resident_budget(&self, bytes: u64) {
        self.d.lock().budget = bytes;
    }

    /// Keep routed experts in a VRAM cache of at most `bytes` (a hard budget; least recently
    /// used evicted first), identified by layer, expert and matrix rather than by host
    /// address, so experts streamed through the RAM tier are uploaded once per miss here.
    /// Experts then never count as resident weights, and the resident budget shrinks by
    /// `bytes`. Call before the first product; 0 turns the cache off. Refused (with the
    /// numbers) when the budget does not fit the VRAM left for weights.
    pub fn set_expert_cache(&self, bytes: u64) -> Result<(), String> {
        let mut g = self.d.lock();
        let room = g.budget + g.stats.expert_budget - g.stats.resident_bytes;
        if bytes > room {
            return Err(format!(
                "{bytes} bytes is more than the {room} bytes of VRAM this GPU has left for weights (free VRAM at start - 1 GiB - resident weights)"
            ));
        }
        g.budget = g.budget + g.stats.expert_budget - bytes;
        g.stats.expert_budget = bytes;
        g.experts = (bytes > 0).then(|| ExpertCache::new(bytes));
        g.stats.expert_bytes = 0;
        Ok(())
    }

    /// Counters so far.
    pub fn stats(&self) -> CudaStats {
        let mut s = self.d.lock().stats;
        let h = self.d.host();
        s.pinned_bytes = h.bytes;
        s.pinned_ranges = h.ranges.len() as u64;
        s.pin_failures = h.failures;
        s.pin_ns = h.ns;
        s
    }

    /// The first error the driver gave when page-locking host memory, if any.
    pub fn pin_error(&self) -> Option<String> {
        self.d.host().first_error.clone()
    }

    /// Page-lock `bytes` (`cuMemHostRegister`) so copies out of it run at pinned speed;
    /// the memory must stay allocated until [`Cuda::unpin_host`]. Errors (the range stays
    /// pageable, and everything still works) are counted and returned.
    pub fn pin_host(&self, bytes: &[u8]) -> Result<(), String> {
        self.d.pin(bytes.as_ptr() as usize, bytes.len())
    }

    /// Undo [`Cuda::pin_host`] for the range starting at `bytes` (nothing if not pinned).
    pub fn unpin_host(&self, bytes: &[u8]) {
        self.d.unpin(bytes.as_ptr() as usize)
    }
}

/// The RAM expert tier's slot buffers, page-locked while they exist.
impl SlotMemory for Cuda {
    fn added(&self, addr: usize, len: usize) {
        let _ = self.d.pin(addr, len);
    }
    fn removed(&self, addr: usize, _len: usize) {
        self.d.unpin(addr);
    }
}

impl Device {
    fn open(stable: (usize, usize)) -> Result<Device, CudaError> {
        let n = CudaContext::device_count().map_err(|e| CudaError::NoDevice(e.to_string()))?;
        if n < 1 {
            return Err(CudaError::NoDevice("the driver reports 0 devices".into()));
        }
        let ctx = CudaContext::new(0).map_err(|e| CudaError::NoDevice(e.to_string()))?;
        let (major, minor) = ctx.compute_capability().map_err(drv)?;
        let device = ctx.name().map_err(drv)?;
        let ptx = ptx_for(&format!("compute_{major}{minor}"))?;
        let module = ctx.load_module(Ptx::from_src(ptx)).map_err(drv)?;
        let mut funcs = Vec::with_capacity(FORMATS.len());
        for (_, s) in FORMATS {
            let mv = module.load_function(&format!("mv_{s}")).map_err(drv)?;
            let mm = module.load_function(&format!("mm_{s}")).map_err(drv)?;
            funcs.push((mv, mm));
        }
        let (free, _total) = ctx.mem_get_info().map_err(drv)?;
        // SAFETY: this crate orders its streams by hand (see run_gpu): a buffer written on
        // the copy stream is read on the compute stream only after it waits on the copy
        // stream's event, every call leaves both streams idle, and buffers are dropped
        // only between calls. cudarc's per-slice event tracking would add an event record
        // and wait per buffer use.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.default_stream();
        let copy = ctx.new_stream().map_err(drv)?;
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let up_start = ctx.new_event(timing).map_err(drv)?;
        let up_end = ctx.new_event(timing).map_err(drv)?;
        let ready_done = ctx.new_event(timing).map_err(drv)?;
        Ok(Device {
            ctx: ctx.clone(),
            stream,
            copy,
            host: Mutex::new(HostPins::default()),
            funcs,
            module,
            device: format!("{device} (sm_{major}{minor})"),
            tiled: std::env::var("SLUICE_CUDA_TILED").is_ok_and(|v| v == "1"),
            mma: if major >= 8 {
                Mma::from_env()
            } else {
                Mma::Never
            },
            stable,
            inner: Mutex::new(Inner {
                resident: HashMap::new(),
                budget: (free as u64).saturating_sub(VRAM_RESERVE),
                x: None,
                y: None,
                w: None,
                d: None,
                up_start,
                up_end,
                ready_done,
                experts: None,
                hx: Vec::new(),
                hy: Vec::new(),
                stats: CudaStats::default(),
            }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn host(&self) -> std::sync::MutexGuard<'_, HostPins> {
        self.host.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Page-lock `[addr, addr + len)` (see `Cuda::pin_host`).
    fn pin(&self, addr: usize, len: usize) -> Result<(), String> {
        if len == 0 {
            return Ok(());
        }
        let mut h = self.host();
        if h.ranges.contains_key(&addr) {
            return Ok(());
        }
        let t0 = std::time::Instant::now();
        let r = self.ctx.bind_to_thread().and_then(|()| {
            // SAFETY: cuMemHostRegister page-locks the pages of [addr, addr + len) and
            // records the range with the driver; it neither reads nor writes the bytes. The
            // caller keeps the range allocated until `unpin` (the SlotMemory contract); a
            // range that is not mapped makes the call fail, which is handled below.
            unsafe {
                cudarc::driver::sys::cuMemHostRegister_v2(addr as *mut std::ffi::c_void, len, 0)
            }
            .result()
        });
        h.ns += t0.elapsed().as_nanos() as u64;
        match r {
            Ok(()) => {
                h.ranges.insert(addr, len);
                h.bytes += len as u64;
                Ok(())
            }
            Err(e) => {
                h.failures += 1;
                let msg = format!("cuMemHostRegister of {len} bytes: {e}");
                h.first_error.get_or_insert_with(|| msg.clone());
                Err(msg)
            }
        }
    }

    /// Undo `pin` for the range starting at `addr`. No copy reads it any more: every call
    /// leaves the copy stream idle, and the tier releases a slot only while no job holds it.
    fn unpin(&self, addr: usize) {
        let mut h = self.host();
        let Some(len) = h.ranges.remove(&addr) else {
            return;
        };
        h.bytes -= len as u64;
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `addr` is the start of a range registered by `pin` and not yet
            // unregistered; unregistering only unlocks its pages.
            let _ =
                unsafe { cudarc::driver::sys::cuMemHostUnregister(addr as *mut std::ffi::c_void) };
        }
    }

    fn is_stable(&self, w: &[u8]) -> bool {
        let (p, l) = (w.as_ptr() as usize, w.len());
        p >= self.stable.0 && p + l <= self.stable.0 + self.stable.1
    }

    /// Whether the GPU kernels take this job (else the CPU backend runs it, and reports
    /// a malformed one exactly as without a GPU).
    fn gpu_job(j: &LinearJob<'_>) -> Option<usize> {
        let fi = kernel_format(j.ty, j.cols)?;
        let rb = j.ty.row_bytes(j.cols as u64)? as usize;
        let ok = j.rows > 0
            && j.n > 0
            && j.cols <= i32::MAX as usize
            && j.rows <= i32::MAX as usize
            && j.n <= MATVEC_MAX_N * MAX_GRID_Y
            && j.w.len() == rb * j.rows
            && j.x.len() == j.n * j.cols
            && j.y.len() == j.n * j.rows;
        ok.then_some(fi)
    }

    fn run_gpu(&self, jobs: &mut [&mut LinearJob<'_>], fis: &[usize]) -> Result<(), KernelError> {
        let t0 = std::time::Instant::now();
        let mut g = self.lock();
        let inner = &mut *g;
        let stream = &self.stream;
        let copy = &self.copy;
        // Copies below may read the jobs' slices asynchronously: whatever happens, both
        // streams are idle again before this returns.
        let _idle = Idle(stream, copy);
        let XyLayout {
            x_offs,
            x_of,
            x_total,
            y_offs,
            y_total,
        } = xy_layout(jobs);
        let places = self.place_weights(inner, jobs)?;
        grow(stream, &mut inner.x, x_total)?;
        grow(stream, &mut inner.y, y_total)?;
        grow(copy, &mut inner.w, places.w_total)?;
        // Uploads on the copy stream, timed by two events; the compute stream waits on the
        // end event before the first product that needs them.
        let any_pending = places.pending.iter().any(|&p| p);
        if any_pending {
            self.upload_pending(inner, jobs, &places.pending, &places.w_off)?;
        }
        inner.hx.clear();
        inner.hx.resize(x_total, 0.0);
        for (ki, &off) in x_offs.iter().enumerate() {
            let ji = x_of.iter().position(|&i| i == ki).expect("a job has it");
            let x = jobs[ji].x;
            inner.hx[off..off + x.len()].copy_from_slice(x);
        }
        let xb = inner.x.as_mut().expect("grown");
        stream
            .memcpy_htod(&inner.hx[..], &mut xb.slice_mut(0..x_total))
            .map_err(|e| dev_err("copy x", e))?;
        inner.stats.act_bytes += 4 * x_total as u64;
        // Raw device addresses: the kernels take them inside a job table (mv) or as
        // parameters (mm). Every buffer stays alive and unmoved until the synchronize below.
        let xbase = xb.device_ptr(stream).0;
        let ybase = inner.y.as_ref().expect("grown").device_ptr(stream).0;
        let wptr = weight_addrs(inner, stream, jobs, &places);
        let addr = |ji: usize| {
            (
                wptr[ji],
                xbase + 4 * x_offs[x_of[ji]] as u64,
                ybase + 4 * y_offs[ji] as u64,
            )
        };
        self.launch_products(inner, jobs, fis, &places.pending, &addr)?;
        inner.hy.resize(y_total.max(inner.hy.len()), 0.0);
        let yb = inner.y.as_ref().expect("grown");
        stream
            .memcpy_dtoh(&yb.slice(0..y_total), &mut inner.hy[..y_total])
            .map_err(|e| dev_err("copy y", e))?;
        stream
            .synchronize()
            .map_err(|e| dev_err("synchronize", e))?;
        if any_pending {
            copy.synchronize()
                .map_err(|e| dev_err("synchronize copies", e))?;
            // Timing only: a failure to read it must not fail the products.
            if let Ok(ms) = inner.up_start.elapsed_ms(&inner.up_end) {
                inner.stats.upload_ns += (ms.max(0.0) as f64 * 1e6) as u64;
            }
            if let Ok(ms) = inner.ready_done.elapsed_ms(&inner.up_end) {
                inner.stats.upload_wait_ns += (ms.max(0.0) as f64 * 1e6) as u64;
            }
        }
        for (ji, j) in jobs.iter_mut().enumerate() {
            let yo = y_offs[ji];
            let len = j.y.len();
            j.y.copy_from_slice(&inner.hy[yo..yo + len]);
        }
        inner.stats.act_bytes += 4 * y_total as u64;
        inner.stats.gpu_jobs += jobs.len() as u64;
        inner.stats.calls += 1;
        inner.stats.busy_ns += t0.elapsed().as_nanos() as u64;
        Ok(())
    }

    /// Where each job's weights are for this call: in the expert cache (present, or a slot
    /// made now that the copy stream fills), resident (uploaded now if new and within
    /// budget) or copied per use into the scratch buffer (on the copy stream).
    fn place_weights(
        &self,
        inner: &mut Inner,
        jobs: &[&mut LinearJob<'_>],
    ) -> Result<Placement, KernelError> {
        let stream = &self.stream;
        let mut p = Placement {
            w_off: Vec::with_capacity(jobs.len()),
            in_cache: Vec::with_capacity(jobs.len()),
            pending: Vec::with_capacity(jobs.len()),
            w_total: 0,
        };
        for j in jobs.iter() {
            if let (Some(u), Some(ec)) = (j.unit, inner.experts.as_mut()) {
                match cache_expert(&self.copy, ec, &mut inner.stats, u, j.w.len(), jobs)? {
                    Cached::Hit | Cached::Miss => {
                        let miss = ec.get(&u).expect("made above").1;
                        p.w_off.push(None);
                        p.in_cache.push(true);
                        p.pending.push(miss);
                    }
                    Cached::NoRoom => {
                        p.in_cache.push(false);
                        p.pending.push(true);
                        p.w_off.push(Some(p.w_total));
                        p.w_total += j.w.len().next_multiple_of(ALIGN_B);
                    }
                }
                continue;
            }
            p.in_cache.push(false);
            let key = (j.w.as_ptr() as usize, j.w.len());
            if inner.resident.contains_key(&key) {
                p.w_off.push(None);
                p.pending.push(false);
                continue;
            }
            let len = j.w.len() as u64;
            if self.is_stable(j.w) && inner.stats.resident_bytes + len <= inner.budget {
                let d = stream.clone_htod(j.w).map_err(|e| dev_err("upload", e))?;
                inner.resident.insert(key, d);
                inner.stats.resident_bytes += len;
                inner.stats.resident_mats += 1;
                p.w_off.push(None);
                p.pending.push(false);
            } else {
                p.w_off.push(Some(p.w_total));
                p.pending.push(true);
                p.w_total += j.w.len().next_multiple_of(ALIGN_B);
            }
        }
        Ok(p)
    }

    /// The call's product launches, through their typed launches ([`launch::MvLaunch`],
    /// [`launch::Mm`]): matvec jobs in one table, per phase (weights already in VRAM, then
    /// those uploaded by this call, after the compute stream waited for the copies) one
    /// launch per format; tiled jobs (`SLUICE_CUDA_TILED=1`) one launch each. `addr(ji)`:
    /// job ji's W, X and Y device addresses.
    fn launch_products(
        &self,
        inner: &mut Inner,
        jobs: &[&mut LinearJob<'_>],
        fis: &[usize],
        pending: &[bool],
        addr: &dyn Fn(usize) -> (u64, u64, u64),
    ) -> Result<(), KernelError> {
        let stream = &self.stream;
        let tiled = |j: &LinearJob<'_>| self.tiled && j.n > MATVEC_MAX_N;
        let (table, launches) = job_table(jobs, fis, pending, &tiled, addr);
        let mut dbase = 0u64;
        if !table.is_empty() {
            grow(stream, &mut inner.d, table.len())?;
            let db = inner.d.as_mut().expect("grown");
            stream
                .memcpy_htod(&table[..], &mut db.slice_mut(0..table.len()))
                .map_err(|e| dev_err("copy job table", e))?;
            dbase = db.device_ptr(stream).0;
        }
        let launched =
            |r: Result<(), String>| r.map_err(|m| KernelError::Device(format!("cuda {m}")));
        for phase in [false, true] {
            if phase {
                if !pending.iter().any(|&p| p) {
                    break;
                }
                inner
                    .ready_done
                    .record(stream)
                    .map_err(|e| dev_err("event", e))?;
                stream
                    .wait(&inner.up_end)
                    .map_err(|e| dev_err("wait for uploads", e))?;
            }
            for l in launches.iter().filter(|l| l.uploaded == phase) {
                // SAFETY: the table (the layout `MvJob::write` gives) is on the device;
                // each entry names a W of rows * row_bytes bytes, an X of n * cols floats
                // and a Y of n * rows floats inside live buffers (checked by gpu_job and
                // the offsets of run_gpu), whose bytes are on the device before this
                // launch (phase 1 runs after the compute stream waited for the uploads).
                launched(unsafe { l.launch(stream, &self.funcs[l.format].0, dbase) })?;
            }
            for (ji, j) in jobs.iter().enumerate() {
                if !tiled(j) || pending[ji] != phase {
                    continue;
                }
                let (w, x, y) = addr(ji);
                let mm = launch::Mm {
                    w,
                    x,
                    y,
                    rows: j.rows as i32,
                    cols: j.cols as i32,
                    row_bytes: (j.w.len() / j.rows) as i64,
                    n: j.n as i32,
                };
                // SAFETY: W, X and Y are device addresses inside live buffers of rows *
                // row_bytes bytes, n * cols and n * rows floats (as above), W's bytes on
                // the device before this launch.
                launched(unsafe { mm.launch(stream, &self.funcs[fis[ji]].1) })?;
            }
        }
        Ok(())
    }

    /// Upload the weights of the jobs `pending` names on the copy stream (into their expert
    /// cache slot, or the scratch buffer at `w_off`), between the two upload events.
    fn upload_pending(
        &self,
        inner: &mut Inner,
        jobs: &[&mut LinearJob<'_>],
        pending: &[bool],
        w_off: &[Option<usize>],
    ) -> Result<(), KernelError> {
        let copy = &self.copy;
        inner
            .up_start
            .record(copy)
            .map_err(|e| dev_err("event", e))?;
        let (mut bytes, mut pinned) = (0u64, 0u64);
        let host = self.host();
        for (ji, j) in jobs.iter().enumerate() {
            if !pending[ji] {
                continue;
            }
            let len = j.w.len();
            match w_off[ji] {
                None => {
                    let u = j.unit.expect("cached jobs have a unit");
                    let e = inner
                        .experts
                        .as_mut()
                        .expect("on")
                        .get_mut(&u)
                        .expect("made above");
                    copy.memcpy_htod(j.w, &mut e.0)
                        .map_err(|e| dev_err("expert upload", e))?;
                    e.1 = false;
                    inner.stats.expert_upload_bytes += len as u64;
                }
                Some(off) => {
                    let wb = inner.w.as_mut().expect("grown");
                    copy.memcpy_htod(j.w, &mut wb.slice_mut(off..off + len))
                        .map_err(|e| dev_err("copy weights", e))?;
                    inner.stats.transient_bytes += len as u64;
                }
            }
            bytes += len as u64;
            if host.covers(j.w.as_ptr() as usize, len) {
                pinned += len as u64;
            }
        }
        drop(host);
        inner.up_end.record(copy).map_err(|e| dev_err("event", e))?;
        inner.stats.upload_bytes += bytes;
        inner.stats.upload_pinned_bytes += pinned;
        Ok(())
    }
}

/// Alignment of the jobs' X / Y rows (floats, 256 bytes) and of their weights in the
/// scratch buffer (bytes).
const ALIGN_F: usize = 64;
const ALIGN_B: usize = 256;

/// Where each job's input and output rows go in the call's X and Y buffers: inputs one
/// copy per distinct slice (`x_offs`, the job's slice `x_of`), outputs one per job, each
/// aligned to [`ALIGN_F`] floats.
struct XyLayout {
    x_offs: Vec<usize>,
    x_of: Vec<usize>,
    x_total: usize,
    y_offs: Vec<usize>,
    y_total: usize,
}

fn xy_layout(jobs: &[&mut LinearJob<'_>]) -> XyLayout {
    // Inputs: one copy per distinct slice.
    let mut x_keys: Vec<(usize, usize)> = Vec::new();
    let mut x_offs: Vec<usize> = Vec::new();
    let mut x_of = Vec::with_capacity(jobs.len());
    let mut x_total = 0usize;
    for j in jobs.iter() {
        let key = (j.x.as_ptr() as usize, j.x.len());
        let i = match x_keys.iter().position(|k| *k == key) {
            Some(i) => i,
            None => {
                x_keys.push(key);
                x_offs.push(x_total);
                x_total += j.x.len().next_multiple_of(ALIGN_F);
                x_keys.len() - 1
            }
        };
        x_of.push(i);
    }
    let mut y_offs = Vec::with_capacity(jobs.len());
    let mut y_total = 0usize;
    for j in jobs.iter() {
        y_offs.push(y_total);
        y_total += j.y.len().next_multiple_of(ALIGN_F);
    }
    XyLayout {
        x_offs,
        x_of,
        x_total,
        y_offs,
        y_total,
    }
}

/// Where a call's jobs' weights are ([`Device::place_weights`]): `w_off` the offset in
/// the scratch buffer of those copied per use (None: in VRAM), `in_cache` those in the
/// expert cache, `pending` those this call uploads, `w_total` the scratch bytes.
struct Placement {
    w_off: Vec<Option<usize>>,
    in_cache: Vec<bool>,
    pending: Vec<bool>,
    w_total: usize,
}

/// Each job's weights' device address, as `places` put them.
fn weight_addrs(
    inner: &Inner,
    stream: &Arc<CudaStream>,
    jobs: &[&mut LinearJob<'_>],
    places: &Placement,
) -> Vec<u64> {
    let mut wptr = Vec::with_capacity(jobs.len());
    for (ji, j) in jobs.iter().enumerate() {
        let key = (j.w.as_ptr() as usize, j.w.len());
        let p = match places.w_off[ji] {
            None if places.in_cache[ji] => {
                let u = j.unit.expect("cached jobs have a unit");
                inner
                    .experts
                    .as_ref()
                    .expect("on")
                    .get(&u)
                    .expect("made above")
                    .0
                    .device_ptr(stream)
                    .0
            }
            None => inner.resident[&key].device_ptr(stream).0,
            Some(off) => inner.w.as_ref().expect("grown").device_ptr(stream).0 + off as u64,
        };
        wptr.push(p);
    }
    wptr
}

/// The matvec jobs' table (per phase, 0: weights already in VRAM, 1: uploaded by this
/// call, one launch per format; blockIdx.y = job) and its launches; `addr(ji)`: job ji's
/// W, X and Y device addresses; tiled jobs are left out.
fn job_table(
    jobs: &[&mut LinearJob<'_>],
    fis: &[usize],
    pending: &[bool],
    tiled: &dyn Fn(&LinearJob<'_>) -> bool,
    addr: &dyn Fn(usize) -> (u64, u64, u64),
) -> (Vec<u8>, Vec<MvLaunch>) {
    let mut table: Vec<u8> = Vec::new();
    let mut launches: Vec<MvLaunch> = Vec::new();
    for uploaded in [false, true] {
        for format in 0..FORMATS.len() {
            let mut l = MvLaunch {
                format,
                first: table.len() / MvJob::BYTES,
                count: 0,
                max_rows: 0,
                max_groups: 0,
                uploaded,
            };
            for (ji, j) in jobs.iter().enumerate() {
                if fis[ji] != format || tiled(j) || pending[ji] != uploaded {
                    continue;
                }
                let (w, x, y) = addr(ji);
                MvJob {
                    w,
                    x,
                    y,
                    row_bytes: (j.w.len() / j.rows) as i64,
                    rows: j.rows as i32,
                    cols: j.cols as i32,
                    n: j.n as i32,
                }
                .write(&mut table);
                l.count += 1;
                l.max_rows = l.max_rows.max(j.rows);
                l.max_groups = l.max_groups.max(j.n.div_ceil(MATVEC_MAX_N));
                if l.count == MAX_GRID_Y {
                    launches.push(l);
                    l.first += l.count;
                    (l.count, l.max_rows, l.max_groups) = (0, 0, 0);
                }
            }
            if l.count > 0 {
                launches.push(l);
            }
        }
    }
    (table, launches)
}

/// Waits for two streams when dropped (errors ignored: the call already reports one).
struct Idle<'a>(&'a Arc<CudaStream>, &'a Arc<CudaStream>);

impl Drop for Idle<'_> {
    fn drop(&mut self) {
        let _ = self.1.synchronize();
        let _ = self.0.synchronize();
    }
}

/// What [`cache_expert`] did.
enum Cached {
    /// Present (or made earlier in this call: its upload is pending).
    Hit,
    /// A slot made now: the caller uploads the bytes into it.
    Miss,
    /// It cannot fit: copy it for this use only.
    NoRoom,
}

/// Make room for expert matrix `u` (`len` bytes) in the cache, evicting the least recently
/// used matrices that no job of this call uses. A new entry's device buffer is allocated
/// on the copy stream and marked for upload (its third field).
fn cache_expert(
    copy: &Arc<CudaStream>,
    ec: &mut ExpertCache,
    st: &mut CudaStats,
    u: UnitKey,
    len: usize,
    jobs: &[&mut LinearJob<'_>],
) -> Result<Cached, KernelError> {
    ec.tick();
    if ec.touch(&u).map(|(_, held_len)| held_len) == Some(len as u64) {
        st.expert_hits += 1;
        return Ok(Cached::Hit);
    }
    st.expert_misses += 1;
    ec.remove(&u);
    st.expert_bytes = ec.held();
    let len64 = len as u64;
    if len64 > ec.budget() {
        return Ok(Cached::NoRoom);
    }
    // Least recently used, never one this call needs.
    let (evicted, fits) = ec.make_room(len64, |k| jobs.iter().any(|j| j.unit == Some(*k)));
    st.expert_evictions += evicted;
    st.expert_bytes = ec.held();
    if !fits {
        return Ok(Cached::NoRoom);
    }
    // SAFETY: the buffer's bytes are written by the upload the caller issues on the copy
    // stream before any product reads them (the compute stream waits for that upload).
    let d = unsafe { copy.alloc::<u8>(len) }.map_err(|e| dev_err("expert alloc", e))?;
    ec.insert(u, (d, true), len64);
    st.expert_bytes = ec.held();
    st.expert_peak = st.expert_peak.max(st.expert_bytes);
    Ok(Cached::Miss)
}

/// Make `buf` hold at least `len` elements (grown to the next power of two).
fn grow<T: cudarc::driver::DeviceRepr>(
    stream: &Arc<CudaStream>,
    buf: &mut Option<CudaSlice<T>>,
    len: usize,
) -> Result<(), KernelError> {
    let have = buf.as_ref().map_or(0, |b| b.len());
    if have >= len.max(1) {
        return Ok(());
    }
    *buf = None;
    // SAFETY: the buffer is scratch; every range a kernel reads is written by a copy first
    // and every range copied back is written by a kernel.
    let b = unsafe { stream.alloc::<T>(len.max(1).next_power_of_two()) }
        .map_err(|e| dev_err("alloc", e))?;
    *buf = Some(b);
    Ok(())
}

impl Compute for Cuda {
    fn linear(
        &self,
        ty: GgmlType,
        w: &[u8],
        rows: usize,
        cols: usize,
        x: &[f32],
        n: usize,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        let mut jobs = [LinearJob {
            ty,
            w,
            rows,
            cols,
            x,
            n,
            y,
            unit: None,
        }];
        self.linear_group(&mut jobs)
    }

    fn linear_group(&self, jobs: &mut [LinearJob<'_>]) -> Result<(), KernelError> {
        let mut gpu: Vec<&mut LinearJob<'_>> = Vec::with_capacity(jobs.len());
        let mut fis = Vec::with_capacity(jobs.len());
        let mut cpu = 0u64;
        for j in jobs.iter_mut() {
            match Device::gpu_job(j) {
                Some(fi) => {
                    fis.push(fi);
                    gpu.push(j);
                }
                None => {
                    Cpu.linear(j.ty, j.w, j.rows, j.cols, j.x, j.n, j.y)?;
                    cpu += 1;
                }
            }
        }
        if cpu > 0 {
            self.d.lock().stats.cpu_jobs += cpu;
        }
        if gpu.is_empty() {
            return Ok(());
        }
        self.d.run_gpu(&mut gpu, &fis)
    }

    fn name(&self) -> &'static str {
        "cuda"
    }
}
