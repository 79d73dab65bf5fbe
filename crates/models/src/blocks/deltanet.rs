//! Gated DeltaNet linear attention (Qwen3-Next / Qwen3.5 / `qwen4exp` layers).
//!
//! Owns: the fused q|k|v projection, the causal depthwise conv (state: the last
//! `kernel - 1` PRE-conv inputs per channel), SiLU, per-head L2 norm of q and k, the gated
//! delta rule over a `[H_v, d_k, d_v]` f32 recurrent state, and the gated RMS norm
//! (`rms(o) * w * act(z)`) before the output projection.
//!
//! One form for prefill and decode: the recurrent update, token by token, in a fixed
//! order (`sluice_kernels::delta_rule`, two passes over each head's state per token, the
//! widest vectors the CPU has, the same bits on every tier). Prefill chunked or not and
//! token-by-token decode therefore give the same bits. The chunked UT-transform form of
//! the reference computes the same function with different rounding; it would turn this
//! step into matrix products on long prompts and is not implemented (the step is a small
//! share of a layer's time, see issue 11's closing note).
//!
//! Head order: GGUF files from llama.cpp's converter store the value side (v part of
//! `attn_qkv`, `attn_gate`, `ssm_alpha/beta/a/dt`, `ssm_out` columns) in tiled order, so
//! value head `j` reads key head `j % H_k`.

use rayon::prelude::*;

use sluice_kernels::delta_rule::delta_rule_step;

use super::Env;
use crate::ops::silu;
use crate::weights::Mat;
use crate::ModelError;

/// Shape of a DeltaNet layer.
#[derive(Debug, Clone, Copy)]
pub struct DeltaShape {
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    pub d_k: usize,
    pub d_v: usize,
    pub conv_kernel: usize,
    pub rms_eps: f32,
    /// Output gate: sigmoid (the real model, llama.cpp) or SiLU.
    pub gate_sigmoid: bool,
}

impl DeltaShape {
    /// Bytes of one layer's state (f32): the conv history and the recurrent matrix.
    pub fn state_bytes(&self) -> usize {
        4 * ((self.conv_kernel - 1) * self.conv_dim() + self.n_v_heads * self.d_k * self.d_v)
    }

    pub fn conv_dim(&self) -> usize {
        2 * self.n_k_heads * self.d_k + self.n_v_heads * self.d_v
    }
}

/// The weights of one DeltaNet layer.
#[derive(Debug, Clone)]
pub struct DeltaWeights {
    /// `[conv_dim, E]`
    pub qkv: Mat,
    /// `[H_v * d_v, E]`
    pub gate: Mat,
    /// `[H_v, E]`
    pub beta: Mat,
    /// `[H_v, E]`
    pub alpha: Mat,
    /// `[conv_dim * kernel]`, channel-major (the kernel taps of a channel contiguous).
    pub conv: Vec<f32>,
    /// `[H_v]`
    pub dt_bias: Vec<f32>,
    /// `[H_v]`: `-exp(A_log)`.
    pub a: Vec<f32>,
    /// `[d_v]` (not `1 + w`).
    pub norm: Vec<f32>,
    /// `[E, H_v * d_v]`
    pub out: Mat,
}

/// Per-sequence state of one DeltaNet layer.
#[derive(Debug, Clone)]
pub struct DeltaState {
    /// `[(kernel - 1), conv_dim]`, oldest first.
    pub conv: Vec<f32>,
    /// `[H_v, d_k, d_v]`
    pub s: Vec<f32>,
}

impl DeltaState {
    pub fn new(sh: &DeltaShape) -> DeltaState {
        DeltaState {
            conv: vec![0.0; (sh.conv_kernel - 1) * sh.conv_dim()],
            s: vec![0.0; sh.n_v_heads * sh.d_k * sh.d_v],
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

/// DeltaNet over a chunk `h` (`[T, E]`, the block input): returns `[T, E]`.
pub fn delta_net(
    env: &Env<'_>,
    w: &DeltaWeights,
    sh: &DeltaShape,
    st: &mut DeltaState,
    h: &[f32],
    t_len: usize,
) -> Result<Vec<f32>, ModelError> {
    let cd = sh.conv_dim();
    let kk = sh.conv_kernel;
    let (hk, hv, dk, dv) = (sh.n_k_heads, sh.n_v_heads, sh.d_k, sh.d_v);
    let [qkv, z, beta, alpha] = env.linear_many([&w.qkv, &w.gate, &w.beta, &w.alpha], h, t_len)?;

    // Causal depthwise conv over [state | chunk], then SiLU.
    let mut hist = Vec::with_capacity((kk - 1 + t_len) * cd);
    hist.extend_from_slice(&st.conv);
    hist.extend_from_slice(&qkv);
    let mut conv = vec![0.0f32; t_len * cd];
    conv.par_chunks_mut(cd).enumerate().for_each(|(t, row)| {
        for (c, o) in row.iter_mut().enumerate() {
            let taps = &w.conv[c * kk..(c + 1) * kk];
            let mut acc = 0.0f32;
            for (j, &wt) in taps.iter().enumerate() {
                acc += wt * hist[(t + j) * cd + c];
            }
            *o = silu(acc);
        }
    });
    st.conv.copy_from_slice(&hist[t_len * cd..]);

    let q_scale = 1.0 / (dk as f32).sqrt();
    let mut o = vec![0.0f32; t_len * hv * dv];
    // Heads are independent: one task per value head walks the chunk's tokens in order.
    let mut outs: Vec<Vec<f32>> = vec![Vec::new(); hv];
    st.s.par_chunks_mut(dk * dv)
        .zip(outs.par_iter_mut())
        .enumerate()
        .for_each(|(j, (s, out))| {
            let kh = j % hk;
            out.resize(t_len * dv, 0.0);
            let mut q = vec![0.0f32; dk];
            let mut k = vec![0.0f32; dk];
            let mut kv = vec![0.0f32; dv];
            let mut decay_rows = vec![0.0f32; dk];
            for t in 0..t_len {
                let row = &conv[t * cd..(t + 1) * cd];
                q.copy_from_slice(&row[kh * dk..(kh + 1) * dk]);
                k.copy_from_slice(&row[hk * dk + kh * dk..hk * dk + (kh + 1) * dk]);
                let v = &row[2 * hk * dk + j * dv..2 * hk * dk + (j + 1) * dv];
                l2norm(&mut q, 1e-6);
                l2norm(&mut k, 1e-6);
                q.iter_mut().for_each(|x| *x *= q_scale);
                let b = sigmoid(beta[t * hv + j]);
                let g = w.a[j] * softplus(alpha[t * hv + j] + w.dt_bias[j]);
                decay_rows.fill(g.exp());
                let orow = &mut out[t * dv..(t + 1) * dv];
                delta_rule_step(s, dv, &k, &q, v, &decay_rows, b, &mut kv, orow);
            }
        });
    // Gated RMS norm per head.
    for t in 0..t_len {
        for (j, out) in outs.iter().enumerate() {
            let src = &out[t * dv..(t + 1) * dv];
            let dst = &mut o[(t * hv + j) * dv..(t * hv + j + 1) * dv];
            let ms: f32 = src.iter().map(|v| v * v).sum::<f32>() / dv as f32;
            let r = 1.0 / (ms + sh.rms_eps).sqrt();
            let zr = &z[(t * hv + j) * dv..(t * hv + j + 1) * dv];
            for (((d, &x), &nw), &zz) in dst.iter_mut().zip(src).zip(&w.norm).zip(zr) {
                let act = if sh.gate_sigmoid {
                    sigmoid(zz)
                } else {
                    silu(zz)
                };
                *d = x * r * nw * act;
            }
        }
    }
    env.linear(&w.out, &o, t_len)
}
