//! DeepSeek V4 attention on the GPU (the CPU's `sluice_models::blocks::dsv4_attention`).
//!
//! Owns: the launch sequence of one layer ([`GpuDecoder::dsv4`]): q-LoRA and the KV row
//! (`dsv4_heads`: per-head RMS and partial interleaved RoPE; `dsv4_kv_prep`), the KV
//! compressor (`dsv4_compress` + `ring_store`: compressed rows from the batch and the carry
//! ring), the lightning indexer (scores and top-k through `GpuDecoder::index_select`),
//! `dsv4_attention` (window rows from the batch or the ring, the chosen compressed rows, the
//! head's sink), the window ring's update, the output's de-rotation and the grouped
//! low-rank output. Also its device weights ([`DDsv4`], [`DComp`], [`DIndexer`]), its
//! check ([`check_dsv4`]: what the kernels refuse) and its per-sequence state ([`Dsv4Kv`]:
//! the window ring, the compressors' carries and rows, in place of KV rows; [`Dsv4Ptrs`]
//! for a call), which continues or restarts at 0.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use sluice_models::blocks::dsv4_attention::{Dsv4AttnWeights, Dsv4Shape};
use sluice_models::plan::{DecoderPlan, PlanAttn};
use sluice_models::ModelError;

use crate::blocks::dsa_indexer::{IndexSelect, IDX_MAX_Q};
use crate::forward::bufs::{AttnBufs, Dsv4Bufs, IndexBufs, Io, MlaBufs};
use crate::forward::state::{dup, ptr, zeros};
use crate::forward::{i32_of, rows_n, Call, DMat, GpuDecoder, Uploader, MAX_HEAD_DIM_V};
use crate::kernels;

/// A DeepSeek V4 KV compressor (the attention's or the indexer's).
pub(crate) struct DComp {
    pub(crate) ratio: usize,
    pub(crate) head_dim: usize,
    pub(crate) coff: usize,
    pub(crate) kv: DMat,
    pub(crate) gate: DMat,
    pub(crate) ape: u64,
    pub(crate) norm: u64,
}

/// A DeepSeek V4 layer's lightning indexer.
pub(crate) struct DIndexer {
    pub(crate) n_head: usize,
    pub(crate) head_dim: usize,
    pub(crate) top_k: usize,
    pub(crate) q_b: DMat,
    pub(crate) proj: DMat,
    pub(crate) comp: DComp,
}

/// DeepSeek V4 attention of one layer (`out_a` with one pointer-table entry per output
/// group, `rows` a group's).
pub(crate) struct DDsv4 {
    pub(crate) q_a: DMat,
    pub(crate) q_a_norm: u64,
    pub(crate) q_b: DMat,
    pub(crate) kv: DMat,
    pub(crate) kv_norm: u64,
    pub(crate) sinks: u64,
    pub(crate) out_a: DMat,
    pub(crate) out_b: DMat,
    pub(crate) rope: u64,
    pub(crate) rope_compress: u64,
    pub(crate) comp: Option<DComp>,
    pub(crate) indexer: Option<DIndexer>,
}

/// A compressor's state in VRAM: the carry of the last `coff * ratio` positions' kv and
/// gate products (slot `p % (coff * ratio)`), and every emitted row (f32, rounded to f16
/// with an f16 cache).
pub(crate) struct CompKv {
    pub(crate) rc: CudaSlice<f32>,
    pub(crate) rz: CudaSlice<f32>,
    pub(crate) rows: CudaSlice<f32>,
}

/// One DeepSeek V4 layer's state in VRAM: the ring of the last `window` key rows (slot
/// `p % window`), the compressor's and the indexer's.
pub(crate) struct Dsv4Kv {
    pub(crate) ring: CudaSlice<f32>,
    pub(crate) comp: Option<CompKv>,
    pub(crate) index: Option<CompKv>,
}

/// Device addresses of one layer's [`Dsv4Kv`] (0 where absent): ring, then (carry kv, carry
/// gate, rows) of the compressor and of the indexer.
#[derive(Clone, Copy, Default)]
pub(crate) struct Dsv4Ptrs {
    pub(crate) ring: u64,
    pub(crate) comp: [u64; 3],
    pub(crate) index: [u64; 3],
}

pub(crate) const DSV4_MAX_COMP: usize = 1024;

impl GpuDecoder {
    /// DeepSeek V4 attention of layer `il` (the CPU's `blocks::dsv4_attention`): q-LoRA,
    /// the KV row, the compressor and the lightning indexer, attention over the window
    /// and the chosen compressed rows with the head's sink, the grouped low-rank output.
    /// Its output rows and matrix.
    pub(crate) fn dsv4<'w>(
        &self,
        a: &'w DDsv4,
        c: &Call<'_>,
        dp: Dsv4Ptrs,
    ) -> Result<(&'w DMat, u64), ModelError> {
        let Io {
            n,
            eps,
            kvt,
            pos,
            rows,
            heads: groups,
            h,
            ..
        } = c.io;
        let AttnBufs { q, k, att, .. } = c.attn;
        let MlaBufs { qa, qan, .. } = c.mla;
        let Dsv4Bufs { cc, cz, ic, iz, dz } = c.dsv4;
        let IndexBufs { iq, wh, .. } = c.index;

        let s = self
            .dsv4
            .as_ref()
            .expect("checked: DeepSeek V4 has a shape");
        let nrot = s.n_rot as i32;
        let round = i32::from(kvt == 0);
        // Every product of the normed input.
        let mut from_h: Vec<(&DMat, u64)> = vec![(&a.q_a, qa), (&a.kv, k)];
        if let Some(c) = &a.comp {
            from_h.extend([(&c.kv, cc), (&c.gate, cz)]);
        }
        if let Some(ix) = &a.indexer {
            from_h.extend([(&ix.proj, wh), (&ix.comp.kv, ic), (&ix.comp.gate, iz)]);
        }
        self.mv_rows(&from_h, rows, h)?;
        self.rms_norm(qa, a.q_a_norm, qan, 0, n, s.q_lora, eps)?;
        let mut from_q: Vec<(&DMat, u64)> = vec![(&a.q_b, q)];
        if let Some(ix) = &a.indexer {
            from_q.push((&ix.q_b, iq));
        }
        self.mv_rows(&from_q, rows, qan)?;
        let heads = |buf: u64, n_heads: usize, dim: usize, freq: u64, flags: i32| {
            kernels::Dsv4Heads {
                x: buf,
                pos,
                inv_freq: freq,
                n_heads: n_heads as i32,
                hd: dim as i32,
                n_rot: nrot,
                flags,
                eps,
            }
            .launch(self, (n as u32, n_heads as u32, 1))
        };
        heads(q, s.n_head, s.head_dim, a.rope, 1)?;
        kernels::Dsv4KvPrep {
            kv: k,
            norm: a.kv_norm,
            pos,
            inv_freq: a.rope,
            hd: s.head_dim as i32,
            n_rot: nrot,
            round,
            eps,
        }
        .launch(self, rows_n(n))?;
        let compress = |c: &DComp, cb: u64, zb: u64, st: [u64; 3]| {
            kernels::Dsv4Compress {
                c: cb,
                z: zb,
                rc: st[0],
                rz: st[1],
                ape: c.ape,
                norm: c.norm,
                pos,
                inv_freq: a.rope_compress,
                rows: st[2],
                ratio: c.ratio as i32,
                hd: c.head_dim as i32,
                coff: c.coff as i32,
                n_rot: nrot,
                round,
                eps,
            }
            .launch(self, rows_n(n))?;
            let width = c.coff * c.head_dim;
            self.ring_store(cb, zb, st[0], st[1], pos, width, c.coff * c.ratio, n)
        };
        if let Some(c) = &a.comp {
            compress(c, cc, cz, dp.comp)?;
        }
        let (mut sel, mut nsel, mut top) = (0, 0, 0);
        if let Some(ix) = &a.indexer {
            heads(iq, ix.n_head, ix.head_dim, a.rope_compress, 0)?;
            compress(&ix.comp, ic, iz, dp.index)?;
            let ix_sel = IndexSelect {
                iq,
                wh,
                n_head: ix.n_head,
                head_dim: ix.head_dim,
                rows: dp.index[2],
                ratio: ix.comp.ratio,
                top_k: ix.top_k,
            };
            self.index_select(&ix_sel, pos, &c.index, n)?;
            (sel, nsel, top) = (c.index.sel, c.index.nsel, ix.top_k);
        }
        let ratio = a.comp.as_ref().map_or(0, |c| c.ratio);
        kernels::Dsv4Attention {
            q,
            kb: k,
            ring: dp.ring,
            rows: dp.comp[2],
            sel,
            nsel,
            sinks: a.sinks,
            out: att,
            pos,
            nh: s.n_head as i32,
            hd: s.head_dim as i32,
            window: i32_of(s.window, "window")?,
            ratio: ratio as i32,
            top_k: top as i32,
            scale: self.plan.shape.scale,
        }
        .launch(self, (n as u32, s.n_head as u32, 1))?;
        // The window's ring after every read of it.
        self.ring_store(k, 0, dp.ring, 0, pos, s.head_dim, s.window, n)?;
        heads(att, s.n_head, s.head_dim, a.rope, 2)?;
        // (The per-head chunk table's units are the output groups.)
        self.mv_rows(&[(&a.out_a, dz)], groups, att)?;
        Ok((&a.out_b, dz))
    }
}

/// Why DeepSeek V4 attention layer `il` does not fit the kernels, if it does not.
pub(crate) fn check_dsv4(
    il: usize,
    w: &sluice_models::blocks::dsv4_attention::Dsv4AttnWeights,
    s: &Dsv4Shape,
    first: &Dsv4Shape,
) -> Result<(), String> {
    let bad = |what: String| Err(format!("layer {il}: DeepSeek V4 attention: {what}"));
    let same = (
        s.n_embd, s.n_head, s.head_dim, s.n_rot, s.q_lora, s.o_groups, s.o_lora,
    ) == (
        first.n_embd,
        first.n_head,
        first.head_dim,
        first.n_rot,
        first.q_lora,
        first.o_groups,
        first.o_lora,
    ) && s.window == first.window;
    if !same {
        return bad("its shape differs from the first layer's".into());
    }
    let (nh, hd) = (s.n_head, s.head_dim);
    if hd > MAX_HEAD_DIM_V || hd == 0 || s.n_rot == 0 || !s.n_rot.is_multiple_of(2) || s.n_rot > hd
    {
        return bad(format!(
            "heads of {hd} with {} roped dims (the kernel takes even rotations within heads up to {MAX_HEAD_DIM_V})",
            s.n_rot
        ));
    }
    if s.window == 0 || s.o_groups == 0 || !(nh * hd).is_multiple_of(s.o_groups) {
        return bad(format!(
            "window {}, {} output groups over {nh} heads of {hd}",
            s.window, s.o_groups
        ));
    }
    if w.rope.len() != s.n_rot / 2
        || w.rope_compress.len() != s.n_rot / 2
        || w.sinks.len() != nh
        || w.kv_norm.len() != hd
        || w.q_a_norm.len() != s.q_lora
    {
        return bad("RoPE tables, sinks or norms of the wrong length".into());
    }
    let shapes = (
        w.q_a.rows,
        w.q_b.rows,
        w.q_b.cols,
        w.kv.rows,
        w.out_a.rows,
        w.out_a.cols,
    ) == (
        s.q_lora,
        nh * hd,
        s.q_lora,
        hd,
        s.o_groups * s.o_lora,
        nh * hd / s.o_groups,
    ) && (w.out_b.rows, w.out_b.cols) == (s.n_embd, s.o_groups * s.o_lora)
        && (w.q_a.cols, w.kv.cols) == (s.n_embd, s.n_embd);
    if !shapes {
        return bad("projection shapes do not match its shape".into());
    }
    let comp_ok = |c: &sluice_models::blocks::dsv4_attention::CompressorWeights| {
        c.ratio > 0
            && (c.coff == 1 || c.coff == 2)
            && c.head_dim <= DSV4_MAX_COMP
            && c.head_dim.is_multiple_of(2)
            && c.head_dim >= s.n_rot
            && c.ape.len() == c.ratio * c.coff * c.head_dim
            && c.norm.len() == c.head_dim
            && (c.kv.rows, c.gate.rows) == (c.coff * c.head_dim, c.coff * c.head_dim)
            && (c.kv.cols, c.gate.cols) == (s.n_embd, s.n_embd)
    };
    if let Some(c) = &w.comp {
        if !comp_ok(c) || c.head_dim != hd {
            return bad(format!(
                "a compressor of ratio {} rows of {} (the kernel takes rows of the head size, up to {DSV4_MAX_COMP})",
                c.ratio, c.head_dim
            ));
        }
    }
    match (&w.indexer, &w.comp) {
        (None, _) => {}
        (Some(ix), Some(c)) => {
            let ok = comp_ok(&ix.comp)
                && ix.comp.ratio == c.ratio
                && ix.comp.head_dim == ix.head_dim
                && ix.n_head * ix.head_dim <= IDX_MAX_Q
                && ix.top_k > 0
                && (ix.q_b.rows, ix.proj.rows) == (ix.n_head * ix.head_dim, ix.n_head)
                && (ix.q_b.cols, ix.proj.cols) == (s.q_lora, s.n_embd);
            if !ok {
                return bad(format!(
                    "an indexer of {} heads of {} (top {}) the kernels do not take",
                    ix.n_head, ix.head_dim, ix.top_k
                ));
            }
        }
        (Some(_), None) => return bad("an indexer without a compressor".into()),
    }
    Ok(())
}

impl CompKv {
    /// Zeros for compressor `c` over a sequence of `n_ctx` positions.
    fn new(stream: &Arc<CudaStream>, c: &DComp, n_ctx: usize) -> Result<CompKv, ModelError> {
        let carry = c.coff * c.ratio * c.coff * c.head_dim;
        let what = "DeepSeek V4 state";
        Ok(CompKv {
            rc: zeros(stream, carry, what)?,
            rz: zeros(stream, carry, what)?,
            rows: zeros(stream, n_ctx / c.ratio * c.head_dim, what)?,
        })
    }

    fn copy(&self, stream: &Arc<CudaStream>) -> Option<CompKv> {
        Some(CompKv {
            rc: dup(stream, &self.rc)?,
            rz: dup(stream, &self.rz)?,
            rows: dup(stream, &self.rows)?,
        })
    }

    fn ptrs(&self, stream: &Arc<CudaStream>) -> [u64; 3] {
        [
            ptr(stream, &self.rc),
            ptr(stream, &self.rz),
            ptr(stream, &self.rows),
        ]
    }
}

impl Dsv4Kv {
    /// Zeros for layer `a` (of the decoder's DeepSeek V4 shape `s`) over a sequence of
    /// `n_ctx` positions. The kernels read no ring or carry slot in a batch starting at 0.
    pub(crate) fn new(
        stream: &Arc<CudaStream>,
        a: &DDsv4,
        s: &Dsv4Shape,
        n_ctx: usize,
    ) -> Result<Dsv4Kv, ModelError> {
        Ok(Dsv4Kv {
            ring: zeros(stream, s.window * s.head_dim, "DeepSeek V4 state")?,
            comp: a
                .comp
                .as_ref()
                .map(|c| CompKv::new(stream, c, n_ctx))
                .transpose()?,
            index: a
                .indexer
                .as_ref()
                .map(|ix| CompKv::new(stream, &ix.comp, n_ctx))
                .transpose()?,
        })
    }

    pub(crate) fn ptrs(&self, stream: &Arc<CudaStream>) -> Dsv4Ptrs {
        let c = |c: &Option<CompKv>| c.as_ref().map_or([0; 3], |c| c.ptrs(stream));
        Dsv4Ptrs {
            ring: ptr(stream, &self.ring),
            comp: c(&self.comp),
            index: c(&self.index),
        }
    }

    /// A copy on the device (a snapshot); None if a copy failed.
    pub(crate) fn copy(&self, stream: &Arc<CudaStream>) -> Option<Dsv4Kv> {
        let c = |c: &Option<CompKv>| -> Option<Option<CompKv>> {
            match c {
                None => Some(None),
                Some(c) => Some(Some(c.copy(stream)?)),
            }
        };
        Some(Dsv4Kv {
            ring: dup(stream, &self.ring)?,
            comp: c(&self.comp)?,
            index: c(&self.index)?,
        })
    }
}

impl GpuDecoder {
    /// The carry of the batch's last `slots` tokens (positions at `pos`): rows of `c` (and
    /// `z` unless 0) to slot `position % slots` of `rc` (`rz`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn ring_store(
        &self,
        c: u64,
        z: u64,
        rc: u64,
        rz: u64,
        pos: u64,
        width: usize,
        slots: usize,
        n: usize,
    ) -> Result<(), ModelError> {
        kernels::RingStore {
            c,
            z,
            rc,
            rz,
            pos,
            width: i32_of(width, "carry row")?,
            slots: i32_of(slots, "carry slots")?,
            n: n as i32,
        }
        .launch(self, (n as u32, width.div_ceil(256).min(64) as u32, 1))
    }
}

/// What the DeepSeek V4 kernels refuse: DeepSeek V4 layers mixed with other attention,
/// layers unlike the first ([`check_dsv4`]), a plan shape unlike its layers'. The reason
/// when not.
pub(crate) fn check(plan: &DecoderPlan) -> Result<(), String> {
    if let Some(first) = plan.dsv4_shape() {
        for (il, l) in plan.layers.iter().enumerate() {
            match &l.attn {
                PlanAttn::Dsv4 { w, shape } => check_dsv4(il, w, shape, &first)?,
                _ => {
                    return Err(format!(
                        "layer {il}: DeepSeek V4 layers mixed with other attention"
                    ))
                }
            }
        }
        let sh = &plan.shape;
        if (sh.n_head, sh.n_head_kv, sh.head_dim, sh.head_dim_v)
            != (first.n_head, 1, first.head_dim, first.head_dim)
        {
            return Err("DeepSeek V4: the plan's attention shape differs from its layers'".into());
        }
    }
    Ok(())
}

impl Uploader<'_> {
    /// Upload a DeepSeek V4 attention layer: its projections, norms, sinks, RoPE tables,
    /// the grouped output's per-group entries, its compressor and indexer.
    pub(crate) fn dsv4(&mut self, w: &Dsv4AttnWeights, shape: &Dsv4Shape) -> Result<DDsv4, String> {
        let mut comp = |c: &sluice_models::blocks::dsv4_attention::CompressorWeights| -> Result<DComp, String> {
        Ok(DComp {
            ratio: c.ratio,
            head_dim: c.head_dim,
            coff: c.coff,
            kv: self.mat(&c.kv)?,
            gate: self.mat(&c.gate)?,
            ape: self.norm(&c.ape)?,
            norm: self.norm(&c.norm)?,
        })
    };
        let c = w.comp.as_ref().map(&mut comp).transpose()?;
        let ix = match &w.indexer {
            Some(ix) => Some(DIndexer {
                n_head: ix.n_head,
                head_dim: ix.head_dim,
                top_k: ix.top_k,
                comp: comp(&ix.comp)?,
                q_b: self.mat(&ix.q_b)?,
                proj: self.mat(&ix.proj)?,
            }),
            None => None,
        };
        Ok(DDsv4 {
            q_a: self.mat(&w.q_a)?,
            q_a_norm: self.norm(&w.q_a_norm)?,
            q_b: self.mat(&w.q_b)?,
            kv: self.mat(&w.kv)?,
            kv_norm: self.norm(&w.kv_norm)?,
            sinks: self.norm(&w.sinks)?,
            out_a: self.heads(&w.out_a, shape.o_groups)?,
            out_b: self.mat(&w.out_b)?,
            rope: self.norm(&w.rope)?,
            rope_compress: self.norm(&w.rope_compress)?,
            comp: c,
            indexer: ix,
        })
    }
}
