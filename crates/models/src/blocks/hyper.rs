//! Manifold-constrained hyper-connections (DeepSeek V4): the residual is `n_hc` parallel
//! streams per token. Before a block the streams are collapsed (`pre` weights); after it
//! the block output is spread back (`post`) and the streams mixed by a doubly-stochastic
//! matrix (`comb`, Sinkhorn-normalised). The final head collapses the streams once more.
//!
//! Owns: the mixing weights from one projection of the RMS-normalised (unweighted)
//! concatenated streams, Sinkhorn, collapse and expand. Layout of a token's streams:
//! `[n_hc][n_embd]` contiguous, so a batch is `[T, n_hc, n_embd]`.

use super::Env;
use crate::weights::Mat;
use crate::ModelError;

/// One hyper-connection (per half-layer, or the head).
#[derive(Debug, Clone)]
pub struct HcWeights {
    /// `[n_out, n_hc * n_embd]`: `n_out = (2 + n_hc) * n_hc` for a block, `n_hc` for the head.
    pub proj: Mat,
    /// `[n_out]`
    pub base: Vec<f32>,
    /// `[3]` for a block (pre, post, comb), `[1]` for the head.
    pub scale: Vec<f32>,
}

/// Constants of the hyper-connections of a model.
#[derive(Debug, Clone, Copy)]
pub struct HcShape {
    pub n_hc: usize,
    pub n_embd: usize,
    pub sinkhorn_iters: usize,
    /// Added to `pre` and inside every Sinkhorn denominator.
    pub eps: f32,
    /// Epsilon of the RMS norm over the concatenated streams.
    pub rms_eps: f32,
}

/// What `pre` produced for a chunk: the block input and how to put the output back.
pub struct HcMix {
    /// `[T, n_embd]`: `sum_i pre[i] * X[i]`.
    pub input: Vec<f32>,
    /// `[T, n_hc]`
    pub post: Vec<f32>,
    /// `[T, n_hc * n_hc]`, `comb[src * n_hc + dst]`.
    pub comb: Vec<f32>,
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// The projection of every token's RMS-normalised concatenated streams (`[T, n_out]`).
fn mixes(env: &Env<'_>, w: &HcWeights, s: &HcShape, x: &[f32]) -> Result<Vec<f32>, ModelError> {
    let width = s.n_hc * s.n_embd;
    let t_len = x.len() / width;
    let mut flat = x.to_vec();
    for row in flat.chunks_mut(width) {
        let mut sum = 0.0f64;
        for &v in row.iter() {
            sum += (v as f64) * (v as f64);
        }
        let scale = (1.0 / ((sum / width as f64) + s.rms_eps as f64).sqrt()) as f32;
        row.iter_mut().for_each(|v| *v *= scale);
    }
    env.linear(&w.proj, &flat, t_len)
}

/// Collapse the streams of every token of `x` (`[T, n_hc, n_embd]`) for a block.
pub fn pre(env: &Env<'_>, w: &HcWeights, s: &HcShape, x: &[f32]) -> Result<HcMix, ModelError> {
    let (hc, e) = (s.n_hc, s.n_embd);
    let n_out = (2 + hc) * hc;
    let m = mixes(env, w, s, x)?;
    let t_len = x.len() / (hc * e);
    let mut input = vec![0.0f32; t_len * e];
    let mut post = vec![0.0f32; t_len * hc];
    let mut comb = vec![0.0f32; t_len * hc * hc];
    for t in 0..t_len {
        let mt = &m[t * n_out..(t + 1) * n_out];
        let pre: Vec<f32> = (0..hc)
            .map(|i| sigmoid(mt[i] * w.scale[0] + w.base[i]) + s.eps)
            .collect();
        for i in 0..hc {
            post[t * hc + i] = 2.0 * sigmoid(mt[hc + i] * w.scale[1] + w.base[hc + i]);
        }
        let c = &mut comb[t * hc * hc..(t + 1) * hc * hc];
        for (k, v) in c.iter_mut().enumerate() {
            *v = mt[2 * hc + k] * w.scale[2] + w.base[2 * hc + k];
        }
        sinkhorn(c, hc, s.sinkhorn_iters, s.eps);
        let dst = &mut input[t * e..(t + 1) * e];
        for (i, &p) in pre.iter().enumerate() {
            let src = &x[(t * hc + i) * e..(t * hc + i + 1) * e];
            dst.iter_mut().zip(src).for_each(|(a, &b)| *a += p * b);
        }
    }
    Ok(HcMix { input, post, comb })
}

/// Softmax over each row (`dst`), + eps, then one column pass and `iters - 1` (row, column)
/// passes, every denominator + eps. `c[src * n + dst]`.
pub fn sinkhorn(c: &mut [f32], n: usize, iters: usize, eps: f32) {
    for row in c.chunks_mut(n) {
        crate::ops::softmax(row);
        row.iter_mut().for_each(|v| *v += eps);
    }
    let cols = |c: &mut [f32]| {
        for dst in 0..n {
            let sum: f32 = (0..n).map(|src| c[src * n + dst]).sum();
            for src in 0..n {
                c[src * n + dst] /= sum + eps;
            }
        }
    };
    cols(c);
    for _ in 1..iters.max(1) {
        for row in c.chunks_mut(n) {
            let sum: f32 = row.iter().sum();
            row.iter_mut().for_each(|v| *v /= sum + eps);
        }
        cols(c);
    }
}

/// Put a block's output `y` (`[T, n_embd]`) back: `X'[dst] = post[dst] * y + sum_src
/// comb[src][dst] * X[src]`.
pub fn post(x: &mut [f32], y: &[f32], mix: &HcMix, s: &HcShape) {
    let (hc, e) = (s.n_hc, s.n_embd);
    let mut out = vec![0.0f32; hc * e];
    for (t, xt) in x.chunks_mut(hc * e).enumerate() {
        let yt = &y[t * e..(t + 1) * e];
        let c = &mix.comb[t * hc * hc..(t + 1) * hc * hc];
        for dst in 0..hc {
            let o = &mut out[dst * e..(dst + 1) * e];
            let p = mix.post[t * hc + dst];
            o.iter_mut().zip(yt).for_each(|(a, &b)| *a = p * b);
            for src in 0..hc {
                let w = c[src * hc + dst];
                let xs = &xt[src * e..(src + 1) * e];
                o.iter_mut().zip(xs).for_each(|(a, &b)| *a += w * b);
            }
        }
        xt.copy_from_slice(&out);
    }
}

/// The final collapse (`[T, n_hc, n_embd]` -> `[T, n_embd]`): `sum_i (sigmoid(m_i *
/// scale + base_i) + eps) * X[i]`.
pub fn head(env: &Env<'_>, w: &HcWeights, s: &HcShape, x: &[f32]) -> Result<Vec<f32>, ModelError> {
    let (hc, e) = (s.n_hc, s.n_embd);
    let m = mixes(env, w, s, x)?;
    let t_len = x.len() / (hc * e);
    let mut out = vec![0.0f32; t_len * e];
    for t in 0..t_len {
        let dst = &mut out[t * e..(t + 1) * e];
        for i in 0..hc {
            let p = sigmoid(m[t * hc + i] * w.scale[0] + w.base[i]) + s.eps;
            let src = &x[(t * hc + i) * e..(t * hc + i + 1) * e];
            dst.iter_mut().zip(src).for_each(|(a, &b)| *a += p * b);
        }
    }
    Ok(out)
}

/// The unweighted collapse (`[T, n_hc, e]` -> `[T, e]`; GLM-5.3-Flash's head): each
/// position's streams summed in stream order, then times `1 / n_hc`.
pub fn mean(x: &[f32], n_hc: usize, e: usize) -> Vec<f32> {
    let inv = 1.0 / n_hc as f32;
    let mut out = Vec::with_capacity(x.len() / n_hc);
    for xs in x.chunks(n_hc * e) {
        let mut m = vec![0.0f32; e];
        for s in xs.chunks(e) {
            m.iter_mut().zip(s).for_each(|(a, &b)| *a += b);
        }
        m.iter_mut().for_each(|v| *v *= inv);
        out.extend_from_slice(&m);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sinkhorn_is_doubly_stochastic() {
        let mut c: Vec<f32> = (0..16).map(|i| ((i * 7) % 5) as f32 * 0.9 - 1.0).collect();
        sinkhorn(&mut c, 4, 20, 1e-6);
        for r in 0..4 {
            let row: f32 = c[r * 4..r * 4 + 4].iter().sum();
            let col: f32 = (0..4).map(|s| c[s * 4 + r]).sum();
            assert!(
                (row - 1.0).abs() < 1e-3 && (col - 1.0).abs() < 1e-5,
                "{row} {col}"
            );
        }
    }
}
