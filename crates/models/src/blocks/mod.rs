//! Shared building blocks of the architectures.
//!
//! Each block takes its weights explicitly and a [`Env`] (mapped bytes, the compute
//! backend, the expert source, the routing recorder) plus the [`Batch`] (token ids and
//! their positions), and computes in a fixed order so logits never depend on thread count
//! or chunking.
//! - [`attention`]: grouped-query attention with optional q/k norms, NEOX RoPE, optional
//!   sliding window, over the sequence's KV cache.
//! - [`ffn`]: dense gated FFN (GLU) with a chosen activation.
//! - [`moe`]: routed experts with a [`moe::Router`] (softmax, biased sqrt-softplus /
//!   sigmoid, token-id hash table), run through the expert source.
//! - [`head`]: token embedding rows and the output head.
//! - [`hyper`]: hyper-connections (several residual streams mixed by Sinkhorn; DeepSeek V4).
//! - [`dsv4_attention`]: DeepSeek V4 attention (q-LoRA, shared K=V latent, sinks, KV
//!   compressors, lightning indexer) and its per-sequence layer state.
//! - [`mla`]: multi-head latent attention (absorbed, latent cache, optional token selection).
//! - [`dsa_indexer`]: GLM's DSA lightning indexer (top-k token selection, shared by later layers).
//! - [`kda`]: Kimi Delta Attention (GLM-5.3-Flash linear-attention layers) and its state.
//! - [`mla_pooled`]: NoPE latent attention with the k-pool sparse indexer (GLM-5.3-Flash).
//!
//! Norms, RoPE tables and activations are in [`crate::ops`].

pub mod attention;
pub mod deltanet;
pub mod dsa_indexer;
pub mod dsv4_attention;
pub mod ffn;
pub mod head;
pub mod hyper;
pub mod hyper_lowrank;
pub mod kda;
pub mod mla;
pub mod mla_pooled;
pub mod moe;
pub mod ple;
pub mod qsa;

use std::sync::Mutex;

use sluice_tier::{ExpertSource, ReplayBatch, RoutingRecorder};

use crate::compute::Compute;
use crate::weights::Mat;
use crate::ModelError;

/// What a block may use besides its weights.
pub struct Env<'a> {
    /// The mapped model file (every resident matrix is a range of it).
    pub map: &'a [u8],
    pub compute: &'a dyn Compute,
    pub experts: &'a dyn ExpertSource,
    /// `--record-routing`: every token's chosen experts, per MoE layer.
    pub routing: Option<&'a Mutex<RoutingRecorder>>,
    /// `--replay-routing`: this batch's tokens of a recorded trace, whose experts the MoE
    /// blocks use in place of their routers' choice (an IO benchmark; logits meaningless).
    pub replay: Option<ReplayBatch<'a>>,
}

impl Env<'_> {
    /// `y = W x` for `n` rows of `x` (`[n, m.cols]` -> `[n, m.rows]`). The result is a
    /// [`take_buf`] buffer (every value written by the product); hand it back with
    /// [`give_buf`] when done to spare the next call a fresh allocation.
    pub fn linear(&self, m: &Mat, x: &[f32], n: usize) -> Result<Vec<f32>, ModelError> {
        let mut y = take_buf(n * m.rows);
        self.compute
            .linear(m.ty, m.bytes(self.map), m.rows, m.cols, x, n, &mut y)?;
        Ok(y)
    }
}

impl Env<'_> {
    /// Several products of the same input `x` (`[n, cols]`), e.g. q/k/v or gate/up:
    /// one grouped pass, the input prepared once per weight type. Same bits as
    /// [`Env::linear`] on each. One output per matrix, in order, so callers destructure
    /// (`let [q, k, v] = env.linear_many([&wq, &wk, &wv], x, n)?`).
    pub fn linear_many<const N: usize>(
        &self,
        ms: [&Mat; N],
        x: &[f32],
        n: usize,
    ) -> Result<[Vec<f32>; N], ModelError> {
        let mut ys: [Vec<f32>; N] = ms.map(|m| take_buf(n * m.rows));
        let mut jobs: Vec<crate::compute::LinearJob<'_>> = ms
            .iter()
            .zip(ys.iter_mut())
            .map(|(m, y)| crate::compute::LinearJob {
                ty: m.ty,
                w: m.bytes(self.map),
                rows: m.rows,
                cols: m.cols,
                x,
                n,
                y,
                unit: None,
            })
            .collect();
        self.compute.linear_group(&mut jobs)?;
        drop(jobs);
        Ok(ys)
    }
}

thread_local! {
    /// This thread's spare activation buffers ([`take_buf`] / [`give_buf`]).
    static SPARE: std::cell::RefCell<Vec<Vec<f32>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Most spare buffers a thread keeps.
const SPARE_BUFFERS: usize = 16;
/// Most bytes a thread's spare buffers hold together.
const SPARE_BYTES: usize = 64 << 20;

/// A buffer of exactly `len` f32s whose contents are unspecified (finite or not, values
/// of an earlier use on this thread): for results the caller overwrites entirely. Taken
/// from this thread's spares when one is large enough, so the activations of one layer
/// reuse memory the previous layer already touched (no page faults, no zeroing; large
/// fresh allocations are mapped and faulted in page by page).
pub fn take_buf(len: usize) -> Vec<f32> {
    let spare = SPARE.with(|s| {
        let mut s = s.borrow_mut();
        let fit = s
            .iter()
            .enumerate()
            .filter(|(_, v)| v.capacity() >= len)
            .min_by_key(|(_, v)| v.capacity())
            .map(|(i, _)| i);
        fit.map(|i| s.swap_remove(i))
    });
    let mut v = spare.unwrap_or_default();
    if v.len() >= len {
        v.truncate(len);
    } else {
        v.resize(len, 0.0);
    }
    v
}

/// [`take_buf`] set to zeros.
pub fn take_zeroed(len: usize) -> Vec<f32> {
    let mut v = take_buf(len);
    v.fill(0.0);
    v
}

/// Hand a buffer back for [`take_buf`] on this thread (kept while this thread holds
/// fewer than [`SPARE_BUFFERS`] spares of at most [`SPARE_BYTES`] in all).
pub fn give_buf(v: Vec<f32>) {
    if v.capacity() == 0 {
        return;
    }
    SPARE.with(|s| {
        let mut s = s.borrow_mut();
        let held: usize = s.iter().map(|b| b.capacity() * 4).sum();
        if s.len() < SPARE_BUFFERS && held + v.capacity() * 4 <= SPARE_BYTES {
            s.push(v);
        }
    });
}

/// The tokens of one forward call and where they sit in the sequence.
pub struct Batch<'a> {
    pub tokens: &'a [u32],
    /// Position of each token (the sequence length before the call, then +1 each).
    pub positions: Vec<usize>,
}

impl Batch<'_> {
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

/// RMS-normalise every `width`-wide row of `x` with weight `w`, in place (a chunk's rows
/// spread over the compute pool, at least 8 per task; one row: this thread).
pub fn rms_norm_rows(x: &mut [f32], w: &[f32], eps: f32) {
    crate::threads::for_each_chunk(x, w.len(), 8, |_, row| {
        crate::ops::rms_norm_inplace(row, w, eps)
    });
}

/// The rows `rows` of `x` (rows of `width` values), in that order.
pub fn gather_rows(x: &[f32], rows: &[usize], width: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows.len() * width);
    for &r in rows {
        out.extend_from_slice(&x[r * width..(r + 1) * width]);
    }
    out
}

/// `y += sigmoid(g) * s` per position (`y`, `s`: rows of `e`; `g`: one gate logit a row):
/// a shared expert's output `s` scaled by its sigmoid gate (Qwen3.8-Flash-Next).
pub fn add_gated(y: &mut [f32], s: &[f32], g: &[f32], e: usize) {
    for ((yr, sr), &gv) in y.chunks_mut(e).zip(s.chunks(e)).zip(g) {
        let gv = 1.0 / (1.0 + (-gv).exp());
        yr.iter_mut().zip(sr).for_each(|(a, &b)| *a += gv * b);
    }
}

/// `x += y` element-wise (large chunks spread over the compute pool).
pub fn add_into(x: &mut [f32], y: &[f32]) {
    const PIECE: usize = 4096;
    crate::threads::for_each_chunk(x, PIECE, 8, |i, xs| {
        xs.iter_mut()
            .zip(&y[(i * PIECE).min(y.len())..])
            .for_each(|(a, b)| *a += b)
    });
}

/// Where a check for non-finite values looks (for the error message).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// The token embedding rows.
    Embedding,
    /// The residual stream after layer `n`.
    Layer(usize),
    /// The output logits.
    Logits,
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stage::Embedding => f.write_str("the token embedding"),
            Stage::Layer(l) => write!(f, "the output of layer {l}"),
            Stage::Logits => f.write_str("the logits"),
        }
    }
}

/// Fails if a `width`-wide row of `x` holds NaN or Inf, naming the first such row's
/// position (`positions[row]`) and `stage`. One pass over the activations: cheap next to
/// the matrix products that made them, and it changes no value.
pub fn check_finite(
    x: &[f32],
    width: usize,
    positions: &[usize],
    stage: Stage,
) -> Result<(), ModelError> {
    if x.iter().all(|v| v.is_finite()) {
        return Ok(());
    }
    let row = x.iter().position(|v| !v.is_finite()).unwrap_or(0) / width.max(1);
    Err(ModelError::NonFinite {
        path: std::path::PathBuf::new(),
        position: positions.get(row).copied().unwrap_or(row),
        stage,
    })
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
