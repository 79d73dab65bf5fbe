//! One forward call's layout on the GPU: its header ([`Header`]: tokens, positions, the
//! chunk tables), the decoder's scratch buffers ([`Scratch`], grown as needed), the
//! addresses the blocks read ([`Call`], made by `GpuDecoder::call`, with the sequence's
//! per-layer addresses) and a captured decode step's key ([`graph_key`]).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use sluice_models::blocks::hyper::HcShape;
use sluice_models::blocks::mla::MlaShape;
use sluice_models::blocks::Batch;
use sluice_models::plan::DecoderPlan;
use sluice_models::ModelError;

use crate::blocks::dsa_indexer::SCORES_MAX;
use crate::blocks::qsa::QsaBufs;
use crate::forward::scratch::{NextBufs, NextScratch, Rows};
use crate::forward::state::LayerPtrs;
use crate::forward::{err, i32_of, GpuDecoder, IndexDims, CHUNK_BYTES, MVG_N};
use crate::grow;

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
    pub(crate) x: Option<CudaSlice<f32>>,
    pub(crate) h: Option<CudaSlice<f32>>,
    pub(crate) q: Option<CudaSlice<f32>>,
    pub(crate) k: Option<CudaSlice<f32>>,
    pub(crate) v: Option<CudaSlice<f32>>,
    pub(crate) att: Option<CudaSlice<f32>>,
    pub(crate) o: Option<CudaSlice<f32>>,
    pub(crate) rl: Option<CudaSlice<f32>>,
    pub(crate) wts: Option<CudaSlice<f32>>,
    /// MLA: q-LoRA (raw and normed), the kv_a output, gathered nope queries, their k_b
    /// products, the attention queries, the v_b products.
    pub(crate) qa: Option<CudaSlice<f32>>,
    pub(crate) qan: Option<CudaSlice<f32>>,
    pub(crate) kva: Option<CudaSlice<f32>>,
    pub(crate) qn: Option<CudaSlice<f32>>,
    pub(crate) qabs: Option<CudaSlice<f32>>,
    pub(crate) qatt: Option<CudaSlice<f32>>,
    pub(crate) ov: Option<CudaSlice<f32>>,
    /// The shared expert's output.
    pub(crate) sh: Option<CudaSlice<f32>>,
    /// Hyper-connections: the normalised streams, their mix projection, post and comb.
    pub(crate) hcf: Option<CudaSlice<f32>>,
    pub(crate) hcm: Option<CudaSlice<f32>>,
    pub(crate) hcpc: Option<CudaSlice<f32>>,
    /// DeepSeek V4: compressor products (kv, gate) of the attention's and the indexer's
    /// compressors, indexer queries and head weights, row scores, the selected rows and
    /// their counts, the grouped output's low-rank values.
    pub(crate) cc: Option<CudaSlice<f32>>,
    pub(crate) cz: Option<CudaSlice<f32>>,
    pub(crate) ic: Option<CudaSlice<f32>>,
    pub(crate) iz: Option<CudaSlice<f32>>,
    pub(crate) iq: Option<CudaSlice<f32>>,
    pub(crate) wh: Option<CudaSlice<f32>>,
    /// GLM's DSA indexer keys of the batch before their LayerNorm.
    pub(crate) ik: Option<CudaSlice<f32>>,
    pub(crate) scores: Option<CudaSlice<f32>>,
    pub(crate) sel: Option<CudaSlice<i32>>,
    pub(crate) nsel: Option<CudaSlice<i32>>,
    pub(crate) dz: Option<CudaSlice<f32>>,
    pub(crate) g: Option<CudaSlice<f32>>,
    pub(crate) u: Option<CudaSlice<f32>>,
    pub(crate) dd: Option<CudaSlice<f32>>,
    pub(crate) hsel: Option<CudaSlice<f32>>,
    pub(crate) logits: Option<CudaSlice<f32>>,
    pub(crate) ids: Option<CudaSlice<i32>>,
    pub(crate) chunks: Option<CudaSlice<u8>>,
    pub(crate) nchunks: Option<CudaSlice<i32>>,
    pub(crate) hdr: Option<CudaSlice<u8>>,
    /// Qwen3.8-Flash-Next's parts' buffers.
    pub(crate) next: NextScratch,
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
    /// The sequence's per-layer addresses (`GpuKv::ptrs`).
    pub(crate) layers: &'a [LayerPtrs],
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
    pub(crate) bytes: Vec<u8>,
    pub(crate) tokens: usize,
    pub(crate) pos: usize,
    pub(crate) counts: usize,
    pub(crate) rowmap: usize,
    pub(crate) dense: usize,
    pub(crate) row_chunks: usize,
    pub(crate) head_chunks: usize,
    pub(crate) seg_chunks: usize,
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
    pub(crate) fn new(batch: &Batch<'_>, rows: &[usize], heads: usize, segs: usize) -> Header {
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

/// The key of a captured decode step: every address its launches take (the header at
/// `hb`, the scratch buffers, the sequence's state).
pub(crate) fn graph_key(c: &Call<'_>, hb: u64) -> Vec<u64> {
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
        layers,
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
    for l in layers {
        l.key(&mut key);
    }
    key
}

impl GpuDecoder {
    /// One call's [`Call`]: the header (tokens, positions, chunk tables) uploaded, every
    /// scratch buffer grown for `batch` and `rows` logits rows, the PLE rows uploaded; the
    /// header's device address with it (a captured graph's key).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn call<'a>(
        &'a self,
        sc: &'a mut Scratch,
        batch: &Batch<'_>,
        rows: &[usize],
        kvt: usize,
        heads: usize,
        ple_rows: Option<Vec<f32>>,
        layers: &'a [LayerPtrs],
    ) -> Result<(Call<'a>, u64), ModelError> {
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
            layers,
        };
        Ok((call, hb))
    }
}
