//! GQA softmax attention on the GPU (the CPU's `sluice_models::blocks::attention`).
//!
//! Owns: [`Gqa`] (its device weights: q / k / v / o, the optional q / k norms, the RoPE
//! frequencies, the sliding window) and its launch sequence ([`GpuDecoder::gqa`]). The
//! KV cache rows (`kv_store_*`) and the softmax attention kernel (`attention_*`) it
//! launches are shared with MLA and QSA (`GpuDecoder::kv_store` / `attention`). Its
//! per-sequence state is its KV rows in [`crate::forward::GpuKv`].

use sluice_models::blocks::attention::GqaWeights;
use sluice_models::plan::DecoderPlan;
use sluice_models::ModelError;

use crate::forward::bufs::{AttnBufs, Io};
use crate::forward::{i32_of, DMat, GpuDecoder, Uploader, MAX_HEAD_DIM, MAX_HEAD_DIM_V};
use crate::kernels;

/// A GQA layer in VRAM.
pub(crate) struct Gqa {
    pub(crate) wq: DMat,
    pub(crate) wk: DMat,
    pub(crate) wv: DMat,
    pub(crate) wo: DMat,
    /// Per-head q / k RMS norms (0: none).
    pub(crate) q_norm: u64,
    pub(crate) k_norm: u64,
    pub(crate) inv_freq: u64,
    /// Sliding window (0: global).
    pub(crate) window: i32,
}

impl GpuDecoder {
    /// GQA softmax attention (the CPU's `blocks::attention`): q / k / v products of the
    /// normed input, q / k norms and NEOX RoPE, the KV cache rows, attention over the
    /// cache (`cache`: this layer's keys and values). Its output rows and matrix.
    pub(crate) fn gqa<'w>(
        &self,
        w: &'w Gqa,
        io: &Io,
        a: &AttnBufs,
        cache: (u64, u64),
    ) -> Result<(&'w DMat, u64), ModelError> {
        let Gqa {
            wq,
            wk,
            wv,
            wo,
            q_norm,
            k_norm,
            inv_freq,
            window,
        } = w;
        let Io {
            n,
            eps,
            kvt,
            pos,
            rows,
            h,
            ..
        } = *io;
        let AttnBufs {
            nh,
            nkv,
            hd,
            kdim,
            vdim,
            q,
            k,
            v,
            att,
        } = *a;
        let (kc, vc) = cache;
        self.mv_rows(&[(wq, q), (wk, k), (wv, v)], rows, h)?;
        // The cache store inside qk_norm_rope (SLUICE_CUDA_FUSE=0: kv_store's launch).
        let fused = self.fuse && kdim == nkv * hd && vdim % nkv == 0;
        kernels::QkNormRope {
            q,
            k,
            qn: *q_norm,
            kn: *k_norm,
            pos,
            inv_freq: *inv_freq,
            nh: nh as i32,
            nkv: nkv as i32,
            hd: hd as i32,
            eps,
            kc: if fused { kc } else { 0 },
            vc,
            v,
            kv_f32: kvt as i32,
            kdim: i32_of(kdim, "key row")?,
            vdim: i32_of(vdim, "value row")?,
        }
        .launch(self, (n as u32, (nh + nkv) as u32, 1))?;
        if !fused {
            self.kv_store(kvt, k, v, kc, vc, pos, n, kdim, vdim)?;
        }
        self.attention(kvt, q, kc, vc, att, pos, n, *window, (0, 0, 0))?;
        Ok((wo, att))
    }
}

impl GpuDecoder {
    /// Store `n` tokens' key and value rows (`k`, `v`) to the cache rows their positions
    /// name (`kvt`: 0 f16 cache, 1 f32).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn kv_store(
        &self,
        kvt: usize,
        k: u64,
        v: u64,
        kc: u64,
        vc: u64,
        pos: u64,
        n: usize,
        kdim: usize,
        vdim: usize,
    ) -> Result<(), ModelError> {
        kernels::KvStore {
            cache: kvt,
            k,
            v,
            kc,
            vc,
            pos,
            kdim: i32_of(kdim, "key row")?,
            vdim: i32_of(vdim, "value row")?,
        }
        .launch(self, (n as u32, 1, 1))
    }

    /// Attention of `n` tokens' query heads `q` over the cache (`window` 0: global; `select`:
    /// (positions `[n][top_k]`, their counts, top_k), the positions each token attends to,
    /// or (0, 0, 0) for all).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn attention(
        &self,
        kvt: usize,
        q: u64,
        kc: u64,
        vc: u64,
        out: u64,
        pos: u64,
        n: usize,
        window: i32,
        select: (u64, u64, usize),
    ) -> Result<(), ModelError> {
        let sh = &self.plan.shape;
        let (sel, nsel, top_k) = select;
        kernels::Attention {
            cache: kvt,
            q,
            kc,
            vc,
            out,
            pos,
            nh: sh.n_head as i32,
            nkv: sh.n_head_kv as i32,
            hd: sh.head_dim as i32,
            hdv: sh.head_dim_v as i32,
            scale: sh.scale,
            window,
            sel,
            nsel,
            top_k: i32_of(top_k, "top-k")?,
        }
        .launch(self, (n as u32, sh.n_head as u32, 1))
    }
}

/// What the attention kernel refuses of the plan's attention shape: odd key heads or heads
/// wider than it takes, query heads not a multiple of the KV heads. The reason when not.
pub(crate) fn check_shape(plan: &DecoderPlan) -> Result<(), String> {
    let sh = &plan.shape;
    if sh.head_dim > MAX_HEAD_DIM
        || sh.head_dim_v > MAX_HEAD_DIM_V
        || !sh.head_dim.is_multiple_of(2)
        || sh.head_dim_v == 0
    {
        return Err(format!(
            "head sizes {} / {} (the attention kernel takes even key sizes up to {MAX_HEAD_DIM}, values up to {MAX_HEAD_DIM_V})",
            sh.head_dim, sh.head_dim_v
        ));
    }
    if sh.n_head_kv == 0 || !sh.n_head.is_multiple_of(sh.n_head_kv) {
        return Err(format!(
            "{} query heads over {} KV heads",
            sh.n_head, sh.n_head_kv
        ));
    }
    Ok(())
}

impl Uploader<'_> {
    /// Upload a GQA layer's weights.
    pub(crate) fn gqa(
        &mut self,
        a: &GqaWeights,
        inv_freq: &[f32],
        window: &Option<usize>,
    ) -> Result<Gqa, String> {
        Ok(Gqa {
            wq: self.mat(&a.wq)?,
            wk: self.mat(&a.wk)?,
            wv: self.mat(&a.wv)?,
            wo: self.mat(&a.wo)?,
            q_norm: self.opt_norm(&a.q_norm)?,
            k_norm: self.opt_norm(&a.k_norm)?,
            inv_freq: self.norm(inv_freq)?,
            window: window.map_or(0, |w| w.min(i32::MAX as usize) as i32),
        })
    }
}
