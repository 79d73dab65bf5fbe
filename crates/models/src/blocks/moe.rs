//! Routed mixture of experts.
//!
//! Owns: the [`Router`] (how a token's experts and weights are chosen: softmax top-k,
//! biased sqrt-softplus / sigmoid scores, or a token-id hash table), recording the choice
//! in the routing trace, and running each expert the chunk needs once for all its tokens
//! through the [`sluice_tier::ExpertSource`], then summing every token's k weighted outputs
//! in slot order (so the order experts arrive in never changes a bit). Router lookahead:
//! during a single-token step, layer L's MoE input goes through layer L+1's router
//! ([`NextRouter`], linked at load by [`link_lookahead`]) and the predicted units are
//! handed to [`sluice_tier::ExpertSource::lookahead`] once layer L's own reads are issued;
//! the prediction only moves bytes, it never feeds a computation.

use std::borrow::Cow;

use sluice_kernels::GgmlType;
use sluice_tier::{Stop, UnitGroup, UnitLayer};

use super::ffn::Activation;
use super::{lock, Batch, Env};
use crate::compute::{LinearJob, UnitKey};
use crate::ops::{softmax, top_k};
use crate::threads;
use crate::weights::{Mat, Stacked};
use crate::ModelError;

/// How a MoE layer picks its experts.
#[derive(Debug, Clone)]
pub enum Router {
    /// Softmax over the router logits, top-k; weights renormalised to sum 1 if `norm`.
    Softmax { norm: bool },
    /// Scores `score(logit)`, top-k chosen on `score + bias` (the bias steers selection
    /// only), weights = the chosen scores, normalised to sum 1 if `norm`, times `scale`.
    Biased {
        score: ScoreFn,
        bias: Vec<f32>,
        norm: bool,
        scale: f32,
    },
    /// Experts fixed per token id (`table[token * k + slot]`), weights from `score` of the
    /// router logits of those experts, normalised if `norm`, times `scale`.
    Hash {
        table: Vec<u32>,
        score: ScoreFn,
        norm: bool,
        scale: f32,
    },
}

/// The score a biased or hashed router applies to a logit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScoreFn {
    Sigmoid,
    /// `sqrt(softplus(x))` (DeepSeek V4).
    SqrtSoftplus,
    Softmax,
}

impl ScoreFn {
    fn apply(self, logits: &[f32]) -> Vec<f32> {
        match self {
            ScoreFn::Sigmoid => logits.iter().map(|&x| 1.0 / (1.0 + (-x).exp())).collect(),
            ScoreFn::SqrtSoftplus => logits
                .iter()
                .map(|&x| {
                    let sp = if x > 20.0 { x } else { x.exp().ln_1p() };
                    sp.sqrt()
                })
                .collect(),
            ScoreFn::Softmax => {
                let mut p = logits.to_vec();
                softmax(&mut p);
                p
            }
        }
    }
}

impl Router {
    /// Every token's `k` experts and weights: (`chosen[t*k + slot]`, `weights[..]`).
    pub fn route(
        &self,
        logits: &[f32],
        tokens: &[u32],
        n_expert: usize,
        k: usize,
    ) -> Result<(Vec<usize>, Vec<f32>), ModelError> {
        let mut chosen = Vec::with_capacity(tokens.len() * k);
        let mut weights = Vec::with_capacity(tokens.len() * k);
        for (t, row) in logits.chunks(n_expert).enumerate() {
            let (sel, mut w, norm, scale) = match self {
                Router::Softmax { norm } => {
                    let mut probs = row.to_vec();
                    softmax(&mut probs);
                    let sel = top_k(&probs, k);
                    let w: Vec<f32> = sel.iter().map(|&i| probs[i]).collect();
                    (sel, w, *norm, 1.0)
                }
                Router::Biased {
                    score,
                    bias,
                    norm,
                    scale,
                } => {
                    let s = score.apply(row);
                    let biased: Vec<f32> = s.iter().zip(bias).map(|(a, b)| a + b).collect();
                    let sel = top_k(&biased, k);
                    let w: Vec<f32> = sel.iter().map(|&i| s[i]).collect();
                    (sel, w, *norm, *scale)
                }
                Router::Hash {
                    table,
                    score,
                    norm,
                    scale,
                } => {
                    let tok = tokens[t] as usize;
                    let ids =
                        table
                            .get(tok * k..(tok + 1) * k)
                            .ok_or(ModelError::TokenOutOfRange {
                                id: tokens[t],
                                n_vocab: table.len() / k.max(1),
                            })?;
                    let s = score.apply(row);
                    let sel: Vec<usize> = ids.iter().map(|&i| i as usize).collect();
                    if let Some(&bad) = sel.iter().find(|&&i| i >= n_expert) {
                        return Err(ModelError::Compute(format!(
                            "hash router table names expert {bad}; the layer has {n_expert}"
                        )));
                    }
                    let w: Vec<f32> = sel.iter().map(|&i| s[i]).collect();
                    (sel, w, *norm, *scale)
                }
            };
            if norm {
                let sum: f32 = w.iter().sum();
                w.iter_mut().for_each(|v| *v /= sum);
            }
            if scale != 1.0 {
                w.iter_mut().for_each(|v| *v *= scale);
            }
            chosen.extend_from_slice(&sel);
            weights.extend_from_slice(&w);
        }
        Ok((chosen, weights))
    }
}

/// One matrix of a routed expert: type and shape (its bytes come from the expert source).
#[derive(Debug, Clone, Copy)]
pub struct UnitMat {
    pub ty: GgmlType,
    pub rows: usize,
    pub cols: usize,
}

impl From<&Stacked> for UnitMat {
    /// The shape of one expert's slice of a stacked tensor.
    fn from(s: &Stacked) -> UnitMat {
        UnitMat {
            ty: s.ty,
            rows: s.rows,
            cols: s.cols,
        }
    }
}

/// A routed-experts layer: router weights and the shape of every expert's gate/up/down
/// (units' parts 0, 1, 2 in the streamable group).
#[derive(Debug, Clone)]
pub struct MoeWeights {
    /// `[n_expert, n_embd]`
    pub router_w: Mat,
    pub router: Router,
    pub n_expert: usize,
    pub k: usize,
    pub gate: UnitMat,
    pub up: UnitMat,
    pub down: UnitMat,
    pub act: Activation,
    /// The next MoE layer's router, for lookahead (set by [`link_lookahead`]; `None`:
    /// the last MoE layer, a hash-routed next layer, or not linked).
    pub next: Option<Box<NextRouter>>,
}

/// The router of the MoE layer after this one, applied to this layer's MoE input to guess
/// which of its units the next layer will pick (router lookahead).
#[derive(Debug, Clone)]
pub struct NextRouter {
    /// The next MoE layer's index.
    pub layer: usize,
    pub router_w: Mat,
    pub router: Router,
    pub n_expert: usize,
    pub k: usize,
    /// `w_next / w_this` per channel of the two layers' MoE input norms: turns this
    /// layer's normed input into the next norm applied to the same residual (channels
    /// where this layer's weight is 0 get 0).
    pub rescale: Option<Vec<f32>>,
}

/// Link every MoE layer to the next one's router for lookahead. `layers`: per MoE layer
/// in order, (layer index, its weights, the RMS-norm weights applied to its MoE input).
/// Hash-routed next layers are left out (their units are certain: `prefetch`).
pub fn link_lookahead<'a>(
    layers: impl IntoIterator<Item = (usize, &'a mut MoeWeights, &'a [f32])>,
) {
    let mut layers: Vec<(usize, &'a mut MoeWeights, &'a [f32])> = layers.into_iter().collect();
    for i in 0..layers.len() {
        let next = layers.get(i + 1).and_then(|(il, w, norm)| {
            if matches!(w.router, Router::Hash { .. }) {
                return None;
            }
            Some(NextRouter {
                layer: *il,
                router_w: w.router_w.clone(),
                router: w.router.clone(),
                n_expert: w.n_expert,
                k: w.k,
                rescale: Some(norm.to_vec()),
            })
        });
        let this_norm = layers[i].2;
        layers[i].1.next = next.map(|mut n| {
            n.rescale = n.rescale.map(|next_norm| {
                if next_norm.len() != this_norm.len() || next_norm == this_norm {
                    return Vec::new();
                }
                next_norm
                    .iter()
                    .zip(this_norm)
                    .map(|(&a, &b)| if b == 0.0 { 0.0 } else { a / b })
                    .collect()
            });
            if n.rescale.as_ref().is_some_and(Vec::is_empty) {
                n.rescale = None;
            }
            Box::new(n)
        });
    }
}

/// Tell the expert source which units of the next MoE layer its router would pick for
/// `h` (this layer's MoE input, one token). Never changes a result; errors only skip it.
fn predict_next(
    env: &Env<'_>,
    batch: &Batch<'_>,
    next: &NextRouter,
    h: &[f32],
) -> Option<Vec<usize>> {
    let x: Cow<'_, [f32]> = match &next.rescale {
        Some(r) => Cow::Owned(h.iter().zip(r).map(|(&a, &b)| a * b).collect()),
        None => Cow::Borrowed(h),
    };
    let logits = env.linear(&next.router_w, &x, 1).ok()?;
    // One token: k distinct units, most likely first (reads are issued in this order).
    let (chosen, _) = next
        .router
        .route(&logits, batch.tokens, next.n_expert, next.k)
        .ok()?;
    Some(chosen)
}

/// `--replay-routing`: every token's experts in layer `il` from the trace instead of the
/// router (`chosen[t*k + slot]`, router order). The router's weights stay: they only scale
/// outputs, which an IO benchmark never claims.
fn replay_choice(
    rb: &sluice_tier::ReplayBatch<'_>,
    il: usize,
    k: usize,
    chosen: &mut [usize],
) -> Result<(), ModelError> {
    for (t, sel) in chosen.chunks_mut(k).enumerate() {
        let ids = rb.ids(t, il).filter(|ids| ids.len() == k).ok_or_else(|| {
            ModelError::Compute(format!(
                "routing trace {}: no top-{k} experts for layer {il}",
                rb.replay.path().display()
            ))
        })?;
        for (c, &id) in sel.iter_mut().zip(ids) {
            *c = id as usize;
        }
    }
    Ok(())
}

/// Tensor names of a GLU expert unit's matrices, in the order [`routed`] reads them.
pub const GLU_UNIT_TENSORS: [&str; 3] = ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"];

/// The streamable unit layer of layer `il`'s stacked gate / up / down expert tensors.
/// The routed experts of a model as its one streamable group: `layers` gives each
/// decoder layer's experts (`None` for a dense layer), `mtp` the experts of the MTP
/// blocks (never run; described so they stream and stay on disk) at their own layer index.
pub fn expert_group<'a>(
    n_expert: usize,
    layers: impl IntoIterator<Item = Option<&'a [Stacked; 3]>>,
    mtp: impl IntoIterator<Item = &'a (usize, [Stacked; 3])>,
) -> UnitGroup {
    let mut out: Vec<Option<UnitLayer>> = layers
        .into_iter()
        .enumerate()
        .map(|(il, ex)| ex.map(|ex| glu_unit_layer(il, n_expert, ex)))
        .collect();
    for (il, ex) in mtp {
        out.resize(*il, None);
        out.push(Some(glu_unit_layer(*il, n_expert, ex)));
    }
    UnitGroup { layers: out }
}

pub fn glu_unit_layer(il: usize, n_units: usize, experts: &[Stacked; 3]) -> UnitLayer {
    UnitLayer {
        n_units,
        parts: experts
            .iter()
            .zip(GLU_UNIT_TENSORS)
            .map(|(s, n)| s.part(&format!("blk.{il}.{n}.weight")))
            .collect(),
    }
}

/// The identity of part `part` of expert `unit` in layer `il` (for backends that cache
/// experts by it).
fn unit_key(il: usize, unit: usize, part: u8) -> UnitKey {
    UnitKey {
        layer: il as u32,
        unit: unit as u32,
        part,
    }
}

thread_local! {
    /// [`routed`]'s output buffers (weighted slot outputs; gate, up and down outputs of a
    /// batch of experts), kept between calls on this thread: a prefill chunk's are
    /// megabytes per layer, which as fresh allocations were page faults and zeroing every
    /// layer (see [`sized`]).
    static MOE_SCRATCH: std::cell::RefCell<[Vec<f32>; 4]> = const {
        std::cell::RefCell::new([Vec::new(), Vec::new(), Vec::new(), Vec::new()])
    };
}

/// The first `len` values of `buf` (grown if shorter). They hold whatever the last call
/// left: every value a call reads is written by that call first (the grouped products
/// write every output row; every (token, slot) row of the slot outputs is written by the
/// one expert it chose), so old values never reach a result.
fn sized(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
    &mut buf[..len]
}

/// `buf` split into consecutive pieces of the given lengths.
fn split_pieces(mut buf: &mut [f32], lens: impl Iterator<Item = usize>) -> Vec<&mut [f32]> {
    let mut out = Vec::new();
    for n in lens {
        let (a, rest) = std::mem::take(&mut buf).split_at_mut(n);
        out.push(a);
        buf = rest;
    }
    out
}

/// Routed experts over a chunk `h` (`[T, E]`) of layer `il`.
pub fn routed(
    env: &Env<'_>,
    batch: &Batch<'_>,
    il: usize,
    w: &MoeWeights,
    h: &[f32],
) -> Result<Vec<f32>, ModelError> {
    let t_len = batch.len();
    let e = w.down.rows;
    let (k, ff) = (w.k, w.gate.rows);
    // Small steps (decode) stay on one thread: splitting them costs more than they take.
    let seq_len = if t_len * k < 64 { usize::MAX } else { 1 };
    let logits = env.linear(&w.router_w, h, t_len)?;
    let (mut chosen, weights) = w.router.route(&logits, batch.tokens, w.n_expert, k)?;
    if let Some(rb) = &env.replay {
        replay_choice(rb, il, k, &mut chosen)?;
    }
    if let Some(rec) = env.routing {
        let ids: Vec<u32> = chosen.iter().map(|&x| x as u32).collect();
        lock(rec)
            .record_layer(il as u32, &ids)
            .map_err(sluice_tier::StreamError::from)?;
    }
    // Which (token, slot) pairs use each expert.
    let mut users: Vec<Vec<usize>> = vec![Vec::new(); w.n_expert];
    for (ts, &ex) in chosen.iter().enumerate() {
        users[ex].push(ts);
    }
    let needed: Vec<usize> = (0..w.n_expert).filter(|&x| !users[x].is_empty()).collect();
    // Buffers taken from this thread's scratch (left empty there while in use, so a
    // nested call would allocate its own) and put back at the end.
    let mut scratch = MOE_SCRATCH.with(|c| std::mem::take(&mut *c.borrow_mut()));
    let [slot_buf, g_buf, u_buf, d_buf] = &mut scratch;
    // Router lookahead (decode): the next layer's likely units, handed over once this
    // layer's own reads are issued (its first batch), so they queue behind them.
    let mut ahead = match &w.next {
        Some(next) if t_len == 1 && env.replay.is_none() && env.experts.lookahead_enabled() => {
            predict_next(env, batch, next, h).map(|u| (next.layer, u))
        }
        _ => None,
    };
    // slot_out[(t * k + slot) * E ..]: weighted output of token t's slot-th expert.
    let slot_out = sized(slot_buf, t_len * k * e);
    let mut failed: Option<ModelError> = None;
    let compute = env.compute;
    // Every expert of a ready batch runs in one grouped pass for gate+up and one for down
    // (a backend schedules (expert, row block) tasks together), each expert on the tokens
    // that chose it.
    let mut run = |batch: &[(usize, sluice_tier::ExpertView<'_>)]| -> Result<(), ModelError> {
        let (gm, um, dm) = (&w.gate, &w.up, &w.down);
        let lists: Vec<&[usize]> = batch.iter().map(|&(i, _)| &users[needed[i]][..]).collect();
        // An expert with one token reads that token's row of `h` in place, so experts
        // sharing a token share one prepared (quantized) input; several tokens: gathered.
        let xs: Vec<Cow<'_, [f32]>> = threads::map(lists.len(), seq_len, |i| match lists[i] {
            [ts] => Cow::Borrowed(&h[ts / k * e..(ts / k + 1) * e]),
            ts_list => {
                let mut xs = Vec::with_capacity(ts_list.len() * e);
                for &ts in ts_list.iter() {
                    let t = ts / k;
                    xs.extend_from_slice(&h[t * e..(t + 1) * e]);
                }
                Cow::Owned(xs)
            }
        });
        let rows: usize = lists.iter().map(|l| l.len()).sum();
        let mut g = split_pieces(sized(g_buf, rows * ff), lists.iter().map(|l| l.len() * ff));
        let mut u = split_pieces(sized(u_buf, rows * ff), lists.iter().map(|l| l.len() * ff));
        let mut d = split_pieces(sized(d_buf, rows * e), lists.iter().map(|l| l.len() * e));
        {
            let mut jobs = Vec::with_capacity(2 * batch.len());
            for (((&(i, view), x), (gj, uj)), l) in batch
                .iter()
                .zip(&xs)
                .zip(g.iter_mut().zip(u.iter_mut()))
                .zip(&lists)
            {
                jobs.push(LinearJob {
                    ty: gm.ty,
                    w: view.part(0),
                    rows: gm.rows,
                    cols: gm.cols,
                    x,
                    n: l.len(),
                    y: &mut gj[..],
                    unit: Some(unit_key(il, needed[i], 0)),
                });
                jobs.push(LinearJob {
                    ty: um.ty,
                    w: view.part(1),
                    rows: um.rows,
                    cols: um.cols,
                    x,
                    n: l.len(),
                    y: &mut uj[..],
                    unit: Some(unit_key(il, needed[i], 1)),
                });
            }
            compute.linear_group(&mut jobs)?;
        }
        threads::for_each_chunk(&mut g, 1, seq_len, |i, gj| {
            for (a, &b) in gj[0].iter_mut().zip(u[i].iter()) {
                *a = w.act.glu(*a, b);
            }
        });
        {
            let mut jobs = Vec::with_capacity(batch.len());
            for (((&(i, view), gj), dj), l) in batch.iter().zip(&g).zip(d.iter_mut()).zip(&lists) {
                jobs.push(LinearJob {
                    ty: dm.ty,
                    w: view.part(2),
                    rows: dm.rows,
                    cols: dm.cols,
                    x: &gj[..],
                    n: l.len(),
                    y: &mut dj[..],
                    unit: Some(unit_key(il, needed[i], 2)),
                });
            }
            compute.linear_group(&mut jobs)?;
        }
        // (token, slot) -> (expert in this batch, its row): each slot_out row is written
        // by exactly one expert, so rows are filled in parallel.
        let mut src: Vec<Option<(usize, usize)>> = vec![None; t_len * k];
        for (bi, ts_list) in lists.iter().enumerate() {
            for (j, &ts) in ts_list.iter().enumerate() {
                src[ts] = Some((bi, j));
            }
        }
        threads::for_each_chunk(slot_out, e, seq_len, |ts, dst| {
            if let Some((bi, j)) = src[ts] {
                let wt = weights[ts];
                for (o, &v) in dst.iter_mut().zip(&d[bi][j * e..(j + 1) * e]) {
                    *o = v * wt;
                }
            }
        });
        Ok(())
    };
    let walked = env
        .experts
        .for_each_batch(env.map, il, &needed, &mut |batch| {
            if let Some((layer, units)) = ahead.take() {
                env.experts.lookahead(layer, &units);
            }
            run(batch).map_err(|e| {
                failed = Some(e);
                Stop
            })
        });
    if let Some(e) = failed {
        return Err(e);
    }
    walked?;
    let mut out = vec![0.0f32; t_len * e];
    let slot_out = &scratch[0];
    threads::for_each_chunk(&mut out, e, seq_len, |t, dst| {
        for slot in 0..k {
            let src = &slot_out[(t * k + slot) * e..(t * k + slot + 1) * e];
            dst.iter_mut().zip(src).for_each(|(a, &b)| *a += b);
        }
    });
    MOE_SCRATCH.with(|c| *c.borrow_mut() = scratch);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn softmax_router_picks_largest_and_renormalises() {
        let r = Router::Softmax { norm: true };
        let (c, w) = r.route(&[0.0, 2.0, 1.0, -1.0], &[5], 4, 2).unwrap();
        assert_eq!(c, vec![1, 2]);
        // softmax restricted to {2.0, 1.0}: e^1 / (e^1 + 1)
        let want = std::f32::consts::E / (std::f32::consts::E + 1.0);
        assert!((w[0] - want).abs() < 1e-6 && (w[0] + w[1] - 1.0).abs() < 1e-6);
    }

    #[test]
    fn bias_steers_selection_not_weights() {
        let r = Router::Biased {
            score: ScoreFn::Sigmoid,
            bias: vec![0.0, 0.0, 10.0],
            norm: false,
            scale: 2.0,
        };
        let (c, w) = r.route(&[3.0, 2.0, -3.0], &[0], 3, 1).unwrap();
        assert_eq!(c, vec![2]);
        let sig = 1.0 / (1.0 + 3.0f32.exp());
        assert!((w[0] - 2.0 * sig).abs() < 1e-6);
    }

    #[test]
    fn sqrt_softplus_scores() {
        let s = ScoreFn::SqrtSoftplus.apply(&[0.0, 30.0]);
        assert!((s[0] - 2.0f32.ln().sqrt()).abs() < 1e-6);
        assert!((s[1] - 30.0f32.sqrt()).abs() < 1e-5);
    }

    fn moe(router: Router) -> MoeWeights {
        let m = |rows, cols| UnitMat {
            ty: GgmlType::F32,
            rows,
            cols,
        };
        MoeWeights {
            router_w: Mat {
                ty: GgmlType::F32,
                rows: 4,
                cols: 2,
                range: 0..32,
            },
            router,
            n_expert: 4,
            k: 2,
            gate: m(3, 2),
            up: m(3, 2),
            down: m(2, 3),
            act: Activation::Silu,
            next: None,
        }
    }

    #[test]
    fn lookahead_links_each_moe_layer_to_the_next_router() {
        let hash = Router::Hash {
            table: vec![0, 1],
            score: ScoreFn::Softmax,
            norm: true,
            scale: 1.0,
        };
        let biased = Router::Biased {
            score: ScoreFn::Sigmoid,
            bias: vec![0.0, 1.0, 0.0, 0.0],
            norm: true,
            scale: 2.5,
        };
        let mut ls = [
            moe(Router::Softmax { norm: true }),
            moe(biased),
            moe(hash),
            moe(Router::Softmax { norm: false }),
        ];
        let norms = [
            vec![2.0, 0.0],
            vec![1.0, 3.0],
            vec![1.0, 1.0],
            vec![1.0, 1.0],
        ];
        // Layers 0, 2, 3, 5 are MoE layers (1 and 4 dense).
        let idx = [0, 2, 3, 5];
        link_lookahead(
            ls.iter_mut()
                .zip(&norms)
                .zip(idx)
                .map(|((m, n), il)| (il, m, &n[..])),
        );
        let n0 = ls[0].next.as_ref().expect("layer 0 -> layer 2");
        assert_eq!(n0.layer, 2);
        assert!(matches!(n0.router, Router::Biased { scale, .. } if scale == 2.5));
        // w_next / w_this, 0 where this layer's weight is 0.
        assert_eq!(n0.rescale.as_deref(), Some(&[0.5, 0.0][..]));
        assert!(ls[1].next.is_none(), "the next layer is hash-routed");
        let n2 = ls[2].next.as_ref().expect("layer 3 -> layer 5");
        assert_eq!(n2.layer, 5);
        assert!(n2.rescale.is_none(), "equal norms need no rescale");
        assert!(ls[3].next.is_none(), "the last MoE layer has no next");
    }

    #[test]
    fn hash_router_uses_token_table_and_checks_range() {
        let r = Router::Hash {
            table: vec![0, 1, 2, 3, 3, 0],
            score: ScoreFn::Softmax,
            norm: true,
            scale: 1.0,
        };
        let (c, w) = r.route(&[0.0; 8], &[1, 2], 4, 2).unwrap();
        assert_eq!(c, vec![2, 3, 3, 0]);
        assert!((w[0] - 0.5).abs() < 1e-6);
        assert!(r.route(&[0.0; 4], &[3], 4, 2).is_err());
    }
}
