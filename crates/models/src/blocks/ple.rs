//! The hashed n-gram per-layer embedding (PLE) of `qwen4exp`.
//!
//! Owns: the row ids of a token (n-gram of the token and its predecessors, XOR of
//! `token * multiplier`, `% prime` per head plus the head's offset; an EOS predecessor cuts
//! the context and the cut propagates to older positions; a missing predecessor is EOS),
//! and the PLE layer applied to the hyper-connection streams: per-stream sigmoid gate of
//! a shared value by `<norm(key_s), norm(x_s)>`, grouped norm, a dilated causal depthwise
//! conv with SiLU, `X += G + C`.
//!
//! The table rows themselves come from a [`PleRows`] source (mapped file, direct reads, a
//! RAM copy): the block only asks for row ids and gets `f32` rows back.

use super::hyper_lowrank::rms_norm_grouped;
use super::Env;
use crate::ops::silu;
use crate::weights::Mat;
use crate::ModelError;

/// The hash constants of the table (from the GGUF metadata, the contract).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NgramHash {
    pub ngram: usize,
    pub heads_per_ngram: usize,
    pub eos: u32,
    /// `[ngram]`
    pub multipliers: Vec<u64>,
    /// `[(ngram - 1) * heads_per_ngram]`
    pub offsets: Vec<u64>,
    pub vocab_sizes: Vec<u64>,
}

impl NgramHash {
    pub fn n_heads(&self) -> usize {
        (self.ngram - 1) * self.heads_per_ngram
    }

    /// Row ids (`[T, n_heads]`, head-major within a token) of `tokens`, whose predecessors
    /// are `ctx` (the last `ngram - 1` tokens before them, oldest first; EOS at a sequence
    /// start). Returns the ids and the new context.
    pub fn rows(&self, ctx: &[u32], tokens: &[u32]) -> (Vec<u64>, Vec<u32>) {
        let n = self.ngram;
        let nh = self.n_heads();
        let mut hist: Vec<u32> = ctx.to_vec();
        hist.extend_from_slice(tokens);
        let c0 = ctx.len();
        let mut ids = Vec::with_capacity(tokens.len() * nh);
        let mut c = vec![0u64; n];
        for p in 0..tokens.len() {
            let i = c0 + p;
            c[0] = hist[i] as u64;
            let mut cut = false;
            for (s, cs) in c.iter_mut().enumerate().skip(1) {
                let prev = if i >= s { hist[i - s] } else { self.eos };
                if cut || prev == self.eos {
                    cut = true;
                    *cs = self.eos as u64;
                } else {
                    *cs = prev as u64;
                }
            }
            let mut h = c[0].wrapping_mul(self.multipliers[0]);
            for g in 2..=n {
                h ^= c[g - 1].wrapping_mul(self.multipliers[g - 1]);
                for hh in (g - 2) * self.heads_per_ngram..(g - 1) * self.heads_per_ngram {
                    ids.push(h % self.vocab_sizes[hh] + self.offsets[hh]);
                }
            }
        }
        let keep = hist.len() - (n - 1);
        (ids, hist[keep..].to_vec())
    }
}

/// Where PLE rows come from: row ids in, `[ids.len(), row_width]` f32 out. `map` is the
/// mapped model file (sources that read it another way ignore it).
pub trait PleRows: Send + Sync {
    fn gather(&self, map: &[u8], ids: &[u64], out: &mut [f32]) -> Result<(), ModelError>;
    /// The rows of tokens just known: start reading them (may do nothing).
    fn prefetch(&self, _ids: &[u64]) {}
}

/// PLE rows from a [`sluice_tier::PleSource`] (raw rows), dequantised here.
pub struct TierRows {
    pub src: std::sync::Arc<dyn sluice_tier::PleSource>,
    pub ty: sluice_kernels::GgmlType,
    pub width: usize,
    pub row_bytes: usize,
}

impl PleRows for TierRows {
    fn gather(&self, _map: &[u8], ids: &[u64], out: &mut [f32]) -> Result<(), ModelError> {
        let mut raw = vec![0u8; ids.len() * self.row_bytes];
        self.src.read_rows(ids, &mut raw)?;
        for (r, o) in raw.chunks(self.row_bytes).zip(out.chunks_mut(self.width)) {
            sluice_kernels::dequantize_row(self.ty, r, o)?;
        }
        Ok(())
    }

    fn prefetch(&self, ids: &[u64]) {
        self.src.prefetch(ids);
    }
}

/// The weights of the PLE layer.
#[derive(Debug, Clone)]
pub struct PleWeights {
    /// `[S * E, P]` (P = n_heads * row width)
    pub key: Mat,
    /// `[E, P]`
    pub value: Mat,
    /// `[S * E]` each, `1 + w`.
    pub norm_key: Vec<f32>,
    pub norm_query: Vec<f32>,
    pub norm_conv: Vec<f32>,
    /// `[S * E * kernel]`, channel-major.
    pub conv: Vec<f32>,
    pub kernel: usize,
    /// Conv dilation (= n-gram size).
    pub dilation: usize,
}

/// Per-sequence PLE state.
#[derive(Debug, Clone)]
pub struct PleState {
    /// The last `ngram - 1` token ids (EOS at a start).
    pub ctx: Vec<u32>,
    /// The last `(kernel - 1) * dilation` normed gated values `[.., S * E]`, oldest first.
    pub hist: Vec<f32>,
}

impl PleState {
    pub fn new(h: &NgramHash, w: &PleWeights, d: usize) -> PleState {
        PleState {
            ctx: vec![h.eos; h.ngram - 1],
            hist: vec![0.0; (w.kernel - 1) * w.dilation * d],
        }
    }

    pub fn clear(&mut self, eos: u32) {
        self.ctx.iter_mut().for_each(|c| *c = eos);
        self.hist.iter_mut().for_each(|v| *v = 0.0);
    }
}

/// `X += PLE(X)` for a chunk (`x` `[T, S * E]`), `emb` the gathered rows `[T, P]`.
#[allow(clippy::too_many_arguments)]
pub fn ple_apply(
    env: &Env<'_>,
    w: &PleWeights,
    st: &mut PleState,
    s: usize,
    e: usize,
    eps: f32,
    emb: &[f32],
    x: &mut [f32],
    t_len: usize,
) -> Result<(), ModelError> {
    let d = s * e;
    let [mut k, v] = env.linear_many([&w.key, &w.value], emb, t_len)?;
    rms_norm_grouped(&mut k, &w.norm_key, e, eps);
    let mut q = x[..t_len * d].to_vec();
    rms_norm_grouped(&mut q, &w.norm_query, e, eps);
    let inv = 1.0 / (e as f32).sqrt();
    let mut gv = vec![0.0f32; t_len * d];
    for t in 0..t_len {
        for st_i in 0..s {
            let o = t * d + st_i * e;
            let sc: f32 = super::attention::dot(&k[o..o + e], &q[o..o + e]) * inv;
            let g = if sc == 0.0 {
                0.0
            } else {
                sc.signum() * sc.abs().max(1e-6).sqrt()
            };
            let g = 1.0 / (1.0 + (-g).exp());
            for (a, &b) in gv[o..o + e].iter_mut().zip(&v[t * e..(t + 1) * e]) {
                *a = g * b;
            }
        }
    }
    let mut n = gv.clone();
    rms_norm_grouped(&mut n, &w.norm_conv, e, eps);
    let span = (w.kernel - 1) * w.dilation;
    let mut hist = Vec::with_capacity((span + t_len) * d);
    hist.extend_from_slice(&st.hist);
    hist.extend_from_slice(&n);
    for t in 0..t_len {
        let xr = &mut x[t * d..(t + 1) * d];
        for c in 0..d {
            let taps = &w.conv[c * w.kernel..(c + 1) * w.kernel];
            let mut acc = 0.0f32;
            for (j, &wt) in taps.iter().enumerate() {
                acc += wt * hist[(t + j * w.dilation) * d + c];
            }
            xr[c] += gv[t * d + c] + silu(acc);
        }
    }
    st.hist.copy_from_slice(&hist[t_len * d..]);
    Ok(())
}
