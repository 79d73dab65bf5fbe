//! Grouped-query self-attention over a sequence's KV cache.
//!
//! Owns: projections, optional per-head q/k RMS norms, NEOX RoPE (cos/sin once per
//! position), appending K/V, and softmax(q K^T * scale) V with an optional sliding window.
//! The output projection is applied by the caller's block (`wo`).

use std::rc::Rc;
use std::sync::Mutex;

use sluice_kernels::attn::{self, Span};

use super::{Batch, Env};
use crate::kv::KvCache;
use crate::ops::{rms_norm_inplace, rope_cos_sin, rope_neox_cs, softmax};
use crate::weights::{Mat, Tensors};
use crate::ModelError;

/// Head layout of an attention layer.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub n_head: usize,
    pub n_head_kv: usize,
    /// Per-head size of queries and keys.
    pub head_dim: usize,
    /// Per-head size of values.
    pub head_dim_v: usize,
    /// Multiplier on q.k.
    pub scale: f32,
    pub rms_eps: f32,
}

/// The weights of one GQA attention layer.
#[derive(Debug, Clone)]
pub struct GqaWeights {
    /// `[n_head * head_dim, n_embd]`
    pub wq: Mat,
    /// `[n_head_kv * head_dim, n_embd]`
    pub wk: Mat,
    /// `[n_head_kv * head_dim_v, n_embd]`
    pub wv: Mat,
    /// `[n_embd, n_head * head_dim_v]`
    pub wo: Mat,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
}

impl GqaWeights {
    /// Layer `il`'s `attn_q/k/v/output` (+ optional `attn_q_norm`/`attn_k_norm`) for
    /// `shape` over `n_embd` columns, by their llama.cpp names.
    pub fn load(
        t: &Tensors<'_>,
        il: usize,
        shape: &AttnShape,
        n_embd: usize,
    ) -> Result<GqaWeights, ModelError> {
        let n = |s: &str| format!("blk.{il}.{s}.weight");
        let (nh, nkv, hd, hdv) = (
            shape.n_head,
            shape.n_head_kv,
            shape.head_dim,
            shape.head_dim_v,
        );
        Ok(GqaWeights {
            wq: t.mat(&n("attn_q"), nh * hd, n_embd)?,
            wk: t.mat(&n("attn_k"), nkv * hd, n_embd)?,
            wv: t.mat(&n("attn_v"), nkv * hdv, n_embd)?,
            wo: t.mat(&n("attn_output"), n_embd, nh * hdv)?,
            q_norm: t.opt_vec(&n("attn_q_norm"), hd)?,
            k_norm: t.opt_vec(&n("attn_k_norm"), hd)?,
        })
    }
}

impl AttnShape {
    /// A KV cache for `n_layer` layers of this shape and `n_ctx` positions.
    pub fn kv_cache(&self, n_layer: usize, n_ctx: usize) -> KvCache {
        KvCache::new(
            n_layer,
            self.n_head_kv * self.head_dim,
            self.n_head_kv * self.head_dim_v,
            n_ctx,
        )
    }
}

/// Attention of a chunk `h` (`[T, n_embd]`, already normed) for layer `il`: returns
/// `[T, n_embd]` after the output projection. `inv_freq` is the layer's RoPE table,
/// `window` its sliding window (None = global).
#[allow(clippy::too_many_arguments)]
pub fn gqa(
    env: &Env<'_>,
    batch: &Batch<'_>,
    kv: &mut KvCache,
    il: usize,
    w: &GqaWeights,
    shape: &AttnShape,
    inv_freq: &[f32],
    window: Option<usize>,
    h: &[f32],
) -> Result<Vec<f32>, ModelError> {
    let t_len = batch.len();
    let AttnShape {
        n_head: nh,
        n_head_kv: nkv,
        head_dim: hd,
        head_dim_v: hdv,
        scale,
        rms_eps,
    } = *shape;
    let [mut q, mut k, v] = env.linear_many([&w.wq, &w.wk, &w.wv], h, t_len)?;
    // Per token: q/k head norms and RoPE (cos/sin once per position and table, shared by
    // every layer with that table), q and k of a token in one task, tokens spread over the
    // compute pool in prefill.
    let cs_table = rope_table(&batch.positions, inv_freq);
    let cs: &[(f32, f32)] = &cs_table;
    let nf = inv_freq.len();
    let per_tok = t_len.div_ceil(sluice_kernels::pool::threads() * 4).max(4);
    let rows: Vec<Mutex<(&mut [f32], &mut [f32])>> = q
        .chunks_mut(per_tok * nh * hd)
        .zip(k.chunks_mut(per_tok * nkv * hd))
        .map(Mutex::new)
        .collect();
    let norm_rope = |x: &mut [f32], cs: &[(f32, f32)], norm: &Option<Vec<f32>>| {
        for head in x.chunks_mut(hd) {
            if let Some(w) = norm {
                rms_norm_inplace(head, w, rms_eps);
            }
            rope_neox_cs(head, cs);
        }
    };
    let run_rows = |c: usize| {
        let mut r = super::lock(&rows[c]);
        let (qs, ks) = &mut *r;
        for (i, (qt, kt)) in qs
            .chunks_mut(nh * hd)
            .zip(ks.chunks_mut(nkv * hd))
            .enumerate()
        {
            let t = c * per_tok + i;
            let cs = &cs[t * nf..(t + 1) * nf];
            norm_rope(qt, cs, &w.q_norm);
            norm_rope(kt, cs, &w.k_norm);
        }
    };
    if rows.len() == 1 {
        run_rows(0);
    } else {
        sluice_kernels::pool::run(rows.len(), &|_, c| run_rows(c));
    }
    drop(rows);
    kv.append(il, &k, &v);
    let (kc, vc) = kv.layer(il);
    let group = nh / nkv;
    super::give_buf(k);
    super::give_buf(v);
    let mut out = super::take_zeroed(t_len * nh * hdv);
    // Items: (position, kv head, run of `hpi` query heads of its group); a decode step
    // splits the group so every thread has work. Each head's sums run in a fixed order
    // (sluice_kernels::attn), so neither the split nor the thread count changes a bit.
    let threads = sluice_kernels::pool::threads();
    let mut hpi = group.max(1);
    while t_len * nkv * (group / hpi) < 2 * threads && hpi.is_multiple_of(2) {
        hpi /= 2;
    }
    let hg = group / hpi.max(1);
    let items = t_len * nkv * hg;
    let per = items.div_ceil(threads * 8).clamp(1, 16);
    let tasks: Vec<Mutex<&mut [f32]>> = out.chunks_mut(per * hpi * hdv).map(Mutex::new).collect();
    let err: Mutex<Option<sluice_kernels::KernelError>> = Mutex::new(None);
    sluice_kernels::pool::run(tasks.len(), &|_, c| {
        let mut o = super::lock(&tasks[c]);
        let mut scores: Vec<f32> = Vec::new();
        for (ii, o) in o.chunks_mut(hpi * hdv).enumerate() {
            let i = c * per + ii;
            let (t, g, hc) = (i / (nkv * hg), (i / hg) % nkv, i % hg);
            let head = g * group + hc * hpi;
            let pos = batch.positions[t];
            let lo = match window {
                None => 0,
                Some(win) => (pos + 1).saturating_sub(win),
            };
            let n = pos + 1 - lo;
            if n == 0 {
                continue; // an empty window attends to nothing: zeros
            }
            let qh = &q[(t * nh + head) * hd..(t * nh + head + hpi) * hd];
            scores.clear();
            scores.resize(hpi * n, 0.0);
            let span = |dim: usize| Span {
                heads: hpi,
                n,
                stride: nkv * dim,
            };
            let r = attn::scores(qh, &kc[(lo * nkv + g) * hd..], span(hd), scale, &mut scores)
                .and_then(|()| {
                    for row in scores.chunks_mut(n) {
                        softmax(row);
                    }
                    attn::weighted_sum(&scores, &vc[(lo * nkv + g) * hdv..], span(hdv), o)
                });
            if let Err(e) = r {
                super::lock(&err).get_or_insert(e);
            }
        }
    });
    drop(tasks);
    super::give_buf(q);
    if let Some(e) = err.into_inner().unwrap_or_else(|p| p.into_inner()) {
        return Err(e.into());
    }
    let y = env.linear(&w.wo, &out, t_len);
    super::give_buf(out);
    y
}

thread_local! {
    /// [`rope_table`]'s last tables: (inverse frequencies, positions, cos/sin rows).
    static ROPE_TABLES: std::cell::RefCell<Vec<RopeTable>> = const { std::cell::RefCell::new(Vec::new()) };
}

type RopeTable = (Vec<f32>, Vec<usize>, Rc<Vec<(f32, f32)>>);

/// `[T][inv_freq.len()]` cos/sin of every position of the batch ([`rope_cos_sin`] per
/// position), kept for the next calls with the same frequencies and positions: the layers
/// of one forward pass that share a RoPE table compute it once. Same values as computing
/// it each time (the key is the full input, not an identity).
fn rope_table(positions: &[usize], inv_freq: &[f32]) -> Rc<Vec<(f32, f32)>> {
    /// Tables kept (Gemma 3 has two per pass: global and sliding-window layers).
    const KEEP: usize = 4;
    ROPE_TABLES.with(|c| {
        let mut c = c.borrow_mut();
        if let Some(e) = c
            .iter()
            .find(|(f, p, _)| f.as_slice() == inv_freq && p.as_slice() == positions)
        {
            return e.2.clone();
        }
        let mut tab = Vec::with_capacity(positions.len() * inv_freq.len());
        let mut cs = Vec::with_capacity(inv_freq.len());
        for &p in positions {
            rope_cos_sin(p, inv_freq, &mut cs);
            tab.extend_from_slice(&cs);
        }
        let tab = Rc::new(tab);
        if c.len() >= KEEP {
            c.remove(0);
        }
        c.push((inv_freq.to_vec(), positions.to_vec(), tab.clone()));
        tab
    })
}

/// Plain f32 dot product in a fixed order (see [`sluice_kernels::attn::dot`]): the
/// thread count never changes a bit.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    attn::dot(a, b)
}
