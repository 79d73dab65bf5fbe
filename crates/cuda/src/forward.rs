//! The whole forward pass of a plain decoder on the GPU.
//!
//! Owns: [`GpuDecoder`], a `sluice_models::plan::DeviceForward` over a
//! [`DecoderPlan`] (every architecture's): its check (`check`; the blocks' own checks in
//! `blocks` and `forward/check.rs`), the upload of every resident weight at start (`new`;
//! `Uploader`, whose block methods live with the blocks), the per-sequence state
//! ([`GpuKv`], in `SeqState::device`: `forward/state.rs`, the KV rows and each layer's
//! `LayerState`, a block's own state type), and per forward call one upload of the batch's
//! header (tokens, positions, chunk tables, `Header`), then only kernel launches on one
//! stream through the typed launches of `crate::kernels` (all through `crate::launch`):
//! `GpuDecoder::run` is the loop (embedding, per layer the PLE layer, the attention
//! block, the residual mix, the feed-forward block, the residual mix, then
//! `GpuDecoder::head`), each block's launch sequence a method in `crate::blocks` reading
//! its group of the call's buffers from `Call` (`forward/bufs.rs`, `forward/scratch.rs`);
//! the weight products are `forward/products.rs`. Decode steps are captured as CUDA graphs
//! and replayed (`GpuDecoder::replay`). One download of the logits.
//!
//! Routed experts either live in VRAM whole (the stacked tensors uploaded at start; the
//! router's choice never leaves the device) or, when they do not fit or stream from the
//! SSD, in a VRAM unit cache with a hard byte budget (`--gpu-expert-cache`, least recently
//! used evicted, never a unit the layer uses) over the expert source (the RAM tier over the
//! SSD): then each MoE layer downloads its chosen ids and builds its chunk table on the
//! host, hits first: the hits' gate / up products are queued at once, and the misses are
//! read through the source and copied on a stream of their own while those run; the
//! misses' rows of the pointer table are written and their products queued after. The
//! kernels see weights only through that table, so where an expert lives never changes a
//! bit; each (token, slot) row is computed by one warp with the same arithmetic whatever
//! chunk it is in, so prompt chunking never does either.

use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUdevice_attribute;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr};
use sluice_models::blocks::dsv4_attention::Dsv4Shape;
use sluice_models::blocks::hyper::HcShape;
use sluice_models::blocks::mla::MlaShape;
use sluice_models::blocks::{head, Batch, Env};
use sluice_models::plan::{DecoderPlan, DeviceForward, HyperHead, PlanAttn, PlanFfn};
use sluice_models::state::SeqState;
use sluice_models::ModelError;

use crate::blocks::attention::Gqa;
use crate::blocks::deltanet::{DDelta, GDN_STATIC_SMEM};
use crate::blocks::dsv4_attention::DDsv4;
use crate::blocks::ffn::DenseFfn;
use crate::blocks::hyper::DHc;
use crate::blocks::hyper_lowrank::DMix;
use crate::blocks::kda::DKda;
use crate::blocks::mla::{DSelect, Mla};
use crate::blocks::mla_pooled::pooled_mla_shape;
use crate::blocks::moe::{Moe, UnitCache};
use crate::blocks::ple::DPle;
use crate::blocks::qsa::DQsa;
use crate::blocks::{attention, dsv4_attention, hyper, mla, moe};
use crate::forward::bufs::{FfnDims, HeadBufs, Io, ResidualBufs};
use crate::forward::check::{glm5next_parts, qwen4exp_parts};
use crate::forward::products::{mvd_min_blocks, Mvt1Staging};
use crate::forward::scratch::NextDims;
use crate::forward::state::{state_mismatch, LayerPtrs, OwnPtrs};
use crate::launch::{launch, A, PRODUCT_SIGNATURES};
use crate::{kernel_format, kernels, Cuda, Device};

pub(crate) mod bufs;
pub(crate) mod call;
mod check;
pub(crate) mod products;
pub(crate) mod scratch;
pub(crate) mod state;
pub(crate) mod upload;

pub(crate) use call::{addr, graph_key, push_chunk, rows_n, Call, Scratch};
pub use state::GpuKv;
pub(crate) use upload::{segment_counts, weights_fit, Uploader};

/// Rows of X one chunk holds (`MVG_N` of `forward.cu`).
pub(crate) const MVG_N: usize = 32;

/// Bytes of one `Chunk` of `forward.cu`.
pub(crate) const CHUNK_BYTES: usize = 8 + 4 * MVG_N;

/// Widest key and value heads and most experts the kernels take (`ATT_MAX_D`,
/// `ATT_MAX_V`, `ROUTER_MAX`).
pub(crate) const MAX_HEAD_DIM: usize = 576;

pub(crate) const MAX_HEAD_DIM_V: usize = 512;

/// Captured decode steps kept (sequences decoding in turn each replay their own).
pub(crate) const GRAPHS_KEPT: usize = 8;

/// Threads of one attention block (`ATT_THREADS` of `forward.cu`).
pub(crate) const ATT_THREADS: u32 = 256;

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn err(what: &str, e: impl std::fmt::Display) -> ModelError {
    ModelError::Compute(format!("cuda: {what}: {e}"))
}

/// A weight matrix in VRAM: the index of its pointer-table entry (or of the first of
/// `n_expert` entries for a routed part), format and shape.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DMat {
    pub(crate) tab: usize,
    pub(crate) fi: usize,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) row_bytes: i64,
}

pub(crate) enum DFfn {
    Dense(DenseFfn),
    Moe(Box<Moe>),
}

pub(crate) enum DAttn {
    Gqa(Gqa),
    /// Absorbed MLA (and GLM-5.3-Flash's pooled layers through the same view).
    Mla(Box<Mla>),
    /// DeepSeek V4 attention (sliding window, compressed rows, sinks).
    Dsv4(Box<DDsv4>),
    /// Gated DeltaNet (a recurrent state per value head).
    Delta(Box<DDelta>),
    /// QSA indexed attention (gated GQA over the positions its indexer picks).
    Qsa(Box<DQsa>),
    /// Kimi delta attention (a recurrent state per head, per-channel decay).
    Kda(Box<DKda>),
}

pub(crate) struct DLayer {
    attn_norm: u64,
    attn: DAttn,
    post_attn: u64,
    ffn_norm: u64,
    ffn: DFfn,
    post_ffn: u64,
    /// Hyper-connection mixes around the attention and feed-forward halves.
    hc: Option<[DHc; 2]>,
    /// Low-rank mixers of the two halves (in place of the norms).
    lr: Option<[DMix; 2]>,
    /// The PLE layer applied to the streams before this layer.
    ple: Option<Box<DPle>>,
}

/// Parameter kinds of every `forward.cu` kernel, in order: `P` a device address (u64), `L`
/// a long long, `I` an int, `F` a float. Per-format and per-cache-type kernels are named by
/// their prefix (`mvg_`, `embed_`, `kv_store_`, `attention_`). Every launch is checked
/// against this table, and `no_gpu::kernels_compile_with_nvrtc` checks the table against
/// the compiled PTX's parameter lists, so a launch whose arguments drift from its kernel
/// fails with an error (on CI, without a GPU), not with garbage on the device.
pub const KERNEL_SIGNATURES: &[(&str, &str)] = &[
    ("mvg_", "PPPPPPIPPPIIIIL"),
    ("mvt_", "PPPPPPIPPPIIIIL"),
    ("mvt1_", "PPPPPPIPPPIIIILIII"),
    ("mvd_", "PPPPPPIPPPIIIILIII"),
    ("mvi_", "PPPPPPIPPPIIIIL"),
    ("mvi1_", "PPPPPPIPPPIIIILIII"),
    ("mvid_", "PPPPPPIPPPIIIILIII"),
    ("mvq_", "PPPPPPIPPPIIIIL"),
    ("quant_x8", "PPPIPI"),
    ("embed_", "PLPPIF"),
    ("rms_norm_rows", "PPPPIF"),
    ("residual_norm", "PPPPPIFPPPPI"),
    ("qk_norm_rope", "PPPPPPIIIFPPPIII"),
    ("kv_store_", "PPPPPII"),
    ("attention_", "PPPPPIIIIFIPPI"),
    ("topk_route", "PPIIIIFPPPPPP"),
    ("moe_chunks", "PIIPP"),
    ("glu_act", "PPLIF"),
    ("moe_combine", "PPPPPII"),
    ("mla_kv_prep", "PPPPPPIIF"),
    ("mla_q_split", "PPIII"),
    ("mla_q_join", "PPPPPIIII"),
    ("hc_expand", "PPII"),
    ("hc_pre", "PPPPPPPIIIIFF"),
    ("hc_post", "PPPII"),
    ("dsv4_heads", "PPPIIIIF"),
    ("dsv4_kv_prep", "PPPPIIIF"),
    ("dsv4_compress", "PPPPPPPPPIIIIIF"),
    ("ring_store", "PPPPPIII"),
    ("dsv4_index_scores", "PPPPPIIII"),
    ("dsv4_topk", "PPPPIII"),
    ("dsv4_attention", "PPPPPPPPPIIIIIF"),
    ("dsa_key_prep", "PPPPPPIIF"),
    ("rms_groups", "PPPIF"),
    ("lr_act", "PPPIIIF"),
    ("lr_mix", "PPPII"),
    ("lr_post", "PPPII"),
    ("ple_gate", "PPPPI"),
    ("conv_ring", "PPPPPPIII"),
    ("delta_rule", "PPPPPPPPPPPPIIIIIIIF"),
    ("qsa_prep", "PPPPPPPPPPPPIIIIIIF"),
    ("qsa_pool", "PPPPPIIIF"),
    ("qsa_expand", "PPPPPIIII"),
    ("rows_gather", "PPPI"),
    ("dot_rows_f32", "PPPII"),
    ("stream_mean", "PPII"),
    ("kda_gate", "PPPIIFI"),
    ("pool_prep", "PPPPPPPIFI"),
    ("pool_make", "PPPPPIII"),
];

/// The parameter kinds of kernel `name` ([`KERNEL_SIGNATURES`], and the products
/// backend's `mv_*` / `mm_*`: `crate::launch::PRODUCT_SIGNATURES`).
pub fn kernel_signature(name: &str) -> Option<&'static str> {
    KERNEL_SIGNATURES
        .iter()
        .chain(PRODUCT_SIGNATURES)
        .find(|(k, _)| {
            if k.ends_with('_') {
                name.starts_with(k)
            } else {
                name == *k
            }
        })
        .map(|(_, s)| *s)
}

/// A loaded kernel and what it takes.
pub(crate) struct Kernel {
    f: CudaFunction,
    name: String,
    sig: &'static str,
}

/// Kernels of `forward.cu` (per format where they dequantize).
pub(crate) struct Funcs {
    pub(crate) mvg: Vec<Kernel>,
    /// The tensor-core form per format (None: F32, BF16, or no sm_80): for chunks of at
    /// most 8 rows (`mvt1_*`, fewer registers), of up to MVG_N (`mvt_*`), and the decode
    /// kernel in blocks of 4 warps (`mvd_*`, the default for chunks of at most 8 rows); all
    /// three compute a row the same way.
    pub(crate) mvt: Vec<Option<[Kernel; 3]>>,
    /// The int8 forms of the same three (`mvi1_*`, `mvi_*`, `mvid_*`: Q4_K and Q8_0, when
    /// the f16 ones are loaded; None otherwise), over `quant_x8`'s quantized input.
    pub(crate) mvi: Vec<Option<[Kernel; 3]>>,
    pub(crate) quant_x8: Kernel,
    /// The int8 decode product on dp4a (`mvq_*`: Q4_K), the same bits as `mvi*_*`: 16
    /// lanes a weight row, and 8 (`mvq_*_q`).
    pub(crate) mvq: Vec<Option<[Kernel; 2]>>,
    pub(crate) embed: Vec<Kernel>,
    pub(crate) rms_norm_rows: Kernel,
    pub(crate) residual_norm: Kernel,
    pub(crate) qk_norm_rope: Kernel,
    /// (f16 cache, f32 cache)
    pub(crate) kv_store: [Kernel; 2],
    pub(crate) attention: [Kernel; 2],
    pub(crate) topk_route: Kernel,
    pub(crate) moe_chunks: Kernel,
    pub(crate) glu_act: Kernel,
    pub(crate) moe_combine: Kernel,
    pub(crate) mla_kv_prep: Kernel,
    pub(crate) mla_q_split: Kernel,
    pub(crate) mla_q_join: Kernel,
    pub(crate) hc_expand: Kernel,
    pub(crate) hc_pre: Kernel,
    pub(crate) hc_post: Kernel,
    pub(crate) dsv4_heads: Kernel,
    pub(crate) dsv4_kv_prep: Kernel,
    pub(crate) dsv4_compress: Kernel,
    pub(crate) ring_store: Kernel,
    pub(crate) dsv4_index_scores: Kernel,
    pub(crate) dsv4_topk: Kernel,
    pub(crate) dsv4_attention: Kernel,
    pub(crate) dsa_key_prep: Kernel,
    /// Qwen3.8-Flash-Next's blocks' kernels (`qwen4exp.cu`).
    pub(crate) rms_groups: Kernel,
    pub(crate) lr_act: Kernel,
    pub(crate) lr_mix: Kernel,
    pub(crate) lr_post: Kernel,
    pub(crate) ple_gate: Kernel,
    pub(crate) conv_ring: Kernel,
    pub(crate) delta_rule: Kernel,
    pub(crate) qsa_prep: Kernel,
    pub(crate) qsa_pool: Kernel,
    pub(crate) qsa_expand: Kernel,
    pub(crate) rows_gather: Kernel,
    pub(crate) dot_rows_f32: Kernel,
    /// GLM-5.3-Flash's blocks' kernels (`glm5next.cu`).
    pub(crate) stream_mean: Kernel,
    pub(crate) kda_gate: Kernel,
    pub(crate) pool_prep: Kernel,
    pub(crate) pool_make: Kernel,
}

/// A captured decode step (`CudaGraph` holds raw driver handles, so it is neither `Send`
/// nor `Sync` by itself).
pub(crate) struct Graph(cudarc::driver::CudaGraph);

// SAFETY: the graph is only touched under `GpuDecoder::graph`'s mutex (launched or
// dropped by one thread at a time), which is what the driver requires of graph objects;
// its handles are not tied to the thread that made them.
unsafe impl Send for Graph {}

// SAFETY: as above: every use goes through the mutex.
unsafe impl Sync for Graph {}

/// A plain decoder's forward pass on one GPU (see the module header).
pub struct GpuDecoder {
    pub(crate) d: Arc<Device>,
    /// The decoder's own stream (the device's default stream cannot be captured).
    pub(crate) stream: Arc<CudaStream>,
    /// Uploads of VRAM expert-cache misses, while the hits' products run on `stream`.
    pub(crate) copy: Arc<CudaStream>,
    /// Captured decode steps, most recent first, keyed by every address their launches
    /// take (scratch buffers, the sequence's KV cache): one per sequence a server
    /// interleaves, up to [`GRAPHS_KEPT`].
    pub(crate) graph: Mutex<Vec<(Vec<u64>, Graph)>>,
    /// Whether decode steps are captured and replayed (`SLUICE_CUDA_GRAPHS=0`: never;
    /// turned off if a capture fails).
    pub(crate) graphs: std::sync::atomic::AtomicBool,
    /// The decode kernels' staging (`mvt1_*`, `mvd_*`).
    pub(crate) mvt1: Mvt1Staging,
    pub(crate) mvd: Mvt1Staging,
    /// Decode products (chunks of at most 8 rows) of at least this many blocks (16-row
    /// tiles x chunks) take `mvd_*`, the rest `mvt1_*` (`SLUICE_CUDA_MVD_MIN_BLOCKS`,
    /// default [`MVD_MIN_BLOCKS`]; `SLUICE_CUDA_DECODE=mvt1`: never, for A/B; the same bits).
    pub(crate) mvd_min_blocks: usize,
    /// Whether the products of Q4_K and Q8_0 weights take the int8 kernels (`mvi_*`,
    /// default; `SLUICE_CUDA_INT8=0`: the f16 ones, for A/B); and the widest product input
    /// (columns), which sizes their quantized input.
    pub(crate) int8: bool,
    pub(crate) xq_cols: usize,
    /// Whether decode products take `mvq_*` where the format has it (default;
    /// `SLUICE_CUDA_DP4A=0`: the tensor-core decode kernels, for A/B; the same bits).
    pub(crate) dp4a: bool,
    /// Which rows take `mvq_*_q` (8 lanes a row): 1 those of a number of 32-column blocks
    /// that leaves 16 lanes unevenly loaded (1..=8 mod 16, the default), 0 none, 2 all
    /// (`SLUICE_CUDA_MVQ_Q`, for A/B; the same bits).
    pub(crate) mvq_q: u8,
    /// Fused small launches (`SLUICE_CUDA_FUSE=0`: off, for A/B; the same bits): a decode
    /// step's resident experts' chunk table written by `topk_route` (no `moe_chunks`), the
    /// MoE combine inside the next `residual_norm` (no `moe_combine`).
    pub(crate) fuse: bool,
    /// The plan's MLA layers' shape (`DecoderPlan::mla_shape`; checked to be every one's),
    /// or its pooled layers' absorbed view.
    pub(crate) mla: Option<MlaShape>,
    /// Column segments of the hyper-connection projections.
    pub(crate) hc_nseg: usize,
    /// The plan's DeepSeek V4 layers' shape (checked to be every one's).
    pub(crate) dsv4: Option<Dsv4Shape>,
    /// The hyper-connection residual's shape and head mix (None: the streams' mean).
    pub(crate) hyper: Option<(HcShape, Option<DHc>)>,
    /// The low-rank residual's output mixer (its stream count is `next_dims.streams`).
    pub(crate) lowrank: Option<DMix>,
    /// Whether some layer keeps state that only continues or restarts at position 0
    /// (DeepSeek V4's windows, DeltaNet's recurrence, the PLE convolution).
    pub(crate) sequential: bool,
    pub(crate) index_dims: IndexDims,
    pub(crate) next_dims: NextDims,
    pub(crate) plan: DecoderPlan,
    pub(crate) f: Funcs,
    pub(crate) layers: Vec<DLayer>,
    pub(crate) embd: DMat,
    pub(crate) embd_ptr: u64,
    pub(crate) output_norm: u64,
    pub(crate) output: DMat,
    /// Pointer table: one entry per dense matrix, `n_expert` per routed part (written
    /// again per layer for cached experts).
    pub(crate) ptrs: Mutex<CudaSlice<u64>>,
    /// The table's device address (entry i at `ptrs_base + 8 i`).
    pub(crate) ptrs_base: u64,
    /// Experts not resident whole: the VRAM unit cache.
    pub(crate) units: Option<Mutex<UnitCache>>,
    /// The widest feed-forward (the feed-forward buffers' sizes).
    pub(crate) ffn_dims: FfnDims,
    pub(crate) scratch: Mutex<Scratch>,
    /// Device memory the weights took (statistics).
    pub weight_bytes: u64,
    pub(crate) _owned: Vec<CudaSlice<u8>>,
    pub(crate) _norms: Vec<CudaSlice<f32>>,
}

/// Where routed experts live on the GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertPlacement {
    /// The stacked expert tensors uploaded whole at start.
    Resident,
    /// A VRAM unit cache of the backend's `--gpu-expert-cache` budget over the expert
    /// source.
    Cached,
}

/// Per-token widths of the compressor and indexer scratch, the widest over the layers
/// (found once, when the decoder is built).
#[derive(Debug, Clone, Copy)]
pub(crate) struct IndexDims {
    /// A DeepSeek V4 compressor's and its indexer compressor's products (`coff * head_dim`).
    comp_w: usize,
    idx_w: usize,
    /// An indexer's queries (`n_head * head_dim`), head weights and top-k.
    idx_q: usize,
    idx_heads: usize,
    top_max: usize,
    /// GLM's DSA indexer keys, QSA's raw indexer keys (0: none).
    dsa_d: usize,
    /// Positions per scored row (the smallest; 1 for GLM's indexer, 0: no indexer).
    ratio: usize,
}

impl IndexDims {
    fn of(layers: &[DLayer]) -> IndexDims {
        let mut d = IndexDims {
            comp_w: 1,
            idx_w: 1,
            idx_q: 1,
            idx_heads: 1,
            top_max: 1,
            dsa_d: 0,
            ratio: 0,
        };
        for l in layers {
            match &l.attn {
                DAttn::Mla(m) => match &m.select {
                    DSelect::Indexer(ix) => {
                        d.indexer(ix.n_head, ix.head_dim, ix.top_k, 1, ix.head_dim)
                    }
                    DSelect::Pooled(ix) => {
                        d.indexer(ix.n_head, ix.head_dim, ix.keep, ix.kpool, ix.head_dim)
                    }
                    DSelect::All | DSelect::Previous => {}
                },
                DAttn::Qsa(a) => {
                    let s = &a.shape;
                    if let Some(blocks) = s.budget.checked_div(s.ratio) {
                        d.indexer(s.idx_heads, s.idx_dim, blocks, s.ratio, s.idx_dim);
                    }
                }
                DAttn::Dsv4(a) => {
                    if let Some(c) = &a.comp {
                        d.comp_w = d.comp_w.max(c.coff * c.head_dim);
                    }
                    if let Some(ix) = &a.indexer {
                        d.idx_w = d.idx_w.max(ix.comp.coff * ix.comp.head_dim);
                        d.indexer(ix.n_head, ix.head_dim, ix.top_k, ix.comp.ratio, 0);
                    }
                }
                _ => {}
            }
        }
        d
    }

    /// Widen the dims for an indexer of `heads` query heads of `dim`, choosing `top` rows
    /// of `ratio` positions each, whose batch keys are `keys` wide (0: none in the scratch).
    fn indexer(&mut self, heads: usize, dim: usize, top: usize, ratio: usize, keys: usize) {
        self.idx_q = self.idx_q.max(heads * dim);
        self.idx_heads = self.idx_heads.max(heads);
        self.top_max = self.top_max.max(top);
        self.dsa_d = self.dsa_d.max(keys);
        self.ratio = if self.ratio == 0 {
            ratio
        } else {
            self.ratio.min(ratio)
        };
    }
}

/// The most dynamic shared memory a block of any GPU this backend runs on may opt in to
/// (Hopper's 227 KiB); the device's own limit is checked again when the decoder is built.
pub(crate) const SMEM_OPTIN_MAX: usize = 227 * 1024;

impl GpuDecoder {
    /// Whether `plan` can run on the GPU: every matrix in a format the kernels take, heads
    /// and routers within the kernels' limits. The reason when not.
    pub fn check(plan: &DecoderPlan) -> Result<(), String> {
        for (il, l) in plan.layers.iter().enumerate() {
            // Without low-rank mixers every half-block has its norm.
            if plan.lowrank.is_none() && (l.attn_norm.is_empty() || l.ffn_norm.is_empty()) {
                return Err(format!(
                    "layer {il}: a block without its norms has no GPU kernel"
                ));
            }
        }
        if plan.lowrank.is_none() && plan.output_norm.is_empty() {
            return Err("a head without an output norm has no GPU kernel".into());
        }
        if plan.lowrank.is_some() && plan.hyper.is_some() {
            return Err("low-rank and learned hyper-connections together".into());
        }
        let gdn_max = SMEM_OPTIN_MAX - GDN_STATIC_SMEM;
        qwen4exp_parts(plan, gdn_max)?;
        glm5next_parts(plan, gdn_max)?;
        hyper::check(plan)?;
        dsv4_attention::check(plan)?;
        moe::check_hash_tables(plan)?;
        attention::check_shape(plan)?;
        mla::check(plan)?;
        let kernel = |ty: sluice_kernels::GgmlType, cols: usize, what: &str| {
            kernel_format(ty, cols)
                .map(|_| ())
                .ok_or_else(|| format!("{what}: {ty:?} with {cols} columns has no GPU kernel"))
        };
        for (what, m) in plan.matrices() {
            kernel(m.ty, m.cols, &what)?;
        }
        moe::check(plan)?;
        Ok(())
    }

    /// Upload `plan`'s weights (ranges of `map`) and build the decoder. `experts`: where
    /// routed experts live ([`ExpertPlacement::Cached`] needs the backend's VRAM expert
    /// cache budget, [`Cuda::set_expert_cache`]). Errors name what does not fit or has no
    /// kernel.
    pub fn new(
        cuda: &Cuda,
        plan: DecoderPlan,
        map: &[u8],
        experts: ExpertPlacement,
    ) -> Result<GpuDecoder, String> {
        Self::check(&plan)?;
        let d = cuda.d.clone();
        let stream = d
            .ctx
            .new_stream()
            .map_err(|e| format!("a stream for the forward pass: {e}"))?;
        let copy = d
            .ctx
            .new_stream()
            .map_err(|e| format!("a stream for expert uploads: {e}"))?;
        // The decode kernel's dynamic shared memory: up to what a block may opt in to.
        let smem_max = d
            .ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(|e| format!("shared memory per block: {e}"))?
            .max(48 * 1024) as usize;
        let (mvt1, mvd) = (Mvt1Staging::mvt1(smem_max), Mvt1Staging::mvd(smem_max));
        let f = Funcs::load(&d, smem_max)?;
        // DeltaNet's state lives in shared memory while a batch runs: the kernel may have
        // what its widest head needs (the opt-in limit less the kernel's static shared
        // memory is the driver's to check).
        let gdn_max = smem_max.saturating_sub(GDN_STATIC_SMEM);
        qwen4exp_parts(&plan, gdn_max)?;
        glm5next_parts(&plan, gdn_max)?;
        f.fit_delta_rule(&plan)?;
        let expert_budget = weights_fit(&d, &plan, experts)?;
        let mut up = Uploader {
            stream: stream.clone(),
            map,
            owned: Vec::new(),
            norms: Vec::new(),
            tab: Vec::new(),
            uploaded: 0,
        };
        let embd = up.mat(&plan.embd)?;
        let embd_ptr = up.tab[embd.tab];
        let output = up.mat(&plan.output)?;
        let output_norm = up.norm(&plan.output_norm)?;
        let (hc_nseg, lr_nseg) = segment_counts(&plan);
        let (layers, ffn_dims) = up.layers(&plan, experts, hc_nseg, lr_nseg)?;
        let hyper = match &plan.hyper {
            Some(h) => match &h.head {
                HyperHead::Learned(w) => Some((h.shape, Some(up.hc(w, hc_nseg)?))),
                HyperHead::Mean => Some((h.shape, None)),
            },
            None => None,
        };
        let lowrank = plan
            .lowrank
            .as_ref()
            .map(|lr| up.mix(&lr.head, 1))
            .transpose()?;
        let Uploader {
            owned,
            norms,
            tab,
            uploaded,
            ..
        } = up;
        let ptrs = stream
            .clone_htod(&tab[..])
            .map_err(|e| format!("uploading the pointer table: {e}"))?;
        let ptrs_base = ptrs.device_ptr(&stream).0;
        stream
            .synchronize()
            .map_err(|e| format!("uploading the weights: {e}"))?;
        {
            let mut g = d.lock();
            g.stats.resident_bytes += uploaded;
            g.stats.resident_mats += owned.len() as u64;
        }
        let units = (experts == ExpertPlacement::Cached)
            .then(|| Mutex::new(UnitCache::new(expert_budget, tab.clone())));
        Ok(GpuDecoder {
            d,
            stream,
            copy,
            graph: Mutex::new(Vec::new()),
            graphs: std::sync::atomic::AtomicBool::new(
                !std::env::var("SLUICE_CUDA_GRAPHS").is_ok_and(|v| v == "0"),
            ),
            mvt1,
            mvd,
            mvd_min_blocks: mvd_min_blocks(),
            int8: std::env::var("SLUICE_CUDA_INT8").map_or(true, |v| v != "0"),
            xq_cols: widest_cols(&plan),
            dp4a: std::env::var("SLUICE_CUDA_DP4A").map_or(true, |v| v != "0"),
            mvq_q: std::env::var("SLUICE_CUDA_MVQ_Q")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(1),
            fuse: std::env::var("SLUICE_CUDA_FUSE").map_or(true, |v| v != "0"),
            mla: plan
                .mla_shape()
                .or(plan.layers.iter().find_map(|l| match &l.attn {
                    PlanAttn::Pooled { shape, .. } => Some(pooled_mla_shape(shape)),
                    _ => None,
                })),
            hc_nseg,
            dsv4: plan.dsv4_shape(),
            index_dims: IndexDims::of(&layers),
            hyper,
            lowrank,
            sequential: plan.layers.iter().any(|l| {
                matches!(
                    l.attn,
                    PlanAttn::Dsv4 { .. } | PlanAttn::Delta { .. } | PlanAttn::Kda { .. }
                ) || l.ple.is_some()
            }),
            next_dims: NextDims::of(&plan, lr_nseg),
            plan,
            f,
            layers,
            embd,
            embd_ptr,
            output_norm,
            output,
            ptrs: Mutex::new(ptrs),
            ptrs_base,
            units,
            ffn_dims,
            scratch: Mutex::new(Scratch::default()),
            weight_bytes: uploaded,
            _owned: owned,
            _norms: norms,
        })
    }
}

/// The most columns any of `plan`'s products has (dense matrices, routed experts, pooled
/// layers' per-head tensors).
fn widest_cols(plan: &DecoderPlan) -> usize {
    let dense = plan
        .matrices()
        .iter()
        .map(|(_, m)| m.cols)
        .max()
        .unwrap_or(0);
    let other = plan
        .layers
        .iter()
        .flat_map(|l| {
            let routed = match &l.ffn {
                PlanFfn::Moe { experts, .. } => experts.iter().map(|s| s.cols).max(),
                PlanFfn::Dense { .. } => None,
            };
            let pooled = match &l.attn {
                PlanAttn::Pooled { w, .. } => Some(w.k_b.cols.max(w.v_b.cols)),
                _ => None,
            };
            [routed, pooled]
        })
        .flatten()
        .max()
        .unwrap_or(0);
    dense.max(other)
}

pub(crate) fn i32_of(v: usize, what: &str) -> Result<i32, ModelError> {
    i32::try_from(v).map_err(|_| ModelError::Compute(format!("cuda: {what} {v} is too large")))
}

impl GpuDecoder {
    /// Launch `k` over `grid` with `block` threads and `smem` bytes of dynamic shared
    /// memory (the one door every typed launch of [`crate::kernels`] goes through).
    pub(crate) fn launch_smem(
        &self,
        k: &Kernel,
        grid: (u32, u32, u32),
        block: u32,
        smem: usize,
        args: &[A],
    ) -> Result<(), ModelError> {
        // SAFETY: `k.sig` is the `forward.cu` kernel's parameter list (KERNEL_SIGNATURES,
        // which the NVRTC test checks against the PTX: device addresses as 64-bit values,
        // int, float, long long), and `launch` refuses arguments of other kinds; the dynamic
        // shared memory is what the kernel is told it has (`mvt1_*`: its stage layout,
        // within the size its attribute allows, set at load); each address points into a
        // live buffer of this decoder (weights, pointer table, scratch grown for this call,
        // the sequence's KV cache and state) sized for the grid, whose blocks past the data
        // return. Buffers outlive the launch: the call synchronizes (the logits download)
        // before any of them can be dropped or regrown.
        unsafe { launch(&self.stream, &k.f, &k.name, k.sig, grid, block, smem, args) }
            .map_err(|m| ModelError::Compute(format!("cuda: {m}")))
    }

    /// `out[i] = rms_norm(x[rows ? rows[i] : i]) * w` for `n` rows of `cols`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rms_norm(
        &self,
        x: u64,
        w: u64,
        out: u64,
        rows: u64,
        n: usize,
        cols: usize,
        eps: f32,
    ) -> Result<(), ModelError> {
        kernels::RmsNormRows {
            x,
            w,
            out,
            rows,
            cols: i32_of(cols, "n_embd")?,
            eps,
        }
        .launch(self, (n as u32, 1, 1))
    }

    /// `x += post ? rms_norm(o) * post : o`, then `h = rms_norm(x) * next` if `next`
    /// (addresses; 0 = none), for `n` rows.
    #[allow(clippy::too_many_arguments)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn residual(
        &self,
        x: u64,
        o: u64,
        post: u64,
        next: u64,
        h: u64,
        n: usize,
        cols: usize,
        eps: f32,
        combine: Option<moe::Combine>,
    ) -> Result<(), ModelError> {
        let c = combine.unwrap_or_default();
        kernels::ResidualNorm {
            x,
            o,
            post,
            next,
            h,
            cols: i32_of(cols, "n_embd")?,
            eps,
            d: c.d,
            wts: c.wts,
            sh: c.sh,
            sg: c.sg,
            k: c.k,
        }
        .launch(self, (n as u32, 1, 1))
    }
}

impl GpuDecoder {
    /// Launch the decode step captured under `key` (every address its launches take), or
    /// capture `run` under it first; `run` directly when the step cannot be captured.
    fn replay(
        &self,
        key: Vec<u64>,
        run: &dyn Fn() -> Result<(), ModelError>,
    ) -> Result<(), ModelError> {
        let stream = &self.stream;
        let mut gc = lock(&self.graph);
        match gc.iter().position(|(k0, _)| *k0 == key) {
            Some(i) => {
                let hit = gc.remove(i);
                gc.insert(0, hit);
            }
            None => {
                stream
                    .begin_capture(
                        cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
                    )
                    .map_err(|e| err("graph capture", e))?;
                let r = run();
                let captured = stream.end_capture(cudarc::driver::sys::CUgraphInstantiate_flags(0));
                r?;
                match captured {
                    Ok(Some(gr)) => {
                        gc.truncate(GRAPHS_KEPT - 1);
                        gc.insert(0, (key, Graph(gr)));
                    }
                    // Not capturable here: launch directly from now on.
                    _ => {
                        self.graphs
                            .store(false, std::sync::atomic::Ordering::Relaxed);
                        gc.clear();
                    }
                }
            }
        }
        match gc.first() {
            Some((_, gr)) => gr.0.launch().map_err(|e| err("graph launch", e))?,
            None => run()?,
        }
        Ok(())
    }

    /// The attention half of layer `il` (`attn`) on the normed input `c.io.h`, its output
    /// into `c.io.o` (through the block's output matrix); `mla_sel` carries the MLA
    /// selection later layers reuse.
    fn attention_half(
        &self,
        il: usize,
        attn: &DAttn,
        c: &Call<'_>,
        mla_sel: &mut (u64, u64, usize),
    ) -> Result<(), ModelError> {
        let (io, nb) = (&c.io, &c.next);
        let LayerPtrs { kv: cache, own, .. } = c.layers[il];
        let wo = match (attn, own) {
            (DAttn::Gqa(w), _) => self.gqa(w, io, &c.attn, cache)?,
            (DAttn::Mla(w), own) => self.mla(w, il, c, cache, own, mla_sel)?,
            (DAttn::Dsv4(a), OwnPtrs::Dsv4(st)) => self.dsv4(a, c, st)?,
            (DAttn::Delta(w), OwnPtrs::Delta(st)) => {
                self.delta(w, st, io, nb)?;
                (&w.out, nb.dout)
            }
            (DAttn::Qsa(w), own) => {
                let st = match own {
                    OwnPtrs::Qsa(st) => Some(st),
                    _ => None,
                };
                (&w.wo, self.qsa(w, c, cache, st)?)
            }
            (DAttn::Kda(w), OwnPtrs::Kda(st)) => {
                self.kda(w, st, io, nb)?;
                (&w.out, nb.dout)
            }
            _ => return Err(state_mismatch(il)),
        };
        self.mv_rows(&[(wo.0, io.o)], io.rows, wo.1)
    }

    /// The feed-forward half of layer `il` (`ffn`) on the normed input `c.io.h`, its output
    /// into `c.io.o`; with `defer_combine` (and fusing on) a MoE layer leaves its combine to
    /// the caller's `residual_norm` and returns it.
    #[allow(clippy::too_many_arguments)]
    fn feed_forward(
        &self,
        il: usize,
        ffn: &DFfn,
        c: &Call<'_>,
        env: &Env<'_>,
        host_ids: &mut Vec<i32>,
        defer_combine: bool,
    ) -> Result<Option<moe::Combine>, ModelError> {
        match ffn {
            DFfn::Dense(w) => self.dense_ffn(w, &c.io, &c.ffn).map(|()| None),
            DFfn::Moe(w) => {
                let defer = defer_combine && self.fuse;
                self.moe(w, il, &c.io, &c.ffn, c.next.sg, env, host_ids, defer)
            }
        }
    }

    /// One forward call's launches, in the plan's order (the GPU form of `CpuDecoder`'s
    /// loop): the embedding, per layer the PLE layer, the attention half (its block from
    /// `blocks`) and the feed-forward half, each between its residual mixes (norms,
    /// hyper-connections or low-rank mixers), then the head's rows. Captured as a graph
    /// for a decode step.
    fn run(&self, c: &Call<'_>, env: &Env<'_>) -> Result<(), ModelError> {
        let Io {
            n,
            e,
            ei,
            eps,
            tokens,
            rows,
            h,
            o,
            ..
        } = c.io;
        let ResidualBufs {
            x,
            n_hc,
            hs,
            lr_streams,
            hcf,
            hcm,
            hcpc,
            segs,
        } = c.res;
        let nb = &c.next;
        // With hyper-connections the embedding goes to `o`, then into every stream.
        let streams = hs.is_some() || lr_streams.is_some();
        kernels::Embed {
            format: self.embd.fi,
            w: self.embd_ptr,
            row_bytes: self.embd.row_bytes,
            tokens,
            x: if streams { o } else { x },
            cols: ei,
            scale: self.plan.embd_scale,
        }
        .launch(self, rows_n(n))?;
        if streams {
            kernels::HcExpand {
                src: o,
                x,
                e: ei,
                hc: n_hc as i32,
            }
            .launch(self, (n as u32, e.div_ceil(256) as u32, 1))?;
        } else if let Some(l0) = self.layers.first() {
            self.rms_norm(x, l0.attn_norm, h, 0, n, e, eps)?;
        }
        let mut host_ids: Vec<i32> = Vec::new();
        // The most recent DSA indexer's selection (positions, counts, top-k; zeros: all).
        let mut mla_sel: (u64, u64, usize) = (0, 0, 0);
        let hc_bufs = (hcf, hcm);
        for (il, l) in self.layers.iter().enumerate() {
            // Attention.
            if let Some(w) = &l.ple {
                self.ple_layer(w, (n_hc, x), c.layers[il].ple, &c.io, nb)?;
            }
            if let (Some(hw), Some(hs)) = (&l.hc, &hs) {
                self.hc_mix(&hw[0], hs, x, hc_bufs, hcpc, l.attn_norm, h, n, segs, eps)?;
            }
            if let Some(mx) = &l.lr {
                self.lr_mixer(&mx[0], n_hc, x, h, nb, (rows, segs), n, eps)?;
            }
            self.attention_half(il, &l.attn, c, &mut mla_sel)?;
            if let (Some(hw), Some(hs)) = (&l.hc, &hs) {
                self.hc_post(hs, x, o, hcpc, n)?;
                self.hc_mix(&hw[1], hs, x, hc_bufs, hcpc, l.ffn_norm, h, n, segs, eps)?;
            } else if let Some(mx) = &l.lr {
                self.lr_post(n_hc, x, o, nb.inj, n)?;
                self.lr_mixer(&mx[1], n_hc, x, h, nb, (rows, segs), n, eps)?;
            } else {
                self.residual(x, o, l.post_attn, l.ffn_norm, h, n, e, eps, None)?;
            }
            // Feed-forward. A MoE layer's combine goes into the plain residual step.
            let plain = !(l.hc.is_some() && hs.is_some()) && l.lr.is_none();
            let combine = self.feed_forward(il, &l.ffn, c, env, &mut host_ids, plain)?;
            if let (Some(_), Some(hs)) = (&l.hc, &hs) {
                self.hc_post(hs, x, o, hcpc, n)?;
            } else if l.lr.is_some() {
                self.lr_post(n_hc, x, o, nb.inj, n)?;
            } else {
                let next = self.layers.get(il + 1).map_or(0, |nl| nl.attn_norm);
                self.residual(x, o, l.post_ffn, next, h, n, e, eps, combine)?;
            }
        }
        self.head(c)
    }

    /// The head's launches: the logits rows' collapse of the streams (the low-rank output
    /// mixer, the hyper-connections' head mix or mean) and final norm, the output product.
    fn head(&self, c: &Call<'_>) -> Result<(), ModelError> {
        let Io { n, e, eps, h, .. } = c.io;
        let ResidualBufs {
            x,
            n_hc,
            hcf,
            hcm,
            segs,
            ..
        } = c.res;
        let HeadBufs {
            nr,
            rows,
            rowmap,
            hsel,
            logits,
        } = c.head;
        if nr == 0 {
            return Ok(());
        }
        if let Some(w) = &self.lowrank {
            // The output mixer normalises: it reads the logits rows' streams.
            let nb = &c.next;
            self.gather(x, rowmap, nb.xg, nr, n_hc * e)?;
            // (Its down product is not segmented: the rows are the logits rows.)
            self.lr_mixer(w, n_hc, nb.xg, hsel, nb, (rows, rows), nr, eps)?;
        } else {
            // Hyper-connections: the head's collapse of the streams first (into h).
            let last = match &self.hyper {
                Some((hs, Some(w))) => {
                    self.hc_mix(w, hs, x, (hcf, hcm), 0, 0, h, n, segs, eps)?;
                    h
                }
                Some((hs, None)) => {
                    self.stream_mean(x, h, hs.n_hc, n)?;
                    h
                }
                None => x,
            };
            self.rms_norm(last, self.output_norm, hsel, rowmap, nr, e, eps)?;
        }
        self.mv_rows(&[(&self.output, logits)], rows, hsel)
    }
}

impl DeviceForward for GpuDecoder {
    fn forward(
        &self,
        env: &Env<'_>,
        batch: &Batch<'_>,
        state: &mut SeqState,
        rows: &[usize],
    ) -> Result<Vec<f32>, ModelError> {
        let t0 = std::time::Instant::now();
        let n = batch.len();
        if n == 0 {
            return Ok(Vec::new());
        }
        let p = &self.plan;
        let nv = p.n_vocab;
        let pos0 = batch.positions[0];
        if pos0 + n > state.n_ctx() {
            return Err(ModelError::ContextFull {
                needed: pos0 + n,
                n_ctx: state.n_ctx(),
            });
        }
        p.check_length(&batch.positions)?;
        let mla = self.mla;
        // Rows of the per-head (MLA) or per-group (DeepSeek V4 output) products.
        let heads = mla
            .map(|m| m.n_head)
            .or(self.dsv4.map(|s| s.o_groups))
            .unwrap_or(0);
        let kv = self.kv(state, pos0)?;
        let kvt = usize::from(kv.f32);
        if self.sequential {
            // Windows, compressor carries, recurrent states and the PLE convolution
            // continue or restart at 0 (like PlanOnCpu).
            if pos0 != 0 && pos0 != kv.next {
                let held = if kv.next == usize::MAX {
                    "no position (an earlier call failed)".to_string()
                } else {
                    format!("{} positions", kv.next)
                };
                return Err(ModelError::Compute(format!(
                    "{}: the GPU attention state holds {held}, the batch starts at {pos0} (it cannot be truncated)",
                    p.arch
                )));
            }
            kv.next = usize::MAX;
        }
        // The PLE rows depend only on the token ids: hashed and gathered on the host (from
        // the mapped file or the row tier), uploaded once per call below.
        let ple_rows: Option<Vec<f32>> = match &p.ple {
            Some(pp) if self.next_dims.ple > 0 => {
                if pos0 == 0 {
                    kv.ple_ctx = vec![pp.hash.eos; pp.hash.ngram.saturating_sub(1)];
                }
                let (ids, ctx) = pp.hash.rows(&kv.ple_ctx, batch.tokens);
                pp.rows.prefetch(&ids);
                kv.ple_ctx = ctx;
                let mut rows = vec![0.0f32; n * self.next_dims.ple];
                pp.rows.gather(env.map, &ids, &mut rows)?;
                Some(rows)
            }
            _ => None,
        };
        let ptrs = kv.ptrs();
        let nr = rows.len();
        let stream = &self.stream;
        let mut sc = lock(&self.scratch);
        let sc = &mut *sc;
        let (call, hb) = self.call(sc, batch, rows, kvt, heads, ple_rows, &ptrs)?;
        let run = || self.run(&call, env);
        // A decode step whose buffers and sequence were captured before replays those
        // launches (one graph launch instead of ~16 launches per layer; the same kernels
        // with the same arguments, so the same bits: `--dump-logits` with
        // SLUICE_CUDA_GRAPHS=0 and 1 compared byte for byte on the H200).
        let graphable = n == 1
            && self.units.is_none()
            && env.routing.is_none()
            && self.graphs.load(std::sync::atomic::Ordering::Relaxed);
        if graphable {
            self.replay(graph_key(&call, hb), &run)?;
        } else {
            run()?;
        }
        let mut logits = Vec::new();
        if nr > 0 {
            logits.resize(nr * nv, 0.0f32);
            stream
                .memcpy_dtoh(
                    &sc.head.logits.as_ref().expect("grown").slice(0..nr * nv),
                    &mut logits[..],
                )
                .map_err(|e| err("logits", e))?;
        }
        stream.synchronize().map_err(|e| err("forward", e))?;
        if let Some(kv) = state
            .device
            .as_mut()
            .and_then(|x| x.as_any_mut().downcast_mut::<GpuKv>())
        {
            kv.next = pos0 + n;
        }
        {
            let mut g = self.d.lock();
            g.stats.forward_calls += 1;
            g.stats.forward_ns += t0.elapsed().as_nanos() as u64;
        }
        head::check_logits(&logits, rows, batch)?;
        Ok(logits)
    }

    fn name(&self) -> &'static str {
        "cuda"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocks::moe::{layer_table, rows_by_unit, LAYER_COUNTS_BYTES};
    use crate::forward::call::Header;
    use crate::forward::products::{MVD_STAGES, MVT1_PART, MVT_STEP};

    fn i32_at(b: &[u8], off: usize) -> i32 {
        i32::from_le_bytes(b[off..off + 4].try_into().unwrap())
    }

    /// The call header's layout is what `forward.cu` reads: tokens and positions as i32,
    /// the two chunk counts, the logits' row map, then 16-byte aligned `Chunk`s of MVG_N
    /// rows (every token once, in order; the logits' rows 0..rows.len()).
    #[test]
    fn header_layout() {
        let tokens: Vec<u32> = (100..119).collect();
        let batch = Batch {
            tokens: &tokens,
            positions: (7..26).collect(),
        };
        let h = Header::new(&batch, &[18, 3], 3, 2);
        let b = &h.bytes;
        assert_eq!(i32_at(b, h.tokens + 4 * 5), 105);
        assert_eq!(i32_at(b, h.pos + 4 * 18), 25);
        assert_eq!(i32_at(b, h.counts), 19usize.div_ceil(MVG_N) as i32);
        assert_eq!(i32_at(b, h.counts + 4), 1);
        assert_eq!(i32_at(b, h.rowmap), 18);
        assert_eq!(i32_at(b, h.rowmap + 4), 3);
        assert_eq!(h.dense % 16, 0);
        let mut seen = Vec::new();
        for c in 0..19usize.div_ceil(MVG_N) {
            let at = h.dense + c * CHUNK_BYTES;
            assert_eq!(i32_at(b, at), 0, "dense chunks use pointer-table entry 0");
            let count = i32_at(b, at + 4) as usize;
            for r in 0..count {
                seen.push(i32_at(b, at + 8 + 4 * r));
            }
        }
        assert_eq!(seen, (0..19).collect::<Vec<i32>>());
        assert_eq!(
            h.row_chunks,
            h.dense + 19usize.div_ceil(MVG_N) * CHUNK_BYTES
        );
        assert_eq!(i32_at(b, h.row_chunks + 4), 2);
        assert_eq!(
            (i32_at(b, h.row_chunks + 8), i32_at(b, h.row_chunks + 12)),
            (0, 1)
        );
        // MLA's per-head chunks: head h's unit is h, its rows t * 3 + h of every token.
        assert_eq!(i32_at(b, h.counts + 8), 3);
        assert_eq!(h.head_chunks, h.row_chunks + CHUNK_BYTES);
        for hd in 0..3usize {
            let at = h.head_chunks + hd * CHUNK_BYTES;
            assert_eq!(i32_at(b, at), hd as i32);
            assert_eq!(i32_at(b, at + 4), 19);
            let rows: Vec<i32> = (0..19).map(|r| i32_at(b, at + 8 + 4 * r)).collect();
            assert_eq!(rows, (0..19).map(|t| t * 3 + hd as i32).collect::<Vec<_>>());
        }
        // The hyper-connection segments: unit s, rows t * 2 + s.
        assert_eq!(i32_at(b, h.counts + 12), 2);
        assert_eq!(h.seg_chunks, h.head_chunks + 3 * CHUNK_BYTES);
        for sg in 0..2usize {
            let at = h.seg_chunks + sg * CHUNK_BYTES;
            assert_eq!(i32_at(b, at), sg as i32);
            let rows: Vec<i32> = (0..19).map(|r| i32_at(b, at + 8 + 4 * r)).collect();
            assert_eq!(rows, (0..19).map(|t| t * 2 + sg as i32).collect::<Vec<_>>());
        }
        assert_eq!(b.len(), h.seg_chunks + 2 * CHUNK_BYTES);
        assert_eq!(
            Header::new(&batch, &[18, 3], 0, 0).bytes.len(),
            h.head_chunks
        );
    }

    /// The decode kernel's staging: steps of whole 512-column multiples, as many as asked,
    /// fewer past a byte limit, the matrix or the shared memory a block may have; the stages
    /// fit that memory, the partial sums always fit.
    #[test]
    fn mvt1_staging_layout() {
        let (q8_row, q4k_row) = (2176, 1152); // 2048 columns of Q8_0, Q4_K
        let s = |stages: usize, step: usize, kb: usize| Mvt1Staging {
            stages,
            step,
            stage_bytes: kb * 1024,
            smem_max: 227 * 1024,
            fit_steps: false,
        };
        assert_eq!(s(3, 512, 0).layout(2048, q8_row), (3, 512, 8704, 3 * 8704));
        assert_eq!(
            s(3, 1536, 0).layout(2048, q8_row),
            (3, 1536, 26112, 3 * 26112)
        );
        // A byte limit: as many 512-column steps as fit it.
        assert_eq!(
            s(3, 4096, 16).layout(2048, q4k_row),
            (3, 1536, 13824, 3 * 13824)
        );
        assert_eq!(
            s(3, 4096, 16).layout(2048, q8_row),
            (3, 512, 8704, 3 * 8704)
        );
        // 768 columns: one step holds them all.
        assert_eq!(s(6, 4096, 0).layout(768, 432).1, 1024);
        // One small stage: the partial sums (8 KB) still fit.
        assert_eq!(s(1, 512, 0).layout(512, 288).3, MVT1_PART);
        // Too many stages for the memory: as many as fit.
        let (stages, _, stage, smem) = s(8, 1 << 20, 0).layout(16384, 34816);
        assert!(stages * stage <= 227 * 1024 && smem <= 227 * 1024 && stages >= 1);
        // `mvd_*`'s layout: 512-column stages within 32 KB, no more than the matrix's steps.
        let d = Mvt1Staging {
            stages: MVD_STAGES,
            step: MVT_STEP,
            stage_bytes: 0,
            smem_max: 32 * 1024,
            fit_steps: true,
        };
        assert_eq!(d.layout(2048, q4k_row), (4, 512, 4608, 4 * 4608));
        assert_eq!(d.layout(768, 432), (2, 512, 4608, MVT1_PART.max(2 * 4608)));
        assert_eq!(d.layout(2048, q8_row), (3, 512, 8704, 3 * 8704));
        // F16 (16 KB a stage): two.
        assert_eq!(d.layout(2048, 4096).0, 2);
    }

    /// A MoE layer's host-built table: the counts first, then every (token, slot) row
    /// exactly once, hits' units before misses' in the order given, each chunk one unit's
    /// rows in row order, at most MVG_N per chunk.
    #[test]
    fn layer_table_layout() {
        // 40 rows: unit 3 takes 35 of them (two chunks), units 1 and 7 the rest.
        let ids: Vec<i32> = (0..40)
            .map(|i| {
                if i % 8 == 1 {
                    1
                } else if i == 6 {
                    7
                } else {
                    3
                }
            })
            .collect();
        let rows_of = rows_by_unit(&ids);
        assert_eq!(rows_of.keys().copied().collect::<Vec<_>>(), vec![1, 3, 7]);
        let (b, hit, miss) = layer_table(&rows_of, &[3], &[1, 7]);
        assert_eq!((hit, miss), (2, 2));
        assert_eq!((i32_at(&b, 0), i32_at(&b, 4), i32_at(&b, 8)), (2, 2, 4));
        assert_eq!(b.len(), LAYER_COUNTS_BYTES + 4 * CHUNK_BYTES);
        let mut seen = Vec::new();
        let mut units = Vec::new();
        for c in 0..4 {
            let at = LAYER_COUNTS_BYTES + c * CHUNK_BYTES;
            let (unit, count) = (i32_at(&b, at), i32_at(&b, at + 4) as usize);
            assert!(count <= MVG_N);
            units.push(unit);
            for r in 0..count {
                let row = i32_at(&b, at + 8 + 4 * r);
                assert_eq!(ids[row as usize], unit, "row {row} in unit {unit}'s chunk");
                seen.push(row);
            }
        }
        assert_eq!(units, vec![3, 3, 1, 7]);
        let mut sorted = seen.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..40).collect::<Vec<i32>>(), "every row once");
    }
}
