//! The DSA lightning indexer of GLM-5.x (`glm-dsa`): per query, a score for every visible
//! token `I(t, s) = sum_h w_h(t) * relu(iq_h(t) . ik_s / sqrt(D))` with `w = proj x / sqrt(H)`,
//! queries from the attention's q-LoRA residual, one LayerNorm'd key per token, interleaved
//! RoPE on the FIRST `rope` dims of both (GLM; DeepSeek V3.2 differs), and the top-k tokens
//! as the attention's selection. Layers of kind "shared" (IndexShare, GLM-5.2/5.3) run no
//! indexer and reuse the previous full layer's selection; the architecture passes it on.
//!
//! Owns: the per-layer indexer key cache ([`IndexerState`], one f32 key per position, appended
//! in position order; never f16-rounded: the top-k is so sensitive that rounding the keys to
//! f16 flips choices on the tiny oracle models and moves logits by O(1) in transformers as in
//! sluice, while llama.cpp's default run stays within 1e-2) and the selection per query: `None`
//! while every visible token fits in top-k (then DSA is dense attention), else the chosen
//! positions in ascending order, ties to the lower position.

use rayon::prelude::*;

use super::attention::dot;
use super::dsv4_attention::rope_tail;
use super::{Batch, Env};
use crate::ops::{rope_cos_sin, top_k};
use crate::weights::Mat;
use crate::ModelError;

/// One full layer's indexer weights.
#[derive(Debug, Clone)]
pub struct IndexerWeights {
    pub n_head: usize,
    pub head_dim: usize,
    pub top_k: usize,
    /// `[n_head * head_dim, q_lora]`
    pub q_b: Mat,
    /// `[head_dim, n_embd]`
    pub k: Mat,
    pub k_norm: Vec<f32>,
    pub k_norm_bias: Vec<f32>,
    /// LayerNorm epsilon of the key norm.
    pub k_norm_eps: f32,
    /// `[n_head, n_embd]`
    pub proj: Mat,
}

/// One full layer's indexer keys for one sequence.
#[derive(Debug, Clone, Default)]
pub struct IndexerState {
    /// `[n][head_dim]`, row p = position p.
    pub keys: Vec<f32>,
}

impl IndexerState {
    pub fn clear(&mut self) {
        self.keys.clear();
    }
}

/// LayerNorm of `x` in place with weight `w` and bias `b`.
pub fn layer_norm(x: &mut [f32], w: &[f32], b: &[f32], eps: f32) {
    let n = x.len() as f64;
    let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n;
    let var = x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
    let inv = 1.0 / (var + eps as f64).sqrt();
    for ((v, &wi), &bi) in x.iter_mut().zip(w).zip(b) {
        *v = ((*v as f64 - mean) * inv) as f32 * wi + bi;
    }
}

/// Selections of the chunk's tokens (see the module header); appends the chunk's keys to
/// `st`. `x`: the normed layer input `[T, n_embd]`; `qr`: the q-LoRA residual `[T, q_lora]`.
#[allow(clippy::too_many_arguments)]
pub fn select(
    env: &Env<'_>,
    batch: &Batch<'_>,
    w: &IndexerWeights,
    inv_freq: &[f32],
    st: &mut IndexerState,
    x: &[f32],
    qr: &[f32],
) -> Result<Vec<Option<Vec<usize>>>, ModelError> {
    let t_len = batch.len();
    let (nh, d) = (w.n_head, w.head_dim);
    let mut iq = env.linear(&w.q_b, qr, t_len)?;
    let mut ik = env.linear(&w.k, x, t_len)?;
    let wh = env.linear(&w.proj, x, t_len)?;
    let n_rot = 2 * inv_freq.len();
    let mut cs = Vec::new();
    for t in 0..t_len {
        let p = batch.positions[t];
        if p != st.keys.len() / d {
            return Err(ModelError::Compute(format!(
                "indexer cache holds {} positions, the batch continues at {p}",
                st.keys.len() / d
            )));
        }
        rope_cos_sin(p, inv_freq, &mut cs);
        for head in iq[t * nh * d..(t + 1) * nh * d].chunks_mut(d) {
            rope_tail(&mut head[..n_rot], &cs, false);
        }
        let k = &mut ik[t * d..(t + 1) * d];
        layer_norm(k, &w.k_norm, &w.k_norm_bias, w.k_norm_eps);
        rope_tail(&mut k[..n_rot], &cs, false);
        st.keys.extend_from_slice(k);
    }
    let (ks, ws) = (1.0 / (d as f32).sqrt(), 1.0 / (nh as f32).sqrt());
    let keys = &st.keys;
    let mut out = Vec::with_capacity(t_len);
    for t in 0..t_len {
        let n_vis = batch.positions[t] + 1;
        if n_vis <= w.top_k {
            out.push(None);
            continue;
        }
        let qt = &iq[t * nh * d..(t + 1) * nh * d];
        let wt = &wh[t * nh..(t + 1) * nh];
        // One score per visible token, tokens in parallel (each by one thread: same bits).
        let scores: Vec<f32> = (0..n_vis)
            .into_par_iter()
            .map(|s| {
                let k = &keys[s * d..(s + 1) * d];
                let mut acc = 0.0f32;
                for (h, qh) in qt.chunks(d).enumerate() {
                    acc += (dot(qh, k) * ks).max(0.0) * (wt[h] * ws);
                }
                acc
            })
            .collect();
        let mut sel = top_k(&scores, w.top_k);
        sel.sort_unstable();
        out.push(Some(sel));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_norm_centres_and_scales() {
        let mut x = [1.0f32, 2.0, 3.0, 4.0];
        layer_norm(&mut x, &[1.0; 4], &[0.5; 4], 0.0);
        let mean: f32 = x.iter().sum::<f32>() / 4.0;
        assert!((mean - 0.5).abs() < 1e-6);
        let var: f32 = x.iter().map(|v| (v - 0.5) * (v - 0.5)).sum::<f32>() / 4.0;
        assert!((var - 1.0).abs() < 1e-5);
    }
}
