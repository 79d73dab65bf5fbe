//! QSA indexed attention (`qwen4exp` full-attention layers): gated GQA whose keys are
//! chosen per query by a lightweight indexer over pooled key blocks.
//!
//! Owns: the per-head interleaved `[q | gate]` projection, q/k RMS norms, partial NEOX RoPE
//! (first `n_rot` dims of a head), the indexer (its query heads, raw keys cached per
//! sequence, pooled block keys = RMS-normed mean of `ratio` raw keys roped at the block's
//! first position, computed once per complete block), the selection (top `budget / ratio`
//! blocks by `sum_h relu(q_h . K_b)`, ties to the lower block, plus the incomplete tail),
//! and softmax attention over the selected positions with the sigmoid output gate.
//! `ratio == 0` means dense causal attention (what llama.cpp runs for such a layer).

use rayon::prelude::*;

use super::attention::dot;
use super::{Batch, Env};
use crate::kv::KvCache;
use crate::ops::{rms_norm_inplace, rope_cos_sin, softmax, top_k};
use crate::weights::Mat;
use crate::ModelError;

/// Shape of a QSA layer.
#[derive(Debug, Clone, Copy)]
pub struct QsaShape {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    /// Rotated dims at the start of every head (attention and indexer).
    pub n_rot: usize,
    pub idx_heads: usize,
    pub idx_dim: usize,
    /// Token budget (`top_k` in the file): `budget / ratio` blocks are kept.
    pub budget: usize,
    /// Tokens per pooled block; 0 = dense attention.
    pub ratio: usize,
    pub rms_eps: f32,
}

/// The weights of one QSA layer.
#[derive(Debug, Clone)]
pub struct QsaWeights {
    /// `[n_head * 2 * head_dim, E]`: per head `[q | gate]`.
    pub wq: Mat,
    pub wk: Mat,
    pub wv: Mat,
    /// `[E, n_head * head_dim]`
    pub wo: Mat,
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
    /// `[idx_heads * idx_dim, E]`
    pub idx_q: Mat,
    /// `[idx_dim, E]`
    pub idx_k: Mat,
    pub idx_q_norm: Vec<f32>,
    pub idx_k_norm: Vec<f32>,
}

/// Per-sequence indexer state of one QSA layer.
#[derive(Debug, Clone, Default)]
pub struct QsaState {
    /// Raw indexer keys `[pos, idx_dim]` (no norm, no RoPE).
    pub raw: Vec<f32>,
    /// Pooled, normed, roped block keys `[block, idx_dim]` of every complete block.
    pub pooled: Vec<f32>,
}

impl QsaState {
    pub fn clear(&mut self) {
        self.raw.clear();
        self.pooled.clear();
    }
}

/// NEOX rotation of the first `2 * cs.len()` dims of `head`.
fn rope_partial(head: &mut [f32], cs: &[(f32, f32)]) {
    let half = cs.len();
    for (i, &(cos, sin)) in cs.iter().enumerate() {
        let a = head[i];
        let b = head[i + half];
        head[i] = a * cos - b * sin;
        head[i + half] = a * sin + b * cos;
    }
}

/// The positions query `pos` attends to (ascending), given its indexer query heads.
fn select(sh: &QsaShape, st: &QsaState, iq: &[f32], pos: usize) -> Vec<usize> {
    if sh.ratio == 0 {
        return (0..=pos).collect();
    }
    let r = sh.ratio;
    let nb = (pos + 1) / r;
    let keep = (sh.budget / r).min(nb);
    let mut blocks: Vec<usize> = if keep == nb {
        (0..nb).collect()
    } else {
        let d = sh.idx_dim;
        let scale = 1.0 / (d as f32).sqrt();
        let scores: Vec<f32> = (0..nb)
            .map(|b| {
                let kb = &st.pooled[b * d..(b + 1) * d];
                let s: f32 = iq.chunks(d).map(|q| dot(q, kb).max(0.0)).sum();
                s * scale
            })
            .collect();
        top_k(&scores, keep)
    };
    blocks.sort_unstable();
    let mut out: Vec<usize> = blocks.iter().flat_map(|&b| b * r..(b + 1) * r).collect();
    out.extend(nb * r..=pos);
    out
}

/// QSA attention of a chunk `h` (`[T, E]`) for layer `il`; returns `[T, E]`.
#[allow(clippy::too_many_arguments)]
pub fn qsa(
    env: &Env<'_>,
    batch: &Batch<'_>,
    kv: &mut KvCache,
    st: &mut QsaState,
    il: usize,
    w: &QsaWeights,
    sh: &QsaShape,
    inv_freq: &[f32],
    h: &[f32],
) -> Result<Vec<f32>, ModelError> {
    let t_len = batch.len();
    let (nh, nkv, hd, d) = (sh.n_head, sh.n_head_kv, sh.head_dim, sh.idx_dim);
    let [qg, mut k, v, mut iq, ik] =
        env.linear_many([&w.wq, &w.wk, &w.wv, &w.idx_q, &w.idx_k], h, t_len)?;
    let mut q = vec![0.0f32; t_len * nh * hd];
    let mut gate = vec![0.0f32; t_len * nh * hd];
    let mut cs = Vec::with_capacity(inv_freq.len());
    for t in 0..t_len {
        rope_cos_sin(batch.positions[t], inv_freq, &mut cs);
        for hh in 0..nh {
            let src = &qg[(t * nh + hh) * 2 * hd..(t * nh + hh + 1) * 2 * hd];
            let qh = &mut q[(t * nh + hh) * hd..(t * nh + hh + 1) * hd];
            qh.copy_from_slice(&src[..hd]);
            gate[(t * nh + hh) * hd..(t * nh + hh + 1) * hd].copy_from_slice(&src[hd..]);
            rms_norm_inplace(qh, &w.q_norm, sh.rms_eps);
            rope_partial(qh, &cs);
        }
        for kh in k[t * nkv * hd..(t + 1) * nkv * hd].chunks_mut(hd) {
            rms_norm_inplace(kh, &w.k_norm, sh.rms_eps);
            rope_partial(kh, &cs);
        }
        for qh in iq[t * sh.idx_heads * d..(t + 1) * sh.idx_heads * d].chunks_mut(d) {
            rms_norm_inplace(qh, &w.idx_q_norm, sh.rms_eps);
            rope_partial(qh, &cs);
        }
    }
    kv.append(il, &k, &v);
    let (kc, vc) = kv.layer(il);
    let group = nh / nkv;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0.0f32; t_len * nh * hd];
    for t in 0..t_len {
        let pos = batch.positions[t];
        // This token's raw key, then the block it completes (if any).
        st.raw.extend_from_slice(&ik[t * d..(t + 1) * d]);
        if sh.ratio > 0 && (pos + 1).is_multiple_of(sh.ratio) {
            let b = pos / sh.ratio;
            let start = b * sh.ratio;
            let mut pk = vec![0.0f32; d];
            for j in start..=pos {
                for (a, &x) in pk.iter_mut().zip(&st.raw[j * d..(j + 1) * d]) {
                    *a += x;
                }
            }
            pk.iter_mut().for_each(|x| *x /= sh.ratio as f32);
            rms_norm_inplace(&mut pk, &w.idx_k_norm, sh.rms_eps);
            rope_cos_sin(start, inv_freq, &mut cs);
            rope_partial(&mut pk, &cs);
            st.pooled.extend_from_slice(&pk);
        }
        let sel = select(
            sh,
            st,
            &iq[t * sh.idx_heads * d..(t + 1) * sh.idx_heads * d],
            pos,
        );
        out[t * nh * hd..(t + 1) * nh * hd]
            .par_chunks_mut(hd)
            .enumerate()
            .for_each(|(head, o)| {
                let g = head / group;
                let qh = &q[(t * nh + head) * hd..(t * nh + head + 1) * hd];
                let mut scores: Vec<f32> = sel
                    .iter()
                    .map(|&j| dot(qh, &kc[(j * nkv + g) * hd..(j * nkv + g + 1) * hd]) * scale)
                    .collect();
                softmax(&mut scores);
                for (&j, &p) in sel.iter().zip(&scores) {
                    let vh = &vc[(j * nkv + g) * hd..(j * nkv + g + 1) * hd];
                    for (a, &b) in o.iter_mut().zip(vh) {
                        *a += p * b;
                    }
                }
            });
    }
    for (o, &g) in out.iter_mut().zip(&gate) {
        *o *= 1.0 / (1.0 + (-g).exp());
    }
    env.linear(&w.wo, &out, t_len)
}
