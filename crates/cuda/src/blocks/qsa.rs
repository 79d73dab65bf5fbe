//! QSA indexed attention on the GPU (the CPU's `sluice_models::blocks::qsa`).
//!
//! Owns: [`DQsa`] (its device weights) and its launches ([`GpuDecoder::qsa`]: the
//! products, `qsa_prep` (norms, RoPE, the output gate, the indexer's queries and keys),
//! `qsa_pool` (pooled block keys), the blocks' scores and top-k through
//! `GpuDecoder::index_select`, [`GpuDecoder::expand`] (blocks to positions), attention over
//! them, the gate), reading the shared attention and indexer buffers of `forward::Call`. Its per-sequence state beside the KV rows:
//! [`QsaState`] (raw and pooled indexer keys, with an indexer; [`QsaPtrs`] for a call).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use sluice_models::blocks::qsa::{QsaShape, QsaWeights};
use sluice_models::plan::DecoderPlan;
use sluice_models::ModelError;

use crate::blocks::dsa_indexer::{IndexSelect, IDX_MAX_Q};
use crate::blocks::ffn::ACT_SIGMOID;
use crate::forward::bufs::Io;
use crate::forward::scratch::NextBufs;
use crate::forward::state::{dup, ptr, zeros};
use crate::forward::{i32_of, Call, DMat, GpuDecoder, Uploader};
use crate::kernels;

/// A QSA layer in VRAM (`qsa::QsaWeights`).
pub(crate) struct DQsa {
    pub(crate) wq: DMat,
    pub(crate) wk: DMat,
    pub(crate) wv: DMat,
    pub(crate) wo: DMat,
    pub(crate) idx_q: DMat,
    pub(crate) idx_k: DMat,
    pub(crate) q_norm: u64,
    pub(crate) k_norm: u64,
    pub(crate) idx_q_norm: u64,
    pub(crate) idx_k_norm: u64,
    pub(crate) inv_freq: u64,
    pub(crate) shape: QsaShape,
}

/// An indexed QSA layer's state for a sequence: every position's raw indexer key and every
/// complete block's pooled key (by position and block, written before they are read).
pub(crate) struct QsaState {
    pub(crate) keys: CudaSlice<f32>,
    pub(crate) pooled: CudaSlice<f32>,
}

/// [`QsaState`]'s device addresses for one call.
#[derive(Clone, Copy, Default)]
pub(crate) struct QsaPtrs {
    pub(crate) keys: u64,
    pub(crate) pooled: u64,
}

impl QsaState {
    /// Zeros for a sequence of `n_ctx` positions; None for a layer without an indexer.
    pub(crate) fn new(
        stream: &Arc<CudaStream>,
        s: &QsaShape,
        n_ctx: usize,
    ) -> Result<Option<QsaState>, ModelError> {
        if s.ratio == 0 {
            return Ok(None);
        }
        Ok(Some(QsaState {
            keys: zeros(stream, n_ctx * s.idx_dim, "QSA state")?,
            pooled: zeros(stream, (n_ctx / s.ratio + 1) * s.idx_dim, "QSA state")?,
        }))
    }

    /// A copy on the device (a snapshot); None if a copy failed.
    pub(crate) fn copy(&self, stream: &Arc<CudaStream>) -> Option<QsaState> {
        Some(QsaState {
            keys: dup(stream, &self.keys)?,
            pooled: dup(stream, &self.pooled)?,
        })
    }

    pub(crate) fn ptrs(&self, stream: &Arc<CudaStream>) -> QsaPtrs {
        QsaPtrs {
            keys: ptr(stream, &self.keys),
            pooled: ptr(stream, &self.pooled),
        }
    }
}

impl Uploader<'_> {
    pub(crate) fn qsa(
        &mut self,
        w: &QsaWeights,
        shape: &QsaShape,
        inv_freq: &[f32],
    ) -> Result<DQsa, String> {
        Ok(DQsa {
            wq: self.mat(&w.wq)?,
            wk: self.mat(&w.wk)?,
            wv: self.mat(&w.wv)?,
            wo: self.mat(&w.wo)?,
            idx_q: self.mat(&w.idx_q)?,
            idx_k: self.mat(&w.idx_k)?,
            q_norm: self.norm(&w.q_norm)?,
            k_norm: self.norm(&w.k_norm)?,
            idx_q_norm: self.norm(&w.idx_q_norm)?,
            idx_k_norm: self.norm(&w.idx_k_norm)?,
            inv_freq: self.norm(inv_freq)?,
            shape: *shape,
        })
    }
}

impl GpuDecoder {
    /// The positions of `n` tokens from their indexer's chosen blocks (`bsel`, counts `nb`,
    /// `kb` per token) of `ratio` tokens, with the incomplete block's tail when `tail`,
    /// into `b.psel` (`kp` per token) and `b.npsel`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn expand(
        &self,
        bsel: u64,
        nb: u64,
        pos: u64,
        b: &NextBufs,
        ratio: usize,
        kb: usize,
        kp: usize,
        tail: bool,
        n: usize,
    ) -> Result<(), ModelError> {
        kernels::QsaExpand {
            bsel,
            nb,
            pos,
            psel: b.psel,
            np: b.npsel,
            ratio: ratio as i32,
            kb: i32_of(kb, "blocks")?,
            kp: i32_of(kp, "positions")?,
            tail: i32::from(tail),
        }
        .launch(self, (n as u32, 1, 1))
    }

    /// QSA attention `w` of the block input `c.io.h`, gated (`[n][nh * hd]`, before the
    /// output product; its address is returned): the attention and indexer buffers of `c`
    /// and its gates (`c.next`), the KV cache `cache`, the indexer's state `st` (None
    /// without an indexer).
    pub(crate) fn qsa(
        &self,
        w: &DQsa,
        c: &Call<'_>,
        cache: (u64, u64),
        st: Option<QsaPtrs>,
    ) -> Result<u64, ModelError> {
        let Io {
            n,
            kvt,
            pos,
            rows,
            h,
            ..
        } = c.io;
        let (bufs, idx, b) = (&c.attn, &c.index, &c.next);
        let s = &w.shape;
        let (nh, nkv, hd) = (s.n_head, s.n_head_kv, s.head_dim);
        let indexed = s.ratio > 0;
        let mut parts = vec![(&w.wq, b.qg), (&w.wk, bufs.k), (&w.wv, bufs.v)];
        if indexed {
            parts.extend([(&w.idx_q, idx.iq), (&w.idx_k, idx.ik)]);
        }
        self.mv_rows(&parts, rows, h)?;
        // With an indexer: its query heads and one more block storing the raw keys.
        let blocks = nh + nkv + if indexed { s.idx_heads + 1 } else { 0 };
        let st = match st {
            Some(st) => st,
            None if !indexed => QsaPtrs::default(),
            None => {
                return Err(ModelError::Compute(
                    "cuda: a QSA indexer without its state".into(),
                ))
            }
        };
        let keys = st.keys;
        kernels::QsaPrep {
            qg: b.qg,
            q: bufs.q,
            gate: b.gate,
            k: bufs.k,
            iq: idx.iq,
            ik: idx.ik,
            keys,
            qn: w.q_norm,
            kn: w.k_norm,
            iqn: w.idx_q_norm,
            pos,
            inv_freq: w.inv_freq,
            nh: nh as i32,
            nkv: nkv as i32,
            hd: hd as i32,
            ih: s.idx_heads as i32,
            id: s.idx_dim as i32,
            n_rot: s.n_rot as i32,
            eps: s.rms_eps,
        }
        .launch(self, (n as u32, blocks as u32, 1))?;
        let (kdim, vdim) = (nkv * hd, nkv * hd);
        self.kv_store(kvt, bufs.k, bufs.v, cache.0, cache.1, pos, n, kdim, vdim)?;
        let mut sel = (0, 0, 0);
        if indexed {
            let pooled = st.pooled;
            kernels::QsaPool {
                keys,
                pooled,
                norm: w.idx_k_norm,
                pos,
                inv_freq: w.inv_freq,
                id: s.idx_dim as i32,
                ratio: s.ratio as i32,
                n_rot: s.n_rot as i32,
                eps: s.rms_eps,
            }
            .launch(self, (n as u32, 1, 1))?;
            let kb = s.budget / s.ratio;
            let ix = IndexSelect {
                iq: idx.iq,
                wh: 0,
                n_head: s.idx_heads,
                head_dim: s.idx_dim,
                rows: pooled,
                ratio: s.ratio,
                top_k: kb,
            };
            self.index_select(&ix, pos, idx, n)?;
            let kp = s.budget + s.ratio - 1;
            self.expand(idx.sel, idx.nsel, pos, b, s.ratio, kb, kp, true, n)?;
            sel = (b.psel, b.npsel, kp);
        }
        self.attention(kvt, bufs.q, cache.0, cache.1, bufs.att, pos, n, 0, sel)?;
        // The output gate: gate = sigmoid(gate) * attention, the output product's input.
        self.glu(b.gate, bufs.att, n * nh * hd, ACT_SIGMOID)?;
        Ok(b.gate)
    }
}

/// What the QSA kernels refuse of layer `il`: heads unlike the plan's attention shape, an
/// odd or too wide rotation, an indexer the kernels do not take. The reason when not.
pub(crate) fn check_layer(
    plan: &DecoderPlan,
    il: usize,
    w: &QsaWeights,
    sh: &QsaShape,
    inv_freq: &[f32],
) -> Result<(), String> {
    let e = plan.n_embd;
    let a = &plan.shape;
    let (nh, hd, id) = (sh.n_head, sh.head_dim, sh.idx_dim);
    let ok = (nh, sh.n_head_kv, hd, hd) == (a.n_head, a.n_head_kv, a.head_dim, a.head_dim_v)
        && sh.n_rot.is_multiple_of(2)
        && sh.n_rot <= hd
        && inv_freq.len() == sh.n_rot / 2
        && (w.wq.rows, w.wk.rows, w.wv.rows) == (nh * 2 * hd, sh.n_head_kv * hd, sh.n_head_kv * hd)
        && (w.wo.rows, w.wo.cols) == (e, nh * hd)
        && (w.q_norm.len(), w.k_norm.len()) == (hd, hd)
        && (sh.ratio == 0
            || (sh.idx_heads > 0
                && sh.idx_heads * id <= IDX_MAX_Q
                && sh.n_rot <= id
                && sh.budget >= sh.ratio
                && sh.budget.is_multiple_of(sh.ratio)
                && (w.idx_q.rows, w.idx_k.rows) == (sh.idx_heads * id, id)
                && (w.idx_q_norm.len(), w.idx_k_norm.len()) == (id, id)));
    if !ok {
        return Err(format!(
            "layer {il}: a QSA layer of {nh} heads of {hd} (rotating {}, indexer {} x {id}, ratio {}, budget {}) the kernels do not take",
            sh.n_rot, sh.idx_heads, sh.ratio, sh.budget
        ));
    }
    Ok(())
}
