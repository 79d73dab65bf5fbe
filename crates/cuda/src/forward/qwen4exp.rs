//! Qwen3.8-Flash-Next's parts of the GPU forward pass (kernels in `qwen4exp.cu`).
//!
//! Owns: the low-rank hyper-connection mixers that replace every norm ([`DMix`]), the hashed
//! n-gram PLE layer ([`DPle`]; its row ids are hashed and its rows gathered on the host,
//! then uploaded per call), Gated DeltaNet ([`DDelta`]) and QSA indexed attention
//! ([`DQsa`]) in VRAM; their shape checks ([`check`]); their per-call scratch
//! ([`NextScratch`]) and per-sequence state ([`layer_state`], [`ple_state`]: the
//! convolution rings, DeltaNet's recurrent matrices, QSA's raw and pooled indexer keys);
//! and the launches that evaluate them, each the GPU form of a CPU block of
//! `sluice_models::blocks` (`hyper_lowrank`, `ple`, `deltanet`, `qsa`). The gated shared
//! expert is the caller's (`moe_combine` takes its gate's logits).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use sluice_kernels::GgmlType;
use sluice_models::blocks::deltanet::{DeltaShape, DeltaWeights};
use sluice_models::blocks::hyper_lowrank::HcWeights;
use sluice_models::blocks::ple::PleWeights;
use sluice_models::blocks::qsa::{QsaShape, QsaWeights};
use sluice_models::plan::{DecoderPlan, PlanAttn, PlanFfn};
use sluice_models::weights::Mat;
use sluice_models::ModelError;

use crate::kernels;

use super::{addr, err, i32_of, DMat, GpuDecoder, IndexSelect, Uploader, ACT_SIGMOID, IDX_MAX_Q};

/// Threads of a block that reduces over one stream of a token (`rms_groups`, `ple_gate`):
/// a decode step has one block per stream, so each is wide.
pub(crate) const GROUP_THREADS: u32 = 1024;

/// Threads of `delta_rule` and the value columns each owns at most (`GDN_THREADS`,
/// `GDN_COLS` of qwen4exp.cu): the widest value head it takes.
pub(crate) const GDN_THREADS: u32 = 128;
const GDN_COLS: usize = 4;
pub(crate) const DV_MAX: usize = GDN_THREADS as usize * GDN_COLS;

/// Where a product's rows come from: the chunk table, the address of its count, the
/// chunks in the grid, whether every chunk has at most 8 rows (`GpuDecoder::mv`).
#[derive(Clone, Copy)]
pub(crate) struct Rows {
    pub table: u64,
    pub count: u64,
    pub chunks: usize,
    pub small: bool,
}

/// A low-rank mixer in VRAM (`hyper_lowrank::HcWeights`): the down product in `nseg`
/// column segments (`Uploader::segments`; 1: whole).
pub(crate) struct DMix {
    norm: u64,
    down: DMat,
    nseg: usize,
    up: DMat,
    inject: Option<DFew>,
}

/// Most rows a product of f32 weights may have to go through `dot_rows_f32` (a block per
/// token and row) instead of the product kernels (a warp per row: a few long rows would
/// keep a few warps busy).
const FEW_ROWS: usize = 64;

/// A product of few rows: f32 weights through `dot_rows_f32` (their address and shape),
/// others through the product kernels.
pub(crate) enum DFew {
    F32 { ptr: u64, rows: usize, cols: usize },
    Mat(DMat),
}

/// The PLE layer in VRAM (`ple::PleWeights`).
pub(crate) struct DPle {
    key: DMat,
    value: DMat,
    norm_key: u64,
    norm_query: u64,
    norm_conv: u64,
    conv: u64,
    kernel: usize,
    dilation: usize,
}

/// A Gated DeltaNet layer in VRAM (`deltanet::DeltaWeights`).
pub(crate) struct DDelta {
    qkv: DMat,
    gate: DMat,
    beta: DFew,
    alpha: DFew,
    pub out: DMat,
    conv: u64,
    dt_bias: u64,
    a: u64,
    norm: u64,
    pub shape: DeltaShape,
}

/// A QSA layer in VRAM (`qsa::QsaWeights`).
pub(crate) struct DQsa {
    wq: DMat,
    wk: DMat,
    wv: DMat,
    pub wo: DMat,
    idx_q: DMat,
    idx_k: DMat,
    q_norm: u64,
    k_norm: u64,
    idx_q_norm: u64,
    idx_k_norm: u64,
    inv_freq: u64,
    pub shape: QsaShape,
}

impl Uploader<'_> {
    /// A low-rank mixer, its down product in `nseg` column segments.
    pub(crate) fn mix(&mut self, w: &HcWeights, nseg: usize) -> Result<DMix, String> {
        Ok(DMix {
            norm: self.norm(&w.norm)?,
            down: if nseg > 1 {
                self.segments(&w.down, nseg)?
            } else {
                self.mat(&w.down)?
            },
            nseg,
            up: self.mat(&w.up)?,
            inject: w.inject.as_ref().map(|m| self.few(m)).transpose()?,
        })
    }

    /// A product of few rows ([`DFew`]).
    pub(crate) fn few(&mut self, m: &Mat) -> Result<DFew, String> {
        if m.ty == GgmlType::F32 && m.rows <= FEW_ROWS {
            Ok(DFew::F32 {
                ptr: self.bytes(m.bytes(self.map))?,
                rows: m.rows,
                cols: m.cols,
            })
        } else {
            Ok(DFew::Mat(self.mat(m)?))
        }
    }

    pub(crate) fn ple(&mut self, w: &PleWeights) -> Result<DPle, String> {
        Ok(DPle {
            key: self.mat(&w.key)?,
            value: self.mat(&w.value)?,
            norm_key: self.norm(&w.norm_key)?,
            norm_query: self.norm(&w.norm_query)?,
            norm_conv: self.norm(&w.norm_conv)?,
            conv: self.norm(&w.conv)?,
            kernel: w.kernel,
            dilation: w.dilation,
        })
    }

    pub(crate) fn delta(&mut self, w: &DeltaWeights, shape: &DeltaShape) -> Result<DDelta, String> {
        Ok(DDelta {
            qkv: self.mat(&w.qkv)?,
            gate: self.mat(&w.gate)?,
            beta: self.few(&w.beta)?,
            alpha: self.few(&w.alpha)?,
            out: self.mat(&w.out)?,
            conv: self.norm(&w.conv)?,
            dt_bias: self.norm(&w.dt_bias)?,
            a: self.norm(&w.a)?,
            norm: self.norm(&w.norm)?,
            shape: *shape,
        })
    }

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

/// Dynamic shared memory of `delta_rule` for a head of `dk x dv` (the state, q, k and the
/// rows' decay).
pub(crate) fn gdn_smem(sh: &DeltaShape) -> usize {
    4 * (sh.d_k * sh.d_v + 3 * sh.d_k)
}

/// Shared memory `delta_rule` declares statically (`block_sum`'s partial sums), with room
/// to spare: the dynamic part may have the opt-in limit less this.
pub(crate) const GDN_STATIC_SMEM: usize = 1024;

/// The shapes these kernels assume, for `GpuDecoder::check` (the reason when not). `smem`:
/// the dynamic shared memory a block may have.
pub(crate) fn check(plan: &DecoderPlan, smem: usize) -> Result<(), String> {
    let e = plan.n_embd;
    let s = plan.lowrank.as_ref().map_or(1, |lr| lr.n_stream);
    if s == 0 {
        return Err("low-rank hyper-connections of 0 streams".into());
    }
    let d = s * e;
    let mix_ok = |w: &HcWeights, inject: bool| {
        let r = w.down.rows;
        r > 0
            && w.norm.len() == d
            && (w.down.cols, w.up.rows, w.up.cols) == (d, d, r)
            && match &w.inject {
                Some(m) => (m.rows, m.cols) == (s, d),
                None => !inject,
            }
    };
    if let Some(lr) = &plan.lowrank {
        if !mix_ok(&lr.head, false) {
            return Err("the output low-rank mixer's shapes do not match the streams".into());
        }
    }
    for (il, l) in plan.layers.iter().enumerate() {
        // The mixers normalise: the kernels apply no norm beside them.
        let norms = !l.attn_norm.is_empty()
            || !l.ffn_norm.is_empty()
            || l.post_attn_norm.is_some()
            || l.post_ffn_norm.is_some();
        if plan.lowrank.is_some() && norms {
            return Err(format!(
                "layer {il}: norms beside low-rank mixers have no GPU kernel"
            ));
        }
        match (&l.hc_lowrank, &plan.lowrank) {
            (Some(w), Some(_)) if w.iter().all(|w| mix_ok(w, true)) => {}
            (None, None) => {}
            (Some(_), Some(_)) => {
                return Err(format!(
                    "layer {il}: low-rank mixers of the wrong shape or without injection weights"
                ))
            }
            _ => {
                return Err(format!(
                    "layer {il}: low-rank mixers do not match the plan's residual"
                ))
            }
        }
        if let Some(w) = &l.ple {
            let Some(pp) = &plan.ple else {
                return Err(format!("layer {il}: a PLE layer without the plan's hash"));
            };
            let heads = pp.hash.n_heads();
            let width = heads * (e / heads.max(1));
            let ok = heads > 0
                && w.kernel > 0
                && w.dilation > 0
                && (w.key.rows, w.key.cols, w.value.rows, w.value.cols) == (d, width, e, width)
                && w.norm_key.len() == d
                && w.norm_query.len() == d
                && w.norm_conv.len() == d
                && w.conv.len() == d * w.kernel;
            if !ok {
                return Err(format!(
                    "layer {il}: PLE layer shapes do not match the streams"
                ));
            }
        }
        if let PlanFfn::Moe {
            shared: Some(sh), ..
        } = &l.ffn
        {
            if let Some(g) = &sh.gate {
                if (g.rows, g.cols) != (1, e) {
                    return Err(format!(
                        "layer {il}: a shared expert gate of {} x {}",
                        g.rows, g.cols
                    ));
                }
            }
        }
        match &l.attn {
            PlanAttn::Delta { w, shape: sh } => {
                let (hv, dk, dv) = (sh.n_v_heads, sh.d_k, sh.d_v);
                let cd = sh.conv_dim();
                let ok = sh.n_k_heads > 0
                    && hv > 0
                    && dk > 0
                    && dv > 0
                    && dv <= DV_MAX
                    && gdn_smem(sh) <= smem
                    && sh.conv_kernel > 0
                    && (w.qkv.rows, w.gate.rows, w.beta.rows, w.alpha.rows)
                        == (cd, hv * dv, hv, hv)
                    && (w.out.rows, w.out.cols) == (e, hv * dv)
                    && w.conv.len() == cd * sh.conv_kernel
                    && (w.dt_bias.len(), w.a.len(), w.norm.len()) == (hv, hv, dv);
                if !ok {
                    return Err(format!(
                        "layer {il}: a Gated DeltaNet of {} key / {hv} value heads of {dk} x {dv} the kernels do not take (values up to {}, the state within {smem} bytes of shared memory)",
                        sh.n_k_heads,
                        DV_MAX
                    ));
                }
            }
            PlanAttn::Qsa {
                w,
                shape: sh,
                inv_freq,
            } => {
                let a = &plan.shape;
                let (nh, hd, id) = (sh.n_head, sh.head_dim, sh.idx_dim);
                let ok = (nh, sh.n_head_kv, hd, hd)
                    == (a.n_head, a.n_head_kv, a.head_dim, a.head_dim_v)
                    && sh.n_rot.is_multiple_of(2)
                    && sh.n_rot <= hd
                    && inv_freq.len() == sh.n_rot / 2
                    && (w.wq.rows, w.wk.rows, w.wv.rows)
                        == (nh * 2 * hd, sh.n_head_kv * hd, sh.n_head_kv * hd)
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
            }
            _ => {}
        }
    }
    Ok(())
}

/// Per-token widths of this module's scratch, the widest over the layers (1 where a part
/// is absent), found once when the decoder is built.
#[derive(Debug, Clone, Copy)]
pub(crate) struct NextDims {
    /// Whether the residual has low-rank mixers, its streams (1: a plain residual), the
    /// mixers' widest rank, and the column segments of their down products.
    lowrank: bool,
    pub streams: usize,
    rank: usize,
    pub segs: usize,
    /// The PLE layer's gathered row width (0: no PLE layer).
    pub ple: usize,
    /// DeltaNet and KDA: q|k|v before and after the convolutions, the value heads' width,
    /// the value heads, their decay inputs (DeltaNet's per head, KDA's per channel), KDA's
    /// low-rank gate values.
    conv: usize,
    dvw: usize,
    hv: usize,
    chan: usize,
    low: usize,
    /// QSA: the [q | gate] rows, the gates, the positions a token may attend to.
    qg: usize,
    gate: usize,
    kp: usize,
    /// GLM-5.3-Flash's k-pool indexer: its gate logits per token.
    pool_gates: usize,
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

/// Per-call device buffers of these parts, grown as needed.
#[derive(Default)]
pub(crate) struct NextScratch {
    xn: Option<CudaSlice<f32>>,
    ud: Option<CudaSlice<f32>>,
    gw: Option<CudaSlice<f32>>,
    u: Option<CudaSlice<f32>>,
    inj: Option<CudaSlice<f32>>,
    xg: Option<CudaSlice<f32>>,
    pub pe: Option<CudaSlice<f32>>,
    pk: Option<CudaSlice<f32>>,
    pkn: Option<CudaSlice<f32>>,
    pq: Option<CudaSlice<f32>>,
    pv: Option<CudaSlice<f32>>,
    gv: Option<CudaSlice<f32>>,
    pn: Option<CudaSlice<f32>>,
    cqkv: Option<CudaSlice<f32>>,
    cconv: Option<CudaSlice<f32>>,
    z: Option<CudaSlice<f32>>,
    beta: Option<CudaSlice<f32>>,
    alpha: Option<CudaSlice<f32>>,
    dout: Option<CudaSlice<f32>>,
    fl: Option<CudaSlice<f32>>,
    gl: Option<CudaSlice<f32>>,
    pg: Option<CudaSlice<f32>>,
    qg: Option<CudaSlice<f32>>,
    gate: Option<CudaSlice<f32>>,
    sg: Option<CudaSlice<f32>>,
    psel: Option<CudaSlice<i32>>,
    npsel: Option<CudaSlice<i32>>,
}

/// The addresses of [`NextScratch`]'s buffers for one call.
#[derive(Clone, Copy)]
pub(crate) struct NextBufs {
    /// Low-rank mixer: the normed streams, the down product's partial sums, the
    /// per-element gates, the rank values, the injection weights, the head's gathered rows.
    pub xn: u64,
    ud: u64,
    gw: u64,
    u: u64,
    pub inj: u64,
    pub xg: u64,
    /// PLE: the gathered rows, key products (raw, normed), the normed streams, the value,
    /// the gated values and their norm.
    pub pe: u64,
    pk: u64,
    pkn: u64,
    pq: u64,
    pv: u64,
    gv: u64,
    pn: u64,
    /// DeltaNet / KDA: q|k|v before and after the convolution, the output gate, beta,
    /// the decay inputs (DeltaNet's alpha, KDA's per-channel log-decay), the gated-normed
    /// output.
    pub cqkv: u64,
    pub cconv: u64,
    pub z: u64,
    pub beta: u64,
    pub alpha: u64,
    pub dout: u64,
    /// KDA's forget-gate and output-gate low-rank values.
    pub fl: u64,
    pub gl: u64,
    /// The k-pool indexer's gate logits.
    pub pg: u64,
    /// QSA: the [q | gate] rows, the gates, the positions and their counts.
    qg: u64,
    gate: u64,
    pub psel: u64,
    pub npsel: u64,
    /// The shared expert gate's logits.
    pub sg: u64,
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

/// The PLE layer's convolution ring for a sequence: the last `(kernel - 1) * dilation`
/// normed gated values of every stream.
pub(crate) fn ple_state(
    stream: &Arc<CudaStream>,
    w: &DPle,
    width: usize,
) -> Result<CudaSlice<f32>, ModelError> {
    stream
        .alloc_zeros::<f32>(((w.kernel - 1) * w.dilation * width).max(1))
        .map_err(|e| err("PLE state", e))
}

/// A QSA layer's view of the shared scratch: the q, k, v and attention buffers, the
/// indexer's queries and keys, and the indexer scratch (scores, their row stride, tokens
/// per tile, chosen blocks, their counts).
#[derive(Clone, Copy)]
pub(crate) struct QsaBufs {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub att: u64,
    pub iq: u64,
    pub ik: u64,
    pub index: (u64, usize, usize, u64, u64),
}

impl GpuDecoder {
    /// `n` rows' low-rank mixer `w` over the streams `x` (`[n][s][e]`): the block input into
    /// `h`, and the injection weights into `b.inj` when `w` has them. `rows`: the rows'
    /// chunk table and the per-segment one (for a segmented down product).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn lr_mixer(
        &self,
        w: &DMix,
        s: usize,
        x: u64,
        h: u64,
        b: &NextBufs,
        rows: (Rows, Rows),
        n: usize,
        eps: f32,
    ) -> Result<(), ModelError> {
        let (rows, seg) = rows;
        let e = self.plan.n_embd;
        let ei = i32_of(e, "n_embd")?;
        let si = i32_of(s, "streams")?;
        kernels::RmsGroups {
            x,
            w: w.norm,
            out: b.xn,
            e: ei,
            eps,
        }
        .launch(self, (n as u32, s as u32, 1))?;
        let down = if w.nseg > 1 { seg } else { rows };
        self.mv_rows(&[(&w.down, b.ud)], down, b.xn)?;
        if let Some(m) = &w.inject {
            self.few(m, b.xn, b.inj, rows, n)?;
        }
        let inj = if w.inject.is_some() { b.inj } else { 0 };
        kernels::LrAct {
            part: b.ud,
            u: b.u,
            inj,
            r: i32_of(w.down.rows, "rank")?,
            s: si,
            nseg: w.nseg as i32,
            inv_s: 1.0 / s as f32,
        }
        .launch(self, (n as u32, 1, 1))?;
        self.mv_rows(&[(&w.up, b.gw)], rows, b.u)?;
        kernels::LrMix {
            gw: b.gw,
            xn: b.xn,
            m: h,
            e: ei,
            s: si,
        }
        .launch(self, (n as u32, e.div_ceil(256) as u32, 1))
    }

    /// `x[t][st] += inj[t][st] * y[t]` for `n` tokens of `s` streams.
    pub(crate) fn lr_post(
        &self,
        s: usize,
        x: u64,
        y: u64,
        inj: u64,
        n: usize,
    ) -> Result<(), ModelError> {
        let e = self.plan.n_embd;
        kernels::LrPost {
            x,
            y,
            inj,
            e: i32_of(e, "n_embd")?,
            s: s as i32,
        }
        .launch(self, (n as u32, e.div_ceil(256) as u32, 1))
    }

    /// The PLE layer `w` on the streams `x` (`[n][s][e]`) from the gathered rows in `b.pe`:
    /// `x += G + silu(conv(norm(G)))`, the convolution reading the ring `hist` for
    /// positions before the batch; the ring gets the batch's last values after.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn ple_layer(
        &self,
        w: &DPle,
        s: usize,
        x: u64,
        hist: u64,
        pos: u64,
        b: &NextBufs,
        rows: Rows,
        n: usize,
        eps: f32,
    ) -> Result<(), ModelError> {
        let e = self.plan.n_embd;
        let ei = i32_of(e, "n_embd")?;
        let width = s * e;
        let norm = |src: u64, wt: u64, dst: u64| {
            kernels::RmsGroups {
                x: src,
                w: wt,
                out: dst,
                e: ei,
                eps,
            }
            .launch(self, (n as u32, s as u32, 1))
        };
        self.mv_rows(&[(&w.key, b.pk), (&w.value, b.pv)], rows, b.pe)?;
        norm(b.pk, w.norm_key, b.pkn)?;
        norm(x, w.norm_query, b.pq)?;
        kernels::PleGate {
            k: b.pkn,
            q: b.pq,
            v: b.pv,
            gv: b.gv,
            e: ei,
        }
        .launch(self, (n as u32, s as u32, 1))?;
        norm(b.gv, w.norm_conv, b.pn)?;
        let taps = (w.conv, w.kernel, w.dilation);
        self.conv(b.pn, hist, taps, b.gv, x, pos, width, n)
    }

    /// The causal depthwise convolution of `n` tokens' rows `input` (`width` channels; taps
    /// `(weights, kernel, dilation)`) over the batch and the per-sequence `ring` of earlier
    /// positions, into `out` (`gv` null: SiLU of it; else `out += gv + SiLU`), then the
    /// batch's last inputs into the ring: every read of the ring comes first.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn conv(
        &self,
        input: u64,
        ring: u64,
        taps: (u64, usize, usize),
        gv: u64,
        out: u64,
        pos: u64,
        width: usize,
        n: usize,
    ) -> Result<(), ModelError> {
        let (w, kernel, dil) = taps;
        kernels::ConvRing {
            input,
            ring,
            w,
            gv,
            out,
            pos,
            width: i32_of(width, "convolution channels")?,
            kernel: kernel as i32,
            dil: dil as i32,
        }
        .launch(self, (n as u32, width.div_ceil(256) as u32, 1))?;
        let slots = (kernel - 1) * dil;
        if slots > 0 {
            self.ring_store(input, 0, ring, 0, pos, width, slots, n)?;
        }
        Ok(())
    }

    /// Gated DeltaNet `w` of the block input `h` into `b.dout` (`[n][hv * dv]`, before the
    /// output product); `st`: the layer's convolution ring and recurrent matrices.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn delta(
        &self,
        w: &DDelta,
        st: (u64, u64),
        pos: u64,
        h: u64,
        b: &NextBufs,
        rows: Rows,
        n: usize,
    ) -> Result<(), ModelError> {
        let s = &w.shape;
        let cd = s.conv_dim();
        self.few(&w.beta, h, b.beta, rows, n)?;
        self.few(&w.alpha, h, b.alpha, rows, n)?;
        let parts = [(&w.qkv, b.cqkv), (&w.gate, b.z)];
        self.mv_rows(&parts, rows, h)?;
        let taps = (w.conv, s.conv_kernel, 1);
        self.conv(b.cqkv, st.0, taps, 0, b.cconv, pos, cd, n)?;
        let (hk, dk) = (s.n_k_heads as u64, s.d_k as u64);
        let q = b.cconv;
        let (k, v) = (q + 4 * hk * dk, q + 8 * hk * dk);
        let gates = (b.beta, b.alpha, b.z);
        let st = (st.1, b.dout);
        self.delta_rule(
            s,
            (q, k, v, cd),
            gates,
            (w.a, w.dt_bias),
            w.norm,
            st,
            pos,
            n,
            false,
        )
    }

    /// The delta rule (`delta_rule`) of `n` tokens for every value head of `sh`: q, k, v
    /// rows at `qkv` (token stride `qkv.3` values), `gates`: beta, the decay inputs
    /// (alpha, or the per-channel log-decay when `per_channel`) and the output gate; `ab`:
    /// the per-head rate and dt bias (DeltaNet); `st`: the state and the output.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn delta_rule(
        &self,
        sh: &DeltaShape,
        qkv: (u64, u64, u64, usize),
        gates: (u64, u64, u64),
        ab: (u64, u64),
        norm: u64,
        st: (u64, u64),
        pos: u64,
        n: usize,
        per_channel: bool,
    ) -> Result<(), ModelError> {
        kernels::DeltaRule {
            q: qkv.0,
            k: qkv.1,
            v: qkv.2,
            beta: gates.0,
            g: gates.1,
            z: gates.2,
            a: ab.0,
            dt_bias: ab.1,
            norm,
            state: st.0,
            out: st.1,
            pos,
            ts: i32_of(qkv.3, "row stride")?,
            n: n as i32,
            hk: sh.n_k_heads as i32,
            dk: sh.d_k as i32,
            dv: sh.d_v as i32,
            gate_sigmoid: i32::from(sh.gate_sigmoid),
            per_channel: i32::from(per_channel),
            eps: sh.rms_eps,
        }
        .launch_smem(self, (sh.n_v_heads as u32, 1, 1), gdn_smem(sh))
    }

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

    /// QSA attention `w` of the block input `h`, gated (`[n][nh * hd]`, before the output
    /// product; its address is returned): the KV cache `cache` (`kvt` its type), the
    /// indexer's state `st` (raw keys, pooled keys; empty without an indexer).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn qsa(
        &self,
        w: &DQsa,
        kvt: usize,
        cache: (u64, u64),
        st: &[u64],
        pos: u64,
        h: u64,
        bufs: &QsaBufs,
        b: &NextBufs,
        rows: Rows,
        n: usize,
    ) -> Result<u64, ModelError> {
        let s = &w.shape;
        let (nh, nkv, hd) = (s.n_head, s.n_head_kv, s.head_dim);
        let indexed = s.ratio > 0;
        let mut parts = vec![(&w.wq, b.qg), (&w.wk, bufs.k), (&w.wv, bufs.v)];
        if indexed {
            parts.extend([(&w.idx_q, bufs.iq), (&w.idx_k, bufs.ik)]);
        }
        self.mv_rows(&parts, rows, h)?;
        // With an indexer: its query heads and one more block storing the raw keys.
        let blocks = nh + nkv + if indexed { s.idx_heads + 1 } else { 0 };
        let keys = st.first().copied().unwrap_or(0);
        kernels::QsaPrep {
            qg: b.qg,
            q: bufs.q,
            gate: b.gate,
            k: bufs.k,
            iq: bufs.iq,
            ik: bufs.ik,
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
            let pooled = st[1];
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
                iq: bufs.iq,
                wh: 0,
                n_head: s.idx_heads,
                head_dim: s.idx_dim,
                rows: pooled,
                ratio: s.ratio,
                top_k: kb,
            };
            self.index_select(&ix, pos, bufs.index, n)?;
            let kp = s.budget + s.ratio - 1;
            let (_, _, _, bsel, nb) = bufs.index;
            self.expand(bsel, nb, pos, b, s.ratio, kb, kp, true, n)?;
            sel = (b.psel, b.npsel, kp);
        }
        self.attention(kvt, bufs.q, cache.0, cache.1, bufs.att, pos, n, 0, sel)?;
        // The output gate: gate = sigmoid(gate) * attention, the output product's input.
        self.glu(b.gate, bufs.att, n * nh * hd, ACT_SIGMOID)?;
        Ok(b.gate)
    }

    /// `y = W x` for `n` rows of `x` (`rows`: their chunk table) of a few-row product.
    pub(crate) fn few(
        &self,
        w: &DFew,
        x: u64,
        y: u64,
        rows: Rows,
        n: usize,
    ) -> Result<(), ModelError> {
        match w {
            DFew::F32 { ptr, rows: r, cols } => kernels::DotRowsF32 {
                w: *ptr,
                x,
                y,
                rows: *r as i32,
                cols: i32_of(*cols, "columns")?,
            }
            .launch(self, (n as u32, *r as u32, 1)),
            DFew::Mat(m) => self.mv_rows(&[(m, y)], rows, x),
        }
    }

    /// `out[i] = x[rows[i]]` for `n` rows of `cols`.
    pub(crate) fn gather(
        &self,
        x: u64,
        rows: u64,
        out: u64,
        n: usize,
        cols: usize,
    ) -> Result<(), ModelError> {
        kernels::RowsGather {
            x,
            rows,
            out,
            cols: i32_of(cols, "row")?,
        }
        .launch(self, (n as u32, cols.div_ceil(256) as u32, 1))
    }
}
