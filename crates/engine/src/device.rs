//! Device choice: where a loaded model computes.
//!
//! Owns: [`Device`] (the CPU, or a CUDA GPU with its [`GpuOptions`]) as
//! [`crate::load::LoadOptions`] carries it, and attaching the GPU to a loaded model:
//! finding CUDA at run time (driver and NVRTC are loaded on first use, so a machine without
//! them says why in one line and stays on the CPU), the VRAM expert cache, page-locking
//! the RAM expert tier's slots, and the whole forward pass on the GPU when the
//! architecture's decoder plan exists and fits (else the weight products only). Every
//! line about it is a note of the load, so `run`, `bench`, `perplexity` and `serve` print
//! the same ones.

use std::sync::Arc;
use std::time::Instant;

use sluice_cuda::forward::{ExpertPlacement, GpuDecoder};
pub use sluice_cuda::{Cuda, CudaStats};

use crate::load::{human, Loaded};
use crate::EngineError;

/// Where the model computes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Device {
    /// The CPU's SIMD kernels (the default).
    #[default]
    Cpu,
    /// A CUDA GPU if this machine has a usable one (`--gpu`), else the CPU after one line
    /// saying why.
    Gpu(GpuOptions),
}

/// What `--gpu` is asked to do.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GpuOptions {
    /// `--gpu-expert-cache`: routed experts in a VRAM cache of this many bytes, a hard
    /// budget over the RAM tier and the SSD. None: experts read through the memory map
    /// stay in VRAM once used (while free VRAM lasts), streamed ones are copied per use.
    pub expert_cache: Option<u64>,
    /// The longest sequence the caller will run, when it is shorter than the context
    /// (`bench`: its prompt and generation lengths). A decoder plan that holds only up
    /// to a length (GLM-DSA: its indexer's top-k) is judged against this, else `ctx`.
    pub longest: Option<usize>,
}

/// `--gpu`: compute on the CUDA backend if this machine has a usable GPU, else say why
/// (one note) and stay on the CPU. A `--gpu-expert-cache` the GPU cannot hold is an error.
/// `ctx` is the context the caller plans for.
pub(crate) fn attach(
    l: &mut Loaded,
    opts: &GpuOptions,
    ctx: usize,
) -> Result<Option<Cuda>, EngineError> {
    let t0 = Instant::now();
    let c = match Cuda::new(l.model.map.bytes()) {
        Ok(c) => c,
        Err(e) => {
            l.notes.push(format!("--gpu: {e}; running on the CPU"));
            return Ok(None);
        }
    };
    l.notes.push(format!(
        "gpu: {} (CUDA; kernels compiled in {:.2} s)",
        c.device(),
        t0.elapsed().as_secs_f64(),
    ));
    if let Some(b) = opts.expert_cache {
        c.set_expert_cache(b).map_err(|e| EngineError::Option {
            flag: "--gpu-expert-cache",
            what: format!("{}: {e}", human(b)),
        })?;
        l.notes.push(format!(
            "gpu expert cache: {} of {} routed-expert bytes",
            human(b),
            human(l.model.groups.experts.total_bytes())
        ));
    }
    pin_slots(&c, l);
    l.model.set_compute(Box::new(c.clone()));
    whole_forward(
        &c,
        l,
        opts.expert_cache.is_some(),
        opts.longest.unwrap_or(ctx),
    );
    Ok(Some(c))
}

/// Run the whole forward pass on the GPU when the architecture describes itself as a plan
/// and its weights fit (routed experts resident whole in VRAM, or through the VRAM expert
/// cache when one is set or experts stream from the SSD); otherwise only the weight
/// products run there. A plan that holds only up to a length (GLM-DSA: its indexer's
/// top-k) is taken only when the sequences are within it, so a sequence never outgrows
/// it. `SLUICE_CUDA_FORWARD=0` keeps the products-only path (for A/B). One note either way.
fn whole_forward(c: &Cuda, l: &mut Loaded, vram_cache: bool, ctx: usize) {
    let products_only = |l: &mut Loaded, why: &str| {
        let n = format!(
            "gpu: weight products on the GPU, the rest on {} CPU threads ({why})",
            l.threads
        );
        l.notes.push(n);
    };
    if std::env::var("SLUICE_CUDA_FORWARD").is_ok_and(|v| v == "0") {
        products_only(l, "SLUICE_CUDA_FORWARD=0");
        return;
    }
    let Some(plan) = l.model.plan() else {
        let why = format!(
            "the whole-forward path does not cover {} yet",
            l.model.cfg.arch
        );
        products_only(l, &why);
        return;
    };
    let ctx = ctx.min(l.model.cfg.n_ctx_train);
    if let Some(max) = plan.max_positions.filter(|&m| ctx > m) {
        let why = format!(
            "{} runs as a plain decoder for {max} positions, its sparse indexer's top-k; sequences here reach {ctx} (--ctx, or bench's longest test): {max} or less for the whole forward pass on the GPU",
            l.model.cfg.arch
        );
        products_only(l, &why);
        return;
    }
    let placement = if vram_cache || l.streaming.is_some() {
        ExpertPlacement::Cached
    } else {
        ExpertPlacement::Resident
    };
    let t0 = Instant::now();
    match GpuDecoder::new(c, plan, l.model.map.bytes(), placement) {
        Ok(dec) => {
            l.notes.push(format!(
                "gpu: whole forward pass on the GPU ({}): {} of weights uploaded in {:.2} s{}",
                c.tensor_cores(),
                human(dec.weight_bytes),
                t0.elapsed().as_secs_f64(),
                match (placement, l.model.cfg.n_expert > 0) {
                    (_, false) => "",
                    (ExpertPlacement::Resident, true) => ", routed experts resident in VRAM",
                    (ExpertPlacement::Cached, true) =>
                        ", routed experts through the VRAM expert cache",
                }
            ));
            l.model.set_device_forward(Box::new(dec));
        }
        Err(e) => products_only(l, &e),
    }
}

/// Page-lock the RAM expert tier's slots for the GPU (slots allocated later are locked as
/// they come), so uploads of streamed experts run at pinned speed; `SLUICE_CUDA_PIN=0`
/// leaves them pageable (for A/B). One note either way.
fn pin_slots(c: &Cuda, l: &mut Loaded) {
    let Some(st) = &l.streaming else {
        return;
    };
    if std::env::var("SLUICE_CUDA_PIN").is_ok_and(|v| v == "0") {
        l.notes
            .push("gpu: expert cache slots left pageable (SLUICE_CUDA_PIN=0)".into());
        return;
    }
    st.set_slot_memory(Arc::new(c.clone()));
    let s = c.stats();
    l.notes.push(match c.pin_error() {
        Some(e) => format!(
            "gpu: page-locking the expert cache failed ({e}); uploads from it stay pageable"
        ),
        None => format!(
            "gpu: expert cache page-locked for uploads: {} in {} slots so far ({:.2} s), later slots as they are allocated",
            human(s.pinned_bytes),
            s.pinned_ranges,
            s.pin_ns as f64 * 1e-9
        ),
    });
}
