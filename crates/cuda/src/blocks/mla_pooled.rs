//! GLM-5.3-Flash's pooled latent attention on the GPU (the CPU's
//! `sluice_models::blocks::mla_pooled`): absorbed MLA without RoPE (`blocks::mla`, through
//! [`pooled_mla_shape`]) over the positions its k-pool indexer picks.
//!
//! Owns: the k-pool indexer [`DPool`] (its device weights; `Uploader::pool`, the per-head
//! `k_b` / `v_b` of `Uploader::stacked_heads`), its per-sequence state ([`PoolState`]:
//! LayerNorm'd keys, gate logits and pools; [`PoolPtrs`] for a call) and its launches ([`GpuDecoder::pool_select`]:
//! `pool_prep`, `pool_make`, the pools' scores and top-k through
//! `GpuDecoder::index_select`, their positions and the tail through `qsa_expand`).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use sluice_models::blocks::mla::MlaShape;
use sluice_models::blocks::mla_pooled::{PooledIndexer, PooledShape, PooledWeights};
use sluice_models::plan::{DecoderPlan, PlanAttn, PlanLayer};
use sluice_models::weights::Stacked;
use sluice_models::ModelError;

use crate::blocks::dsa_indexer::{IndexSelect, IDX_MAX_Q};
use crate::blocks::mla::{DSelect, Mla};
use crate::forward::bufs::IndexBufs;
use crate::forward::scratch::NextBufs;
use crate::forward::state::{dup, ptr, zeros};
use crate::forward::{i32_of, DMat, GpuDecoder, Uploader, MAX_HEAD_DIM_V};
use crate::{kernel_format, kernels};

/// The k-pool indexer of a full pooled layer in VRAM (`mla_pooled::PooledIndexer`).
pub(crate) struct DPool {
    pub(crate) q_b: DMat,
    pub(crate) k: DMat,
    pub(crate) k_norm: u64,
    pub(crate) k_norm_b: u64,
    pub(crate) proj: DMat,
    pub(crate) gate: DMat,
    pub(crate) ape: u64,
    pub(crate) n_head: usize,
    pub(crate) head_dim: usize,
    /// Pools a query keeps (`top_k / kpool`), tokens per pool, whether the incomplete
    /// pool's tokens are always attended to.
    pub(crate) keep: usize,
    pub(crate) kpool: usize,
    pub(crate) tail: bool,
    pub(crate) ln_eps: f32,
}

/// A pooled layer's attention as the absorbed-MLA kernels see it: latent rows of
/// `kv_lora` values without a RoPE part.
pub(crate) fn pooled_mla_shape(s: &PooledShape) -> MlaShape {
    MlaShape {
        n_head: s.n_head,
        q_lora: s.q_lora,
        kv_lora: s.kv_lora,
        nope: s.head_k,
        rope: 0,
        v_dim: s.head_v,
        scale: 1.0 / (s.head_k as f32).sqrt(),
        rms_eps: s.rms_eps,
    }
}

/// One full pooled layer's indexer state for a sequence: every position's key and gate
/// logits, every complete pool's key (by position and pool, written before they are read).
pub(crate) struct PoolState {
    pub(crate) keys: CudaSlice<f32>,
    pub(crate) gates: CudaSlice<f32>,
    pub(crate) pooled: CudaSlice<f32>,
}

/// [`PoolState`]'s device addresses for one call.
#[derive(Clone, Copy, Default)]
pub(crate) struct PoolPtrs {
    pub(crate) keys: u64,
    pub(crate) gates: u64,
    pub(crate) pooled: u64,
}

impl PoolState {
    /// Zeros for a sequence of `n_ctx` positions.
    pub(crate) fn new(
        stream: &Arc<CudaStream>,
        ix: &DPool,
        n_ctx: usize,
    ) -> Result<PoolState, ModelError> {
        let d = ix.head_dim;
        let what = "k-pool indexer state";
        Ok(PoolState {
            keys: zeros(stream, n_ctx * d, what)?,
            gates: zeros(stream, n_ctx * d, what)?,
            pooled: zeros(stream, (n_ctx / ix.kpool + 1) * d, what)?,
        })
    }

    /// A copy on the device (a snapshot); None if a copy failed.
    pub(crate) fn copy(&self, stream: &Arc<CudaStream>) -> Option<PoolState> {
        Some(PoolState {
            keys: dup(stream, &self.keys)?,
            gates: dup(stream, &self.gates)?,
            pooled: dup(stream, &self.pooled)?,
        })
    }

    pub(crate) fn ptrs(&self, stream: &Arc<CudaStream>) -> PoolPtrs {
        PoolPtrs {
            keys: ptr(stream, &self.keys),
            gates: ptr(stream, &self.gates),
            pooled: ptr(stream, &self.pooled),
        }
    }
}

impl DPool {
    pub(crate) fn q_b(&self) -> &DMat {
        &self.q_b
    }

    /// Positions a token may attend to at most (its pools and the tail).
    pub(crate) fn positions(&self) -> usize {
        self.keep * self.kpool + self.kpool - 1
    }
}

impl Uploader<'_> {
    pub(crate) fn pool(&mut self, ix: &PooledIndexer, sh: &PooledShape) -> Result<DPool, String> {
        Ok(DPool {
            q_b: self.mat(&ix.q_b)?,
            k: self.mat(&ix.k)?,
            k_norm: self.norm(&ix.k_norm)?,
            k_norm_b: self.norm(&ix.k_norm_b)?,
            proj: self.mat(&ix.proj)?,
            gate: self.mat(&ix.gate)?,
            ape: self.norm(&ix.ape)?,
            n_head: sh.idx_heads,
            head_dim: sh.idx_dim,
            keep: sh.pools_kept(),
            kpool: sh.kpool,
            tail: sh.select_tail,
            ln_eps: sh.ln_eps,
        })
    }

    /// Upload a per-head stacked tensor (`k_b`, `v_b` of a pooled layer) and give each
    /// head a pointer-table entry (consecutive); the result's rows are one head's.
    pub(crate) fn stacked_heads(&mut self, s: &Stacked) -> Result<DMat, String> {
        let base = self.bytes(&self.map[s.range.clone()])?;
        let first = self.tab.len();
        for h in 0..s.n_expert {
            self.tab
                .push(base + (h * s.slice_bytes() + s.sub.start) as u64);
        }
        Ok(DMat {
            tab: first,
            fi: kernel_format(s.ty, s.cols).expect("checked"),
            rows: s.rows,
            cols: s.cols,
            row_bytes: s.ty.row_bytes(s.cols as u64).expect("checked") as i64,
        })
    }
}

impl GpuDecoder {
    /// A full pooled layer's selection for `n` tokens: its indexer's keys, gate logits and
    /// completed pools into the state `st` (keys, gates, pools; the batch's keys and gate
    /// logits from `idx.ik` and `b.pg`), the pools' scores and top-k (`idx`), then the
    /// positions (chosen pools and, when the layer says so, the tail) into `b.psel` /
    /// `b.npsel`. Returns (positions, counts, positions per token) for the attention.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn pool_select(
        &self,
        ix: &DPool,
        st: PoolPtrs,
        pos: u64,
        idx: &IndexBufs,
        b: &NextBufs,
        round: bool,
        n: usize,
    ) -> Result<(u64, u64, usize), ModelError> {
        let PoolPtrs {
            keys,
            gates,
            pooled,
        } = st;
        let id = i32_of(ix.head_dim, "indexer keys")?;
        kernels::PoolPrep {
            ik: idx.ik,
            gt: b.pg,
            lnw: ix.k_norm,
            lnb: ix.k_norm_b,
            pos,
            keys,
            gates,
            id,
            eps: ix.ln_eps,
            round: i32::from(round),
        }
        .launch(self, (n as u32, 1, 1))?;
        kernels::PoolMake {
            keys,
            gates,
            ape: ix.ape,
            pooled,
            pos,
            id,
            kp: ix.kpool as i32,
            round: i32::from(round),
        }
        .launch(self, (n as u32, 1, 1))?;
        let sel = IndexSelect {
            iq: idx.iq,
            wh: idx.wh,
            n_head: ix.n_head,
            head_dim: ix.head_dim,
            rows: pooled,
            ratio: ix.kpool,
            top_k: ix.keep,
        };
        self.index_select(&sel, pos, idx, n)?;
        let kp = ix.positions();
        self.expand(idx.sel, idx.nsel, pos, b, ix.kpool, ix.keep, kp, ix.tail, n)?;
        Ok((b.psel, b.npsel, kp))
    }
}

/// What the pooled-attention kernels refuse: another attention kind beside pooled layers
/// (layer `il`, `first`: the first pooled layer's shape). The reason when not.
pub(crate) fn check_alone(
    il: usize,
    l: &PlanLayer,
    first: Option<PooledShape>,
) -> Result<(), String> {
    // The kernels' attention shape is the pooled layers' absorbed view for the whole
    // decoder: no other attention beside them.
    if first.is_some()
        && matches!(
            l.attn,
            PlanAttn::Gqa { .. }
                | PlanAttn::Mla { .. }
                | PlanAttn::Qsa { .. }
                | PlanAttn::Dsv4 { .. }
        )
    {
        return Err(format!(
            "layer {il}: pooled latent attention mixed with other attention"
        ));
    }
    Ok(())
}

/// What the pooled-attention kernels refuse of layer `il`: a shape unlike the first pooled
/// layer's or the plan's absorbed view, per-head products with no kernel, a k-pool indexer
/// the kernels do not take, a shared layer before any with its indexer. The reason when
/// not.
pub(crate) fn check_layer(
    plan: &DecoderPlan,
    il: usize,
    w: &PooledWeights,
    s: &PooledShape,
    first: Option<PooledShape>,
) -> Result<(), String> {
    let e = plan.n_embd;
    let dims = |s: &PooledShape| (s.n_head, s.q_lora, s.kv_lora, s.head_k, s.head_v);
    // (The kernels take the plan's attention shape as the absorbed view.)
    let a = &plan.shape;
    let ok = first.as_ref().map(dims) == Some(dims(s))
        && (a.n_head, a.n_head_kv, a.head_dim, a.head_dim_v) == (s.n_head, 1, s.kv_lora, s.kv_lora)
        && s.n_head > 0
        && s.kv_lora <= MAX_HEAD_DIM_V
        && (w.q_a.rows, w.q_b.rows, w.q_b.cols) == (s.q_lora, s.n_head * s.head_k, s.q_lora)
        && (w.q_a_norm.len(), w.kv_a.rows, w.kv_a_norm.len()) == (s.q_lora, s.kv_lora, s.kv_lora)
        && (w.k_b.n_expert, w.k_b.rows, w.k_b.cols) == (s.n_head, s.kv_lora, s.head_k)
        && (w.v_b.n_expert, w.v_b.rows, w.v_b.cols) == (s.n_head, s.head_v, s.kv_lora)
        && (w.out.rows, w.out.cols) == (e, s.n_head * s.head_v);
    if !ok {
        return Err(format!(
            "layer {il}: pooled latent attention of {} heads (kv_lora {}, keys {}, values {}) the kernels do not take, or unlike the first pooled layer's",
            s.n_head, s.kv_lora, s.head_k, s.head_v
        ));
    }
    let kernel = |ty: sluice_kernels::GgmlType, cols: usize, what: &str| {
        kernel_format(ty, cols).map(|_| ()).ok_or_else(|| {
            format!("layer {il} attention {what}: {ty:?} with {cols} columns has no GPU kernel")
        })
    };
    kernel(w.k_b.ty, w.k_b.cols, "k_b")?;
    kernel(w.v_b.ty, w.v_b.cols, "v_b")?;
    if let Some(ix) = &w.indexer {
        let (ih, id, kp) = (s.idx_heads, s.idx_dim, s.kpool);
        let ok = ih > 0
            && ih * id <= IDX_MAX_Q
            && kp > 0
            && s.top_k >= kp
            && (ix.q_b.rows, ix.q_b.cols) == (ih * id, s.q_lora)
            && (ix.k.rows, ix.gate.rows, ix.proj.rows) == (id, id, ih)
            && (ix.k_norm.len(), ix.k_norm_b.len(), ix.ape.len()) == (id, id, kp * id);
        if !ok {
            return Err(format!(
                "layer {il}: a k-pool indexer of {ih} heads of {id} (pools of {kp}, top {}) the kernels do not take",
                s.top_k
            ));
        }
    } else if !plan.layers[..il]
        .iter()
        .any(|l| matches!(&l.attn, PlanAttn::Pooled { w, .. } if w.indexer.is_some()))
    {
        return Err(format!(
            "layer {il}: a shared pooled layer before any layer with its indexer"
        ));
    }
    Ok(())
}

impl Uploader<'_> {
    /// Upload a pooled layer as absorbed MLA without RoPE over the positions its k-pool
    /// indexer picks (or the previous full layer's).
    pub(crate) fn pooled(&mut self, w: &PooledWeights, shape: &PooledShape) -> Result<Mla, String> {
        Ok(Mla {
            select: match &w.indexer {
                Some(ix) => DSelect::Pooled(Box::new(self.pool(ix, shape)?)),
                None => DSelect::Previous,
            },
            q_a: self.mat(&w.q_a)?,
            q_a_norm: self.norm(&w.q_a_norm)?,
            q_b: self.mat(&w.q_b)?,
            kv_a: self.mat(&w.kv_a)?,
            kv_a_norm: self.norm(&w.kv_a_norm)?,
            k_b: self.stacked_heads(&w.k_b)?,
            v_b: self.stacked_heads(&w.v_b)?,
            out: self.mat(&w.out)?,
            // (No RoPE: never read.)
            inv_freq: self.norm(&[0.0])?,
        })
    }
}
