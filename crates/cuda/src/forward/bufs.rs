//! One forward call's buffers, grouped by the block kind that reads them: each group's
//! scratch (device buffers kept by the decoder between calls, grown as needed: `*Scratch`)
//! and its addresses for one call (`*Bufs`, `Copy`, fields of `forward::Call`): [`Io`] (the
//! batch as every block sees it: positions, chunk tables, the block input and output),
//! [`AttnBufs`] (queries, keys, values, attention output: GQA, MLA, QSA, DeepSeek V4),
//! [`MlaBufs`] (q-LoRA, MLA's latent and per-head buffers), [`IndexBufs`] (an indexer's
//! queries, keys, scores and choice: GLM's DSA, DeepSeek V4's, QSA's, the k-pool one),
//! [`Dsv4Bufs`] (DeepSeek V4's compressors and grouped output), [`FfnBufs`] (the dense and
//! routed feed-forward, the shared expert), [`ResidualBufs`] (the residual streams and the
//! hyper-connection mixes) and [`HeadBufs`] (the logits rows). The blocks beyond these
//! (low-rank mixers, PLE, DeltaNet / KDA, QSA's gates) are `forward::scratch`'s.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use sluice_models::blocks::attention::AttnShape;
use sluice_models::blocks::dsv4_attention::Dsv4Shape;
use sluice_models::blocks::hyper::HcShape;
use sluice_models::blocks::mla::MlaShape;
use sluice_models::ModelError;

use crate::blocks::dsa_indexer::SCORES_MAX;
use crate::forward::scratch::Rows;
use crate::forward::{addr, IndexDims, CHUNK_BYTES};

type Buf = Option<CudaSlice<f32>>;

/// The batch as every block sees it: `n` tokens (ids at `tokens`, positions at `pos` in
/// the call's header) of `e` values (`ei` as the kernels take it), the RMS norms' epsilon,
/// the KV cache's type (`kvt`: 0 f16, 1 f32); the chunk tables of every token's rows (`rows`) and of the
/// per-head units (`heads`: MLA's heads or DeepSeek V4's output groups); the block's
/// normed input `h` and its output `o`.
#[derive(Clone, Copy)]
pub(crate) struct Io {
    pub(crate) n: usize,
    pub(crate) e: usize,
    pub(crate) ei: i32,
    pub(crate) eps: f32,
    pub(crate) kvt: usize,
    pub(crate) tokens: u64,
    pub(crate) pos: u64,
    pub(crate) rows: Rows,
    pub(crate) heads: Rows,
    pub(crate) h: u64,
    pub(crate) o: u64,
}

/// The attention blocks' shared buffers: the plan's attention shape (query heads, KV
/// heads, key head size, key and value rows) and the queries, keys, values and attention
/// output of the batch.
#[derive(Clone, Copy)]
pub(crate) struct AttnBufs {
    pub(crate) nh: usize,
    pub(crate) nkv: usize,
    pub(crate) hd: usize,
    pub(crate) kdim: usize,
    pub(crate) vdim: usize,
    pub(crate) q: u64,
    pub(crate) k: u64,
    pub(crate) v: u64,
    pub(crate) att: u64,
}

#[derive(Default)]
pub(crate) struct AttnScratch {
    q: Buf,
    k: Buf,
    v: Buf,
    att: Buf,
}

impl AttnScratch {
    /// For `n` tokens of attention shape `sh` (queries as wide as MLA's `mla` needs).
    pub(crate) fn grow(
        &mut self,
        stream: &Arc<CudaStream>,
        n: usize,
        sh: &AttnShape,
        mla: Option<&MlaShape>,
    ) -> Result<AttnBufs, ModelError> {
        let (nh, nkv, hd, hdv) = (sh.n_head, sh.n_head_kv, sh.head_dim, sh.head_dim_v);
        let (kdim, vdim) = (nkv * hd, nkv * hdv);
        let q_width = mla.map_or(hd, |m| hd.max(m.nope + m.rope));
        Ok(AttnBufs {
            nh,
            nkv,
            hd,
            kdim,
            vdim,
            q: addr(stream, &mut self.q, n * nh * q_width)?,
            k: addr(stream, &mut self.k, n * kdim)?,
            v: addr(stream, &mut self.v, n * vdim)?,
            att: addr(stream, &mut self.att, n * nh * hdv)?,
        })
    }
}

impl AttnBufs {
    pub(crate) fn all(&self) -> [u64; 4] {
        [self.q, self.k, self.v, self.att]
    }
}

/// q-LoRA (raw and normed; MLA's and DeepSeek V4's) and absorbed MLA's buffers: the
/// kv_a output, the gathered nope queries, their k_b products, the attention queries, the
/// v_b products (one value each without an MLA layer).
#[derive(Clone, Copy)]
pub(crate) struct MlaBufs {
    pub(crate) qa: u64,
    pub(crate) qan: u64,
    pub(crate) kva: u64,
    pub(crate) qn: u64,
    pub(crate) qabs: u64,
    pub(crate) qatt: u64,
    pub(crate) ov: u64,
}

#[derive(Default)]
pub(crate) struct MlaScratch {
    qa: Buf,
    qan: Buf,
    kva: Buf,
    qn: Buf,
    qabs: Buf,
    qatt: Buf,
    ov: Buf,
}

impl MlaScratch {
    /// For `n` tokens of MLA shape `mla` (q-LoRA `q_lora` wide).
    pub(crate) fn grow(
        &mut self,
        stream: &Arc<CudaStream>,
        n: usize,
        mla: Option<&MlaShape>,
        q_lora: usize,
    ) -> Result<MlaBufs, ModelError> {
        let ml = |f: &dyn Fn(&MlaShape) -> usize| mla.map_or(1, |m| n * f(m));
        Ok(MlaBufs {
            qa: addr(stream, &mut self.qa, n * q_lora)?,
            qan: addr(stream, &mut self.qan, n * q_lora)?,
            kva: addr(stream, &mut self.kva, ml(&|m| m.row()))?,
            qn: addr(stream, &mut self.qn, ml(&|m| m.n_head * m.nope))?,
            qabs: addr(stream, &mut self.qabs, ml(&|m| m.n_head * m.kv_lora))?,
            qatt: addr(stream, &mut self.qatt, ml(&|m| m.n_head * m.row()))?,
            ov: addr(stream, &mut self.ov, ml(&|m| m.n_head * m.v_dim))?,
        })
    }
}

impl MlaBufs {
    pub(crate) fn all(&self) -> [u64; 7] {
        [
            self.qa, self.qan, self.kva, self.qn, self.qabs, self.qatt, self.ov,
        ]
    }
}

/// An indexer's buffers (DeepSeek V4's, GLM's DSA, QSA's, the k-pool one): its queries
/// (`[n][heads * dim]`), head weights, the batch's keys before their norm, the scores of
/// the rows each token sees (row `stride` floats, `tile` tokens at a time), the chosen rows
/// and their counts.
#[derive(Clone, Copy)]
pub(crate) struct IndexBufs {
    pub(crate) iq: u64,
    pub(crate) wh: u64,
    pub(crate) ik: u64,
    pub(crate) scores: u64,
    pub(crate) stride: usize,
    pub(crate) tile: usize,
    pub(crate) sel: u64,
    pub(crate) nsel: u64,
}

#[derive(Default)]
pub(crate) struct IndexScratch {
    iq: Buf,
    wh: Buf,
    ik: Buf,
    scores: Buf,
    sel: Option<CudaSlice<i32>>,
    nsel: Option<CudaSlice<i32>>,
}

impl IndexScratch {
    /// For `n` tokens, the last at position `last`, of the widest indexer `d` names.
    pub(crate) fn grow(
        &mut self,
        stream: &Arc<CudaStream>,
        n: usize,
        d: &IndexDims,
        last: usize,
    ) -> Result<IndexBufs, ModelError> {
        let idx_len = |len: usize| if d.ratio > 0 { n * len } else { 1 };
        // Scores of the rows the batch's last token sees, per token.
        let stride = (last + 1).checked_div(d.ratio).unwrap_or(1).max(1);
        // Tokens per launch of the scores and top-k: as many as keep the scores within
        // SCORES_MAX floats (a long prompt at a long context does not scale the scratch).
        let tile = (SCORES_MAX / stride).clamp(1, n);
        Ok(IndexBufs {
            iq: addr(stream, &mut self.iq, idx_len(d.idx_q))?,
            wh: addr(stream, &mut self.wh, idx_len(d.idx_heads))?,
            ik: addr(stream, &mut self.ik, idx_len(d.dsa_d.max(1)))?,
            scores: addr(stream, &mut self.scores, idx_len(stride) / n * tile)?,
            stride,
            tile,
            sel: addr(stream, &mut self.sel, idx_len(d.top_max))?,
            nsel: addr(stream, &mut self.nsel, idx_len(1))?,
        })
    }
}

impl IndexBufs {
    pub(crate) fn all(&self) -> [u64; 6] {
        [self.iq, self.wh, self.ik, self.scores, self.sel, self.nsel]
    }
}

/// DeepSeek V4's buffers: the kv and gate products of the attention's compressor and of
/// the indexer's, the grouped output's low-rank values.
#[derive(Clone, Copy)]
pub(crate) struct Dsv4Bufs {
    pub(crate) cc: u64,
    pub(crate) cz: u64,
    pub(crate) ic: u64,
    pub(crate) iz: u64,
    pub(crate) dz: u64,
}

#[derive(Default)]
pub(crate) struct Dsv4Scratch {
    cc: Buf,
    cz: Buf,
    ic: Buf,
    iz: Buf,
    dz: Buf,
}

impl Dsv4Scratch {
    /// For `n` tokens of shape `s` (one value each without DeepSeek V4), its widest
    /// compressors as `d` gives them.
    pub(crate) fn grow(
        &mut self,
        stream: &Arc<CudaStream>,
        n: usize,
        s: Option<&Dsv4Shape>,
        d: &IndexDims,
    ) -> Result<Dsv4Bufs, ModelError> {
        let len = |len: usize| if s.is_some() { n * len } else { 1 };
        Ok(Dsv4Bufs {
            cc: addr(stream, &mut self.cc, len(d.comp_w))?,
            cz: addr(stream, &mut self.cz, len(d.comp_w))?,
            ic: addr(stream, &mut self.ic, len(d.idx_w))?,
            iz: addr(stream, &mut self.iz, len(d.idx_w))?,
            dz: addr(
                stream,
                &mut self.dz,
                len(s.map_or(1, |s| s.o_groups * s.o_lora)),
            )?,
        })
    }
}

impl Dsv4Bufs {
    pub(crate) fn all(&self) -> [u64; 5] {
        [self.cc, self.cz, self.ic, self.iz, self.dz]
    }
}

/// The feed-forward's buffers: the GLU's gate and up values (dense, shared expert, routed
/// rows), the shared expert's output; the router's logits, the chosen experts' ids (and
/// their scratch, `ids_buf`, for the download the VRAM unit cache needs) and weights, the
/// routed rows' down products, the experts' chunk table and its count.
#[derive(Clone, Copy)]
pub(crate) struct FfnBufs<'a> {
    pub(crate) g: u64,
    pub(crate) u: u64,
    pub(crate) sh: u64,
    pub(crate) rl: u64,
    pub(crate) ids: u64,
    pub(crate) ids_buf: &'a CudaSlice<i32>,
    pub(crate) wts: u64,
    pub(crate) dd: u64,
    pub(crate) chunks: u64,
    pub(crate) nchunks: u64,
}

#[derive(Default)]
pub(crate) struct FfnScratch {
    g: Buf,
    u: Buf,
    sh: Buf,
    rl: Buf,
    ids: Option<CudaSlice<i32>>,
    wts: Buf,
    dd: Buf,
    chunks: Option<CudaSlice<u8>>,
    nchunks: Option<CudaSlice<i32>>,
}

/// The widest feed-forward of a decoder: the dense (or shared expert's) and routed widths,
/// the most experts a token picks and the most experts of a layer.
#[derive(Clone, Copy)]
pub(crate) struct FfnDims {
    pub(crate) dense: usize,
    pub(crate) moe: usize,
    pub(crate) k_max: usize,
    pub(crate) n_expert_max: usize,
}

impl FfnScratch {
    /// For `n` tokens of `e` values.
    pub(crate) fn grow(
        &mut self,
        stream: &Arc<CudaStream>,
        n: usize,
        e: usize,
        d: &FfnDims,
    ) -> Result<FfnBufs<'_>, ModelError> {
        let pairs = n * d.k_max;
        let chunks_max = pairs / crate::forward::MVG_N + d.n_expert_max.min(pairs);
        let ffw = (n * d.dense).max(pairs * d.moe);
        let g = addr(stream, &mut self.g, ffw)?;
        let u = addr(stream, &mut self.u, ffw)?;
        let sh = addr(stream, &mut self.sh, n * e)?;
        let rl = addr(stream, &mut self.rl, n * d.n_expert_max)?;
        let ids = addr(stream, &mut self.ids, pairs)?;
        let wts = addr(stream, &mut self.wts, pairs)?;
        let dd = addr(stream, &mut self.dd, pairs * e)?;
        let chunks = addr(stream, &mut self.chunks, chunks_max * CHUNK_BYTES)?;
        let nchunks = addr(stream, &mut self.nchunks, 1)?;
        Ok(FfnBufs {
            g,
            u,
            sh,
            rl,
            ids,
            ids_buf: self.ids.as_ref().expect("grown"),
            wts,
            dd,
            chunks,
            nchunks,
        })
    }
}

impl FfnBufs<'_> {
    pub(crate) fn all(&self) -> [u64; 9] {
        [
            self.g,
            self.u,
            self.sh,
            self.rl,
            self.ids,
            self.wts,
            self.dd,
            self.chunks,
            self.nchunks,
        ]
    }
}

/// The residual's buffers: the streams `x` (`[n][n_hc][e]`; one stream for a plain
/// residual), the hyper-connection mixes' normed streams, projections and post / comb
/// (`hs`: their shape, None without hyper-connections), the per-segment chunk table of
/// their projections (or of the low-rank mixers' down products), and the low-rank
/// residual's stream count (None without it).
#[derive(Clone, Copy)]
pub(crate) struct ResidualBufs {
    pub(crate) x: u64,
    pub(crate) n_hc: usize,
    pub(crate) hs: Option<HcShape>,
    pub(crate) lr_streams: Option<usize>,
    pub(crate) hcf: u64,
    pub(crate) hcm: u64,
    pub(crate) hcpc: u64,
    pub(crate) segs: Rows,
}

#[derive(Default)]
pub(crate) struct ResidualScratch {
    x: Buf,
    h: Buf,
    o: Buf,
    hcf: Buf,
    hcm: Buf,
    hcpc: Buf,
}

impl ResidualScratch {
    /// For `n` tokens of `e` values in `n_hc` streams (`hs`: the hyper-connections' shape,
    /// `segs` their projections' column segments); with the block input and output
    /// (`h`, `o`).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn grow(
        &mut self,
        stream: &Arc<CudaStream>,
        n: usize,
        e: usize,
        n_hc: usize,
        hs: Option<HcShape>,
        segs: usize,
    ) -> Result<(u64, u64, u64, [u64; 3]), ModelError> {
        let x = addr(stream, &mut self.x, n * n_hc * e)?;
        let h = addr(stream, &mut self.h, n * e)?;
        let o = addr(stream, &mut self.o, n * e)?;
        let len = |f: &dyn Fn(usize) -> usize| hs.map_or(1, |s| n * f(s.n_hc));
        let hcf = addr(stream, &mut self.hcf, len(&|hc| hc * e))?;
        let hcm = addr(stream, &mut self.hcm, len(&|hc| segs * (2 + hc) * hc))?;
        let hcpc = addr(stream, &mut self.hcpc, len(&|hc| hc + hc * hc))?;
        Ok((x, h, o, [hcf, hcm, hcpc]))
    }
}

impl ResidualBufs {
    pub(crate) fn all(&self) -> [u64; 4] {
        [self.x, self.hcf, self.hcm, self.hcpc]
    }
}

/// The head's buffers: the logits rows (`nr`; their chunk table `rows`, their token at
/// `rowmap` in the header), their normed inputs `hsel` and the logits.
#[derive(Clone, Copy)]
pub(crate) struct HeadBufs {
    pub(crate) nr: usize,
    pub(crate) rows: Rows,
    pub(crate) rowmap: u64,
    pub(crate) hsel: u64,
    pub(crate) logits: u64,
}

#[derive(Default)]
pub(crate) struct HeadScratch {
    hsel: Buf,
    pub(crate) logits: Buf,
}

impl HeadScratch {
    /// For `nr` logits rows of `e` values and `nv` logits: (hsel, logits).
    pub(crate) fn grow(
        &mut self,
        stream: &Arc<CudaStream>,
        nr: usize,
        e: usize,
        nv: usize,
    ) -> Result<(u64, u64), ModelError> {
        Ok((
            addr(stream, &mut self.hsel, nr.max(1) * e)?,
            addr(stream, &mut self.logits, nr.max(1) * nv)?,
        ))
    }
}

impl HeadBufs {
    pub(crate) fn all(&self) -> [u64; 2] {
        [self.hsel, self.logits]
    }
}
