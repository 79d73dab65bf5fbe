//! Low-rank hyper-connections (Qwen3.8-Flash-Next `qwen4exp`): `S` residual streams of
//! width `E` replace every layer norm.
//!
//! Owns: the mixer in front of each block (grouped RMS norm of the streams, a rank-`R`
//! per-element gate, the gated mean over streams that feeds the block), the per-stream
//! injection weights of the block's output, and the write-back `X_s += inj_s * y`. The
//! output mixer (no injection) is the model's final norm.
//!
//! Layout: the streams of one token are contiguous, stream-major (`[T, S * E]`).

use super::Env;
use crate::ops::{rms_norm_inplace, silu};
use crate::weights::Mat;
use crate::ModelError;

/// The weights of one hyper-connection mixer.
#[derive(Debug, Clone)]
pub struct HcWeights {
    /// `[S * E]`, already `1 + w` in GGUF files.
    pub norm: Vec<f32>,
    /// `[R, S * E]`
    pub down: Mat,
    /// `[S * E, R]`
    pub up: Mat,
    /// `[S, S * E]`; None for the output mixer.
    pub inject: Option<Mat>,
}

/// RMS norm of every `e`-wide group of `x` (the streams) with the matching slice of `w`.
pub fn rms_norm_grouped(x: &mut [f32], w: &[f32], e: usize, eps: f32) {
    let n = w.len();
    for row in x.chunks_mut(n) {
        for (g, wg) in row.chunks_mut(e).zip(w.chunks(e)) {
            rms_norm_inplace(g, wg, eps);
        }
    }
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// The block input of `x` (`[T, S * E]`): returns (`[T, E]` mixed input, `[T, S]`
/// injection weights when the mixer has them).
pub fn hc_pre(
    env: &Env<'_>,
    w: &HcWeights,
    s: usize,
    e: usize,
    eps: f32,
    x: &[f32],
    t_len: usize,
) -> Result<(Vec<f32>, Option<Vec<f32>>), ModelError> {
    let d = s * e;
    let mut xn = x[..t_len * d].to_vec();
    rms_norm_grouped(&mut xn, &w.norm, e, eps);
    let inv_s = 1.0 / s as f32;
    let (mut u, inj) = match &w.inject {
        Some(m) => {
            let [down, mut inj] = env.linear_many([&w.down, m], &xn, t_len)?;
            inj.iter_mut().for_each(|v| *v = 2.0 * sigmoid(*v * inv_s));
            (down, Some(inj))
        }
        None => (env.linear(&w.down, &xn, t_len)?, None),
    };
    u.iter_mut().for_each(|v| *v = silu(*v * inv_s));
    let gw = env.linear(&w.up, &u, t_len)?;
    let mut m = vec![0.0f32; t_len * e];
    for t in 0..t_len {
        let mrow = &mut m[t * e..(t + 1) * e];
        for st in 0..s {
            let o = t * d + st * e;
            for ((a, &g), &xv) in mrow.iter_mut().zip(&gw[o..o + e]).zip(&xn[o..o + e]) {
                *a += sigmoid(g) * xv;
            }
        }
        mrow.iter_mut().for_each(|v| *v *= inv_s);
    }
    Ok((m, inj))
}

/// `x_s += inj_s * y` for every token and stream (`x` `[T, S * E]`, `y` `[T, E]`, `inj` `[T, S]`).
pub fn hc_post(x: &mut [f32], inj: &[f32], y: &[f32], s: usize, e: usize) {
    for (t, yrow) in y.chunks(e).enumerate() {
        for st in 0..s {
            let wgt = inj[t * s + st];
            let o = (t * s + st) * e;
            for (a, &b) in x[o..o + e].iter_mut().zip(yrow) {
                *a += wgt * b;
            }
        }
    }
}
