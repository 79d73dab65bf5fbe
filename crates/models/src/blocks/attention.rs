//! Grouped-query self-attention over a sequence's KV cache.
//!
//! Owns: projections, optional per-head q/k RMS norms, NEOX RoPE (cos/sin once per
//! position), appending K/V, and softmax(q K^T * scale) V with an optional sliding window.
//! The output projection is applied by the caller's block (`wo`).

use std::sync::Mutex;

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
    let mut qkv = env.linear_many(&[&w.wq, &w.wk, &w.wv], h, t_len)?;
    let v = qkv.pop().expect("three outputs");
    let mut k = qkv.pop().expect("three outputs");
    let mut q = qkv.pop().expect("three outputs");
    // Per token: q/k head norms and RoPE (cos/sin once per position and pass), tokens
    // spread over the compute pool in prefill.
    let norm_rope = |x: &mut [f32], heads: usize, norm: &Option<Vec<f32>>| {
        crate::threads::for_each_chunk(x, heads * hd, 4, |t, xt| {
            let mut cs = Vec::with_capacity(inv_freq.len());
            rope_cos_sin(batch.positions[t], inv_freq, &mut cs);
            for head in xt.chunks_mut(hd) {
                if let Some(w) = norm {
                    rms_norm_inplace(head, w, rms_eps);
                }
                rope_neox_cs(head, &cs);
            }
        })
    };
    norm_rope(&mut q, nh, &w.q_norm);
    norm_rope(&mut k, nkv, &w.k_norm);
    kv.append(il, &k, &v);
    let (kc, vc) = kv.layer(il);
    let group = nh / nkv;
    let mut out = vec![0.0f32; t_len * nh * hdv];
    // (position, head) items in tasks of a few heads (one pool pass); each item's sums
    // run in a fixed order, so the thread count never changes a bit.
    let per = (t_len * nh)
        .div_ceil(sluice_kernels::pool::threads() * 4)
        .clamp(1, 16);
    let tasks: Vec<Mutex<&mut [f32]>> = out.chunks_mut(per * hdv).map(Mutex::new).collect();
    sluice_kernels::pool::run(tasks.len(), &|_, c| {
        let mut o = tasks[c].lock().unwrap_or_else(|p| p.into_inner());
        let mut scores: Vec<f32> = Vec::new();
        for (ii, o) in o.chunks_mut(hdv).enumerate() {
            let i = c * per + ii;
            let (t, head) = (i / nh, i % nh);
            let g = head / group;
            let pos = batch.positions[t];
            let lo = match window {
                None => 0,
                Some(win) => (pos + 1).saturating_sub(win),
            };
            let qh = &q[(t * nh + head) * hd..(t * nh + head + 1) * hd];
            scores.clear();
            scores.extend((lo..=pos).map(|j| {
                let kh = &kc[(j * nkv + g) * hd..(j * nkv + g + 1) * hd];
                dot(qh, kh) * scale
            }));
            softmax(&mut scores);
            for (j, &p) in (lo..=pos).zip(&scores) {
                let vh = &vc[(j * nkv + g) * hdv..(j * nkv + g + 1) * hdv];
                for (a, &b) in o.iter_mut().zip(vh) {
                    *a += p * b;
                }
            }
        }
    });
    drop(tasks);
    drop(q);
    env.linear(&w.wo, &out, t_len)
}

/// Plain f32 dot product, sequential (fixed order).
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent accumulators let the compiler vectorise without reassociating
    // across runs: the order is fixed by the code, not by the thread count.
    // chunks_exact keeps the bounds checks out of the loop so it becomes vector code.
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (ca, cb) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] += ca[l] * cb[l];
        }
    }
    let mut s = (acc[0] + acc[4]) + (acc[1] + acc[5]) + (acc[2] + acc[6]) + (acc[3] + acc[7]);
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}
