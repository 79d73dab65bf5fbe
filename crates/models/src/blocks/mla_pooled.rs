//! Latent (MLA) attention without RoPE, restricted by a pooled sparse indexer (the DSA
//! layers of GLM-5.3-Flash, `glm5next`).
//!
//! Owns: the q-LoRA query, the normed key/value latent (one `kv_lora` row per token, the
//! whole cache row), attention in absorbed form (`q_abs[h] = W_kb[h]^T q[h]`, scores against
//! the latents, `o[h] = W_vb[h] sum_s p_s c_s`), the k-pool indexer (LayerNorm'd indexer
//! keys and gate logits per token; every `kpool` tokens counted from the sequence's first
//! one are pooled by a per-channel softmax over the pool's slots plus `ape`; a query scores
//! the complete visible pools `sum_h w_h relu(q_h . P_b / sqrt(d))`, keeps the best
//! `top_k / kpool` and always adds the incomplete tail), and the per-sequence state
//! ([`PooledState`]: latents, indexer keys, gate logits, pooled keys).
//!
//! Selection ties go to the lower pool (a fixed rule: logits never depend on chunking). A
//! query with at most `top_k / kpool` complete visible pools attends to every earlier token
//! (the dense regime). Specification: ../shared/models/glm5.md section 2.B.

use rayon::prelude::*;

use super::Env;
use crate::ops::{rms_norm_inplace, softmax, top_k};
use crate::weights::{Mat, Stacked};
use crate::ModelError;

/// Shape of a pooled-DSA latent-attention layer.
#[derive(Debug, Clone, Copy)]
pub struct PooledShape {
    pub n_head: usize,
    pub q_lora: usize,
    pub kv_lora: usize,
    /// Query/key head width (no RoPE part).
    pub head_k: usize,
    pub head_v: usize,
    pub rms_eps: f32,
    pub idx_heads: usize,
    pub idx_dim: usize,
    pub top_k: usize,
    pub kpool: usize,
    pub select_tail: bool,
    /// Epsilon of the indexer key LayerNorm.
    pub ln_eps: f32,
}

impl PooledShape {
    /// Pools a query keeps.
    pub fn pools_kept(&self) -> usize {
        self.top_k / self.kpool
    }

    /// f32 bytes of state per position (latent, indexer key and gate, pooled share).
    pub fn bytes_per_pos(&self) -> usize {
        4 * (self.kv_lora + 2 * self.idx_dim + self.idx_dim / self.kpool.max(1))
    }
}

/// The indexer of a "full" layer.
#[derive(Debug, Clone)]
pub struct PooledIndexer {
    /// `[idx_heads * idx_dim, q_lora]`
    pub q_b: Mat,
    /// `[idx_dim, E]`
    pub k: Mat,
    pub k_norm: Vec<f32>,
    pub k_norm_b: Vec<f32>,
    /// `[idx_heads, E]`
    pub proj: Mat,
    /// `[idx_dim, E]`
    pub gate: Mat,
    /// `[kpool * idx_dim]`, slot-major.
    pub ape: Vec<f32>,
}

/// The weights of one layer.
#[derive(Debug, Clone)]
pub struct PooledWeights {
    /// `[q_lora, E]`
    pub q_a: Mat,
    pub q_a_norm: Vec<f32>,
    /// `[n_head * head_k, q_lora]`
    pub q_b: Mat,
    /// `[kv_lora, E]`
    pub kv_a: Mat,
    pub kv_a_norm: Vec<f32>,
    /// Per head `[kv_lora, head_k]` (`attn_k_b`, ggml `[head_k, kv_lora, n_head]`).
    pub k_b: Stacked,
    /// Per head `[head_v, kv_lora]` (`attn_v_b`, ggml `[kv_lora, head_v, n_head]`).
    pub v_b: Stacked,
    /// `[E, n_head * head_v]`
    pub out: Mat,
    /// None on a "shared" layer (it reuses the previous full layer's selection).
    pub indexer: Option<PooledIndexer>,
}

/// Per-sequence state of one layer, one row per position (positions 0, 1, ...).
#[derive(Debug, Clone, Default)]
pub struct PooledState {
    /// `[pos, kv_lora]`
    latent: Vec<f32>,
    /// `[pos, idx_dim]`: indexer keys after the LayerNorm.
    ik: Vec<f32>,
    /// `[pos, idx_dim]`: pool gate logits.
    gt: Vec<f32>,
    /// `[pool, idx_dim]`: every complete pool's key.
    pooled: Vec<f32>,
}

impl PooledState {
    pub fn clear(&mut self) {
        self.latent.clear();
        self.ik.clear();
        self.gt.clear();
        self.pooled.clear();
    }

    /// Every array, in the snapshot byte form's order.
    pub(crate) fn arrays(&self) -> [&Vec<f32>; 4] {
        [&self.latent, &self.ik, &self.gt, &self.pooled]
    }

    /// [`PooledState::arrays`], writable.
    pub(crate) fn arrays_mut(&mut self) -> [&mut Vec<f32>; 4] {
        [
            &mut self.latent,
            &mut self.ik,
            &mut self.gt,
            &mut self.pooled,
        ]
    }

    pub fn bytes(&self) -> usize {
        4 * (self.latent.len() + self.ik.len() + self.gt.len() + self.pooled.len())
    }
}

/// Which earlier tokens a query attends to: None = all of `0..=pos`, else sorted positions.
pub type Selection = Vec<Option<Vec<u32>>>;

fn round_f16(x: &mut [f32]) {
    x.iter_mut()
        .for_each(|v| *v = half::f16::from_f32(*v).to_f32());
}

fn layer_norm(x: &mut [f32], w: &[f32], b: &[f32], eps: f32) {
    let n = x.len() as f32;
    let mean = x.iter().sum::<f32>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    let r = 1.0 / (var + eps).sqrt();
    for ((v, &ww), &bb) in x.iter_mut().zip(w).zip(b) {
        *v = (*v - mean) * r * ww + bb;
    }
}

fn head_mat(s: &Stacked, h: usize) -> Mat {
    Mat {
        ty: s.ty,
        rows: s.rows,
        cols: s.cols,
        range: s.expert_range(h),
    }
}

/// Run the indexer over the chunk (appending keys, gates and completed pools to `st`) and
/// return every token's selection.
#[allow(clippy::too_many_arguments)]
fn select(
    env: &Env<'_>,
    ix: &PooledIndexer,
    sh: &PooledShape,
    st: &mut PooledState,
    positions: &[usize],
    a: &[f32],
    qr: &[f32],
    f16: bool,
) -> Result<Selection, ModelError> {
    let t_len = positions.len();
    let (nh, d, kp) = (sh.idx_heads, sh.idx_dim, sh.kpool);
    let [mut ik, mut gt, wts] = env.linear_many([&ix.k, &ix.gate, &ix.proj], a, t_len)?;
    let iq = env.linear(&ix.q_b, qr, t_len)?;
    for row in ik.chunks_mut(d) {
        layer_norm(row, &ix.k_norm, &ix.k_norm_b, sh.ln_eps);
    }
    if f16 {
        round_f16(&mut ik);
        round_f16(&mut gt);
    }
    st.ik.extend_from_slice(&ik);
    st.gt.extend_from_slice(&gt);
    // Pools completed by this chunk, in order.
    let n_pos = st.ik.len() / d;
    let mut p = st.pooled.len() / d;
    while (p + 1) * kp <= n_pos {
        let mut pk = vec![0.0f32; d];
        let mut lg = vec![0.0f32; kp];
        for (j, out) in pk.iter_mut().enumerate() {
            for (r, l) in lg.iter_mut().enumerate() {
                *l = st.gt[(p * kp + r) * d + j] + ix.ape[r * d + j];
            }
            softmax(&mut lg);
            *out = (0..kp).map(|r| lg[r] * st.ik[(p * kp + r) * d + j]).sum();
        }
        if f16 {
            round_f16(&mut pk);
        }
        st.pooled.extend_from_slice(&pk);
        p += 1;
    }
    let keep = sh.pools_kept();
    let scale = 1.0 / (d as f32).sqrt();
    let wscale = 1.0 / (nh as f32).sqrt();
    let pooled = &st.pooled;
    Ok(positions
        .par_iter()
        .enumerate()
        .map(|(t, &pos)| {
            let n_vis = (pos + 1) / kp;
            if n_vis <= keep && sh.select_tail {
                return None;
            }
            let q = &iq[t * nh * d..(t + 1) * nh * d];
            let w = &wts[t * nh..(t + 1) * nh];
            let scores: Vec<f32> = (0..n_vis)
                .map(|b| {
                    let pk = &pooled[b * d..(b + 1) * d];
                    let mut acc = 0.0f32;
                    for (h, qh) in q.chunks(d).enumerate() {
                        let dot: f32 = qh.iter().zip(pk).map(|(x, y)| x * y).sum();
                        acc += w[h] * wscale * (dot * scale).max(0.0);
                    }
                    acc
                })
                .collect();
            let mut toks: Vec<u32> = Vec::with_capacity(keep * kp + kp);
            let mut pools = top_k(&scores, keep.min(n_vis));
            pools.sort_unstable();
            for b in pools {
                toks.extend((b * kp..(b + 1) * kp).map(|x| x as u32));
            }
            if sh.select_tail {
                toks.extend((n_vis * kp..=pos).map(|x| x as u32));
            }
            Some(toks)
        })
        .collect())
}

/// The layer over a chunk `a` (`[T, E]`, the normed block input) at `positions` (which
/// continue `st`). `prev` is the previous full layer's selection (a shared layer reuses
/// it). Returns the output `[T, E]` and this layer's selection.
#[allow(clippy::too_many_arguments)]
pub fn pooled_attention(
    env: &Env<'_>,
    w: &PooledWeights,
    sh: &PooledShape,
    st: &mut PooledState,
    positions: &[usize],
    a: &[f32],
    prev: Option<&Selection>,
    f16: bool,
) -> Result<(Vec<f32>, Selection), ModelError> {
    let t_len = positions.len();
    let (nh, hk, hv, kvl) = (sh.n_head, sh.head_k, sh.head_v, sh.kv_lora);
    let [mut qr, mut c] = env.linear_many([&w.q_a, &w.kv_a], a, t_len)?;
    for row in qr.chunks_mut(sh.q_lora) {
        rms_norm_inplace(row, &w.q_a_norm, sh.rms_eps);
    }
    for row in c.chunks_mut(kvl) {
        rms_norm_inplace(row, &w.kv_a_norm, sh.rms_eps);
    }
    if f16 {
        round_f16(&mut c);
    }
    st.latent.extend_from_slice(&c);
    let q = env.linear(&w.q_b, &qr, t_len)?;
    let sel = match (&w.indexer, prev) {
        (Some(ix), _) => select(env, ix, sh, st, positions, a, &qr, f16)?,
        (None, Some(p)) if p.len() == t_len => p.clone(),
        (None, _) => {
            return Err(ModelError::Compute(
                "glm5next: a shared indexer layer without a preceding full layer".into(),
            ))
        }
    };
    // Absorbed queries, head by head: q_abs[h] = W_kb[h] q[h] ([kv_lora]).
    let mut q_abs = vec![0.0f32; nh * t_len * kvl]; // [h][t][kv_lora]
    for h in 0..nh {
        let mut qh = Vec::with_capacity(t_len * hk);
        for t in 0..t_len {
            qh.extend_from_slice(&q[(t * nh + h) * hk..(t * nh + h + 1) * hk]);
        }
        let y = env.linear(&head_mat(&w.k_b, h), &qh, t_len)?;
        q_abs[h * t_len * kvl..(h + 1) * t_len * kvl].copy_from_slice(&y);
    }
    let scale = 1.0 / (hk as f32).sqrt();
    let lat = &st.latent;
    // o_lat[h][t] = sum_s softmax_s(q_abs . c_s * scale) c_s
    let mut o_lat = vec![0.0f32; nh * t_len * kvl];
    o_lat
        .par_chunks_mut(kvl)
        .zip(q_abs.par_chunks(kvl))
        .enumerate()
        .for_each(|(ht, (o, qa))| {
            let t = ht % t_len;
            let pos = positions[t];
            let score = |s: usize| -> f32 {
                let cs = &lat[s * kvl..(s + 1) * kvl];
                qa.iter().zip(cs).map(|(x, y)| x * y).sum::<f32>() * scale
            };
            let toks: Vec<usize> = match &sel[t] {
                None => (0..=pos).collect(),
                Some(v) => v.iter().map(|&x| x as usize).collect(),
            };
            let mut p: Vec<f32> = toks.iter().map(|&s| score(s)).collect();
            softmax(&mut p);
            for (&s, &pw) in toks.iter().zip(&p) {
                let cs = &lat[s * kvl..(s + 1) * kvl];
                o.iter_mut().zip(cs).for_each(|(a, &b)| *a += pw * b);
            }
        });
    let mut o = vec![0.0f32; t_len * nh * hv];
    for h in 0..nh {
        let y = env.linear(
            &head_mat(&w.v_b, h),
            &o_lat[h * t_len * kvl..(h + 1) * t_len * kvl],
            t_len,
        )?;
        for t in 0..t_len {
            o[(t * nh + h) * hv..(t * nh + h + 1) * hv].copy_from_slice(&y[t * hv..(t + 1) * hv]);
        }
    }
    Ok((env.linear(&w.out, &o, t_len)?, sel))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_norm_centres_and_scales() {
        let mut x = [1.0f32, 3.0];
        layer_norm(&mut x, &[1.0, 2.0], &[0.5, 0.0], 0.0);
        assert!((x[0] + 0.5).abs() < 1e-6 && (x[1] - 2.0).abs() < 1e-6);
    }
}
