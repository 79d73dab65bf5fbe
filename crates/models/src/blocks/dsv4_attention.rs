//! DeepSeek V4 attention: q-LoRA queries, one shared key = value latent (MQA), partial
//! interleaved RoPE on the trailing dims, per-head sinks, de-rotation of the output and a
//! grouped low-rank output projection; per layer kind extra keys from KV compressors:
//! - sliding window only (ratio 0),
//! - CSA (ratio 4): an overlapping compressor emits one row per 4 tokens, a lightning
//!   indexer (its own compressor at the indexer head size) picks the top-k rows per query,
//! - HCA (ratio 128): a compressor emits one row per 128 tokens, all visible.
//!
//! Owns: the per-layer sequence state ([`LayerState`]: the raw window ring, compressor
//! carry, compressed rows), which the tokens of a chunk update one at a time in position
//! order, so any prefill chunking gives the same bits as token-by-token decoding.

use rayon::prelude::*;

use super::attention::dot;
use super::{Batch, Env};
use crate::ops::{rms_norm_inplace, rope_cos_sin, softmax, top_k};
use crate::weights::Mat;
use crate::ModelError;

/// Shape constants of every attention layer of a model.
#[derive(Debug, Clone, Copy)]
pub struct Dsv4Shape {
    pub n_embd: usize,
    pub n_head: usize,
    /// Size of a query head and of the shared key/value latent.
    pub head_dim: usize,
    /// Trailing dims that get RoPE.
    pub n_rot: usize,
    pub q_lora: usize,
    pub o_groups: usize,
    pub o_lora: usize,
    /// Raw key rows visible to a query (the most recent, including its own).
    pub window: usize,
    pub rms_eps: f32,
}

/// A KV compressor (`attn_compressor_*` or `indexer_compressor_*`).
#[derive(Debug, Clone)]
pub struct CompressorWeights {
    /// Tokens per emitted row (4 or 128).
    pub ratio: usize,
    /// Size of an emitted row.
    pub head_dim: usize,
    /// 2 (overlapping, ratio 4) or 1.
    pub coff: usize,
    /// `[coff * head_dim, n_embd]`
    pub kv: Mat,
    /// `[coff * head_dim, n_embd]`
    pub gate: Mat,
    /// `[ratio][coff * head_dim]`: added to the gate at `p mod ratio`.
    pub ape: Vec<f32>,
    /// `[head_dim]`
    pub norm: Vec<f32>,
}

/// The lightning indexer of a CSA layer.
#[derive(Debug, Clone)]
pub struct IndexerWeights {
    pub n_head: usize,
    pub head_dim: usize,
    pub top_k: usize,
    /// `[n_head * head_dim, q_lora]`
    pub q_b: Mat,
    /// `[n_head, n_embd]`
    pub proj: Mat,
    pub comp: CompressorWeights,
}

/// One attention layer's weights.
#[derive(Debug, Clone)]
pub struct Dsv4AttnWeights {
    /// `[q_lora, n_embd]`
    pub q_a: Mat,
    pub q_a_norm: Vec<f32>,
    /// `[n_head * head_dim, q_lora]`
    pub q_b: Mat,
    /// `[head_dim, n_embd]`
    pub kv: Mat,
    pub kv_norm: Vec<f32>,
    /// `[n_head]`
    pub sinks: Vec<f32>,
    /// `[o_groups * o_lora, n_head * head_dim / o_groups]`
    pub out_a: Mat,
    /// `[n_embd, o_groups * o_lora]`
    pub out_b: Mat,
    pub comp: Option<CompressorWeights>,
    pub indexer: Option<IndexerWeights>,
    /// Inverse frequencies of this layer's RoPE (`n_rot / 2`).
    pub rope: Vec<f32>,
    /// Inverse frequencies of the compressed rows' and the indexer's RoPE.
    pub rope_compress: Vec<f32>,
}

/// Carry and output of one compressor for one sequence.
#[derive(Debug, Clone, Default)]
pub struct CompressorState {
    /// `[coff * ratio][coff * head_dim]`: projected kv of the recent tokens, slot `p mod (coff * ratio)`.
    c: Vec<f32>,
    /// Same for the gate scores (APE added).
    z: Vec<f32>,
    /// Emitted rows `[n][head_dim]` (normalised, roped, KV-rounded).
    pub rows: Vec<f32>,
}

/// Everything one attention layer keeps per sequence.
#[derive(Debug, Clone, Default)]
pub struct LayerState {
    /// `[window][head_dim]` ring, row of position p at slot `p mod window`.
    raw: Vec<f32>,
    comp: CompressorState,
    index: CompressorState,
}

impl LayerState {
    pub fn clear(&mut self) {
        *self = LayerState::default();
    }

    /// Every array, in the snapshot byte form's order.
    pub(crate) fn arrays(&self) -> [&Vec<f32>; 7] {
        let (c, i) = (&self.comp, &self.index);
        [&self.raw, &c.c, &c.z, &c.rows, &i.c, &i.z, &i.rows]
    }

    /// [`LayerState::arrays`], writable.
    pub(crate) fn arrays_mut(&mut self) -> [&mut Vec<f32>; 7] {
        let (c, i) = (&mut self.comp, &mut self.index);
        [
            &mut self.raw,
            &mut c.c,
            &mut c.z,
            &mut c.rows,
            &mut i.c,
            &mut i.z,
            &mut i.rows,
        ]
    }

    /// Bytes held (for reports).
    pub fn bytes(&self) -> usize {
        4 * (self.raw.len()
            + self.comp.c.len()
            + self.comp.z.len()
            + self.comp.rows.len()
            + self.index.c.len()
            + self.index.z.len()
            + self.index.rows.len())
    }
}

/// YaRN inverse frequencies over `n_rot` dims (transformers' `_compute_yarn_parameters`
/// with truncation; the magnitude scaling is not applied: DeepSeek V4 cancels it).
pub fn yarn_inv_freq(
    n_rot: usize,
    base: f32,
    factor: f32,
    orig_ctx: f32,
    beta_fast: f32,
    beta_slow: f32,
) -> Vec<f32> {
    let dim = n_rot as f64;
    let base = base as f64;
    let corr = |rot: f64| {
        dim * ((orig_ctx as f64) / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
    };
    let low = corr(beta_fast as f64).floor().max(0.0);
    let high = corr(beta_slow as f64).ceil().min(dim - 1.0);
    let high = if low == high { high + 0.001 } else { high };
    (0..n_rot / 2)
        .map(|i| {
            let pos_freq = base.powf((2 * i) as f64 / dim);
            let extrap = 1.0 / pos_freq;
            let interp = 1.0 / (factor as f64 * pos_freq);
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let e = 1.0 - ramp;
            (interp * (1.0 - e) + extrap * e) as f32
        })
        .collect()
}

/// Plain RoPE inverse frequencies over `n_rot` dims.
pub fn plain_inv_freq(n_rot: usize, base: f32) -> Vec<f32> {
    crate::ops::rope_inv_freq(n_rot, base, 1.0)
}

/// Rotate the trailing `2 * cs.len()` dims of `x` as interleaved pairs (`inverse`: by -theta).
pub fn rope_tail(x: &mut [f32], cs: &[(f32, f32)], inverse: bool) {
    let off = x.len() - 2 * cs.len();
    for (pair, &(cos, sin)) in x[off..].chunks_exact_mut(2).zip(cs) {
        let sin = if inverse { -sin } else { sin };
        let (a, b) = (pair[0], pair[1]);
        pair[0] = a * cos - b * sin;
        pair[1] = b * cos + a * sin;
    }
}

fn rms_unweighted(x: &mut [f32], eps: f32) {
    let mut sum = 0.0f64;
    for &v in x.iter() {
        sum += (v as f64) * (v as f64);
    }
    let scale = (1.0 / ((sum / x.len() as f64) + eps as f64).sqrt()) as f32;
    x.iter_mut().for_each(|v| *v *= scale);
}

fn round_f16(x: &mut [f32]) {
    x.iter_mut()
        .for_each(|v| *v = half::f16::from_f32(*v).to_f32());
}

/// Store token p's projected `c` and `z` (APE already added) and, at a block end, emit the
/// compressed row (pool -> norm -> rope at the block start -> KV rounding).
#[allow(clippy::too_many_arguments)]
fn compress_step(
    w: &CompressorWeights,
    st: &mut CompressorState,
    p: usize,
    c: &[f32],
    z: &[f32],
    rope: &[f32],
    rms_eps: f32,
    f16: bool,
) {
    let (r, hd, coff) = (w.ratio, w.head_dim, w.coff);
    let width = coff * hd;
    let slots = coff * r;
    if st.c.is_empty() {
        st.c = vec![0.0; slots * width];
        st.z = vec![0.0; slots * width];
    }
    let s = p % slots;
    st.c[s * width..(s + 1) * width].copy_from_slice(c);
    st.z[s * width..(s + 1) * width].copy_from_slice(z);
    if !(p + 1).is_multiple_of(r) {
        return;
    }
    let start = p + 1 - r;
    // (slot, column offset) of every pooled entry: the previous block's first half (CSA,
    // from the second block on), then this block's last half (CSA) or whole row (HCA).
    let mut entries: Vec<(usize, usize)> = Vec::with_capacity(2 * r);
    if coff == 2 && start >= r {
        entries.extend((start - r..start).map(|q| (q % slots, 0)));
    }
    let cur_off = if coff == 2 { hd } else { 0 };
    entries.extend((start..=p).map(|q| (q % slots, cur_off)));
    let mut row = vec![0.0f32; hd];
    let mut wts = vec![0.0f32; entries.len()];
    for (j, out) in row.iter_mut().enumerate() {
        for (wt, &(slot, off)) in wts.iter_mut().zip(&entries) {
            *wt = st.z[slot * width + off + j];
        }
        softmax(&mut wts);
        let mut acc = 0.0f32;
        for (&wt, &(slot, off)) in wts.iter().zip(&entries) {
            acc += wt * st.c[slot * width + off + j];
        }
        *out = acc;
    }
    rms_norm_inplace(&mut row, &w.norm, rms_eps);
    let mut cs = Vec::new();
    rope_cos_sin(start, rope, &mut cs);
    rope_tail(&mut row, &cs, false);
    if f16 {
        round_f16(&mut row);
    }
    st.rows.extend_from_slice(&row);
}

/// Projections of a compressor for the chunk: `(c, z + ape)`, each `[T, coff * head_dim]`.
fn compress_proj(
    env: &Env<'_>,
    w: &CompressorWeights,
    batch: &Batch<'_>,
    x: &[f32],
) -> Result<(Vec<f32>, Vec<f32>), ModelError> {
    let t_len = batch.len();
    let width = w.coff * w.head_dim;
    let c = env.linear(&w.kv, x, t_len)?;
    let mut z = env.linear(&w.gate, x, t_len)?;
    for (t, zt) in z.chunks_mut(width).enumerate() {
        let a = batch.positions[t] % w.ratio;
        zt.iter_mut()
            .zip(&w.ape[a * width..(a + 1) * width])
            .for_each(|(v, &b)| *v += b);
    }
    Ok((c, z))
}

/// Attention of layer `w` over a chunk `x` (`[T, n_embd]`, already normed); updates `st`
/// and returns `[T, n_embd]` after the output projection. `f16`: round stored key rows to
/// f16 precision (llama.cpp's default cache type).
pub fn attention(
    env: &Env<'_>,
    batch: &Batch<'_>,
    w: &Dsv4AttnWeights,
    s: &Dsv4Shape,
    st: &mut LayerState,
    x: &[f32],
    f16: bool,
) -> Result<Vec<f32>, ModelError> {
    let t_len = batch.len();
    let (nh, hd) = (s.n_head, s.head_dim);
    let mut qr = env.linear(&w.q_a, x, t_len)?;
    for row in qr.chunks_mut(s.q_lora) {
        rms_norm_inplace(row, &w.q_a_norm, s.rms_eps);
    }
    let mut q = env.linear(&w.q_b, &qr, t_len)?;
    let mut kv = env.linear(&w.kv, x, t_len)?;
    let comp = match &w.comp {
        Some(c) => Some(compress_proj(env, c, batch, x)?),
        None => None,
    };
    // Indexer: queries from the q residual, head weights from x, its own compressor.
    let idx = match &w.indexer {
        Some(ix) => {
            let mut iq = env.linear(&ix.q_b, &qr, t_len)?;
            let wh = env.linear(&ix.proj, x, t_len)?;
            let mut cs = Vec::new();
            for (t, qt) in iq.chunks_mut(ix.n_head * ix.head_dim).enumerate() {
                rope_cos_sin(batch.positions[t], &w.rope_compress, &mut cs);
                for head in qt.chunks_mut(ix.head_dim) {
                    rope_tail(head, &cs, false);
                }
            }
            Some((iq, wh, compress_proj(env, &ix.comp, batch, x)?))
        }
        None => None,
    };
    let mut cs = Vec::new();
    for t in 0..t_len {
        rope_cos_sin(batch.positions[t], &w.rope, &mut cs);
        for head in q[t * nh * hd..(t + 1) * nh * hd].chunks_mut(hd) {
            rms_unweighted(head, s.rms_eps);
            rope_tail(head, &cs, false);
        }
        let k = &mut kv[t * hd..(t + 1) * hd];
        rms_norm_inplace(k, &w.kv_norm, s.rms_eps);
        rope_tail(k, &cs, false);
        if f16 {
            round_f16(k);
        }
    }
    if st.raw.is_empty() {
        st.raw = vec![0.0; s.window * hd];
    }
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0.0f32; t_len * nh * hd];
    for t in 0..t_len {
        let p = batch.positions[t];
        // 1. this token's state updates, in position order
        let slot = p % s.window;
        st.raw[slot * hd..(slot + 1) * hd].copy_from_slice(&kv[t * hd..(t + 1) * hd]);
        if let (Some(cw), Some((c, z))) = (&w.comp, &comp) {
            let width = cw.coff * cw.head_dim;
            let r = t * width..(t + 1) * width;
            compress_step(
                cw,
                &mut st.comp,
                p,
                &c[r.clone()],
                &z[r],
                &w.rope_compress,
                s.rms_eps,
                f16,
            );
        }
        if let (Some(ix), Some((_, _, (c, z)))) = (&w.indexer, &idx) {
            let width = ix.comp.coff * ix.comp.head_dim;
            let r = t * width..(t + 1) * width;
            compress_step(
                &ix.comp,
                &mut st.index,
                p,
                &c[r.clone()],
                &z[r],
                &w.rope_compress,
                s.rms_eps,
                f16,
            );
        }
        // 2. the compressed rows this query sees
        let n_comp = st.comp.rows.len() / hd;
        let selected: Vec<usize> = match (&w.indexer, &idx) {
            (Some(ix), Some((iq, wh, _))) if n_comp > ix.top_k => {
                let ihd = ix.head_dim;
                let rows = &st.index.rows;
                let n_idx = (rows.len() / ihd).min(n_comp);
                let qt = &iq[t * ix.n_head * ihd..(t + 1) * ix.n_head * ihd];
                let wt = &wh[t * ix.n_head..(t + 1) * ix.n_head];
                let (ks, ws) = (1.0 / (ihd as f32).sqrt(), 1.0 / (ix.n_head as f32).sqrt());
                // One score per row, rows in parallel (each by one thread: same bits).
                let scores: Vec<f32> = (0..n_idx)
                    .into_par_iter()
                    .map(|r| {
                        let k = &rows[r * ihd..(r + 1) * ihd];
                        let mut acc = 0.0f32;
                        for (h, qh) in qt.chunks(ihd).enumerate() {
                            acc += (dot(qh, k).max(0.0) * ks) * (wt[h] * ws);
                        }
                        acc
                    })
                    .collect();
                let mut sel = top_k(&scores, ix.top_k);
                sel.sort_unstable();
                sel
            }
            _ => (0..n_comp).collect(),
        };
        // 3. attention over the raw window and the selected rows, with sinks
        let lo = (p + 1).saturating_sub(s.window);
        let raw = &st.raw;
        let comp_rows = &st.comp.rows;
        let qt = &q[t * nh * hd..(t + 1) * nh * hd];
        out[t * nh * hd..(t + 1) * nh * hd]
            .par_chunks_mut(hd)
            .enumerate()
            .for_each(|(h, o)| {
                let qh = &qt[h * hd..(h + 1) * hd];
                let keys = (lo..=p)
                    .map(|j| &raw[(j % s.window) * hd..(j % s.window + 1) * hd])
                    .chain(selected.iter().map(|&r| &comp_rows[r * hd..(r + 1) * hd]));
                let mut scores: Vec<f32> = keys.clone().map(|k| dot(qh, k) * scale).collect();
                let sink = w.sinks[h];
                let max = scores.iter().copied().fold(sink, f32::max);
                let mut sum = (sink - max).exp();
                for v in scores.iter_mut() {
                    *v = (*v - max).exp();
                    sum += *v;
                }
                for (k, &e) in keys.zip(&scores) {
                    let pw = e / sum;
                    o.iter_mut().zip(k).for_each(|(a, &b)| *a += pw * b);
                }
            });
        for head in out[t * nh * hd..(t + 1) * nh * hd].chunks_mut(hd) {
            rope_cos_sin(p, &w.rope, &mut cs);
            rope_tail(head, &cs, true);
        }
    }
    // Grouped low-rank output: group g (heads g*nh/og ..) through rows g*o_lora.. of out_a.
    let gd = nh * hd / s.o_groups;
    let row_bytes =
        w.out_a
            .ty
            .row_bytes(gd as u64)
            .ok_or_else(|| ModelError::Compute("attn_output_a row size".into()))? as usize;
    let zw = s.o_groups * s.o_lora;
    let mut z = vec![0.0f32; t_len * zw];
    for g in 0..s.o_groups {
        let start = w.out_a.range.start + g * s.o_lora * row_bytes;
        let sub = Mat {
            ty: w.out_a.ty,
            rows: s.o_lora,
            cols: gd,
            range: start..start + s.o_lora * row_bytes,
        };
        let mut xin = Vec::with_capacity(t_len * gd);
        for t in 0..t_len {
            let base = t * nh * hd + g * gd;
            xin.extend_from_slice(&out[base..base + gd]);
        }
        let y = env.linear(&sub, &xin, t_len)?;
        for t in 0..t_len {
            z[t * zw + g * s.o_lora..t * zw + (g + 1) * s.o_lora]
                .copy_from_slice(&y[t * s.o_lora..(t + 1) * s.o_lora]);
        }
    }
    env.linear(&w.out_b, &z, t_len)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yarn_matches_plain_rope_outside_the_ramp() {
        // dims below `low` keep the extrapolated (plain) frequency, above `high` the
        // interpolated one (plain / factor).
        let y = yarn_inv_freq(64, 160_000.0, 16.0, 65_536.0, 32.0, 1.0);
        let p = plain_inv_freq(64, 160_000.0);
        assert!((y[0] - p[0]).abs() < 1e-7);
        assert!((y[31] - p[31] / 16.0).abs() < 1e-12);
    }

    #[test]
    fn inverse_rope_undoes_rope() {
        let inv = plain_inv_freq(4, 10_000.0);
        let mut cs = Vec::new();
        rope_cos_sin(17, &inv, &mut cs);
        let orig = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut x = orig;
        rope_tail(&mut x, &cs, false);
        assert_eq!(&x[..2], &orig[..2]);
        rope_tail(&mut x, &cs, true);
        for (a, b) in x.iter().zip(orig) {
            assert!((a - b).abs() < 1e-5);
        }
    }
}
