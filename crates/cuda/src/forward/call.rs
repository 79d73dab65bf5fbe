//! One forward call's layout on the GPU: its header ([`Header`]: tokens, positions, the
//! chunk tables), the decoder's scratch buffers ([`Scratch`], grown as needed), the
//! addresses the blocks read ([`Call`], made by `GpuDecoder::call`, with the sequence's
//! per-layer addresses) and a captured decode step's key ([`graph_key`]).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use sluice_models::blocks::Batch;
use sluice_models::ModelError;

use crate::forward::bufs::{
    AttnBufs, AttnScratch, Dsv4Bufs, Dsv4Scratch, FfnBufs, FfnScratch, HeadBufs, HeadScratch,
    IndexBufs, IndexScratch, Io, MlaBufs, MlaScratch, ResidualBufs, ResidualScratch,
};
use crate::forward::products::xq_bytes;
use crate::forward::scratch::{NextBufs, NextScratch, Rows};
use crate::forward::state::LayerPtrs;
use crate::forward::{err, i32_of, GpuDecoder, MVG_N};
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

/// Per-call device buffers, grown as needed (one call at a time: the mutex): the header,
/// then each block kind's group (`forward::bufs`, `forward::scratch`).
#[derive(Default)]
pub(crate) struct Scratch {
    pub(crate) hdr: Option<CudaSlice<u8>>,
    pub(crate) res: ResidualScratch,
    pub(crate) attn: AttnScratch,
    pub(crate) mla: MlaScratch,
    pub(crate) index: IndexScratch,
    pub(crate) dsv4: Dsv4Scratch,
    pub(crate) ffn: FfnScratch,
    pub(crate) head: HeadScratch,
    /// Qwen3.8-Flash-Next's and GLM-5.3-Flash's blocks' buffers.
    pub(crate) next: NextScratch,
    /// The int8 products' quantized input (`quant_x8`'s output; `Rows::xq`).
    pub(crate) xq: Option<CudaSlice<u8>>,
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

/// What the blocks' launch sequences read of one forward call (`GpuDecoder::call` makes it
/// once per call), by the block kind that reads it (`forward::bufs`): the batch and its
/// chunk tables (`io`), the attention, MLA, indexer, DeepSeek V4, feed-forward, residual
/// and head buffers, the other blocks' (`next`), the sequence's per-layer addresses.
#[derive(Clone, Copy)]
pub(crate) struct Call<'a> {
    pub(crate) io: Io,
    pub(crate) attn: AttnBufs,
    pub(crate) mla: MlaBufs,
    pub(crate) index: IndexBufs,
    pub(crate) dsv4: Dsv4Bufs,
    pub(crate) ffn: FfnBufs<'a>,
    pub(crate) next: NextBufs,
    pub(crate) res: ResidualBufs,
    pub(crate) head: HeadBufs,
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
    let Call { io, head, .. } = c;
    let mut key = vec![
        io.n as u64,
        head.nr as u64,
        io.kvt as u64,
        hb,
        io.h,
        io.o,
        io.rows.xq,
    ];
    key.extend(c.attn.all());
    key.extend(c.mla.all());
    key.extend(c.index.all());
    key.extend(c.dsv4.all());
    key.extend(c.ffn.all());
    key.extend(c.res.all());
    key.extend(head.all());
    key.extend(c.next.all());
    for l in c.layers {
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
        let (e, nv) = (p.n_embd, p.n_vocab);
        let stream = &self.stream;
        // Column segments: the hyper-connection projections' or the low-rank mixers'.
        let segs = match &self.hyper {
            Some(_) => self.hc_nseg,
            None if self.next_dims.segs > 1 => self.next_dims.segs,
            None => 0,
        };
        let hdr = Header::new(batch, rows, heads, segs);
        let hb = addr(stream, &mut sc.hdr, hdr.bytes.len())?;
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
        let at = |off: usize| hb + off as u64;
        let nd = n.div_ceil(MVG_N);
        // At most 8 tokens: every chunk has at most 8 rows (a token picks an expert once).
        let small = n <= 8;
        // The int8 products' quantized input: a row per chunk row of the largest chunk
        // table of the call (dense, per head or segment, logits rows, routed experts).
        let xq_bytes = if self.int8 && self.f.mvi.iter().any(Option::is_some) {
            let pairs = n * self.ffn_dims.k_max;
            let routed = pairs / MVG_N + self.ffn_dims.n_expert_max.min(pairs);
            let chunks = (nd * heads.max(segs).max(1))
                .max(rows.len().div_ceil(MVG_N))
                .max(routed);
            xq_bytes(chunks, self.xq_cols)
        } else {
            0
        };
        let xq = addr(stream, &mut sc.xq, xq_bytes)?;
        // A chunk table of the header and the address of its count (the four counts
        // follow one another at `hdr.counts`).
        let table = |table: usize, count: usize, chunks: usize| Rows {
            table: at(table),
            count: at(hdr.counts + 4 * count),
            chunks,
            small,
            xq,
            xq_bytes,
            rows_max: n.min(MVG_N),
        };
        let hs = self.hyper.as_ref().map(|(s, _)| *s);
        // Residual streams: a hyper-connection's, the low-rank mixers' (1: plain).
        let n_hc = hs.map_or(self.next_dims.streams, |s| s.n_hc);
        let (x, h, o, [hcf, hcm, hcpc]) = sc.res.grow(stream, n, e, n_hc, hs, segs)?;
        let res = ResidualBufs {
            x,
            n_hc,
            hs,
            lr_streams: self.lowrank.as_ref().map(|_| self.next_dims.streams),
            hcf,
            hcm,
            hcpc,
            segs: table(hdr.seg_chunks, 3, nd * segs),
        };
        let io = Io {
            n,
            e,
            ei: i32_of(e, "n_embd")?,
            eps: p.shape.rms_eps,
            kvt,
            tokens: at(hdr.tokens),
            pos: at(hdr.pos),
            rows: table(hdr.dense, 0, nd),
            heads: table(hdr.head_chunks, 2, heads * nd),
            h,
            o,
        };
        let mla = self.mla.as_ref();
        let q_lora = self
            .mla
            .map(|m| m.q_lora)
            .or(self.dsv4.map(|s| s.q_lora))
            .unwrap_or(1);
        let last = *batch.positions.last().expect("n > 0");
        let nr = rows.len();
        let (hsel, logits) = sc.head.grow(stream, nr, e, nv)?;
        let call = Call {
            io,
            attn: sc.attn.grow(stream, n, &p.shape, mla)?,
            mla: sc.mla.grow(stream, n, mla, q_lora)?,
            index: sc.index.grow(stream, n, &self.index_dims, last)?,
            dsv4: sc
                .dsv4
                .grow(stream, n, self.dsv4.as_ref(), &self.index_dims)?,
            ffn: sc.ffn.grow(stream, n, e, &self.ffn_dims)?,
            next: sc.next.grow(stream, &self.next_dims, e, n, nr)?,
            res,
            head: HeadBufs {
                nr,
                rows: table(hdr.row_chunks, 1, nr.div_ceil(MVG_N)),
                rowmap: at(hdr.rowmap),
                hsel,
                logits,
            },
            layers,
        };
        if let (Some(rows), Some(pe)) = (&ple_rows, sc.next.pe.as_mut()) {
            stream
                .memcpy_htod(&rows[..], &mut pe.slice_mut(0..rows.len()))
                .map_err(|e| err("PLE rows", e))?;
        }
        Ok((call, hb))
    }
}
