//! Per-call scratch of the blocks beyond the decoder's own groups (`forward::bufs`): the
//! low-rank mixers', PLE's, DeltaNet's / KDA's, QSA's gates and the k-pool indexer's
//! buffers ([`NextScratch`], sized by [`NextDims`], addressed by [`NextBufs`], the
//! `next` group of `forward::Call`) and [`Rows`] (a chunk table: where a product's rows
//! come from).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use sluice_models::plan::{DecoderPlan, PlanAttn};
use sluice_models::ModelError;

use crate::forward::addr;

/// Where a product's rows come from: the chunk table, the address of its count, the
/// chunks in the grid, whether every chunk has at most 8 rows (`GpuDecoder::mv`); the
/// call's buffer for the int8 products' quantized input and its bytes (the same for every
/// table of a call).
#[derive(Clone, Copy)]
pub(crate) struct Rows {
    pub(crate) table: u64,
    pub(crate) count: u64,
    pub(crate) chunks: usize,
    pub(crate) small: bool,
    pub(crate) xq: u64,
    pub(crate) xq_bytes: usize,
    /// The most rows a chunk of the table may have (the call's tokens, at most MVG_N):
    /// the dp4a decode product's shared memory is sized by it.
    pub(crate) rows_max: usize,
}

/// Per-token widths of this module's scratch, the widest over the layers (1 where a part
/// is absent), found once when the decoder is built.
#[derive(Debug, Clone, Copy)]
pub(crate) struct NextDims {
    /// Whether the residual has low-rank mixers, its streams (1: a plain residual), the
    /// mixers' widest rank, and the column segments of their down products.
    pub(crate) lowrank: bool,
    pub(crate) streams: usize,
    pub(crate) rank: usize,
    pub(crate) segs: usize,
    /// The PLE layer's gathered row width (0: no PLE layer).
    pub(crate) ple: usize,
    /// DeltaNet and KDA: q|k|v before and after the convolutions, the value heads' width,
    /// the value heads, their decay inputs (DeltaNet's per head, KDA's per channel), KDA's
    /// low-rank gate values.
    pub(crate) conv: usize,
    pub(crate) dvw: usize,
    pub(crate) hv: usize,
    pub(crate) chan: usize,
    pub(crate) low: usize,
    /// QSA: the [q | gate] rows, the gates, the positions a token may attend to.
    pub(crate) qg: usize,
    pub(crate) gate: usize,
    pub(crate) kp: usize,
    /// GLM-5.3-Flash's k-pool indexer: its gate logits per token.
    pub(crate) pool_gates: usize,
}

/// Per-call device buffers of these parts, grown as needed.
#[derive(Default)]
pub(crate) struct NextScratch {
    pub(crate) xn: Option<CudaSlice<f32>>,
    pub(crate) ud: Option<CudaSlice<f32>>,
    pub(crate) gw: Option<CudaSlice<f32>>,
    pub(crate) u: Option<CudaSlice<f32>>,
    pub(crate) inj: Option<CudaSlice<f32>>,
    pub(crate) xg: Option<CudaSlice<f32>>,
    pub(crate) pe: Option<CudaSlice<f32>>,
    pub(crate) pk: Option<CudaSlice<f32>>,
    pub(crate) pkn: Option<CudaSlice<f32>>,
    pub(crate) pq: Option<CudaSlice<f32>>,
    pub(crate) pv: Option<CudaSlice<f32>>,
    pub(crate) gv: Option<CudaSlice<f32>>,
    pub(crate) pn: Option<CudaSlice<f32>>,
    pub(crate) cqkv: Option<CudaSlice<f32>>,
    pub(crate) cconv: Option<CudaSlice<f32>>,
    pub(crate) z: Option<CudaSlice<f32>>,
    pub(crate) beta: Option<CudaSlice<f32>>,
    pub(crate) alpha: Option<CudaSlice<f32>>,
    pub(crate) dout: Option<CudaSlice<f32>>,
    pub(crate) fl: Option<CudaSlice<f32>>,
    pub(crate) gl: Option<CudaSlice<f32>>,
    pub(crate) pg: Option<CudaSlice<f32>>,
    pub(crate) qg: Option<CudaSlice<f32>>,
    pub(crate) gate: Option<CudaSlice<f32>>,
    pub(crate) sg: Option<CudaSlice<f32>>,
    pub(crate) psel: Option<CudaSlice<i32>>,
    pub(crate) npsel: Option<CudaSlice<i32>>,
}

/// The addresses of [`NextScratch`]'s buffers for one call.
#[derive(Clone, Copy)]
pub(crate) struct NextBufs {
    /// Low-rank mixer: the normed streams, the down product's partial sums, the
    /// per-element gates, the rank values, the injection weights, the head's gathered rows.
    pub(crate) xn: u64,
    pub(crate) ud: u64,
    pub(crate) gw: u64,
    pub(crate) u: u64,
    pub(crate) inj: u64,
    pub(crate) xg: u64,
    /// PLE: the gathered rows, key products (raw, normed), the normed streams, the value,
    /// the gated values and their norm.
    pub(crate) pe: u64,
    pub(crate) pk: u64,
    pub(crate) pkn: u64,
    pub(crate) pq: u64,
    pub(crate) pv: u64,
    pub(crate) gv: u64,
    pub(crate) pn: u64,
    /// DeltaNet / KDA: q|k|v before and after the convolution, the output gate, beta,
    /// the decay inputs (DeltaNet's alpha, KDA's per-channel log-decay), the gated-normed
    /// output.
    pub(crate) cqkv: u64,
    pub(crate) cconv: u64,
    pub(crate) z: u64,
    pub(crate) beta: u64,
    pub(crate) alpha: u64,
    pub(crate) dout: u64,
    /// KDA's forget-gate and output-gate low-rank values.
    pub(crate) fl: u64,
    pub(crate) gl: u64,
    /// The k-pool indexer's gate logits.
    pub(crate) pg: u64,
    /// QSA: the [q | gate] rows, the gates, the positions and their counts.
    pub(crate) qg: u64,
    pub(crate) gate: u64,
    pub(crate) psel: u64,
    pub(crate) npsel: u64,
    /// The shared expert gate's logits.
    pub(crate) sg: u64,
}

impl NextDims {
    pub(crate) fn of(plan: &DecoderPlan, segs: usize) -> NextDims {
        let mut d = NextDims {
            lowrank: plan.lowrank.is_some(),
            streams: plan.lowrank.as_ref().map_or(1, |lr| lr.n_stream),
            rank: 1,
            segs,
            ple: 0,
            conv: 1,
            dvw: 1,
            hv: 1,
            chan: 1,
            low: 1,
            qg: 1,
            gate: 1,
            kp: 1,
            pool_gates: 1,
        };
        if let Some(lr) = &plan.lowrank {
            d.rank = d.rank.max(lr.head.down.rows);
        }
        for l in &plan.layers {
            for w in l.hc_lowrank.iter().flat_map(|w| w.iter()) {
                d.rank = d.rank.max(w.down.rows);
            }
            if let Some(w) = &l.ple {
                d.ple = d.ple.max(w.key.cols);
            }
            match &l.attn {
                PlanAttn::Delta { shape: s, .. } => {
                    d.conv = d.conv.max(s.conv_dim());
                    d.dvw = d.dvw.max(s.n_v_heads * s.d_v);
                    d.hv = d.hv.max(s.n_v_heads);
                    d.chan = d.chan.max(s.n_v_heads);
                }
                PlanAttn::Kda { shape: s, .. } => {
                    d.conv = d.conv.max(3 * s.inner());
                    d.dvw = d.dvw.max(s.inner());
                    d.hv = d.hv.max(s.n_head);
                    d.chan = d.chan.max(s.inner());
                    d.low = d.low.max(s.head_dim);
                }
                PlanAttn::Pooled { shape: s, .. } if s.kpool > 0 => {
                    d.kp = d.kp.max(s.pools_kept() * s.kpool + s.kpool - 1);
                    d.pool_gates = d.pool_gates.max(s.idx_dim);
                }
                PlanAttn::Qsa { shape: s, .. } => {
                    d.qg = d.qg.max(s.n_head * 2 * s.head_dim);
                    d.gate = d.gate.max(s.n_head * s.head_dim);
                    if s.ratio > 0 {
                        d.kp = d.kp.max(s.budget + s.ratio - 1);
                    }
                }
                _ => {}
            }
        }
        d
    }
}

impl NextBufs {
    /// Every address (a captured graph's key).
    pub(crate) fn all(&self) -> [u64; 27] {
        [
            self.xn, self.ud, self.gw, self.u, self.inj, self.xg, self.pe, self.pk, self.pkn,
            self.pq, self.pv, self.gv, self.pn, self.cqkv, self.cconv, self.z, self.beta,
            self.alpha, self.dout, self.fl, self.gl, self.pg, self.qg, self.gate, self.psel,
            self.npsel, self.sg,
        ]
    }
}

impl NextScratch {
    /// The buffers for `n` tokens and `nr` logits rows.
    pub(crate) fn grow(
        &mut self,
        stream: &Arc<CudaStream>,
        d: &NextDims,
        e: usize,
        n: usize,
        nr: usize,
    ) -> Result<NextBufs, ModelError> {
        let se = d.streams * e;
        let lr = d.lowrank;
        let one = |w: usize, on: bool| if on { n * w } else { 1 };
        let ple = d.ple > 0;
        Ok(NextBufs {
            xn: addr(stream, &mut self.xn, one(se, lr))?,
            ud: addr(stream, &mut self.ud, one(d.rank * d.segs.max(1), lr))?,
            gw: addr(stream, &mut self.gw, one(se, lr))?,
            u: addr(stream, &mut self.u, one(d.rank, lr))?,
            inj: addr(stream, &mut self.inj, one(d.streams, lr))?,
            xg: addr(stream, &mut self.xg, if lr { nr.max(1) * se } else { 1 })?,
            pe: addr(stream, &mut self.pe, one(d.ple, ple))?,
            pk: addr(stream, &mut self.pk, one(se, ple))?,
            pkn: addr(stream, &mut self.pkn, one(se, ple))?,
            pq: addr(stream, &mut self.pq, one(se, ple))?,
            pv: addr(stream, &mut self.pv, one(e, ple))?,
            gv: addr(stream, &mut self.gv, one(se, ple))?,
            pn: addr(stream, &mut self.pn, one(se, ple))?,
            cqkv: addr(stream, &mut self.cqkv, n * d.conv)?,
            cconv: addr(stream, &mut self.cconv, n * d.conv)?,
            z: addr(stream, &mut self.z, n * d.dvw)?,
            beta: addr(stream, &mut self.beta, n * d.hv)?,
            alpha: addr(stream, &mut self.alpha, n * d.chan)?,
            dout: addr(stream, &mut self.dout, n * d.dvw)?,
            fl: addr(stream, &mut self.fl, n * d.low)?,
            gl: addr(stream, &mut self.gl, n * d.low)?,
            pg: addr(stream, &mut self.pg, n * d.pool_gates)?,
            qg: addr(stream, &mut self.qg, n * d.qg)?,
            gate: addr(stream, &mut self.gate, n * d.gate)?,
            psel: addr(stream, &mut self.psel, n * d.kp)?,
            npsel: addr(stream, &mut self.npsel, n)?,
            sg: addr(stream, &mut self.sg, n)?,
        })
    }
}
