//! GLM-5.3-Flash's parts of the GPU forward pass (kernels in `glm5next.cu`, plus the
//! convolution, the delta rule and the block expansion of `qwen4exp.cu`).
//!
//! Owns: Kimi delta attention in VRAM ([`DKda`]) and its launches; the k-pool indexer of
//! the pooled latent-attention layers ([`DPool`]: LayerNorm'd keys, gate logits and pools
//! per sequence, the pools' scores and top-k through the shared indexer kernels, the
//! positions through `qsa_expand`); the pooled layers' absorbed-MLA view
//! ([`pooled_mla_shape`]; the plan's attention shape is already that view); and the shape
//! checks of both
//! ([`check`]). The pooled layers' attention is forward.rs's absorbed MLA path with no
//! RoPE; the streams' mean before the head is `stream_mean`.

use cudarc::driver::CudaSlice;
use sluice_models::blocks::deltanet::DeltaShape;
use sluice_models::blocks::kda::{KdaShape, KdaWeights};
use sluice_models::blocks::mla::MlaShape;
use sluice_models::blocks::mla_pooled::{PooledIndexer, PooledShape};
use sluice_models::plan::{DecoderPlan, PlanAttn};
use sluice_models::weights::Stacked;
use sluice_models::ModelError;

use crate::kernels;

use super::qwen4exp::{gdn_smem, DFew, NextBufs, Rows};
use super::{err, i32_of, kernel_format, DMat, GpuDecoder, IndexSelect, Uploader, IDX_MAX_Q};

/// Kimi delta attention of one layer in VRAM (`kda::KdaWeights`).
pub(crate) struct DKda {
    q: DMat,
    k: DMat,
    v: DMat,
    /// The q, k and v convolutions' taps.
    conv: [u64; 3],
    f_a: DMat,
    f_b: DMat,
    g_a: DMat,
    g_b: DMat,
    beta: DFew,
    dt_bias: u64,
    a: u64,
    norm: u64,
    pub out: DMat,
    pub shape: KdaShape,
}

/// The k-pool indexer of a full pooled layer in VRAM (`mla_pooled::PooledIndexer`).
pub(crate) struct DPool {
    q_b: DMat,
    pub k: DMat,
    k_norm: u64,
    k_norm_b: u64,
    pub proj: DMat,
    pub gate: DMat,
    ape: u64,
    pub n_head: usize,
    pub head_dim: usize,
    /// Pools a query keeps (`top_k / kpool`), tokens per pool, whether the incomplete
    /// pool's tokens are always attended to.
    pub keep: usize,
    pub kpool: usize,
    tail: bool,
    ln_eps: f32,
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
    pub(crate) fn kda(&mut self, w: &KdaWeights, shape: &KdaShape) -> Result<DKda, String> {
        Ok(DKda {
            q: self.mat(&w.q)?,
            k: self.mat(&w.k)?,
            v: self.mat(&w.v)?,
            conv: [
                self.norm(&w.conv_q)?,
                self.norm(&w.conv_k)?,
                self.norm(&w.conv_v)?,
            ],
            f_a: self.mat(&w.f_a)?,
            f_b: self.mat(&w.f_b)?,
            g_a: self.mat(&w.g_a)?,
            g_b: self.mat(&w.g_b)?,
            beta: self.few(&w.beta)?,
            dt_bias: self.norm(&w.dt_bias)?,
            a: self.norm(&w.a)?,
            norm: self.norm(&w.norm)?,
            out: self.mat(&w.out)?,
            shape: *shape,
        })
    }

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

/// A KDA layer as the delta-rule kernel sees it: a DeltaNet of as many key as value heads,
/// square, with the sigmoid-gated output norm.
pub(crate) fn delta_shape(s: &KdaShape) -> DeltaShape {
    DeltaShape {
        n_k_heads: s.n_head,
        n_v_heads: s.n_head,
        d_k: s.head_dim,
        d_v: s.head_dim,
        conv_kernel: s.conv_kernel,
        rms_eps: s.rms_eps,
        gate_sigmoid: true,
    }
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

/// The shapes these kernels assume, for `GpuDecoder::check` (the reason when not).
pub(crate) fn check(plan: &DecoderPlan, smem: usize) -> Result<(), String> {
    let e = plan.n_embd;
    let first = plan.layers.iter().find_map(|l| match &l.attn {
        PlanAttn::Pooled { shape, .. } => Some(*shape),
        _ => None,
    });
    for (il, l) in plan.layers.iter().enumerate() {
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
        match &l.attn {
            PlanAttn::Kda { w, shape: s } => {
                let (h, d) = (s.n_head, s.head_dim);
                let inner = s.inner();
                let delta = delta_shape(s);
                let ok = h > 0
                    && d > 0
                    && d <= super::qwen4exp::DV_MAX
                    && gdn_smem(&delta) <= smem
                    && s.conv_kernel > 0
                    && (w.q.rows, w.k.rows, w.v.rows) == (inner, inner, inner)
                    && (w.f_a.rows, w.g_a.rows) == (d, d)
                    && (w.f_b.rows, w.f_b.cols, w.g_b.rows, w.g_b.cols) == (inner, d, inner, d)
                    && w.beta.rows == h
                    && (w.out.rows, w.out.cols) == (e, inner)
                    && [&w.conv_q, &w.conv_k, &w.conv_v]
                        .iter()
                        .all(|c| c.len() == inner * s.conv_kernel)
                    && (w.dt_bias.len(), w.a.len(), w.norm.len()) == (inner, h, d);
                if !ok {
                    return Err(format!(
                        "layer {il}: a Kimi delta attention of {h} heads of {d} the kernels do not take (heads up to {}, the state within {smem} bytes of shared memory)",
                        super::qwen4exp::DV_MAX
                    ));
                }
            }
            PlanAttn::Pooled { w, shape: s } => {
                let dims = |s: &PooledShape| (s.n_head, s.q_lora, s.kv_lora, s.head_k, s.head_v);
                // (The kernels take the plan's attention shape as the absorbed view.)
                let a = &plan.shape;
                let ok = first.as_ref().map(dims) == Some(dims(s))
                    && (a.n_head, a.n_head_kv, a.head_dim, a.head_dim_v)
                        == (s.n_head, 1, s.kv_lora, s.kv_lora)
                    && s.n_head > 0
                    && s.kv_lora <= super::MAX_HEAD_DIM_V
                    && (w.q_a.rows, w.q_b.rows, w.q_b.cols)
                        == (s.q_lora, s.n_head * s.head_k, s.q_lora)
                    && (w.q_a_norm.len(), w.kv_a.rows, w.kv_a_norm.len())
                        == (s.q_lora, s.kv_lora, s.kv_lora)
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
                    kernel_format(ty, cols)
                        .map(|_| ())
                        .ok_or_else(|| format!("layer {il} attention {what}: {ty:?} with {cols} columns has no GPU kernel"))
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
            }
            _ => {}
        }
    }
    Ok(())
}

/// One KDA layer's state for a sequence, zeros: the q, k and v convolution rings (the last
/// `kernel - 1` inputs each) and the recurrent matrices.
pub(crate) fn kda_state(
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    s: &KdaShape,
) -> Result<Vec<CudaSlice<f32>>, ModelError> {
    let zeros = |len: usize| {
        stream
            .alloc_zeros::<f32>(len.max(1))
            .map_err(|e| err("KDA state", e))
    };
    let ring = (s.conv_kernel - 1) * s.inner();
    Ok(vec![
        zeros(ring)?,
        zeros(ring)?,
        zeros(ring)?,
        zeros(s.n_head * s.head_dim * s.head_dim)?,
    ])
}

/// One full pooled layer's indexer state for a sequence of `n_ctx` positions: every
/// position's key and gate logits, every complete pool's key.
pub(crate) fn pool_state(
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    ix: &DPool,
    n_ctx: usize,
) -> Result<Vec<CudaSlice<f32>>, ModelError> {
    let zeros = |len: usize| {
        stream
            .alloc_zeros::<f32>(len.max(1))
            .map_err(|e| err("k-pool indexer state", e))
    };
    let d = ix.head_dim;
    Ok(vec![
        zeros(n_ctx * d)?,
        zeros(n_ctx * d)?,
        zeros((n_ctx / ix.kpool + 1) * d)?,
    ])
}

/// A pooled layer's indexer buffers: its queries (`[n][heads * dim]`), head weights, keys
/// and gate logits of the batch, and the shared indexer scratch (scores, their stride,
/// tokens per tile, chosen pools, their counts).
pub(crate) struct PoolBufs {
    pub iq: u64,
    pub wh: u64,
    pub ik: u64,
    pub gt: u64,
    pub index: (u64, usize, usize, u64, u64),
}

impl GpuDecoder {
    /// Kimi delta attention `w` of the block input `h` into `b.dout` (`[n][inner]`, before
    /// the output product); `st`: the q, k, v convolution rings and the recurrent matrices.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn kda(
        &self,
        w: &DKda,
        st: &[u64],
        pos: u64,
        h: u64,
        b: &NextBufs,
        rows: Rows,
        n: usize,
    ) -> Result<(), ModelError> {
        let s = &w.shape;
        let inner = s.inner();
        // q, k, v side by side in the DeltaNet buffers: [3][n][inner] before and after the
        // convolutions.
        let part = |base: u64, i: usize| base + 4 * (i * n * inner) as u64;
        let raw = [part(b.cqkv, 0), part(b.cqkv, 1), part(b.cqkv, 2)];
        let conv = [part(b.cconv, 0), part(b.cconv, 1), part(b.cconv, 2)];
        let qkv = [(&w.q, raw[0]), (&w.k, raw[1]), (&w.v, raw[2])];
        self.mv_rows(&qkv, rows, h)?;
        self.mv_rows(&[(&w.f_a, b.fl), (&w.g_a, b.gl)], rows, h)?;
        self.few(&w.beta, h, b.beta, rows, n)?;
        self.mv_rows(&[(&w.f_b, b.alpha)], rows, b.fl)?;
        self.mv_rows(&[(&w.g_b, b.z)], rows, b.gl)?;
        let ii = i32_of(inner, "KDA width")?;
        kernels::KdaGate {
            f: b.alpha,
            dt_bias: w.dt_bias,
            a: w.a,
            inner: ii,
            d: s.head_dim as i32,
            lb: s.lower_bound.unwrap_or(0.0),
            has_lb: i32::from(s.lower_bound.is_some()),
        }
        .launch(self, (n as u32, inner.div_ceil(256) as u32, 1))?;
        for i in 0..3 {
            let taps = (w.conv[i], s.conv_kernel, 1);
            self.conv(raw[i], st[i], taps, 0, conv[i], pos, inner, n)?;
        }
        let delta = delta_shape(s);
        let (q, k, v) = (conv[0], conv[1], conv[2]);
        let (ab, st3) = ((w.a, 0), (st[3], b.dout));
        let gates = (b.beta, b.alpha, b.z);
        self.delta_rule(
            &delta,
            (q, k, v, inner),
            gates,
            ab,
            w.norm,
            st3,
            pos,
            n,
            true,
        )
    }

    /// A full pooled layer's selection for `n` tokens: its indexer's keys, gate logits and
    /// completed pools into the state `st` (keys, gates, pools), the pools' scores and
    /// top-k, then the positions (chosen pools and, when the layer says so, the tail) into
    /// `b.psel` / `b.npsel`. Returns (positions, counts, positions per token) for the
    /// attention.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn pool_select(
        &self,
        ix: &DPool,
        st: &[u64],
        pos: u64,
        bufs: &PoolBufs,
        b: &NextBufs,
        round: bool,
        n: usize,
    ) -> Result<(u64, u64, usize), ModelError> {
        let (keys, gates, pooled) = (st[0], st[1], st[2]);
        let id = i32_of(ix.head_dim, "indexer keys")?;
        kernels::PoolPrep {
            ik: bufs.ik,
            gt: bufs.gt,
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
            iq: bufs.iq,
            wh: bufs.wh,
            n_head: ix.n_head,
            head_dim: ix.head_dim,
            rows: pooled,
            ratio: ix.kpool,
            top_k: ix.keep,
        };
        self.index_select(&sel, pos, bufs.index, n)?;
        let kp = ix.positions();
        let (_, _, _, bsel, nb) = bufs.index;
        self.expand(bsel, nb, pos, b, ix.kpool, ix.keep, kp, ix.tail, n)?;
        Ok((b.psel, b.npsel, kp))
    }

    /// The streams' mean (`[n][s][e]` -> `[n][e]`).
    pub(crate) fn stream_mean(&self, x: u64, h: u64, s: usize, n: usize) -> Result<(), ModelError> {
        let e = self.plan.n_embd;
        kernels::StreamMean {
            x,
            h,
            e: i32_of(e, "n_embd")?,
            s: s as i32,
        }
        .launch(self, (n as u32, e.div_ceil(256) as u32, 1))
    }
}
