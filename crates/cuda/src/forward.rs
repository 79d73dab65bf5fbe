//! The whole forward pass of a plain decoder on the GPU.
//!
//! Owns: [`GpuDecoder`], a `sluice_models::plan::DeviceForward` over a
//! [`DecoderPlan`] (every architecture's): its check (`check`; the blocks' own checks in
//! `blocks` and `forward/check.rs`), the upload of every resident weight at start (`new`;
//! `Uploader`, whose block methods live with the blocks), the per-sequence state
//! ([`GpuKv`], in `SeqState::device`: the KV cache in VRAM and each layer's own state), and
//! per forward call one upload of the batch's header (tokens, positions, chunk tables,
//! `Header`), then only kernel launches on one stream through the typed launches of
//! `crate::kernels`: `GpuDecoder::run` is the loop (embedding, per layer the PLE layer,
//! the attention block, the residual mix, the feed-forward block, the residual mix, the
//! head), each block's launch sequence a method in `crate::blocks` reading the call's
//! addresses from `Call`; the weight products are `forward/products.rs`, the blocks'
//! scratch `forward/scratch.rs`. Decode steps are captured as CUDA graphs and replayed
//! (`GpuDecoder::replay`). One download of the logits.
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

use std::any::Any;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig, PushKernelArg};
use sluice_models::blocks::dsv4_attention::Dsv4Shape;
use sluice_models::blocks::hyper::HcShape;
use sluice_models::blocks::mla::MlaShape;
use sluice_models::blocks::{head, Batch, Env};
use sluice_models::plan::{DecoderPlan, DeviceForward, HyperHead, PlanAttn, PlanFfn};
use sluice_models::state::{ExtraState, SeqState};
use sluice_models::weights::Mat;
use sluice_models::ModelError;

use crate::blocks::attention::Gqa;
use crate::blocks::deltanet::{gdn_smem, DDelta, GDN_STATIC_SMEM};
use crate::blocks::dsa_indexer::SCORES_MAX;
use crate::blocks::dsv4_attention::{CompKv, DComp, DDsv4, Dsv4Kv, Dsv4Ptrs};
use crate::blocks::ffn::{act_id, DenseFfn};
use crate::blocks::hyper::{hc_segments, DHc};
use crate::blocks::hyper_lowrank::DMix;
use crate::blocks::kda::{delta_shape, kda_state, DKda};
use crate::blocks::mla::{DSelect, Mla};
use crate::blocks::mla_pooled::{pool_state, pooled_mla_shape};
use crate::blocks::moe::{Moe, UnitCache};
use crate::blocks::ple::{ple_state, DPle};
use crate::blocks::qsa::{DQsa, QsaBufs};
use crate::blocks::{attention, dsv4_attention, hyper, mla, moe};
use crate::forward::check::{glm5next_parts, qwen4exp_parts};
use crate::forward::products::{takes_f16, Mvt1Staging, MVT1_MAX_STAGES, MVT1_STAGES, MVT1_STEP};
use crate::forward::scratch::{NextBufs, NextDims, NextScratch, Rows};
use crate::lru::Lru;
use crate::{grow, kernel_format, kernels, Cuda, Device, Mma, FORMATS};

mod check;
pub(crate) mod products;
pub(crate) mod scratch;

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
    ("embed_", "PLPPIF"),
    ("rms_norm_rows", "PPPPIF"),
    ("residual_norm", "PPPPPIF"),
    ("qk_norm_rope", "PPPPPPIIIF"),
    ("kv_store_", "PPPPPII"),
    ("attention_", "PPPPPIIIIFIPPI"),
    ("topk_route", "PPIIIIFPPPP"),
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

/// The parameter kinds of kernel `name` ([`KERNEL_SIGNATURES`]).
pub fn kernel_signature(name: &str) -> Option<&'static str> {
    KERNEL_SIGNATURES
        .iter()
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
    /// most 8 rows (`mvt1_*`, fewer registers) and of up to MVG_N (`mvt_*`); both compute
    /// a row the same way.
    pub(crate) mvt: Vec<Option<[Kernel; 2]>>,
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

/// One `Chunk` of forward.cu: `unit`, the row count, the rows padded to MVG_N with 0.
pub(crate) fn push_chunk(out: &mut Vec<u8>, unit: usize, rows: &[usize]) {
    debug_assert!(rows.len() <= MVG_N);
    out.extend_from_slice(&(unit as i32).to_le_bytes());
    out.extend_from_slice(&(rows.len() as i32).to_le_bytes());
    for t in 0..MVG_N {
        out.extend_from_slice(&(rows.get(t).copied().unwrap_or(0) as i32).to_le_bytes());
    }
}

/// Per-call device buffers, grown as needed (one call at a time: the mutex).
#[derive(Default)]
pub(crate) struct Scratch {
    x: Option<CudaSlice<f32>>,
    h: Option<CudaSlice<f32>>,
    q: Option<CudaSlice<f32>>,
    k: Option<CudaSlice<f32>>,
    v: Option<CudaSlice<f32>>,
    att: Option<CudaSlice<f32>>,
    o: Option<CudaSlice<f32>>,
    rl: Option<CudaSlice<f32>>,
    wts: Option<CudaSlice<f32>>,
    /// MLA: q-LoRA (raw and normed), the kv_a output, gathered nope queries, their k_b
    /// products, the attention queries, the v_b products.
    qa: Option<CudaSlice<f32>>,
    qan: Option<CudaSlice<f32>>,
    kva: Option<CudaSlice<f32>>,
    qn: Option<CudaSlice<f32>>,
    qabs: Option<CudaSlice<f32>>,
    qatt: Option<CudaSlice<f32>>,
    ov: Option<CudaSlice<f32>>,
    /// The shared expert's output.
    sh: Option<CudaSlice<f32>>,
    /// Hyper-connections: the normalised streams, their mix projection, post and comb.
    hcf: Option<CudaSlice<f32>>,
    hcm: Option<CudaSlice<f32>>,
    hcpc: Option<CudaSlice<f32>>,
    /// DeepSeek V4: compressor products (kv, gate) of the attention's and the indexer's
    /// compressors, indexer queries and head weights, row scores, the selected rows and
    /// their counts, the grouped output's low-rank values.
    cc: Option<CudaSlice<f32>>,
    cz: Option<CudaSlice<f32>>,
    ic: Option<CudaSlice<f32>>,
    iz: Option<CudaSlice<f32>>,
    iq: Option<CudaSlice<f32>>,
    wh: Option<CudaSlice<f32>>,
    /// GLM's DSA indexer keys of the batch before their LayerNorm.
    ik: Option<CudaSlice<f32>>,
    scores: Option<CudaSlice<f32>>,
    sel: Option<CudaSlice<i32>>,
    nsel: Option<CudaSlice<i32>>,
    dz: Option<CudaSlice<f32>>,
    g: Option<CudaSlice<f32>>,
    u: Option<CudaSlice<f32>>,
    dd: Option<CudaSlice<f32>>,
    hsel: Option<CudaSlice<f32>>,
    logits: Option<CudaSlice<f32>>,
    ids: Option<CudaSlice<i32>>,
    chunks: Option<CudaSlice<u8>>,
    nchunks: Option<CudaSlice<i32>>,
    hdr: Option<CudaSlice<u8>>,
    /// Qwen3.8-Flash-Next's parts' buffers.
    next: NextScratch,
}

/// The device address of `b` after growing it to `len` elements.
pub(crate) fn addr<T: cudarc::driver::DeviceRepr>(
    stream: &Arc<CudaStream>,
    b: &mut Option<CudaSlice<T>>,
    len: usize,
) -> Result<u64, ModelError> {
    grow(stream, b, len).map_err(|e| ModelError::Compute(e.to_string()))?;
    Ok(b.as_ref().expect("grown").device_ptr(stream).0)
}

/// One sequence's KV cache in VRAM: per layer `[n_ctx][n_head_kv * head_dim]` keys and
/// values, f16 (llama.cpp's default cache; the CPU path rounds to f16 the same way) or f32
/// as the sequence's host cache says (`--kv-f32`); DeepSeek V4 layers keep `Dsv4Kv`
/// instead.
pub struct GpuKv {
    k: Vec<CudaSlice<u8>>,
    v: Vec<CudaSlice<u8>>,
    /// Per layer: DeepSeek V4 attention's state (None for other layers).
    dsv4: Vec<Option<Dsv4Kv>>,
    /// Per layer: the attention's own state ([`layer_state`]; empty for most).
    rec: Vec<Vec<CudaSlice<f32>>>,
    /// Per layer: the PLE layer's convolution ring (None without one).
    ple: Vec<Option<CudaSlice<f32>>>,
    /// The PLE hash's context: the last `ngram - 1` token ids (EOS at a start).
    ple_ctx: Vec<u32>,
    /// The position the sequential state (DeepSeek V4's windows and compressor carry,
    /// recurrent states, the PLE ring and context) continues at (usize::MAX while a call
    /// runs, or after one failed).
    next: usize,
    n_ctx: usize,
    f32: bool,
    stream: Arc<CudaStream>,
    /// False when a copy failed (the next forward call reports it).
    ok: bool,
}

impl ExtraState for GpuKv {
    fn clone_box(&self) -> Box<dyn ExtraState> {
        let copy = |src: &[CudaSlice<u8>]| -> Option<Vec<CudaSlice<u8>>> {
            src.iter().map(|s| self.stream.clone_dtod(s).ok()).collect()
        };
        let (k, v) = (copy(&self.k), copy(&self.v));
        let dsv4: Option<Vec<Option<Dsv4Kv>>> = self
            .dsv4
            .iter()
            .map(|d| match d {
                None => Some(None),
                Some(d) => d.copy(&self.stream).map(Some),
            })
            .collect();
        let opt = |src: &[Option<CudaSlice<f32>>]| -> Option<Vec<Option<CudaSlice<f32>>>> {
            src.iter()
                .map(|d| match d {
                    None => Some(None),
                    Some(d) => self.stream.clone_dtod(d).ok().map(Some),
                })
                .collect()
        };
        let ple = opt(&self.ple);
        let rec: Option<Vec<Vec<CudaSlice<f32>>>> = self
            .rec
            .iter()
            .map(|l| l.iter().map(|b| self.stream.clone_dtod(b).ok()).collect())
            .collect();
        let synced = self.stream.synchronize().is_ok();
        let ok = self.ok
            && synced
            && k.is_some()
            && v.is_some()
            && dsv4.is_some()
            && rec.is_some()
            && ple.is_some();
        Box::new(GpuKv {
            k: k.unwrap_or_default(),
            v: v.unwrap_or_default(),
            dsv4: dsv4.unwrap_or_default(),
            rec: rec.unwrap_or_default(),
            ple: ple.unwrap_or_default(),
            ple_ctx: self.ple_ctx.clone(),
            next: self.next,
            n_ctx: self.n_ctx,
            f32: self.f32,
            stream: self.stream.clone(),
            ok,
        })
    }

    fn clear(&mut self) {
        // Rows are indexed by position and written before they are read.
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// One layer's own attention state for a sequence of `n_ctx` positions, zeros: GLM's DSA
/// indexer keys (every position's, f32); DeltaNet's convolution ring of the last `kernel -
/// 1` inputs and recurrent matrices; KDA's ([`kda_state`]); QSA's raw keys of
/// every position and pooled keys of every complete block (with an indexer); a k-pool
/// indexer's ([`pool_state`]); none for the others (DeepSeek V4's is
/// [`Dsv4Kv`]).
pub(crate) fn layer_state(
    stream: &Arc<CudaStream>,
    attn: &DAttn,
    n_ctx: usize,
) -> Result<Vec<CudaSlice<f32>>, ModelError> {
    let zeros = |len: usize| {
        stream
            .alloc_zeros::<f32>(len.max(1))
            .map_err(|e| err("attention state", e))
    };
    match attn {
        DAttn::Mla(m) => match &m.select {
            DSelect::Indexer(ix) => Ok(vec![zeros(n_ctx * ix.head_dim)?]),
            DSelect::Pooled(ix) => pool_state(stream, ix, n_ctx),
            DSelect::All | DSelect::Previous => Ok(Vec::new()),
        },
        DAttn::Delta(w) => {
            let s = &w.shape;
            Ok(vec![
                zeros((s.conv_kernel - 1) * s.conv_dim())?,
                zeros(s.n_v_heads * s.d_k * s.d_v)?,
            ])
        }
        DAttn::Kda(w) => kda_state(stream, &w.shape),
        DAttn::Qsa(w) if w.shape.ratio > 0 => {
            let s = &w.shape;
            Ok(vec![
                zeros(n_ctx * s.idx_dim)?,
                zeros((n_ctx / s.ratio + 1) * s.idx_dim)?,
            ])
        }
        _ => Ok(Vec::new()),
    }
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
    /// The decode kernel's staging.
    pub(crate) mvt1: Mvt1Staging,
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
    /// Largest FFN width (dense) and routed-expert width.
    pub(crate) ff_dense: usize,
    pub(crate) ff_moe: usize,
    pub(crate) k_max: usize,
    pub(crate) n_expert_max: usize,
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
        let env_usize = |name: &str, default: usize| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or(default)
        };
        let mvt1 = Mvt1Staging {
            stages: env_usize("SLUICE_CUDA_MVT1_STAGES", MVT1_STAGES).clamp(1, MVT1_MAX_STAGES),
            step: env_usize("SLUICE_CUDA_MVT1_STEP", MVT1_STEP),
            stage_bytes: env_usize("SLUICE_CUDA_MVT1_STAGE_KB", 0) * 1024,
            smem_max,
        };
        let f = Funcs::load(&d, smem_max)?;
        // DeltaNet's state lives in shared memory while a batch runs: the kernel may have
        // what its widest head needs (the opt-in limit less the kernel's static shared
        // memory is the driver's to check).
        let gdn_max = smem_max.saturating_sub(GDN_STATIC_SMEM);
        qwen4exp_parts(&plan, gdn_max)?;
        glm5next_parts(&plan, gdn_max)?;
        let gdn_need = plan
            .layers
            .iter()
            .filter_map(|l| match &l.attn {
                PlanAttn::Delta { shape, .. } => Some(gdn_smem(shape)),
                PlanAttn::Kda { shape, .. } => Some(gdn_smem(&delta_shape(shape))),
                _ => None,
            })
            .max()
            .unwrap_or(0);
        if gdn_need > 0 {
            f.delta_rule
                .f
                .set_attribute(
                    CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    gdn_need as i32,
                )
                .map_err(|e| {
                    format!("kernel delta_rule: {gdn_need} bytes of shared memory: {e}")
                })?;
        }
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
        let (mut ff_dense, mut ff_moe, mut k_max, mut n_expert_max) = (0, 0, 0, 0);
        // One segment count for every hyper-connection projection (the call header has one
        // chunk table for them); a count that splits one splits the others (powers of two).
        let hc_nseg = plan
            .layers
            .iter()
            .flat_map(|l| l.hc.iter().flat_map(|w| w.iter()))
            .chain(match &plan.hyper {
                Some(h) => match &h.head {
                    HyperHead::Learned(w) => Some(w),
                    HyperHead::Mean => None,
                },
                None => None,
            })
            .map(|w| hc_segments(w.proj.ty, w.proj.cols))
            .min()
            .unwrap_or(1);
        // The low-rank mixers' down products (a few hundred rows, the streams' width in
        // columns) in column segments, one count for all (the call header's segment table).
        let lr_nseg = plan
            .layers
            .iter()
            .flat_map(|l| l.hc_lowrank.iter().flat_map(|w| w.iter()))
            .map(|w| hc_segments(w.down.ty, w.down.cols))
            .min()
            .unwrap_or(1);
        let mut layers = Vec::with_capacity(plan.layers.len());
        for l in &plan.layers {
            let ffn = match &l.ffn {
                PlanFfn::Dense { w, act } => {
                    ff_dense = ff_dense.max(w.gate.rows);
                    DFfn::Dense(DenseFfn {
                        gate: up.mat(&w.gate)?,
                        up: up.mat(&w.up)?,
                        down: up.mat(&w.down)?,
                        act: act_id(*act),
                    })
                }
                PlanFfn::Moe {
                    moe,
                    experts: st,
                    shared,
                } => {
                    ff_moe = ff_moe.max(st[0].rows);
                    k_max = k_max.max(moe.k);
                    n_expert_max = n_expert_max.max(moe.n_expert);
                    if let Some(sh) = shared {
                        ff_dense = ff_dense.max(sh.w.gate.rows);
                    }
                    DFfn::Moe(Box::new(up.moe(moe, st, shared, experts)?))
                }
            };
            let attn = up.attention(&l.attn)?;
            let hc = match &l.hc {
                Some(w) => Some([up.hc(&w[0], hc_nseg)?, up.hc(&w[1], hc_nseg)?]),
                None => None,
            };
            let lr = match &l.hc_lowrank {
                Some(w) => Some([up.mix(&w[0], lr_nseg)?, up.mix(&w[1], lr_nseg)?]),
                None => None,
            };
            let ple = l.ple.as_ref().map(|w| up.ple(w)).transpose()?.map(Box::new);
            layers.push(DLayer {
                lr,
                ple,
                attn_norm: up.norm(&l.attn_norm)?,
                attn,
                post_attn: up.opt_norm(&l.post_attn_norm)?,
                ffn_norm: up.norm(&l.ffn_norm)?,
                ffn,
                post_ffn: up.opt_norm(&l.post_ffn_norm)?,
                hc,
            });
        }
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
        let units = (experts == ExpertPlacement::Cached).then(|| {
            Mutex::new(UnitCache {
                lru: Lru::new(expert_budget),
                transient: Vec::new(),
                tab: tab.clone(),
                chunks: None,
            })
        });
        Ok(GpuDecoder {
            d,
            stream,
            copy,
            graph: Mutex::new(Vec::new()),
            graphs: std::sync::atomic::AtomicBool::new(
                !std::env::var("SLUICE_CUDA_GRAPHS").is_ok_and(|v| v == "0"),
            ),
            mvt1,
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
            ff_dense,
            ff_moe,
            k_max,
            n_expert_max,
            scratch: Mutex::new(Scratch::default()),
            weight_bytes: uploaded,
            _owned: owned,
            _norms: norms,
        })
    }
}

/// Uploads weights at start and keeps their device buffers and the host pointer table.
pub(crate) struct Uploader<'m> {
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) map: &'m [u8],
    pub(crate) owned: Vec<CudaSlice<u8>>,
    pub(crate) norms: Vec<CudaSlice<f32>>,
    pub(crate) tab: Vec<u64>,
    pub(crate) uploaded: u64,
}

impl Uploader<'_> {
    /// Upload `bytes`; their device address.
    pub(crate) fn bytes(&mut self, bytes: &[u8]) -> Result<u64, String> {
        let s = self
            .stream
            .clone_htod(bytes)
            .map_err(|e| format!("uploading {} bytes of weights: {e}", bytes.len()))?;
        let a = s.device_ptr(&self.stream).0;
        self.owned.push(s);
        self.uploaded += bytes.len() as u64;
        Ok(a)
    }

    /// Upload a matrix and give it a pointer-table entry.
    pub(crate) fn mat(&mut self, m: &Mat) -> Result<DMat, String> {
        let a = self.bytes(m.bytes(self.map))?;
        self.tab.push(a);
        Ok(DMat {
            tab: self.tab.len() - 1,
            fi: kernel_format(m.ty, m.cols).expect("checked"),
            rows: m.rows,
            cols: m.cols,
            row_bytes: m.ty.row_bytes(m.cols as u64).expect("checked") as i64,
        })
    }

    /// Upload a matrix of `n` heads' row blocks and give each head a pointer-table entry
    /// (consecutive); the result's `rows` are one head's.
    pub(crate) fn heads(&mut self, m: &Mat, n: usize) -> Result<DMat, String> {
        let a = self.bytes(m.bytes(self.map))?;
        let row_bytes = m.ty.row_bytes(m.cols as u64).expect("checked") as i64;
        let rows = m.rows / n;
        let first = self.tab.len();
        for h in 0..n {
            self.tab.push(a + (h * rows) as u64 * row_bytes as u64);
        }
        Ok(DMat {
            tab: first,
            fi: kernel_format(m.ty, m.cols).expect("checked"),
            rows,
            cols: m.cols,
            row_bytes,
        })
    }

    pub(crate) fn norm(&mut self, v: &[f32]) -> Result<u64, String> {
        let s = self
            .stream
            .clone_htod(v)
            .map_err(|e| format!("uploading a norm: {e}"))?;
        let a = s.device_ptr(&self.stream).0;
        self.norms.push(s);
        Ok(a)
    }

    /// Upload integers (a hash router's table); their device address.
    pub(crate) fn ints(&mut self, v: &[i32]) -> Result<u64, String> {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.bytes(&bytes)
    }

    /// Upload a matrix as `nseg` column segments, each its own `[rows, cols / nseg]` matrix
    /// with a pointer-table entry (consecutive; the result's `cols` are a segment's): a
    /// product through a per-segment chunk table (unit s: the s-th `cols / nseg` values of
    /// each input row) gives every segment's partial sums, which a kernel adds in segment
    /// order, so a short, wide product spreads over `nseg` times the blocks.
    pub(crate) fn segments(&mut self, m: &Mat, nseg: usize) -> Result<DMat, String> {
        let row_bytes = m.ty.row_bytes(m.cols as u64).expect("checked") as usize;
        let seg_cols = m.cols / nseg;
        let seg_bytes = row_bytes / nseg;
        let src = m.bytes(self.map);
        // [nseg][rows][seg_bytes]: segment s of row r is bytes s * seg_bytes.. of the row.
        let mut out = Vec::with_capacity(src.len());
        for sg in 0..nseg {
            for r in 0..m.rows {
                let at = r * row_bytes + sg * seg_bytes;
                out.extend_from_slice(&src[at..at + seg_bytes]);
            }
        }
        let a = self.bytes(&out)?;
        let first = self.tab.len();
        for sg in 0..nseg {
            self.tab.push(a + (sg * m.rows * seg_bytes) as u64);
        }
        Ok(DMat {
            tab: first,
            fi: kernel_format(m.ty, seg_cols).expect("checked"),
            rows: m.rows,
            cols: seg_cols,
            row_bytes: seg_bytes as i64,
        })
    }

    /// A norm's address, 0 (a null pointer for the kernels) when there is none.
    pub(crate) fn opt_norm(&mut self, v: &Option<Vec<f32>>) -> Result<u64, String> {
        match v {
            Some(v) => self.norm(v),
            None => Ok(0),
        }
    }
}

/// One kernel parameter.
#[derive(Clone, Copy)]
pub(crate) enum A {
    /// A device address (or 0 for a null pointer).
    P(u64),
    I(i32),
    F(f32),
    L(i64),
}

pub(crate) fn i32_of(v: usize, what: &str) -> Result<i32, ModelError> {
    i32::try_from(v).map_err(|_| ModelError::Compute(format!("cuda: {what} {v} is too large")))
}

/// The addresses and sizes of one forward call that the blocks' launch sequences read
/// (`GpuDecoder::forward` makes it once per call): the batch (`n` tokens, `tokens` and
/// `pos` in the header), the call's chunk tables, the scratch buffers, the sequence's
/// per-layer state addresses.
#[derive(Clone, Copy)]
pub(crate) struct Call<'a> {
    pub(crate) n: usize,
    pub(crate) e: usize,
    pub(crate) ei: i32,
    pub(crate) nh: usize,
    pub(crate) nkv: usize,
    pub(crate) hd: usize,
    pub(crate) kdim: usize,
    pub(crate) vdim: usize,
    pub(crate) eps: f32,
    /// At most 8 tokens (the decode kernel).
    pub(crate) small: bool,
    /// The KV cache's type (0 f16, 1 f32).
    pub(crate) kvt: usize,
    pub(crate) tokens: u64,
    pub(crate) pos: u64,
    /// Every token's rows: the chunk table, its count's address, its chunks.
    pub(crate) dense: u64,
    pub(crate) n_dense: u64,
    pub(crate) nd: usize,
    pub(crate) dense_rows: Rows,
    /// The per-head (MLA) or per-group (DeepSeek V4 output) chunks and their unit count.
    pub(crate) head_chunks: u64,
    pub(crate) n_headc: u64,
    pub(crate) heads: usize,
    pub(crate) h: u64,
    pub(crate) q: u64,
    pub(crate) k: u64,
    pub(crate) v: u64,
    pub(crate) att: u64,
    pub(crate) o: u64,
    pub(crate) qa: u64,
    pub(crate) qan: u64,
    pub(crate) kva: u64,
    pub(crate) qn: u64,
    pub(crate) qabs: u64,
    pub(crate) qatt: u64,
    pub(crate) ov: u64,
    pub(crate) shb: u64,
    pub(crate) g: u64,
    pub(crate) u: u64,
    pub(crate) rl: u64,
    pub(crate) ids: u64,
    pub(crate) wts: u64,
    pub(crate) dd: u64,
    pub(crate) chunks: u64,
    pub(crate) nchunks: u64,
    pub(crate) cc: u64,
    pub(crate) cz: u64,
    pub(crate) ic: u64,
    pub(crate) iz: u64,
    pub(crate) iq: u64,
    pub(crate) wh: u64,
    pub(crate) ik: u64,
    pub(crate) scores: u64,
    pub(crate) stride: usize,
    pub(crate) idx_tile: usize,
    pub(crate) selb: u64,
    pub(crate) nselb: u64,
    pub(crate) dz: u64,
    pub(crate) nb: NextBufs,
    pub(crate) mla: Option<MlaShape>,
    pub(crate) p: &'a DecoderPlan,
    pub(crate) stream: &'a Arc<CudaStream>,
    pub(crate) sc_ids: &'a CudaSlice<i32>,
    pub(crate) rec_ptrs: &'a [Vec<u64>],
    pub(crate) dsv4_ptrs: &'a [Dsv4Ptrs],
    /// The residual's streams, hyper-connection and head buffers (the loop's own).
    pub(crate) x: u64,
    pub(crate) hcf: u64,
    pub(crate) hcm: u64,
    pub(crate) hcpc: u64,
    pub(crate) seg_rows: Rows,
    pub(crate) n_hc: usize,
    pub(crate) lr_streams: Option<usize>,
    pub(crate) hs: Option<HcShape>,
    pub(crate) qsa_bufs: QsaBufs,
    pub(crate) nr: usize,
    pub(crate) row_chunks: u64,
    pub(crate) n_rowc: u64,
    pub(crate) rowmap: u64,
    pub(crate) hsel: u64,
    pub(crate) lg: u64,
    pub(crate) kv_ptrs: &'a [(u64, u64)],
    pub(crate) ple_ptrs: &'a [u64],
}

/// The device addresses of a sequence's per-layer state ([`GpuKv`]) for one call: each
/// layer's own state buffers, PLE ring, DeepSeek V4 state, and KV cache (keys, values).
#[derive(Clone, Copy)]
pub(crate) struct StatePtrs<'a> {
    pub(crate) rec_ptrs: &'a [Vec<u64>],
    pub(crate) ple_ptrs: &'a [u64],
    pub(crate) dsv4_ptrs: &'a [Dsv4Ptrs],
    pub(crate) kv_ptrs: &'a [(u64, u64)],
}

/// A grid of one block per row.
pub(crate) fn rows_n(n: usize) -> (u32, u32, u32) {
    (n as u32, 1, 1)
}

/// Byte layout of a call's header: tokens, positions, the four chunk counts, the logits'
/// row map, the dense chunks (every token in order), the logits' row chunks, the per-head
/// chunks (MLA's heads or DeepSeek V4's output groups; unit h: rows `t * heads + h` of every
/// token t) and the per-segment chunks of the hyper-connection projections (the same with
/// `segs` units).
pub(crate) struct Header {
    bytes: Vec<u8>,
    tokens: usize,
    pos: usize,
    counts: usize,
    rowmap: usize,
    dense: usize,
    row_chunks: usize,
    head_chunks: usize,
    seg_chunks: usize,
}

/// Chunks of `units` units per token: unit u takes rows `t * units + u` of every token t.
pub(crate) fn unit_chunks(out: &mut Vec<u8>, n: usize, units: usize) {
    for u in 0..units {
        let of_unit: Vec<usize> = (0..n).map(|t| t * units + u).collect();
        for c in of_unit.chunks(MVG_N) {
            push_chunk(out, u, c);
        }
    }
}

pub(crate) fn chunk_bytes(out: &mut Vec<u8>, n: usize) {
    let rows: Vec<usize> = (0..n).collect();
    for c in rows.chunks(MVG_N) {
        push_chunk(out, 0, c);
    }
}

impl Header {
    /// `heads`: the MLA layers' head count or DeepSeek V4's output groups (0: neither);
    /// `segs`: the hyper-connection projections' column segments (0: none).
    fn new(batch: &Batch<'_>, rows: &[usize], heads: usize, segs: usize) -> Header {
        let n = batch.len();
        let mut b: Vec<u8> = Vec::new();
        let tokens = b.len();
        for &t in batch.tokens {
            b.extend_from_slice(&(t as i32).to_le_bytes());
        }
        let pos = b.len();
        for &p in &batch.positions {
            b.extend_from_slice(&(p as i32).to_le_bytes());
        }
        let counts = b.len();
        b.extend_from_slice(&(n.div_ceil(MVG_N) as i32).to_le_bytes());
        b.extend_from_slice(&(rows.len().div_ceil(MVG_N) as i32).to_le_bytes());
        b.extend_from_slice(&((heads * n.div_ceil(MVG_N)) as i32).to_le_bytes());
        b.extend_from_slice(&((segs * n.div_ceil(MVG_N)) as i32).to_le_bytes());
        let rowmap = b.len();
        for &r in rows {
            b.extend_from_slice(&(r as i32).to_le_bytes());
        }
        b.resize(b.len().next_multiple_of(16), 0);
        let dense = b.len();
        chunk_bytes(&mut b, n);
        let row_chunks = b.len();
        chunk_bytes(&mut b, rows.len());
        let head_chunks = b.len();
        unit_chunks(&mut b, n, heads);
        let seg_chunks = b.len();
        unit_chunks(&mut b, n, segs);
        Header {
            bytes: b,
            tokens,
            pos,
            counts,
            rowmap,
            dense,
            row_chunks,
            head_chunks,
            seg_chunks,
        }
    }
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
        let kinds: String = args
            .iter()
            .map(|a| match a {
                A::P(_) => 'P',
                A::I(_) => 'I',
                A::F(_) => 'F',
                A::L(_) => 'L',
            })
            .collect();
        if kinds != k.sig {
            return Err(ModelError::Compute(format!(
                "cuda: kernel {} takes ({}), launched with ({kinds})",
                k.name, k.sig
            )));
        }
        let mut b = self.stream.launch_builder(&k.f);
        for a in args {
            match a {
                A::P(v) => b.arg(v),
                A::I(v) => b.arg(v),
                A::F(v) => b.arg(v),
                A::L(v) => b.arg(v),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: grid,
            block_dim: (block, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // SAFETY: the arguments are the parameters of the `forward.cu` kernel in its order
        // and types (checked above against KERNEL_SIGNATURES, which the NVRTC test checks
        // against the PTX: device addresses as 64-bit values, int, float, long long); the
        // dynamic shared memory is what the kernel is told it has (`mvt1_*`: its stage
        // layout, within the size its attribute allows, set at load);
        // each address points into a live buffer of this decoder (weights, pointer table,
        // scratch grown for this call, the sequence's KV cache) sized for the grid, whose
        // blocks past the data return. Buffers outlive the launch: the call synchronizes
        // (the logits download) before any of them can be dropped or regrown.
        unsafe { b.launch(cfg) }.map_err(|e| err("launch", e))?;
        Ok(())
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
    ) -> Result<(), ModelError> {
        kernels::ResidualNorm {
            x,
            o,
            post,
            next,
            h,
            cols: i32_of(cols, "n_embd")?,
            eps,
        }
        .launch(self, (n as u32, 1, 1))
    }

    /// The sequence's KV cache in VRAM, made on its first call.
    fn kv<'s>(&self, state: &'s mut SeqState, pos0: usize) -> Result<&'s mut GpuKv, ModelError> {
        let want_f32 = !state.kv.f16();
        let usable = state
            .device
            .as_mut()
            .and_then(|x| x.as_any_mut().downcast_mut::<GpuKv>())
            .is_some_and(|kv| kv.ok && kv.k.len() == self.layers.len() && kv.f32 == want_f32);
        if !usable {
            if pos0 > 0 {
                return Err(ModelError::Compute(
                    "cuda: this sequence has no KV cache on the GPU (it was started or restored without it)".into(),
                ));
            }
            let sh = &self.plan.shape;
            // A length-limited plan never writes past its `max_positions` (`check_length`).
            let n_ctx = state
                .n_ctx()
                .min(self.plan.max_positions.unwrap_or(usize::MAX));
            let stream = &self.stream;
            let esize = if want_f32 { 4 } else { 2 };
            let alloc = |dim: usize| -> Result<Vec<CudaSlice<u8>>, ModelError> {
                self.layers
                    .iter()
                    .map(|l| {
                        // DeltaNet and KDA layers keep no KV cache.
                        let dim = if matches!(l.attn, DAttn::Delta(_) | DAttn::Kda(_)) {
                            0
                        } else {
                            dim
                        };
                        // SAFETY: attention reads only rows 0..=pos, each written by
                        // kv_store earlier in the same stream.
                        unsafe { stream.alloc::<u8>((n_ctx * dim * esize).max(1)) }
                            .map_err(|e| err("KV cache", e))
                    })
                    .collect()
            };
            // DeepSeek V4 layers keep their own state instead (Dsv4Kv).
            let (kd, vd) = if self.dsv4.is_some() {
                (0, 0)
            } else {
                (sh.n_head_kv * sh.head_dim, sh.n_head_kv * sh.head_dim_v)
            };
            let k = alloc(kd)?;
            let v = alloc(vd)?;
            let zeros = |len: usize| -> Result<CudaSlice<f32>, ModelError> {
                stream
                    .alloc_zeros::<f32>(len.max(1))
                    .map_err(|e| err("DeepSeek V4 state", e))
            };
            let comp = |c: &DComp| -> Result<CompKv, ModelError> {
                let carry = c.coff * c.ratio * c.coff * c.head_dim;
                Ok(CompKv {
                    rc: zeros(carry)?,
                    rz: zeros(carry)?,
                    rows: zeros(n_ctx / c.ratio * c.head_dim)?,
                })
            };
            let mut dsv4 = Vec::with_capacity(self.layers.len());
            for l in &self.layers {
                dsv4.push(match (&l.attn, &self.dsv4) {
                    (DAttn::Dsv4(a), Some(s)) => Some(Dsv4Kv {
                        ring: zeros(s.window * s.head_dim)?,
                        comp: a.comp.as_ref().map(comp).transpose()?,
                        index: a.indexer.as_ref().map(|ix| comp(&ix.comp)).transpose()?,
                    }),
                    _ => None,
                });
            }
            let rec = self
                .layers
                .iter()
                .map(|l| layer_state(stream, &l.attn, n_ctx))
                .collect::<Result<Vec<_>, _>>()?;
            let width = self.next_dims.streams * self.plan.n_embd;
            let ple = self
                .layers
                .iter()
                .map(|l| {
                    l.ple
                        .as_ref()
                        .map(|w| ple_state(stream, w, width))
                        .transpose()
                })
                .collect::<Result<Vec<_>, _>>()?;
            let ple_ctx = self.plan.ple.as_ref().map_or(Vec::new(), |pp| {
                vec![pp.hash.eos; pp.hash.ngram.saturating_sub(1)]
            });
            state.device = Some(Box::new(GpuKv {
                k,
                v,
                dsv4,
                rec,
                ple,
                ple_ctx,
                next: 0,
                n_ctx,
                f32: want_f32,
                stream: stream.clone(),
                ok: true,
            }));
        }
        Ok(state
            .device
            .as_mut()
            .and_then(|x| x.as_any_mut().downcast_mut::<GpuKv>())
            .expect("made above"))
    }
}

impl GpuDecoder {
    /// One call's [`Call`]: the header (tokens, positions, chunk tables) uploaded, every
    /// scratch buffer grown for `batch` and `rows` logits rows, the PLE rows uploaded; the
    /// header's device address with it (a captured graph's key).
    #[allow(clippy::too_many_arguments)]
    fn call<'a>(
        &'a self,
        sc: &'a mut Scratch,
        batch: &Batch<'_>,
        rows: &[usize],
        kvt: usize,
        heads: usize,
        ple_rows: Option<Vec<f32>>,
        ptrs: StatePtrs<'a>,
    ) -> Result<(Call<'a>, u64), ModelError> {
        let StatePtrs {
            rec_ptrs,
            ple_ptrs,
            dsv4_ptrs,
            kv_ptrs,
        } = ptrs;
        let n = batch.len();
        let p = &self.plan;
        let sh = p.shape;
        let (e, nv) = (p.n_embd, p.n_vocab);
        let (nh, nkv, hd, hdv) = (sh.n_head, sh.n_head_kv, sh.head_dim, sh.head_dim_v);
        let (kdim, vdim) = (nkv * hd, nkv * hdv);
        let mla = self.mla;
        let stream = self.stream.clone();
        // Column segments: the hyper-connection projections' or the low-rank mixers'.
        let segs = match &self.hyper {
            Some(_) => self.hc_nseg,
            None if self.next_dims.segs > 1 => self.next_dims.segs,
            None => 0,
        };
        let hdr = Header::new(batch, rows, heads, segs);
        let hb = addr(&stream, &mut sc.hdr, hdr.bytes.len())?;
        stream
            .memcpy_htod(
                &hdr.bytes[..],
                &mut sc
                    .hdr
                    .as_mut()
                    .expect("grown")
                    .slice_mut(0..hdr.bytes.len()),
            )
            .map_err(|e| err("header", e))?;
        let (tokens, pos) = (hb + hdr.tokens as u64, hb + hdr.pos as u64);
        let (n_dense, n_rowc) = (hb + hdr.counts as u64, hb + hdr.counts as u64 + 4);
        let (rowmap, dense, row_chunks) = (
            hb + hdr.rowmap as u64,
            hb + hdr.dense as u64,
            hb + hdr.row_chunks as u64,
        );
        let (n_headc, head_chunks) = (hb + hdr.counts as u64 + 8, hb + hdr.head_chunks as u64);
        let (n_segc, seg_chunks) = (hb + hdr.counts as u64 + 12, hb + hdr.seg_chunks as u64);
        let nd = n.div_ceil(MVG_N);
        let pairs = n * self.k_max;
        let moe_chunks_max = pairs / MVG_N + self.n_expert_max.min(pairs);
        let hs = self.hyper.as_ref().map(|(s, _)| *s);
        // Residual streams: a hyper-connection's, the low-rank mixers' (1: plain).
        let lr_streams = self.lowrank.as_ref().map(|_| self.next_dims.streams);
        let n_hc = hs.map_or(self.next_dims.streams, |s| s.n_hc);
        let x = addr(&stream, &mut sc.x, n * n_hc * e)?;
        let h = addr(&stream, &mut sc.h, n * e)?;
        let hyper_len = |f: &dyn Fn(usize) -> usize| hs.map_or(1, |s| n * f(s.n_hc));
        let hcf = addr(&stream, &mut sc.hcf, hyper_len(&|hc| hc * e))?;
        let hcm = addr(&stream, &mut sc.hcm, hyper_len(&|hc| segs * (2 + hc) * hc))?;
        let hcpc = addr(&stream, &mut sc.hcpc, hyper_len(&|hc| hc + hc * hc))?;
        let q_width = mla.map_or(hd, |m| hd.max(m.nope + m.rope));
        let q = addr(&stream, &mut sc.q, n * nh * q_width)?;
        // MLA's buffers (one element when there is no MLA layer).
        let ml = |f: &dyn Fn(&MlaShape) -> usize| mla.as_ref().map_or(1, |m| n * f(m));
        let q_lora = mla
            .map(|m| m.q_lora)
            .or(self.dsv4.map(|s| s.q_lora))
            .unwrap_or(1);
        let qa = addr(&stream, &mut sc.qa, n * q_lora)?;
        let qan = addr(&stream, &mut sc.qan, n * q_lora)?;
        // DeepSeek V4's buffers, sized for its widest compressor and indexer.
        let IndexDims {
            comp_w,
            idx_w,
            idx_q,
            idx_heads,
            top_max,
            dsa_d,
            ratio: idx_ratio,
        } = self.index_dims;
        let dsv4_len = |len: usize| if self.dsv4.is_some() { n * len } else { 1 };
        let cc = addr(&stream, &mut sc.cc, dsv4_len(comp_w))?;
        let cz = addr(&stream, &mut sc.cz, dsv4_len(comp_w))?;
        let ic = addr(&stream, &mut sc.ic, dsv4_len(idx_w))?;
        let iz = addr(&stream, &mut sc.iz, dsv4_len(idx_w))?;
        // Indexer buffers (DeepSeek V4's or GLM's).
        let idx_len = |len: usize| if idx_ratio > 0 { n * len } else { 1 };
        let iq = addr(&stream, &mut sc.iq, idx_len(idx_q))?;
        let wh = addr(&stream, &mut sc.wh, idx_len(idx_heads))?;
        let ik = addr(&stream, &mut sc.ik, idx_len(dsa_d.max(1)))?;
        // Scores of the compressed rows the batch's last token sees, per token.
        let last = *batch.positions.last().expect("n > 0");
        let stride = (last + 1).checked_div(idx_ratio).unwrap_or(1).max(1);
        // Tokens per launch of the scores and top-k: as many as keep the scores within
        // SCORES_MAX floats (a long prompt at a long context does not scale the scratch).
        let idx_tile = (SCORES_MAX / stride).clamp(1, n);
        let scores = addr(&stream, &mut sc.scores, idx_len(stride) / n * idx_tile)?;
        let selb = addr(&stream, &mut sc.sel, idx_len(top_max))?;
        let nselb = addr(&stream, &mut sc.nsel, idx_len(1))?;
        let dz = addr(
            &stream,
            &mut sc.dz,
            dsv4_len(self.dsv4.map_or(1, |s| s.o_groups * s.o_lora)),
        )?;
        let kva = addr(&stream, &mut sc.kva, ml(&|m| m.row()))?;
        let qn = addr(&stream, &mut sc.qn, ml(&|m| m.n_head * m.nope))?;
        let qabs = addr(&stream, &mut sc.qabs, ml(&|m| m.n_head * m.kv_lora))?;
        let qatt = addr(&stream, &mut sc.qatt, ml(&|m| m.n_head * m.row()))?;
        let ov = addr(&stream, &mut sc.ov, ml(&|m| m.n_head * m.v_dim))?;
        let shb = addr(&stream, &mut sc.sh, n * e)?;
        let k = addr(&stream, &mut sc.k, n * kdim)?;
        let v = addr(&stream, &mut sc.v, n * vdim)?;
        let att = addr(&stream, &mut sc.att, n * nh * hdv)?;
        let o = addr(&stream, &mut sc.o, n * e)?;
        let ffw = (n * self.ff_dense).max(pairs * self.ff_moe);
        let g = addr(&stream, &mut sc.g, ffw)?;
        let u = addr(&stream, &mut sc.u, ffw)?;
        let rl = addr(&stream, &mut sc.rl, n * self.n_expert_max)?;
        let ids = addr(&stream, &mut sc.ids, pairs)?;
        let wts = addr(&stream, &mut sc.wts, pairs)?;
        let dd = addr(&stream, &mut sc.dd, pairs * e)?;
        let chunks = addr(&stream, &mut sc.chunks, moe_chunks_max * CHUNK_BYTES)?;
        let nchunks = addr(&stream, &mut sc.nchunks, 1)?;
        let nr = rows.len();
        let hsel = addr(&stream, &mut sc.hsel, nr.max(1) * e)?;
        let lg = addr(&stream, &mut sc.logits, nr.max(1) * nv)?;
        let nb = sc.next.grow(&stream, &self.next_dims, e, n, nr)?;
        if let (Some(rows), Some(pe)) = (&ple_rows, sc.next.pe.as_mut()) {
            stream
                .memcpy_htod(&rows[..], &mut pe.slice_mut(0..rows.len()))
                .map_err(|e| err("PLE rows", e))?;
        }
        let eps = sh.rms_eps;
        let ei = i32_of(e, "n_embd")?;
        // At most 8 tokens: every chunk has at most 8 rows (a token picks an expert once).
        let small = n <= 8;

        let sc_ids = sc.ids.as_ref().expect("grown");
        let dense_rows = Rows {
            table: dense,
            count: n_dense,
            chunks: nd,
            small,
        };
        let seg_rows = Rows {
            table: seg_chunks,
            count: n_segc,
            chunks: nd * segs,
            small,
        };
        // QSA's view of the shared buffers.
        let qsa_bufs = QsaBufs {
            q,
            k,
            v,
            att,
            iq,
            ik,
            index: (scores, stride, idx_tile, selb, nselb),
        };
        let call = Call {
            n,
            e,
            ei,
            nh,
            nkv,
            hd,
            kdim,
            vdim,
            eps,
            small,
            kvt,
            tokens,
            pos,
            dense,
            n_dense,
            nd,
            dense_rows,
            head_chunks,
            n_headc,
            heads,
            h,
            q,
            k,
            v,
            att,
            o,
            qa,
            qan,
            kva,
            qn,
            qabs,
            qatt,
            ov,
            shb,
            g,
            u,
            rl,
            ids,
            wts,
            dd,
            chunks,
            nchunks,
            cc,
            cz,
            ic,
            iz,
            iq,
            wh,
            ik,
            scores,
            stride,
            idx_tile,
            selb,
            nselb,
            dz,
            nb,
            mla,
            p,
            stream: &self.stream,
            sc_ids,
            rec_ptrs,
            dsv4_ptrs,
            x,
            hcf,
            hcm,
            hcpc,
            seg_rows,
            n_hc,
            lr_streams,
            hs,
            qsa_bufs,
            nr,
            row_chunks,
            n_rowc,
            rowmap,
            hsel,
            lg,
            kv_ptrs,
            ple_ptrs,
        };
        Ok((call, hb))
    }

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

    /// The attention half of layer `il` (`attn`) on the normed input `c.h`, its output
    /// into `c.o` (through the block's output matrix); `mla_sel` carries the MLA selection
    /// later layers reuse.
    fn attention_half(
        &self,
        il: usize,
        attn: &DAttn,
        c: &Call<'_>,
        mla_sel: &mut (u64, u64, usize),
    ) -> Result<(), ModelError> {
        let call = *c;
        let Call {
            n,
            kvt,
            pos,
            dense,
            n_dense,
            nd,
            dense_rows,
            h,
            o,
            nb,
            small,
            rec_ptrs,
            qsa_bufs,
            kv_ptrs,
            ..
        } = call;
        let (kc, vc) = kv_ptrs[il];
        let wo = match attn {
            DAttn::Gqa(w) => self.gqa(w, &call, (kc, vc))?,
            DAttn::Mla(w) => self.mla(w, il, &call, (kc, vc), mla_sel)?,
            DAttn::Dsv4(a) => self.dsv4(a, il, &call)?,
            DAttn::Delta(w) => {
                let st = &rec_ptrs[il];
                self.delta(w, (st[0], st[1]), pos, h, &nb, dense_rows, n)?;
                (&w.out, nb.dout)
            }
            DAttn::Qsa(w) => {
                let st = &rec_ptrs[il];
                let cache = (kc, vc);
                let y = self.qsa(w, kvt, cache, st, pos, h, &qsa_bufs, &nb, dense_rows, n)?;
                (&w.wo, y)
            }
            DAttn::Kda(w) => {
                self.kda(w, &rec_ptrs[il], pos, h, &nb, dense_rows, n)?;
                (&w.out, nb.dout)
            }
        };
        self.mv(&[(wo.0, o)], dense, n_dense, nd, wo.1, 1, small)?;
        Ok(())
    }

    /// The feed-forward half of layer `il` (`ffn`) on the normed input `c.h`, its output
    /// into `c.o`.
    fn feed_forward(
        &self,
        il: usize,
        ffn: &DFfn,
        c: &Call<'_>,
        env: &Env<'_>,
        host_ids: &mut Vec<i32>,
    ) -> Result<(), ModelError> {
        match ffn {
            DFfn::Dense(w) => self.dense_ffn(w, c),
            DFfn::Moe(w) => self.moe(w, il, c, env, host_ids),
        }
    }

    /// One forward call's launches, in the plan's order (the GPU form of `CpuDecoder`'s
    /// loop): the embedding, per layer the PLE layer, the attention half (its block from
    /// `blocks`) and the feed-forward half, each between its residual mixes (norms,
    /// hyper-connections or low-rank mixers), then the head's rows. Captured as a graph
    /// for a decode step.
    fn run(&self, c: &Call<'_>, env: &Env<'_>) -> Result<(), ModelError> {
        let call = *c;
        let Call {
            n,
            e,
            ei,
            eps,
            small,
            tokens,
            pos,
            dense_rows,
            h,
            o,
            nb,
            p,
            x,
            hcf,
            hcm,
            hcpc,
            seg_rows,
            n_hc,
            lr_streams,
            hs,
            nr,
            row_chunks,
            n_rowc,
            rowmap,
            hsel,
            lg,
            ple_ptrs,
            ..
        } = call;
        // With hyper-connections the embedding goes to `o`, then into every stream.
        kernels::Embed {
            format: self.embd.fi,
            w: self.embd_ptr,
            row_bytes: self.embd.row_bytes,
            tokens,
            x: if hs.is_some() || lr_streams.is_some() {
                o
            } else {
                x
            },
            cols: ei,
            scale: p.embd_scale,
        }
        .launch(self, rows_n(n))?;
        if hs.is_some() || lr_streams.is_some() {
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
        for (il, l) in self.layers.iter().enumerate() {
            // Attention.
            if let Some(w) = &l.ple {
                self.ple_layer(w, n_hc, x, ple_ptrs[il], pos, &nb, dense_rows, n, eps)?;
            }
            if let (Some(hw), Some(hs)) = (&l.hc, &hs) {
                let b = (hcf, hcm);
                self.hc_mix(&hw[0], hs, x, b, hcpc, l.attn_norm, h, n, seg_rows, eps)?;
            }
            if let Some(mx) = &l.lr {
                let rows = (dense_rows, seg_rows);
                self.lr_mixer(&mx[0], n_hc, x, h, &nb, rows, n, eps)?;
            }
            self.attention_half(il, &l.attn, &call, &mut mla_sel)?;
            if let (Some(hw), Some(hs)) = (&l.hc, &hs) {
                self.hc_post(hs, x, o, hcpc, n)?;
                let b = (hcf, hcm);
                self.hc_mix(&hw[1], hs, x, b, hcpc, l.ffn_norm, h, n, seg_rows, eps)?;
            } else if let Some(mx) = &l.lr {
                self.lr_post(n_hc, x, o, nb.inj, n)?;
                let rows = (dense_rows, seg_rows);
                self.lr_mixer(&mx[1], n_hc, x, h, &nb, rows, n, eps)?;
            } else {
                self.residual(x, o, l.post_attn, l.ffn_norm, h, n, e, eps)?;
            }
            // Feed-forward.
            self.feed_forward(il, &l.ffn, &call, env, &mut host_ids)?;
            if let (Some(_), Some(hs)) = (&l.hc, &hs) {
                self.hc_post(hs, x, o, hcpc, n)?;
            } else if l.lr.is_some() {
                self.lr_post(n_hc, x, o, nb.inj, n)?;
            } else {
                let next = self.layers.get(il + 1).map_or(0, |nl| nl.attn_norm);
                self.residual(x, o, l.post_ffn, next, h, n, e, eps)?;
            }
        }
        if let (true, Some(w)) = (nr > 0, &self.lowrank) {
            // The output mixer normalises: it reads the logits rows' streams.
            let head_rows = Rows {
                table: row_chunks,
                count: n_rowc,
                chunks: nr.div_ceil(MVG_N),
                small,
            };
            self.gather(x, rowmap, nb.xg, nr, n_hc * e)?;
            // (Its down product is not segmented: the rows are the logits rows.)
            let rows = (head_rows, head_rows);
            self.lr_mixer(w, n_hc, nb.xg, hsel, &nb, rows, nr, eps)?;
        } else if nr > 0 {
            // Hyper-connections: the head's collapse of the streams first (into h).
            let last = match &self.hyper {
                Some((hs, Some(w))) => {
                    self.hc_mix(w, hs, x, (hcf, hcm), 0, 0, h, n, seg_rows, eps)?;
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
        if nr > 0 {
            self.mv(
                &[(&self.output, lg)],
                row_chunks,
                n_rowc,
                nr.div_ceil(MVG_N),
                hsel,
                1,
                small,
            )?;
        }
        Ok(())
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
        let rec_ptrs: Vec<Vec<u64>> = kv
            .rec
            .iter()
            .map(|l| l.iter().map(|b| b.device_ptr(&kv.stream).0).collect())
            .collect();
        let ple_ptrs: Vec<u64> = kv
            .ple
            .iter()
            .map(|d| d.as_ref().map_or(0, |d| d.device_ptr(&kv.stream).0))
            .collect();
        let dsv4_ptrs: Vec<Dsv4Ptrs> = kv
            .dsv4
            .iter()
            .map(|d| {
                d.as_ref()
                    .map_or_else(Dsv4Ptrs::default, |d| d.ptrs(&kv.stream))
            })
            .collect();
        let kv_ptrs: Vec<(u64, u64)> =
            kv.k.iter()
                .zip(&kv.v)
                .map(|(k, v)| (k.device_ptr(&kv.stream).0, v.device_ptr(&kv.stream).0))
                .collect();
        let ptrs = StatePtrs {
            rec_ptrs: &rec_ptrs,
            ple_ptrs: &ple_ptrs,
            dsv4_ptrs: &dsv4_ptrs,
            kv_ptrs: &kv_ptrs,
        };
        let nr = rows.len();
        let stream = &self.stream;
        let mut sc = lock(&self.scratch);
        let sc = &mut *sc;
        let (call, hb) = self.call(sc, batch, rows, kvt, heads, ple_rows, ptrs)?;
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
                    &sc.logits.as_ref().expect("grown").slice(0..nr * nv),
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

/// The key of a captured decode step: every address its launches take (the header at
/// `hb`, the scratch buffers, the sequence's state).
fn graph_key(c: &Call<'_>, hb: u64) -> Vec<u64> {
    let Call {
        n,
        nr,
        kvt,
        x,
        h,
        q,
        k,
        v,
        att,
        o,
        g,
        u,
        rl,
        ids,
        wts,
        dd,
        chunks,
        nchunks,
        hsel,
        lg,
        qa,
        qan,
        kva,
        qn,
        qabs,
        qatt,
        ov,
        shb,
        hcf,
        hcm,
        hcpc,
        cc,
        cz,
        ic,
        iz,
        iq,
        wh,
        ik,
        scores,
        selb,
        nselb,
        dz,
        nb,
        rec_ptrs,
        ple_ptrs,
        kv_ptrs,
        dsv4_ptrs,
        ..
    } = *c;
    let mut key = vec![
        n as u64, nr as u64, kvt as u64, hb, x, h, q, k, v, att, o, g, u,
    ];
    key.extend([rl, ids, wts, dd, chunks, nchunks, hsel, lg]);
    key.extend([qa, qan, kva, qn, qabs, qatt, ov, shb]);
    key.extend([
        hcf, hcm, hcpc, cc, cz, ic, iz, iq, wh, ik, scores, selb, nselb, dz,
    ]);
    key.extend(nb.all());
    key.extend(rec_ptrs.iter().flatten().copied());
    key.extend(ple_ptrs.iter().copied());
    key.extend(kv_ptrs.iter().flat_map(|&(a, b)| [a, b]));
    key.extend(
        dsv4_ptrs
            .iter()
            .flat_map(|d| [[d.ring, 0, 0], d.comp, d.index].into_iter().flatten()),
    );
    key
}

impl Funcs {
    /// Load every kernel of the forward pass from the compiled module (`mvt1_*` allowed
    /// `smem_max` bytes of dynamic shared memory).
    fn load(d: &Device, smem_max: usize) -> Result<Funcs, String> {
        let load = |n: &str| -> Result<Kernel, String> {
            Ok(Kernel {
                f: d.module
                    .load_function(n)
                    .map_err(|e| format!("kernel {n}: {e}"))?,
                name: n.to_string(),
                sig: kernel_signature(n).ok_or_else(|| format!("kernel {n}: no signature"))?,
            })
        };
        let mut mvg = Vec::new();
        let mut mvt = Vec::new();
        let mut embed = Vec::new();
        for (ty, s) in FORMATS {
            mvg.push(load(&format!("mvg_{s}"))?);
            mvt.push(if d.mma != Mma::Never && takes_f16(ty) {
                let one = load(&format!("mvt1_{s}"))?;
                one.f
                    .set_attribute(
                        CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        smem_max as i32,
                    )
                    .map_err(|e| {
                        format!("kernel mvt1_{s}: {smem_max} bytes of shared memory: {e}")
                    })?;
                Some([one, load(&format!("mvt_{s}"))?])
            } else {
                None
            });
            embed.push(load(&format!("embed_{s}"))?);
        }
        Ok(Funcs {
            mvg,
            mvt,
            embed,
            rms_norm_rows: load("rms_norm_rows")?,
            residual_norm: load("residual_norm")?,
            qk_norm_rope: load("qk_norm_rope")?,
            kv_store: [load("kv_store_f16")?, load("kv_store_f32")?],
            attention: [load("attention_f16")?, load("attention_f32")?],
            topk_route: load("topk_route")?,
            moe_chunks: load("moe_chunks")?,
            glu_act: load("glu_act")?,
            moe_combine: load("moe_combine")?,
            mla_kv_prep: load("mla_kv_prep")?,
            mla_q_split: load("mla_q_split")?,
            mla_q_join: load("mla_q_join")?,
            hc_expand: load("hc_expand")?,
            hc_pre: load("hc_pre")?,
            hc_post: load("hc_post")?,
            dsv4_heads: load("dsv4_heads")?,
            dsv4_kv_prep: load("dsv4_kv_prep")?,
            dsv4_compress: load("dsv4_compress")?,
            ring_store: load("ring_store")?,
            dsv4_index_scores: load("dsv4_index_scores")?,
            dsv4_topk: load("dsv4_topk")?,
            dsv4_attention: load("dsv4_attention")?,
            dsa_key_prep: load("dsa_key_prep")?,
            rms_groups: load("rms_groups")?,
            lr_act: load("lr_act")?,
            lr_mix: load("lr_mix")?,
            lr_post: load("lr_post")?,
            ple_gate: load("ple_gate")?,
            conv_ring: load("conv_ring")?,
            delta_rule: load("delta_rule")?,
            qsa_prep: load("qsa_prep")?,
            qsa_pool: load("qsa_pool")?,
            qsa_expand: load("qsa_expand")?,
            rows_gather: load("rows_gather")?,
            dot_rows_f32: load("dot_rows_f32")?,
            stream_mean: load("stream_mean")?,
            kda_gate: load("kda_gate")?,
            pool_prep: load("pool_prep")?,
            pool_make: load("pool_make")?,
        })
    }
}

/// Whether `plan`'s weights fit what the backend may hold in VRAM (routed experts too when
/// `experts` is resident; cached ones need a VRAM expert cache); the VRAM expert cache's
/// budget.
fn weights_fit(d: &Device, plan: &DecoderPlan, experts: ExpertPlacement) -> Result<u64, String> {
    // What the weights need, against what the backend may hold.
    // (Pooled layers' per-head k_b / v_b are stacked tensors, outside `matrices`.)
    let stacked: u64 = plan
        .layers
        .iter()
        .map(|l| match &l.attn {
            PlanAttn::Pooled { w, .. } => (w.k_b.range.len() + w.v_b.range.len()) as u64,
            _ => 0,
        })
        .sum();
    let dense: u64 = stacked
        + plan
            .matrices()
            .iter()
            .map(|(_, m)| m.range.len() as u64)
            .sum::<u64>();
    let routed: u64 = plan
        .layers
        .iter()
        .map(|l| match &l.ffn {
            PlanFfn::Moe { experts, .. } => {
                experts.iter().map(|s| s.range.len() as u64).sum::<u64>()
            }
            PlanFfn::Dense { .. } => 0,
        })
        .sum();
    let (budget, held, expert_budget) = {
        let g = d.lock();
        (g.budget, g.stats.resident_bytes, g.stats.expert_budget)
    };
    let need = dense
        + if experts == ExpertPlacement::Resident {
            routed
        } else {
            0
        };
    if held + need > budget {
        return Err(format!(
            "the weights need {:.2} GiB of VRAM ({:.2} GiB routed experts{}), {:.2} GiB is left for weights; set --gpu-expert-cache to stream the experts",
            need as f64 / (1u64 << 30) as f64,
            routed as f64 / (1u64 << 30) as f64,
            if experts == ExpertPlacement::Resident { " included" } else { " not included" },
            budget.saturating_sub(held) as f64 / (1u64 << 30) as f64
        ));
    }
    if experts == ExpertPlacement::Cached && routed > 0 && expert_budget == 0 {
        return Err(
            "experts outside VRAM need a VRAM expert cache (--gpu-expert-cache SIZE)".into(),
        );
    }
    Ok(expert_budget)
}

impl Uploader<'_> {
    /// Upload one layer's attention block (its weights, in the block's own type).
    fn attention(&mut self, attn: &PlanAttn) -> Result<DAttn, String> {
        Ok(match attn {
            PlanAttn::Gqa {
                w: a,
                inv_freq,
                window,
            } => DAttn::Gqa(self.gqa(a, inv_freq, window)?),
            PlanAttn::Kda { w, shape } => DAttn::Kda(Box::new(self.kda(w, shape)?)),
            // Absorbed MLA without RoPE over the positions its k-pool indexer picks.
            PlanAttn::Pooled { w, shape } => DAttn::Mla(Box::new(self.pooled(w, shape)?)),
            PlanAttn::Delta { w, shape } => DAttn::Delta(Box::new(self.delta(w, shape)?)),
            PlanAttn::Qsa { w, shape, inv_freq } => {
                DAttn::Qsa(Box::new(self.qsa(w, shape, inv_freq)?))
            }
            PlanAttn::Dsv4 { w, shape } => DAttn::Dsv4(Box::new(self.dsv4(w, shape)?)),
            PlanAttn::Mla { w, shape, select } => DAttn::Mla(Box::new(self.mla(w, shape, select)?)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocks::moe::{layer_table, rows_by_unit, LAYER_COUNTS_BYTES};
    use crate::forward::products::MVT1_PART;

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
