//! Multi-head latent attention (MLA, DeepSeek V2/V3 style, as llama.cpp runs it absorbed):
//! q-LoRA queries split per head into `[nope | rope]`, one compressed key/value latent per
//! token (`c`, RMS-normed) plus one shared RoPE key, per-head absorbed key (`attn_k_b`) and
//! value (`attn_v_b`) maps, interleaved-pair RoPE on the rope slice, and an optional per-query
//! token selection (a sparse indexer's top-k, [`super::dsa_indexer`]).
//!
//! Owns: the per-layer latent cache ([`MlaState`], one `[c | k_rope]` row per position,
//! appended in position order, f16-rounded when the sequence uses llama.cpp's default cache
//! type), so any prefill chunking gives the same bits as token-by-token decoding.

use rayon::prelude::*;

use super::attention::dot;
use super::dsv4_attention::rope_tail;
use super::{Batch, Env};
use crate::ops::{rms_norm_inplace, rope_cos_sin};
use crate::weights::Mat;
use crate::ModelError;

/// Shape constants of every MLA layer of a model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MlaShape {
    pub n_head: usize,
    pub q_lora: usize,
    pub kv_lora: usize,
    /// Per-head query/key dims without RoPE (first in the head).
    pub nope: usize,
    /// Per-head RoPE dims (last in the head) = the shared RoPE key's width.
    pub rope: usize,
    /// Per-head value width.
    pub v_dim: usize,
    /// Score scale (1 / sqrt(nope + rope)).
    pub scale: f32,
    pub rms_eps: f32,
}

impl MlaShape {
    /// Width of one cache row: the latent and the RoPE key.
    pub fn row(&self) -> usize {
        self.kv_lora + self.rope
    }
}

/// One MLA layer's weights.
#[derive(Debug, Clone)]
pub struct MlaWeights {
    /// `[q_lora, n_embd]`
    pub q_a: Mat,
    pub q_a_norm: Vec<f32>,
    /// `[n_head * (nope + rope), q_lora]`
    pub q_b: Mat,
    /// `[kv_lora + rope, n_embd]`
    pub kv_a: Mat,
    pub kv_a_norm: Vec<f32>,
    /// `[n_head * kv_lora, nope]`: head h's rows map its nope query into the latent.
    pub k_b: Mat,
    /// `[n_head * v_dim, kv_lora]`: head h's rows map an attended latent to its value.
    pub v_b: Mat,
    /// `[n_embd, n_head * v_dim]`
    pub out: Mat,
    /// RoPE inverse frequencies (`rope / 2`).
    pub inv_freq: Vec<f32>,
}

/// One layer's latent cache for one sequence.
#[derive(Debug, Clone, Default)]
pub struct MlaState {
    /// `[n][kv_lora + rope]`, row p = position p.
    pub rows: Vec<f32>,
}

impl MlaState {
    pub fn clear(&mut self) {
        self.rows.clear();
    }
}

/// Rows `h * n .. (h + 1) * n` of `m` as their own matrix.
pub fn head_rows(m: &Mat, h: usize, n: usize) -> Result<Mat, ModelError> {
    let rb =
        m.ty.row_bytes(m.cols as u64)
            .ok_or_else(|| ModelError::Compute(format!("row size of a {} matrix", m.ty)))?
            as usize;
    let start = m.range.start + h * n * rb;
    Ok(Mat {
        ty: m.ty,
        rows: n,
        cols: m.cols,
        range: start..start + n * rb,
    })
}

/// Round to f16 precision (llama.cpp's default cache type).
pub fn round_f16(x: &mut [f32]) {
    x.iter_mut()
        .for_each(|v| *v = half::f16::from_f32(*v).to_f32());
}

/// The normed q-LoRA residual `rms(q_a x) * q_a_norm` (`[T, q_lora]`), also the indexer's
/// query input.
pub fn query_residual(
    env: &Env<'_>,
    w: &MlaWeights,
    s: &MlaShape,
    x: &[f32],
    t_len: usize,
) -> Result<Vec<f32>, ModelError> {
    let mut qr = env.linear(&w.q_a, x, t_len)?;
    for row in qr.chunks_mut(s.q_lora) {
        rms_norm_inplace(row, &w.q_a_norm, s.rms_eps);
    }
    Ok(qr)
}

/// Attention of one layer over a chunk: `x` (`[T, n_embd]`, normed), `qr` from
/// [`query_residual`]; appends the chunk's cache rows to `st` and returns `[T, n_embd]`.
/// `select[t]`, when given, lists the (ascending) positions token t may attend to; None = all
/// positions up to its own.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    env: &Env<'_>,
    batch: &Batch<'_>,
    w: &MlaWeights,
    s: &MlaShape,
    st: &mut MlaState,
    x: &[f32],
    qr: &[f32],
    select: Option<&[Option<Vec<usize>>]>,
    f16: bool,
) -> Result<Vec<f32>, ModelError> {
    let t_len = batch.len();
    let (nh, kl, nope, rope, vd) = (s.n_head, s.kv_lora, s.nope, s.rope, s.v_dim);
    let hd = nope + rope;
    let row = s.row();
    let mut q = env.linear(&w.q_b, qr, t_len)?;
    let mut kv = env.linear(&w.kv_a, x, t_len)?;
    let mut cs = Vec::new();
    for t in 0..t_len {
        let p = batch.positions[t];
        if p != st.rows.len() / row {
            return Err(ModelError::Compute(format!(
                "MLA cache holds {} positions, the batch continues at {p}",
                st.rows.len() / row
            )));
        }
        rope_cos_sin(p, &w.inv_freq, &mut cs);
        for head in q[t * nh * hd..(t + 1) * nh * hd].chunks_mut(hd) {
            rope_tail(head, &cs, false);
        }
        let r = &mut kv[t * row..(t + 1) * row];
        rms_norm_inplace(&mut r[..kl], &w.kv_a_norm, s.rms_eps);
        rope_tail(r, &cs, false);
        if f16 {
            round_f16(r);
        }
        st.rows.extend_from_slice(r);
    }
    // Absorbed queries: q_abs[t][h] = W_kb[h]^T q_nope[t][h], one product per head.
    let mut q_abs = vec![0.0f32; t_len * nh * kl];
    for h in 0..nh {
        let mut qn = Vec::with_capacity(t_len * nope);
        for t in 0..t_len {
            let base = (t * nh + h) * hd;
            qn.extend_from_slice(&q[base..base + nope]);
        }
        let y = env.linear(&head_rows(&w.k_b, h, kl)?, &qn, t_len)?;
        for t in 0..t_len {
            q_abs[(t * nh + h) * kl..(t * nh + h + 1) * kl]
                .copy_from_slice(&y[t * kl..(t + 1) * kl]);
        }
    }
    // Attended latents per (token, head), heads in parallel (each by one thread: same bits).
    let rows = &st.rows;
    let mut lat = vec![0.0f32; t_len * nh * kl];
    for t in 0..t_len {
        let p = batch.positions[t];
        let all: Vec<usize>;
        let keys: &[usize] = match select.and_then(|sel| sel.get(t)).and_then(|s| s.as_deref()) {
            Some(k) => k,
            None => {
                all = (0..=p).collect();
                &all
            }
        };
        let qa = &q_abs[t * nh * kl..(t + 1) * nh * kl];
        let qt = &q[t * nh * hd..(t + 1) * nh * hd];
        lat[t * nh * kl..(t + 1) * nh * kl]
            .par_chunks_mut(kl)
            .enumerate()
            .for_each(|(h, o)| {
                let qc = &qa[h * kl..(h + 1) * kl];
                let qrope = &qt[h * hd + nope..(h + 1) * hd];
                let mut sc: Vec<f32> = keys
                    .iter()
                    .map(|&j| {
                        let r = &rows[j * row..(j + 1) * row];
                        (dot(qc, &r[..kl]) + dot(qrope, &r[kl..])) * s.scale
                    })
                    .collect();
                let max = sc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0f32;
                for v in sc.iter_mut() {
                    *v = (*v - max).exp();
                    sum += *v;
                }
                for (&j, &e) in keys.iter().zip(&sc) {
                    let pw = e / sum;
                    let c = &rows[j * row..j * row + kl];
                    o.iter_mut().zip(c).for_each(|(a, &b)| *a += pw * b);
                }
            });
    }
    // Values per head: o[t][h] = W_vb[h] lat[t][h].
    let mut o = vec![0.0f32; t_len * nh * vd];
    for h in 0..nh {
        let mut lh = Vec::with_capacity(t_len * kl);
        for t in 0..t_len {
            lh.extend_from_slice(&lat[(t * nh + h) * kl..(t * nh + h + 1) * kl]);
        }
        let y = env.linear(&head_rows(&w.v_b, h, vd)?, &lh, t_len)?;
        for t in 0..t_len {
            o[(t * nh + h) * vd..(t * nh + h + 1) * vd].copy_from_slice(&y[t * vd..(t + 1) * vd]);
        }
    }
    env.linear(&w.out, &o, t_len)
}
