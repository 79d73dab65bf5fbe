//! Absorbed multi-head latent attention on the GPU (the CPU's `sluice_models::blocks::mla`;
//! GLM-5.3-Flash's pooled layers, `blocks::mla_pooled`, run through the same view).
//!
//! Owns: [`Mla`] (its device weights: q-LoRA, the latent projection, `k_b` / `v_b` with
//! one pointer-table entry per head, the output, and the positions it attends to,
//! [`DSelect`]) and its launch sequence ([`GpuDecoder::mla`]): `mla_kv_prep` (the normed
//! latent and the roped shared key as one `[c | k_rope]` key row and a `c` value row),
//! `mla_q_split` / `mla_q_join` around the per-head `k_b` products, attention over the
//! latent cache, the per-head `v_b` products. GLM's DSA indexer lives in
//! `blocks::dsa_indexer`, the k-pool indexer in `blocks::mla_pooled`.

use sluice_models::blocks::mla::{MlaShape, MlaWeights};
use sluice_models::plan::{DecoderPlan, MlaSelect, PlanAttn};
use sluice_models::ModelError;

use crate::blocks::dsa_indexer::{DDsa, DsaPtrs, IndexSelect, IDX_MAX_Q};
use crate::blocks::mla_pooled::DPool;
use crate::forward::bufs::{AttnBufs, IndexBufs, Io, MlaBufs};
use crate::forward::state::{state_mismatch, OwnPtrs};
use crate::forward::{rows_n, Call, DMat, GpuDecoder, Uploader};
use crate::kernels;

/// An absorbed MLA layer in VRAM (`k_b` and `v_b` with one pointer-table entry per head,
/// `rows` a head's rows).
pub(crate) struct Mla {
    pub(crate) q_a: DMat,
    pub(crate) q_a_norm: u64,
    pub(crate) q_b: DMat,
    pub(crate) kv_a: DMat,
    pub(crate) kv_a_norm: u64,
    pub(crate) k_b: DMat,
    pub(crate) v_b: DMat,
    pub(crate) out: DMat,
    pub(crate) inv_freq: u64,
    pub(crate) select: DSelect,
}

/// The positions an MLA layer attends to (`sluice_models::plan::MlaSelect`; a pooled
/// layer's k-pool indexer, or its reuse of the previous full layer's selection).
pub(crate) enum DSelect {
    All,
    Indexer(Box<DDsa>),
    Pooled(Box<DPool>),
    Previous,
}

impl GpuDecoder {
    /// Absorbed MLA of layer `il` (the CPU's `blocks::mla`, and `blocks::mla_pooled`
    /// through the same view): q-LoRA and the latent row, the selection (all, GLM's DSA
    /// indexer, a k-pool indexer, or the previous layer's, `mla_sel`), the per-head k_b
    /// products, attention over the latent cache, the per-head v_b products. Its output
    /// rows and matrix.
    pub(crate) fn mla<'w>(
        &self,
        w: &'w Mla,
        il: usize,
        c: &Call<'_>,
        cache: (u64, u64),
        own: OwnPtrs,
        mla_sel: &mut (u64, u64, usize),
    ) -> Result<(&'w DMat, u64), ModelError> {
        let Mla {
            q_a,
            q_a_norm,
            q_b,
            kv_a,
            kv_a_norm,
            k_b,
            v_b,
            out,
            inv_freq,
            select,
        } = w;
        let Call {
            io,
            attn,
            mla,
            index,
            next: nb,
            ..
        } = c;
        let Io {
            n,
            eps,
            kvt,
            pos,
            rows,
            heads,
            h,
            ..
        } = *io;
        let AttnBufs {
            kdim,
            vdim,
            q,
            k,
            v,
            att,
            ..
        } = *attn;
        let MlaBufs {
            qa,
            qan,
            kva,
            qn,
            qabs,
            qatt,
            ov,
        } = *mla;
        let IndexBufs { iq, wh, ik, .. } = *index;
        let (kc, vc) = cache;
        let m = self.mla.as_ref().expect("checked: MLA layers have a shape");
        let (nope, rope, kl) = (m.nope as i32, m.rope as i32, m.kv_lora as i32);
        let heads_grid = (n as u32, m.n_head as u32, 1);
        let mut from_h: Vec<(&DMat, u64)> = vec![(q_a, qa), (kv_a, kva)];
        let mut from_q: Vec<(&DMat, u64)> = vec![(q_b, q)];
        if let DSelect::Indexer(ix) = select {
            from_h.extend([(&ix.k, ik), (&ix.proj, wh)]);
            from_q.push((&ix.q_b, iq));
        }
        if let DSelect::Pooled(ix) = select {
            from_h.extend([(&ix.k, ik), (&ix.gate, nb.pg), (&ix.proj, wh)]);
            from_q.push((ix.q_b(), iq));
        }
        self.mv_rows(&from_h, rows, h)?;
        self.rms_norm(qa, *q_a_norm, qan, 0, n, m.q_lora, eps)?;
        self.mv_rows(&from_q, rows, qan)?;
        if let DSelect::Indexer(ix) = select {
            // GLM's DSA indexer: its queries and this batch's keys roped on
            // their first dims, every visible position scored, the top-k.
            let OwnPtrs::Dsa(DsaPtrs { keys }) = own else {
                return Err(state_mismatch(il));
            };
            let (ih, id) = (ix.n_head as i32, ix.head_dim as i32);
            kernels::Dsv4Heads {
                x: iq,
                pos,
                inv_freq: *inv_freq,
                n_heads: ih,
                hd: id,
                n_rot: rope,
                flags: 4,
                eps,
            }
            .launch(self, (n as u32, ix.n_head as u32, 1))?;
            kernels::DsaKeyPrep {
                ik,
                w: ix.k_norm,
                b: ix.k_norm_bias,
                pos,
                inv_freq: *inv_freq,
                keys,
                d: id,
                n_rot: rope,
                eps: ix.k_norm_eps,
            }
            .launch(self, rows_n(n))?;
            let ix_sel = IndexSelect {
                iq,
                wh,
                n_head: ix.n_head,
                head_dim: ix.head_dim,
                rows: keys,
                ratio: 1,
                top_k: ix.top_k,
            };
            self.index_select(&ix_sel, pos, index, n)?;
            *mla_sel = (index.sel, index.nsel, ix.top_k);
        }
        if let DSelect::Pooled(ix) = select {
            // GLM-5.3-Flash's k-pool indexer: keys, gates and pools, the
            // pools' top-k, their positions and the tail.
            let OwnPtrs::Pool(st) = own else {
                return Err(state_mismatch(il));
            };
            *mla_sel = self.pool_select(ix, st, pos, index, nb, kvt == 0, n)?;
        }
        kernels::MlaKvPrep {
            kva,
            norm: *kv_a_norm,
            pos,
            inv_freq: *inv_freq,
            k,
            v,
            kl,
            rope,
            eps,
        }
        .launch(self, rows_n(n))?;
        self.kv_store(kvt, k, v, kc, vc, pos, n, kdim, vdim)?;
        kernels::MlaQSplit {
            q,
            qn,
            nh: m.n_head as i32,
            nope,
            rope,
        }
        .launch(self, heads_grid)?;
        self.mv_rows(&[(k_b, qabs)], heads, qn)?;
        kernels::MlaQJoin {
            qabs,
            q,
            pos,
            inv_freq: *inv_freq,
            qatt,
            nh: m.n_head as i32,
            nope,
            rope,
            kl,
        }
        .launch(self, heads_grid)?;
        let sel = match select {
            DSelect::All => (0, 0, 0),
            DSelect::Indexer(_) | DSelect::Pooled(_) | DSelect::Previous => *mla_sel,
        };
        self.attention(kvt, qatt, kc, vc, att, pos, n, 0, sel)?;
        self.mv_rows(&[(v_b, ov)], heads, att)?;
        Ok((out, ov))
    }
}

/// What the absorbed MLA kernels refuse: a layer whose shapes differ from the plan's
/// latent view (one KV head of `[c | k_rope]`), a DSA indexer the kernels do not take. The
/// reason when not.
pub(crate) fn check(plan: &DecoderPlan) -> Result<(), String> {
    let sh = &plan.shape;
    for (il, l) in plan.layers.iter().enumerate() {
        let PlanAttn::Mla {
            w,
            shape: s,
            select,
        } = &l.attn
        else {
            continue;
        };
        if let MlaSelect::Indexer(ix) = select {
            let ok = ix.n_head > 0
                && ix.n_head * ix.head_dim <= IDX_MAX_Q
                && ix.head_dim >= s.rope
                && ix.top_k > 0
                && ix.k_norm.len() == ix.head_dim
                && ix.k_norm_bias.len() == ix.head_dim
                && (ix.q_b.rows, ix.q_b.cols) == (ix.n_head * ix.head_dim, s.q_lora)
                && (ix.k.rows, ix.proj.rows) == (ix.head_dim, ix.n_head)
                && (ix.k.cols, ix.proj.cols) == (plan.n_embd, plan.n_embd);
            if !ok {
                return Err(format!(
                    "layer {il}: a DSA indexer of {} heads of {} (top {}) the kernels do not take",
                    ix.n_head, ix.head_dim, ix.top_k
                ));
            }
        }
        // The kernels' view of the latent cache (one KV head of [c | k_rope], values c),
        // one shape for every MLA layer (the scratch buffers'), and the per-head
        // products' shapes.
        let ok = sh.n_head_kv == 1
            && plan.mla_shape() == Some(*s)
            && sh.n_head == s.n_head
            && sh.head_dim == s.row()
            && sh.head_dim_v == s.kv_lora
            && s.rope.is_multiple_of(2)
            && w.inv_freq.len() == s.rope / 2
            && (w.q_a.rows, w.q_b.rows, w.q_b.cols)
                == (s.q_lora, s.n_head * (s.nope + s.rope), s.q_lora)
            && (w.kv_a.rows, w.k_b.rows, w.k_b.cols) == (s.row(), s.n_head * s.kv_lora, s.nope)
            && (w.v_b.rows, w.v_b.cols, w.out.cols)
                == (s.n_head * s.v_dim, s.kv_lora, s.n_head * s.v_dim);
        if !ok {
            return Err(format!(
                "layer {il}: MLA shapes do not match the plan's ({} heads, kv_lora {}, nope {}, rope {}, v {})",
                s.n_head, s.kv_lora, s.nope, s.rope, s.v_dim
            ));
        }
    }
    Ok(())
}

impl Uploader<'_> {
    /// Upload an absorbed MLA layer (per-head `k_b` / `v_b` entries) and its selection
    /// (GLM's DSA indexer's weights).
    pub(crate) fn mla(
        &mut self,
        w: &MlaWeights,
        shape: &MlaShape,
        select: &MlaSelect,
    ) -> Result<Mla, String> {
        let nh = shape.n_head;
        let select = match select {
            MlaSelect::All => DSelect::All,
            MlaSelect::Previous => DSelect::Previous,
            MlaSelect::Indexer(ix) => DSelect::Indexer(Box::new(DDsa {
                n_head: ix.n_head,
                head_dim: ix.head_dim,
                top_k: ix.top_k,
                q_b: self.mat(&ix.q_b)?,
                k: self.mat(&ix.k)?,
                k_norm: self.norm(&ix.k_norm)?,
                k_norm_bias: self.norm(&ix.k_norm_bias)?,
                k_norm_eps: ix.k_norm_eps,
                proj: self.mat(&ix.proj)?,
            })),
        };
        Ok(Mla {
            select,
            q_a: self.mat(&w.q_a)?,
            q_a_norm: self.norm(&w.q_a_norm)?,
            q_b: self.mat(&w.q_b)?,
            kv_a: self.mat(&w.kv_a)?,
            kv_a_norm: self.norm(&w.kv_a_norm)?,
            k_b: self.heads(&w.k_b, nh)?,
            v_b: self.heads(&w.v_b, nh)?,
            out: self.mat(&w.out)?,
            inv_freq: self.norm(&w.inv_freq)?,
        })
    }
}
