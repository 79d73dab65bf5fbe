//! Kimi Delta Attention (KDA), the linear-attention layers of GLM-5.3-Flash (`glm5next`).
//!
//! Owns: the q / k / v projections, their causal depthwise convolutions (state: the last
//! `kernel - 1` PRE-conv inputs per channel) and SiLU, per-head L2 norm of q and k (eps
//! inside the sqrt, as FLA), the per-channel forget gate
//! (`lower_bound * sigmoid(exp(A_log) * f)`, or `-exp(A_log) * softplus(f)` when the file has
//! no lower bound), the per-head
//! input gate beta, the delta rule over a `[H, d_k, d_v]` f32 recurrent state whose rows
//! decay per key channel, and the sigmoid-gated RMS norm before the output projection.
//!
//! One form for prefill and decode: the recurrent update, token by token, in a fixed order,
//! so chunked prefill and token-by-token decode give the same bits. (transformers' chunked
//! form `chunk_kimi_delta_attention` is the same function rearranged; the oracle test
//! compares against it.) Specification: ../shared/models/glm5.md section 2.B.

use rayon::prelude::*;

use sluice_kernels::delta_rule::delta_rule_step;

use super::Env;
use crate::ops::silu;
use crate::weights::Mat;
use crate::ModelError;

/// Shape of a KDA layer.
#[derive(Debug, Clone, Copy)]
pub struct KdaShape {
    pub n_head: usize,
    pub head_dim: usize,
    pub conv_kernel: usize,
    /// Epsilon of the gated output RMS norm.
    pub rms_eps: f32,
    /// `kda.gate_lower_bound` (-5 in the release); None selects the softplus gate.
    pub lower_bound: Option<f32>,
}

impl KdaShape {
    /// Width of q, k and v (`n_head * head_dim`).
    pub fn inner(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Bytes of one layer's state (f32).
    pub fn state_bytes(&self) -> usize {
        4 * (3 * (self.conv_kernel - 1) * self.inner() + self.n_head * self.head_dim.pow(2))
    }
}

/// The weights of one KDA layer.
#[derive(Debug, Clone)]
pub struct KdaWeights {
    /// `[inner, E]` each.
    pub q: Mat,
    pub k: Mat,
    pub v: Mat,
    /// `[inner * kernel]` each, channel-major (a channel's taps contiguous).
    pub conv_q: Vec<f32>,
    pub conv_k: Vec<f32>,
    pub conv_v: Vec<f32>,
    /// `[head_dim, E]`, `[inner, head_dim]`: the forget gate's low-rank projection.
    pub f_a: Mat,
    pub f_b: Mat,
    /// `[inner]`
    pub dt_bias: Vec<f32>,
    /// `[H]`: `-exp(A_log)`.
    pub a: Vec<f32>,
    /// `[H, E]`
    pub beta: Mat,
    /// `[head_dim, E]`, `[inner, head_dim]`: the output gate's low-rank projection.
    pub g_a: Mat,
    pub g_b: Mat,
    /// `[head_dim]`
    pub norm: Vec<f32>,
    /// `[E, inner]`
    pub out: Mat,
}

/// Per-sequence state of one KDA layer.
#[derive(Debug, Clone)]
pub struct KdaState {
    /// `[(kernel - 1), 3 * inner]`, oldest first; a row is `[q | k | v]` pre-conv inputs.
    pub conv: Vec<f32>,
    /// `[H, d_k, d_v]`
    pub s: Vec<f32>,
}

impl KdaState {
    pub fn new(sh: &KdaShape) -> KdaState {
        KdaState {
            conv: vec![0.0; (sh.conv_kernel - 1) * 3 * sh.inner()],
            s: vec![0.0; sh.n_head * sh.head_dim * sh.head_dim],
        }
    }

    pub fn clear(&mut self) {
        self.conv.iter_mut().for_each(|v| *v = 0.0);
        self.s.iter_mut().for_each(|v| *v = 0.0);
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// `x / sqrt(sum x^2 + eps)`, in place.
fn l2norm(x: &mut [f32], eps: f32) {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    let r = 1.0 / (ss + eps).sqrt();
    x.iter_mut().for_each(|v| *v *= r);
}

/// The per-channel log-decay `g` of one token from the forget-gate pre-activation `f`
/// (`[inner]`, dt_bias already added).
pub fn forget_gate(sh: &KdaShape, a: &[f32], f: &mut [f32]) {
    let d = sh.head_dim;
    for (h, row) in f.chunks_mut(d).enumerate() {
        let rate = -a[h]; // exp(A_log)
        for v in row.iter_mut() {
            *v = match sh.lower_bound {
                Some(lb) => lb * sigmoid(rate * *v),
                None => a[h] * softplus(*v),
            };
        }
    }
}

/// KDA over a chunk `h` (`[T, E]`, the normed block input): returns `[T, E]`.
pub fn kda(
    env: &Env<'_>,
    w: &KdaWeights,
    sh: &KdaShape,
    st: &mut KdaState,
    h: &[f32],
    t_len: usize,
) -> Result<Vec<f32>, ModelError> {
    let inner = sh.inner();
    let (nh, d, kk) = (sh.n_head, sh.head_dim, sh.conv_kernel);
    let cd = 3 * inner;
    let [q, k, v, f_low, beta, g_low] =
        env.linear_many([&w.q, &w.k, &w.v, &w.f_a, &w.beta, &w.g_a], h, t_len)?;
    let mut fg = env.linear(&w.f_b, &f_low, t_len)?;
    let gate = env.linear(&w.g_b, &g_low, t_len)?;
    for row in fg.chunks_mut(inner) {
        row.iter_mut().zip(&w.dt_bias).for_each(|(x, &b)| *x += b);
        forget_gate(sh, &w.a, row);
    }

    // Causal depthwise conv over [state | chunk] of the [q | k | v] rows, then SiLU.
    let mut hist = Vec::with_capacity((kk - 1 + t_len) * cd);
    hist.extend_from_slice(&st.conv);
    for t in 0..t_len {
        hist.extend_from_slice(&q[t * inner..(t + 1) * inner]);
        hist.extend_from_slice(&k[t * inner..(t + 1) * inner]);
        hist.extend_from_slice(&v[t * inner..(t + 1) * inner]);
    }
    let mut conv = vec![0.0f32; t_len * cd];
    conv.par_chunks_mut(cd).enumerate().for_each(|(t, row)| {
        for (c, o) in row.iter_mut().enumerate() {
            let (wts, ch) = match c / inner {
                0 => (&w.conv_q, c),
                1 => (&w.conv_k, c - inner),
                _ => (&w.conv_v, c - 2 * inner),
            };
            let taps = &wts[ch * kk..(ch + 1) * kk];
            let mut acc = 0.0f32;
            for (j, &wt) in taps.iter().enumerate() {
                acc += wt * hist[(t + j) * cd + c];
            }
            *o = silu(acc);
        }
    });
    st.conv.copy_from_slice(&hist[t_len * cd..]);

    let q_scale = 1.0 / (d as f32).sqrt();
    // Heads are independent: one task per head walks the chunk's tokens in order.
    let mut outs: Vec<Vec<f32>> = vec![Vec::new(); nh];
    st.s.par_chunks_mut(d * d)
        .zip(outs.par_iter_mut())
        .enumerate()
        .for_each(|(hd, (s, out))| {
            out.resize(t_len * d, 0.0);
            let mut qh = vec![0.0f32; d];
            let mut kh = vec![0.0f32; d];
            let mut kv = vec![0.0f32; d];
            let mut decay_rows = vec![0.0f32; d];
            for t in 0..t_len {
                let row = &conv[t * cd..(t + 1) * cd];
                qh.copy_from_slice(&row[hd * d..(hd + 1) * d]);
                kh.copy_from_slice(&row[inner + hd * d..inner + (hd + 1) * d]);
                let vh = &row[2 * inner + hd * d..2 * inner + (hd + 1) * d];
                l2norm(&mut qh, 1e-6);
                l2norm(&mut kh, 1e-6);
                qh.iter_mut().for_each(|x| *x *= q_scale);
                let b = sigmoid(beta[t * nh + hd]);
                let g = &fg[t * inner + hd * d..t * inner + (hd + 1) * d];
                // S = diag(exp(g)) S: row i (key channel i) decays by exp(g[i]).
                for (dr, &gi) in decay_rows.iter_mut().zip(g) {
                    *dr = gi.exp();
                }
                let orow = &mut out[t * d..(t + 1) * d];
                delta_rule_step(s, d, &kh, &qh, vh, &decay_rows, b, &mut kv, orow);
            }
        });
    // Sigmoid-gated RMS norm per head.
    let mut o = vec![0.0f32; t_len * inner];
    for t in 0..t_len {
        for (hd, out) in outs.iter().enumerate() {
            let src = &out[t * d..(t + 1) * d];
            let dst = &mut o[t * inner + hd * d..t * inner + (hd + 1) * d];
            let ms: f32 = src.iter().map(|v| v * v).sum::<f32>() / d as f32;
            let r = 1.0 / (ms + sh.rms_eps).sqrt();
            let zr = &gate[t * inner + hd * d..t * inner + (hd + 1) * d];
            for (((dv, &x), &nw), &zz) in dst.iter_mut().zip(src).zip(&w.norm).zip(zr) {
                *dv = x * r * nw * sigmoid(zz);
            }
        }
    }
    env.linear(&w.out, &o, t_len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forget_gate_lower_bound_is_a_scale_and_softplus_fallback() {
        let sh = KdaShape {
            n_head: 1,
            head_dim: 2,
            conv_kernel: 4,
            rms_eps: 1e-5,
            lower_bound: Some(-5.0),
        };
        let a = [-2.0f32]; // exp(A_log) = 2
        let mut f = [0.0f32, 1.0];
        forget_gate(&sh, &a, &mut f);
        assert!((f[0] + 2.5).abs() < 1e-6);
        assert!((f[1] + 5.0 * sigmoid(2.0)).abs() < 1e-6);
        let sh2 = KdaShape {
            lower_bound: None,
            ..sh
        };
        let mut f = [0.0f32, 30.0];
        forget_gate(&sh2, &a, &mut f);
        assert!((f[0] + 2.0 * 2.0f32.ln()).abs() < 1e-6);
        assert!((f[1] + 60.0).abs() < 1e-4);
    }
}
