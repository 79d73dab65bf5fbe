//! The CPU decoder: an architecture's [`DecoderPlan`] run with the CPU blocks, the one
//! forward pass every architecture takes on the CPU.
//!
//! Owns: [`CpuDecoder`] (the token embedding; per layer the PLE layer, each half's input -
//! the residual, its hyper-connection mix or its low-rank mixer -, its norm, the attention
//! kind or the dense / routed feed-forward with the (gated) shared expert, the post-norm and
//! the residual update; the head) and [`CpuState`], the per-sequence state of the plan's
//! stateful layers, kept in `SeqState::extra`: MLA latent rows and DSA indexer keys by
//! position; DeepSeek V4, KDA, pooled, DeltaNet, QSA and PLE state, which only continue or
//! restart at 0. Half-block inputs and outputs go back to the blocks' per-thread spares
//! (`blocks::take_buf` / `give_buf`), so a layer reuses the memory the previous one touched.
//! Routed layers keep the plan's router-lookahead link (`MoeWeights::next`, applied by
//! `blocks::moe::routed` in decode); the hash-routed layers' certain units are prefetched
//! by `Model::forward` (`Architecture::certain_units`) before the call.

use crate::blocks::deltanet::DeltaState;
use crate::blocks::dsa_indexer::IndexerState;
use crate::blocks::dsv4_attention::LayerState;
use crate::blocks::kda::KdaState;
use crate::blocks::mla::MlaState;
use crate::blocks::mla_pooled::{PooledState, Selection};
use crate::blocks::ple::PleState;
use crate::blocks::qsa::QsaState;
use crate::blocks::{give_buf, take_buf, Batch, Env};
use crate::kv::KvCache;
use crate::plan::{DecoderPlan, HyperHead, MlaSelect, PlanAttn, PlanFfn, PlanLayer};
use crate::state::{ExtraState, SeqState};
use crate::state_codec::{Dec, DecodeError, Enc};
use crate::ModelError;

/// How a half-block's output goes back into the residual.
enum Mix {
    Plain,
    Manifold(crate::blocks::hyper::HcMix),
    /// The low-rank mixer's per-stream injection weights.
    LowRank(Vec<f32>),
}

/// A [`DecoderPlan`] evaluated with the CPU blocks: the CPU's forward pass of every
/// architecture (`Model::forward` without a device backend), and the reference a device
/// backend's logits are held to.
pub struct CpuDecoder {
    plan: DecoderPlan,
}

impl CpuDecoder {
    pub fn new(plan: DecoderPlan) -> CpuDecoder {
        CpuDecoder { plan }
    }

    /// The plan this decoder runs.
    pub fn plan(&self) -> &DecoderPlan {
        &self.plan
    }

    /// A fresh [`CpuState`] for a sequence, when the plan has stateful layers (MLA,
    /// DeepSeek V4, KDA, pooled, DeltaNet, QSA, PLE); None when the KV cache is all a
    /// sequence needs.
    pub fn new_state(&self) -> Option<Box<dyn ExtraState>> {
        let p = &self.plan;
        let sequential = p.layers.iter().any(|l| l.attn.sequential());
        if !sequential && p.mla_shape().is_none() {
            return None;
        }
        Some(Box::new(CpuState {
            mla: vec![MlaState::default(); p.layers.len()],
            index: vec![IndexerState::default(); p.layers.len()],
            dsv4: vec![LayerState::default(); p.layers.len()],
            kda: p
                .layers
                .iter()
                .map(|l| match &l.attn {
                    PlanAttn::Kda { shape, .. } => Some(KdaState::new(shape)),
                    _ => None,
                })
                .collect(),
            pooled: vec![PooledState::default(); p.layers.len()],
            delta: p
                .layers
                .iter()
                .map(|l| match &l.attn {
                    PlanAttn::Delta { shape, .. } => Some(DeltaState::new(shape)),
                    _ => None,
                })
                .collect(),
            qsa: vec![QsaState::default(); p.layers.len()],
            ple: match (&p.ple, p.layers.iter().find_map(|l| l.ple.as_deref())) {
                (Some(pp), Some(w)) => {
                    let streams = p.lowrank.as_ref().map_or(1, |lr| lr.n_stream);
                    Some((PleState::new(&pp.hash, w, streams * p.n_embd), pp.hash.eos))
                }
                _ => None,
            },
            next: 0,
        }))
    }

    /// Evaluate `batch` (whose positions continue `state`), update `state` (the caller
    /// advances its length afterwards) and return the logits of `rows` (indices into the
    /// batch; `[rows.len(), n_vocab]`).
    pub fn forward(
        &self,
        env: &Env<'_>,
        batch: &Batch<'_>,
        state: &mut SeqState,
        rows: &[usize],
    ) -> Result<Vec<f32>, ModelError> {
        let SeqState { kv, extra, .. } = state;
        self.run(env, batch, kv, extra, rows)
    }

    /// The forward pass with the sequence's stateful layers in `slot` (created there on
    /// first use).
    fn run(
        &self,
        env: &Env<'_>,
        batch: &Batch<'_>,
        kv: &mut KvCache,
        slot: &mut Option<Box<dyn ExtraState>>,
        rows: &[usize],
    ) -> Result<Vec<f32>, ModelError> {
        use crate::blocks::{
            add_into, check_finite, gather_rows, head, hyper, hyper_lowrank, ple, rms_norm_rows,
            Stage,
        };
        let p = &self.plan;
        let eps = p.shape.rms_eps;
        let e = p.n_embd;
        p.check_length(&batch.positions)?;
        let pos0 = batch.positions.first().copied().unwrap_or(0);
        // MLA, DeepSeek V4, KDA, pooled, DeltaNet, QSA and PLE layers keep their state in
        // `slot` (for all but QSA the KV cache only counts positions).
        let sequential = p.layers.iter().any(|l| l.attn.sequential());
        if slot.is_none() {
            *slot = self.new_state();
        }
        if sequential {
            // Recurrent states, windows and compressor carries cannot be cut back to a
            // position: a sequence continues where it stopped, or starts again at 0.
            let st = crate::state::extra_as::<CpuState>(slot, p.arch)?;
            if pos0 == 0 {
                st.clear_sequential();
            } else if st.next == usize::MAX {
                return Err(ModelError::Compute(format!(
                    "{}: an earlier call failed part way, so the plan's attention state holds no whole position; the sequence must start again at 0",
                    p.arch
                )));
            } else if pos0 != st.next {
                return Err(ModelError::Compute(format!(
                    "{}: the plan's attention state holds {} positions, the batch starts at {pos0} (it cannot be truncated)",
                    p.arch, st.next
                )));
            }
            // Until this batch has run through every layer the state is no position's: a
            // failed call leaves it so, and only a restart at 0 continues.
            st.next = usize::MAX;
        }
        let f16 = kv.f16();
        let emb = head::embed(env, &p.embd, batch, p.embd_scale)?;
        check_finite(&emb, e, &batch.positions, Stage::Embedding)?;
        // The residual: one stream per position, or `n_hc` copies of the embedding.
        let n_hc = match (&p.hyper, &p.lowrank) {
            (Some(h), _) => h.shape.n_hc,
            (None, Some(lr)) => lr.n_stream,
            (None, None) => 1,
        };
        // The PLE rows depend only on the token ids: hinted before any layer runs.
        let mut ple_ids: Option<(Vec<u64>, usize)> = None;
        if let Some(pp) = &p.ple {
            let st = crate::state::extra_as::<CpuState>(slot, p.arch)?;
            if let Some((ps, _)) = &mut st.ple {
                let (ids, ctx) = pp.hash.rows(&ps.ctx, batch.tokens);
                pp.rows.prefetch(&ids);
                ps.ctx = ctx;
                ple_ids = Some((ids, e / pp.hash.n_heads()));
            }
        }
        let mut x = if n_hc == 1 {
            emb
        } else {
            emb.chunks(e).flat_map(|row| row.repeat(n_hc)).collect()
        };
        // A half-block's input: the residual, or its hyper-connection mix (kept for `put`).
        let t_len = batch.len();
        let take = |x: &[f32], l: &PlanLayer, half: usize| -> Result<_, ModelError> {
            let w = l.hc.as_deref().map(|w| &w[half]);
            let lw = l.hc_lowrank.as_deref().map(|w| &w[half]);
            match (w, &p.hyper, lw, &p.lowrank) {
                (None, None, None, None) => {
                    let mut h = take_buf(x.len());
                    h.copy_from_slice(x);
                    Ok((h, Mix::Plain))
                }
                (Some(w), Some(h), None, None) => {
                    let mut m = hyper::pre(env, w, &h.shape, x)?;
                    Ok((std::mem::take(&mut m.input), Mix::Manifold(m)))
                }
                (None, None, Some(w), Some(lr)) => {
                    let (m, inj) = hyper_lowrank::hc_pre(env, w, lr.n_stream, e, eps, x, t_len)?;
                    let inj = inj.ok_or_else(|| {
                        ModelError::Compute(format!(
                            "{}: a block's low-rank mixer has no injection weights",
                            p.arch
                        ))
                    })?;
                    Ok((m, Mix::LowRank(inj)))
                }
                _ => Err(ModelError::Compute(format!(
                    "{}: a layer's hyper-connections do not match the plan's",
                    p.arch
                ))),
            }
        };
        // Put a half-block's output back: `x += y`, or the hyper-connection update.
        let put = |x: &mut [f32], y: &[f32], mix: Mix| match (mix, &p.hyper) {
            (Mix::Manifold(m), Some(h)) => hyper::post(x, y, &m, &h.shape),
            (Mix::LowRank(inj), _) => hyper_lowrank::hc_post(x, &inj, y, n_hc, e),
            _ => add_into(x, y),
        };
        // An RMS norm, unless the plan's low-rank mixers normalise (empty weights).
        let norm = |h: &mut [f32], w: &[f32]| {
            if !w.is_empty() {
                rms_norm_rows(h, w, eps);
            }
        };
        let mut sel = Selections::default();
        for (il, l) in p.layers.iter().enumerate() {
            if let (Some(pw), Some((ids, width)), Some(pp)) = (&l.ple, &ple_ids, &p.ple) {
                let st = crate::state::extra_as::<CpuState>(slot, p.arch)?;
                let Some((ps, _)) = &mut st.ple else {
                    return Err(ModelError::Compute(format!("{}: no PLE state", p.arch)));
                };
                let mut emb = vec![0.0f32; ids.len() * width];
                pp.rows.gather(env.map, ids, &mut emb)?;
                ple::ple_apply(env, pw, ps, n_hc, e, eps, &emb, &mut x, t_len)?;
            }
            let (mut h, mix) = take(&x, l, 0)?;
            norm(&mut h, &l.attn_norm);
            let mut o = self.attention(env, batch, kv, slot, il, &l.attn, &h, &mut sel, f16)?;
            if let Some(w) = &l.post_attn_norm {
                rms_norm_rows(&mut o, w, eps);
            }
            put(&mut x, &o, mix);
            give_buf(o);
            give_buf(h);
            let (mut h, mix) = take(&x, l, 1)?;
            norm(&mut h, &l.ffn_norm);
            let mut f = feed_forward(env, batch, il, &l.ffn, &h, e)?;
            if let Some(w) = &l.post_ffn_norm {
                rms_norm_rows(&mut f, w, eps);
            }
            give_buf(h);
            put(&mut x, &f, mix);
            give_buf(f);
            check_finite(&x, n_hc * e, &batch.positions, Stage::Layer(il))?;
        }
        let logits = match (&p.hyper, &p.lowrank) {
            (None, Some(lr)) => {
                // The output mixer in place of the output norm, then the head.
                let sel = gather_rows(&x, rows, n_hc * e);
                let (m, _) = hyper_lowrank::hc_pre(env, &lr.head, n_hc, e, eps, &sel, rows.len())?;
                env.linear(&p.output, &m, rows.len())?
            }
            (None, None) => head::logits(env, &x, rows, &p.output_norm, eps, &p.output)?,
            (Some(h), _) => {
                let sel = gather_rows(&x, rows, n_hc * e);
                let collapsed = match &h.head {
                    HyperHead::Learned(w) => hyper::head(env, w, &h.shape, &sel)?,
                    HyperHead::Mean => hyper::mean(&sel, n_hc, e),
                };
                let all: Vec<usize> = (0..rows.len()).collect();
                head::logits(env, &collapsed, &all, &p.output_norm, eps, &p.output)?
            }
        };
        head::check_logits(&logits, rows, batch)?;
        if sequential {
            let st = crate::state::extra_as::<CpuState>(slot, p.arch)?;
            st.next = pos0 + batch.len();
        }
        Ok(logits)
    }

    /// The attention half of layer `il` (`a`) on its normed input `h`, its state in
    /// `slot`; `sel` carries the selections later layers reuse.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        env: &Env<'_>,
        batch: &Batch<'_>,
        kv: &mut KvCache,
        slot: &mut Option<Box<dyn ExtraState>>,
        il: usize,
        a: &PlanAttn,
        h: &[f32],
        sel: &mut Selections,
        f16: bool,
    ) -> Result<Vec<f32>, ModelError> {
        use crate::blocks::attention::gqa;
        use crate::blocks::{deltanet, dsa_indexer, dsv4_attention, kda, mla, mla_pooled, qsa};
        let p = &self.plan;
        let pos0 = batch.positions.first().copied().unwrap_or(0);
        let t_len = batch.len();
        Ok(match a {
            PlanAttn::Gqa {
                w,
                inv_freq,
                window,
            } => gqa(env, batch, kv, il, w, &p.shape, inv_freq, *window, h)?,
            PlanAttn::Mla {
                w,
                shape: s,
                select,
            } => {
                let st = crate::state::extra_as::<CpuState>(slot, p.arch)?;
                // The rows are indexed by position: those at or past the batch's start
                // are not this sequence's any more.
                st.mla[il].rows.truncate(pos0 * s.row());
                let qr = mla::query_residual(env, w, s, h, batch.len())?;
                if let MlaSelect::Indexer(ix) = select {
                    st.index[il].keys.truncate(pos0 * ix.head_dim);
                    sel.mla = dsa_indexer::select(
                        env,
                        batch,
                        ix,
                        &w.inv_freq,
                        &mut st.index[il],
                        h,
                        &qr,
                    )?;
                }
                let chosen = match select {
                    MlaSelect::All => None,
                    MlaSelect::Indexer(_) | MlaSelect::Previous => Some(&sel.mla[..]),
                };
                mla::attention(env, batch, w, s, &mut st.mla[il], h, &qr, chosen, f16)?
            }
            PlanAttn::Dsv4 { w, shape: s } => {
                let st = crate::state::extra_as::<CpuState>(slot, p.arch)?;
                dsv4_attention::attention(env, batch, w, s, &mut st.dsv4[il], h, f16)?
            }
            PlanAttn::Kda { w, shape: s } => {
                let st = crate::state::extra_as::<CpuState>(slot, p.arch)?;
                let ks = st.kda[il].as_mut().ok_or_else(|| {
                    ModelError::Compute(format!("{}: layer {il} has no KDA state", p.arch))
                })?;
                kda::kda(env, w, s, ks, h, batch.len())?
            }
            PlanAttn::Pooled { w, shape: s } => {
                let st = crate::state::extra_as::<CpuState>(slot, p.arch)?;
                let (y, picked) = mla_pooled::pooled_attention(
                    env,
                    w,
                    s,
                    &mut st.pooled[il],
                    &batch.positions,
                    h,
                    sel.pooled.as_ref(),
                    f16,
                )?;
                sel.pooled = Some(picked);
                y
            }
            PlanAttn::Delta { w, shape: s } => {
                let st = crate::state::extra_as::<CpuState>(slot, p.arch)?;
                let ds = st.delta[il].as_mut().ok_or_else(|| {
                    ModelError::Compute(format!("{}: layer {il} has no DeltaNet state", p.arch))
                })?;
                deltanet::delta_net(env, w, s, ds, h, t_len)?
            }
            PlanAttn::Qsa {
                w,
                shape: s,
                inv_freq,
            } => {
                let st = crate::state::extra_as::<CpuState>(slot, p.arch)?;
                qsa::qsa(env, batch, kv, &mut st.qsa[il], il, w, s, inv_freq, h)?
            }
        })
    }
}

/// The feed-forward half of layer `il` on its normed input `h` (`e` wide rows): dense GLU,
/// or the routed experts plus the shared expert (sigmoid-gated when the plan says so).
fn feed_forward(
    env: &Env<'_>,
    batch: &Batch<'_>,
    il: usize,
    ffn: &PlanFfn,
    h: &[f32],
    e: usize,
) -> Result<Vec<f32>, ModelError> {
    use crate::blocks::moe::routed;
    use crate::blocks::{add_gated, add_into, ffn};
    let t_len = batch.len();
    Ok(match ffn {
        PlanFfn::Dense { w, act } => ffn::glu(env, w, *act, h, batch.len())?,
        PlanFfn::Moe { moe, shared, .. } => {
            let mut y = routed(env, batch, il, moe, h)?;
            if let Some(sh) = shared {
                let out = ffn::glu(env, &sh.w, sh.act, h, batch.len())?;
                match &sh.gate {
                    None => add_into(&mut y, &out),
                    // y += sigmoid(gate . h) * shared, per token.
                    Some(g) => {
                        let gv = env.linear(g, h, t_len)?;
                        add_gated(&mut y, &out, &gv, e);
                        give_buf(gv);
                    }
                }
                give_buf(out);
            }
            y
        }
    })
}

/// The selections a layer hands to later ones: the previous full pooled layer's (a shared
/// layer reuses it) and the most recent MLA indexer's (per token; empty: every position).
#[derive(Default)]
struct Selections {
    pooled: Option<Selection>,
    mla: Vec<Option<Vec<usize>>>,
}

/// [`CpuDecoder`]'s per-sequence state (in `SeqState::extra`): MLA layers' rows by
/// position (rows at or past a batch's first position are dropped before it runs);
/// DeepSeek V4 layers' windows and compressor state, KDA layers' recurrent state and
/// pooled layers' rows, which only continue at `next` or start again at position 0.
#[derive(Clone, Default)]
pub struct CpuState {
    mla: Vec<MlaState>,
    /// The DSA indexer keys of MLA layers with their own indexer.
    index: Vec<IndexerState>,
    dsv4: Vec<LayerState>,
    kda: Vec<Option<KdaState>>,
    pooled: Vec<PooledState>,
    delta: Vec<Option<DeltaState>>,
    qsa: Vec<QsaState>,
    /// The PLE layer's token context and convolution history, and the hash's EOS id.
    ple: Option<(PleState, u32)>,
    next: usize,
}

impl CpuState {
    fn clear_sequential(&mut self) {
        self.dsv4.iter_mut().for_each(LayerState::clear);
        self.kda.iter_mut().flatten().for_each(KdaState::clear);
        self.pooled.iter_mut().for_each(PooledState::clear);
        self.delta.iter_mut().flatten().for_each(DeltaState::clear);
        self.qsa.iter_mut().for_each(QsaState::clear);
        if let Some((ps, eos)) = &mut self.ple {
            ps.clear(*eos);
        }
        self.next = 0;
    }
}

impl CpuState {
    /// Every f32 array of every layer, in the snapshot byte form's order. Keep in step
    /// with [`CpuState::arrays_mut`] (the round-trip test compares the two).
    fn arrays(&self) -> Vec<&Vec<f32>> {
        let mut a: Vec<&Vec<f32>> = Vec::new();
        a.extend(self.mla.iter().map(|m| &m.rows));
        a.extend(self.index.iter().map(|i| &i.keys));
        self.dsv4.iter().for_each(|l| a.extend(l.arrays()));
        self.kda
            .iter()
            .flatten()
            .for_each(|k| a.extend([&k.conv, &k.s]));
        self.pooled.iter().for_each(|p| a.extend(p.arrays()));
        self.delta
            .iter()
            .flatten()
            .for_each(|d| a.extend([&d.conv, &d.s]));
        self.qsa.iter().for_each(|q| a.extend([&q.raw, &q.pooled]));
        if let Some((ps, _)) = &self.ple {
            a.push(&ps.hist);
        }
        a
    }

    /// [`CpuState::arrays`], writable.
    fn arrays_mut(&mut self) -> Vec<&mut Vec<f32>> {
        let mut a: Vec<&mut Vec<f32>> = Vec::new();
        a.extend(self.mla.iter_mut().map(|m| &mut m.rows));
        a.extend(self.index.iter_mut().map(|i| &mut i.keys));
        self.dsv4.iter_mut().for_each(|l| a.extend(l.arrays_mut()));
        self.kda
            .iter_mut()
            .flatten()
            .for_each(|k| a.extend([&mut k.conv, &mut k.s]));
        self.pooled
            .iter_mut()
            .for_each(|p| a.extend(p.arrays_mut()));
        self.delta
            .iter_mut()
            .flatten()
            .for_each(|d| a.extend([&mut d.conv, &mut d.s]));
        self.qsa
            .iter_mut()
            .for_each(|q| a.extend([&mut q.raw, &mut q.pooled]));
        if let Some((ps, _)) = &mut self.ple {
            a.push(&mut ps.hist);
        }
        a
    }
}

impl ExtraState for CpuState {
    fn clone_box(&self) -> Box<dyn ExtraState> {
        Box::new(self.clone())
    }
    fn clear(&mut self) {
        self.mla.iter_mut().for_each(MlaState::clear);
        self.index.iter_mut().for_each(IndexerState::clear);
        self.clear_sequential();
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
    fn encode(&self, e: &mut Enc<'_>) -> bool {
        let arrays = self.arrays();
        e.u64(arrays.len() as u64);
        arrays.into_iter().for_each(|a| e.f32s(a));
        match &self.ple {
            Some((ps, _)) => {
                e.u8(1);
                e.u32s(&ps.ctx);
            }
            None => e.u8(0),
        }
        e.u64(self.next as u64);
        true
    }
    fn decode(&mut self, d: &mut Dec<'_>) -> Result<(), DecodeError> {
        let n = d.u64("state arrays")?;
        let mut arrays = self.arrays_mut();
        if n != arrays.len() as u64 {
            return Err(DecodeError(format!(
                "{n} state arrays, this model's state has {}",
                arrays.len()
            )));
        }
        for (i, a) in arrays.iter_mut().enumerate() {
            d.f32s_into(a, &format!("state array {i}"))?;
        }
        let has_ple = d.u8("PLE state")? != 0;
        match (&mut self.ple, has_ple) {
            (Some((ps, _)), true) => {
                let ctx = d.u32s("PLE token context")?;
                if ctx.len() != ps.ctx.len() {
                    return Err(DecodeError(format!(
                        "PLE token context of {}, this model's is {}",
                        ctx.len(),
                        ps.ctx.len()
                    )));
                }
                ps.ctx = ctx;
            }
            (None, false) => {}
            _ => {
                return Err(DecodeError(
                    "PLE state present in one of the two only".into(),
                ))
            }
        }
        self.next = d.u64("next position")? as usize;
        Ok(())
    }
}
