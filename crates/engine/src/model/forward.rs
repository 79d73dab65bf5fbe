//! The forward pass: tokens in, logits out, one chunk of positions at a time.
//!
//! Owns: the per-layer data flow shared by every architecture (norm, attention with the KV
//! cache, FFN or MoE, residuals) and the batching of a chunk of tokens into matrix-matrix
//! products. Every value is computed in a fixed order, so logits are the same for any
//! thread count and any chunking of the prompt (the kernels guarantee matmul == matvec).

use rayon::prelude::*;
use sluice_kernels::{dequantize_row, matmul, matvec};

use super::config::Arch;
use super::ops::{gelu_tanh, rms_norm_inplace, rope_cos_sin, rope_neox_cs, silu, softmax, top_k};
use super::weights::{Ffn, Layer, Mat};
use super::Model;
use crate::kv::KvCache;
use crate::EngineError;

/// Which positions of a chunk need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position (generation).
    Last,
    /// Every position (perplexity, `--dump-logits`).
    All,
    /// None (prompt chunks before the last).
    None,
}

impl Model {
    /// `y = W x` for `n` rows of x.
    fn linear(&self, m: &Mat, x: &[f32], n: usize) -> Result<Vec<f32>, EngineError> {
        let w = self.weights.bytes(m);
        let mut y = vec![0.0f32; n * m.rows];
        if n == 1 {
            matvec(m.ty, w, m.rows, m.cols, x, &mut y)?;
        } else {
            matmul(m.ty, w, m.rows, m.cols, x, n, &mut y)?;
        }
        Ok(y)
    }

    /// Evaluate `tokens` at the positions following those already in `kv`, append their
    /// keys and values, and return logits as `mode` asks (row-major `[rows, n_vocab]`).
    pub fn forward(
        &self,
        kv: &mut KvCache,
        tokens: &[u32],
        mode: Logits,
    ) -> Result<Vec<f32>, EngineError> {
        let cfg = &self.cfg;
        let (t_len, e) = (tokens.len(), cfg.n_embd);
        if t_len == 0 {
            return Ok(Vec::new());
        }
        kv.check_room(t_len)?;
        for &tok in tokens {
            if tok as usize >= cfg.n_vocab {
                return Err(EngineError::TokenOutOfRange {
                    id: tok,
                    n_vocab: cfg.n_vocab,
                });
            }
        }
        let pos0 = kv.len();
        let moe = cfg.n_expert > 0;
        if let (Some(rec), true) = (self.routing_recorder(), moe) {
            lock(rec).begin_batch(t_len as u32).map_err(trace_err)?;
        }

        // Embeddings: [T, E]
        let emb = &self.weights.token_embd;
        let emb_bytes = self.weights.bytes(emb);
        let row_bytes = emb.ty.row_bytes(e as u64).unwrap_or(0) as usize;
        let mut x = vec![0.0f32; t_len * e];
        for (row, &tok) in x.chunks_mut(e).zip(tokens) {
            let start = tok as usize * row_bytes;
            dequantize_row(emb.ty, &emb_bytes[start..start + row_bytes], row)?;
            if cfg.arch == Arch::Gemma3 {
                let s = (e as f32).sqrt();
                row.iter_mut().for_each(|v| *v *= s);
            }
        }

        for (il, layer) in self.weights.layers.iter().enumerate() {
            // Attention block.
            let mut h = x.clone();
            for row in h.chunks_mut(e) {
                rms_norm_inplace(row, &layer.attn_norm, cfg.rms_eps);
            }
            let mut attn = self.attention(il, layer, kv, &h, pos0)?;
            let mut o = self.linear(&layer.wo, &attn, t_len)?;
            attn.clear();
            if let Some(w) = &layer.post_attn_norm {
                for row in o.chunks_mut(e) {
                    rms_norm_inplace(row, w, cfg.rms_eps);
                }
            }
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);

            // Feed-forward block.
            let mut h = x.clone();
            for row in h.chunks_mut(e) {
                rms_norm_inplace(row, &layer.ffn_norm, cfg.rms_eps);
            }
            let mut f = match &layer.ffn {
                Ffn::Dense { gate, up, down } => {
                    let g = self.linear(gate, &h, t_len)?;
                    let u = self.linear(up, &h, t_len)?;
                    let act: Vec<f32> = g.iter().zip(&u).map(|(&g, &u)| gelu_tanh(g) * u).collect();
                    self.linear(down, &act, t_len)?
                }
                Ffn::Moe { router, .. } => self.moe(il, router, &h, t_len)?,
            };
            if let Some(w) = &layer.post_ffn_norm {
                for row in f.chunks_mut(e) {
                    rms_norm_inplace(row, w, cfg.rms_eps);
                }
            }
            x.iter_mut().zip(&f).for_each(|(a, b)| *a += b);
        }
        kv.advance(t_len);
        if let (Some(rec), true) = (self.routing_recorder(), moe) {
            lock(rec).end_batch().map_err(trace_err)?;
        }
        self.experts.end_tokens(t_len);

        let rows: Vec<usize> = match mode {
            Logits::None => return Ok(Vec::new()),
            Logits::Last => vec![t_len - 1],
            Logits::All => (0..t_len).collect(),
        };
        let mut h = Vec::with_capacity(rows.len() * e);
        for &r in &rows {
            let mut row = x[r * e..(r + 1) * e].to_vec();
            rms_norm_inplace(&mut row, &self.weights.output_norm, cfg.rms_eps);
            h.extend_from_slice(&row);
        }
        self.linear(&self.weights.output, &h, rows.len())
    }

    /// Self-attention of a chunk: projections, q/k norms, RoPE, KV append, softmax(qK)V.
    /// Returns `[T, n_head * head_dim_v]`.
    fn attention(
        &self,
        il: usize,
        layer: &Layer,
        kv: &mut KvCache,
        h: &[f32],
        pos0: usize,
    ) -> Result<Vec<f32>, EngineError> {
        let cfg = &self.cfg;
        let t_len = h.len() / cfg.n_embd;
        let (hd, hdv) = (cfg.head_dim, cfg.head_dim_v);
        let (nh, nkv) = (cfg.n_head, cfg.n_head_kv);
        let mut q = self.linear(&layer.wq, h, t_len)?;
        let mut k = self.linear(&layer.wk, h, t_len)?;
        let v = self.linear(&layer.wv, h, t_len)?;
        let swa = cfg.is_swa_layer(il);
        let inv_freq = if swa {
            &self.rope_swa
        } else {
            &self.rope_global
        };
        let mut cs = Vec::with_capacity(inv_freq.len());
        for t in 0..t_len {
            // cos/sin once per position, shared by every q and k head.
            rope_cos_sin(pos0 + t, inv_freq, &mut cs);
            for head in q[t * nh * hd..(t + 1) * nh * hd].chunks_mut(hd) {
                if let Some(w) = &layer.q_norm {
                    rms_norm_inplace(head, w, cfg.rms_eps);
                }
                rope_neox_cs(head, &cs);
            }
            for head in k[t * nkv * hd..(t + 1) * nkv * hd].chunks_mut(hd) {
                if let Some(w) = &layer.k_norm {
                    rms_norm_inplace(head, w, cfg.rms_eps);
                }
                rope_neox_cs(head, &cs);
            }
        }
        kv.append(il, &k, &v);
        let (kc, vc) = kv.layer(il);
        let group = nh / nkv;
        let scale = cfg.attn_scale;
        let window = if swa { cfg.sliding_window } else { usize::MAX };
        let mut out = vec![0.0f32; t_len * nh * hdv];
        out.par_chunks_mut(hdv).enumerate().for_each(|(i, o)| {
            let (t, head) = (i / nh, i % nh);
            let g = head / group;
            let pos = pos0 + t;
            let lo = if window == usize::MAX {
                0
            } else {
                (pos + 1).saturating_sub(window)
            };
            let qh = &q[(t * nh + head) * hd..(t * nh + head + 1) * hd];
            let mut scores: Vec<f32> = (lo..=pos)
                .map(|j| {
                    let kh = &kc[(j * nkv + g) * hd..(j * nkv + g + 1) * hd];
                    dot(qh, kh) * scale
                })
                .collect();
            softmax(&mut scores);
            for (j, &p) in (lo..=pos).zip(&scores) {
                let vh = &vc[(j * nkv + g) * hdv..(j * nkv + g + 1) * hdv];
                for (a, &b) in o.iter_mut().zip(vh) {
                    *a += p * b;
                }
            }
        });
        Ok(out)
    }

    /// Routed mixture of experts over a chunk `h` (`[T, E]`): route each token, load each
    /// expert the chunk needs once, run it for all its tokens, then sum every token's k
    /// weighted expert outputs in slot order.
    fn moe(
        &self,
        il: usize,
        router: &Mat,
        h: &[f32],
        t_len: usize,
    ) -> Result<Vec<f32>, EngineError> {
        let cfg = &self.cfg;
        let (e, k) = (cfg.n_embd, cfg.n_expert_used);
        let logits = self.linear(router, h, t_len)?;
        // Routing: per token, k experts and their weights.
        let mut chosen = Vec::with_capacity(t_len * k);
        let mut weights = Vec::with_capacity(t_len * k);
        for row in logits.chunks(cfg.n_expert) {
            let mut probs = row.to_vec();
            softmax(&mut probs);
            let sel = top_k(&probs, k);
            let mut w: Vec<f32> = sel.iter().map(|&i| probs[i]).collect();
            if cfg.expert_weights_norm {
                let sum: f32 = w.iter().sum();
                w.iter_mut().for_each(|v| *v /= sum);
            }
            chosen.extend_from_slice(&sel);
            weights.extend_from_slice(&w);
        }
        if let Some(rec) = self.routing_recorder() {
            let ids: Vec<u32> = chosen.iter().map(|&x| x as u32).collect();
            lock(rec).record_layer(il as u32, &ids).map_err(trace_err)?;
        }
        // Which (token, slot) pairs use each expert.
        let mut users: Vec<Vec<usize>> = vec![Vec::new(); cfg.n_expert];
        for (ts, &ex) in chosen.iter().enumerate() {
            users[ex].push(ts);
        }
        let needed: Vec<usize> = (0..cfg.n_expert)
            .filter(|&x| !users[x].is_empty())
            .collect();
        let Ffn::Moe {
            experts: shapes, ..
        } = &self.weights.layers[il].ffn
        else {
            unreachable!("moe() is only called on MoE layers");
        };
        let ff = shapes.gate.rows;
        // slot_out[(t * k + slot) * E ..]: weighted output of token t's slot-th expert.
        let mut slot_out = vec![0.0f32; t_len * k * e];
        self.experts
            .for_each_expert(&self.weights, il, &needed, &mut |i, view| {
                let ts_list = &users[needed[i]];
                let m = ts_list.len();
                let mut xs = Vec::with_capacity(m * e);
                for &ts in ts_list {
                    let t = ts / k;
                    xs.extend_from_slice(&h[t * e..(t + 1) * e]);
                }
                let mut g = vec![0.0f32; m * ff];
                let mut u = vec![0.0f32; m * ff];
                let mut d = vec![0.0f32; m * e];
                if m == 1 {
                    matvec(shapes.gate.ty, view.gate, ff, e, &xs, &mut g)?;
                    matvec(shapes.up.ty, view.up, ff, e, &xs, &mut u)?;
                } else {
                    matmul(shapes.gate.ty, view.gate, ff, e, &xs, m, &mut g)?;
                    matmul(shapes.up.ty, view.up, ff, e, &xs, m, &mut u)?;
                }
                for (a, &b) in g.iter_mut().zip(&u) {
                    *a = silu(*a) * b;
                }
                if m == 1 {
                    matvec(shapes.down.ty, view.down, e, ff, &g, &mut d)?;
                } else {
                    matmul(shapes.down.ty, view.down, e, ff, &g, m, &mut d)?;
                }
                for (j, &ts) in ts_list.iter().enumerate() {
                    let w = weights[ts];
                    let dst = &mut slot_out[ts * e..(ts + 1) * e];
                    for (o, &v) in dst.iter_mut().zip(&d[j * e..(j + 1) * e]) {
                        *o = v * w;
                    }
                }
                Ok(())
            })?;
        let mut out = vec![0.0f32; t_len * e];
        for t in 0..t_len {
            let dst = &mut out[t * e..(t + 1) * e];
            for slot in 0..k {
                let src = &slot_out[(t * k + slot) * e..(t * k + slot + 1) * e];
                dst.iter_mut().zip(src).for_each(|(a, &b)| *a += b);
            }
        }
        Ok(out)
    }
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn trace_err(e: crate::expert_tier::TraceError) -> EngineError {
    EngineError::Stream(e.to_string())
}

/// Plain f32 dot product, sequential (fixed order).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent accumulators let the compiler vectorise without reassociating
    // across runs: the order is fixed by the code, not by the thread count.
    // chunks_exact keeps the bounds checks out of the loop so it becomes vector code.
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (ca, cb) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] += ca[l] * cb[l];
        }
    }
    let mut s = (acc[0] + acc[4]) + (acc[1] + acc[5]) + (acc[2] + acc[6]) + (acc[3] + acc[7]);
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}
