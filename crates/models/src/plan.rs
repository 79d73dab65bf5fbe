//! A decoder's whole forward pass as data: the one description of an architecture, run on
//! the CPU by [`crate::decoder::CpuDecoder`] and on a device by a [`DeviceForward`].
//!
//! Owns: [`DecoderPlan`] (every weight of a pre-norm decoder - GQA, absorbed MLA (with a
//! DSA indexer's selection), DeepSeek V4 attention, Kimi delta attention, pooled latent
//! attention, Gated DeltaNet or QSA, dense GLU or routed MoE feed-forward layers with an
//! optional (gated) shared expert, a plain, hyper-connection or low-rank hyper-connection
//! residual, a hashed n-gram PLE layer - as ranges of the mapped file, plus the
//! hyper-parameters the CPU blocks use) and [`DeviceForward`], the interface a device
//! backend implements to evaluate a batch with activations, KV cache and routing kept on the
//! device. Every architecture returns a plan from [`crate::arch::Architecture::plan`]
//! (qwen3moe, gemma3, glm-dsa, deepseek4, glm5next, qwen4exp). A device backend checks which
//! of the plan's parts it has kernels for.

use std::sync::Arc;

use crate::blocks::attention::{AttnShape, GqaWeights};
use crate::blocks::deltanet::{DeltaShape, DeltaWeights};
use crate::blocks::dsa_indexer::IndexerWeights;
use crate::blocks::dsv4_attention::{Dsv4AttnWeights, Dsv4Shape};
use crate::blocks::ffn::{Activation, GluWeights};
use crate::blocks::hyper::{HcShape, HcWeights};
use crate::blocks::hyper_lowrank;
use crate::blocks::kda::{KdaShape, KdaWeights};
use crate::blocks::mla::{MlaShape, MlaWeights};
use crate::blocks::mla_pooled::{PooledShape, PooledWeights};
use crate::blocks::moe::MoeWeights;
use crate::blocks::ple::{NgramHash, PleRows, PleWeights};
use crate::blocks::qsa::{QsaShape, QsaWeights};
use crate::blocks::{Batch, Env};
use crate::config::ModelConfig;
use crate::state::SeqState;
use crate::weights::{Mat, Stacked};
use crate::ModelError;

/// Every weight and constant of a plain decoder.
#[derive(Debug, Clone)]
pub struct DecoderPlan {
    pub arch: &'static str,
    pub n_embd: usize,
    pub n_vocab: usize,
    /// The attention as a kernel sees it (for MLA layers: absorbed, one KV head of
    /// `kv_lora + rope` values whose first `kv_lora` are the values), and the RMS norms' eps.
    pub shape: AttnShape,
    /// The plan equals the model only for sequences of at most this many positions (a
    /// sparse indexer that selects every visible token up to its top-k; None: any length).
    pub max_positions: Option<usize>,
    /// A hyper-connection residual (None: the plain residual `x += block(x)`).
    pub hyper: Option<PlanHyper>,
    /// Low-rank hyper-connections in place of every norm (Qwen3.8-Flash-Next): then the
    /// layers' `attn_norm` / `ffn_norm` and `output_norm` are empty and each half-block's
    /// input is its [`PlanLayer::hc_lowrank`] mixer's.
    pub lowrank: Option<PlanLowRank>,
    /// The hashed n-gram PLE layer's hash and row source (with [`PlanLayer::ple`]).
    pub ple: Option<PlanPle>,
    /// Token embedding table `[n_vocab, n_embd]`, rows multiplied by `embd_scale`.
    pub embd: Mat,
    pub embd_scale: f32,
    pub output_norm: Vec<f32>,
    /// `[n_vocab, n_embd]`
    pub output: Mat,
    pub layers: Vec<PlanLayer>,
}

/// A hyper-connection residual (DeepSeek V4's mHC, [`crate::blocks::hyper`]): `n_hc`
/// streams per position (the embedding copied into each), mixed into every half-block's
/// input and updated from its output by the layer's [`PlanLayer::hc`] weights, collapsed
/// by `head` before the output norm.
#[derive(Debug, Clone)]
pub struct PlanHyper {
    pub shape: HcShape,
    pub head: HyperHead,
}

/// Low-rank hyper-connections ([`crate::blocks::hyper_lowrank`]): `n_stream` streams per
/// position (the embedding copied into each); the head's input is the output mixer's.
#[derive(Debug, Clone)]
pub struct PlanLowRank {
    pub n_stream: usize,
    pub head: hyper_lowrank::HcWeights,
}

/// A hashed n-gram PLE layer's shared parts ([`crate::blocks::ple`]): the hash of each
/// position's token context and where the table's rows come from (the mapped file or the
/// row tier).
#[derive(Clone)]
pub struct PlanPle {
    pub hash: NgramHash,
    pub rows: Arc<dyn PleRows>,
}

impl std::fmt::Debug for PlanPle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlanPle")
            .field("hash", &self.hash)
            .finish_non_exhaustive()
    }
}

/// How the streams of a hyper-connection residual become one row before the head.
#[derive(Debug, Clone)]
pub enum HyperHead {
    /// [`crate::blocks::hyper::head`]'s learned mix (DeepSeek V4).
    Learned(HcWeights),
    /// The unweighted mean of the streams (GLM-5.3-Flash).
    Mean,
}

/// A MoE layer's shared expert and its activation (which may differ from the routed
/// experts', e.g. another SwiGLU clamp).
#[derive(Debug, Clone)]
pub struct PlanShared {
    pub w: GluWeights,
    pub act: Activation,
    /// `[1, n_embd]`: the output scaled by the sigmoid of this product of the input
    /// (Qwen3.8-Flash-Next); None: unscaled.
    pub gate: Option<Mat>,
}

impl DecoderPlan {
    /// A plan of `cfg`'s model with a plain residual, exact at any length, an unscaled
    /// embedding and no PLE layer: an architecture with more sets those fields with struct
    /// update syntax (`DecoderPlan { hyper: .., ..DecoderPlan::new(..) }`), so a new field
    /// touches only the architectures that use it.
    pub fn new(
        cfg: &ModelConfig,
        shape: AttnShape,
        embd: Mat,
        output_norm: Vec<f32>,
        output: Mat,
        layers: Vec<PlanLayer>,
    ) -> DecoderPlan {
        DecoderPlan {
            arch: cfg.arch,
            n_embd: cfg.n_embd,
            n_vocab: cfg.n_vocab,
            shape,
            max_positions: None,
            hyper: None,
            lowrank: None,
            ple: None,
            embd,
            embd_scale: 1.0,
            output_norm,
            output,
            layers,
        }
    }

    /// The shape of the plan's MLA layers (the first one's; None: no MLA layer).
    pub fn mla_shape(&self) -> Option<MlaShape> {
        self.layers.iter().find_map(|l| match &l.attn {
            PlanAttn::Mla { shape, .. } => Some(*shape),
            _ => None,
        })
    }

    /// The shape of the plan's DeepSeek V4 layers (the first one's; None: no such layer).
    pub fn dsv4_shape(&self) -> Option<Dsv4Shape> {
        self.layers.iter().find_map(|l| match &l.attn {
            PlanAttn::Dsv4 { shape, .. } => Some(*shape),
            _ => None,
        })
    }

    /// Whether a batch at `positions` stays within the length the plan holds for
    /// (`max_positions`); the error names both.
    pub fn check_length(&self, positions: &[usize]) -> Result<(), ModelError> {
        match (self.max_positions, positions.last()) {
            (Some(max), Some(&last)) if last >= max => Err(ModelError::Compute(format!(
                "{}: the decoder plan holds for {max} positions, the batch reaches {}",
                self.arch,
                last + 1
            ))),
            _ => Ok(()),
        }
    }

    /// Every matrix the plan holds whole (all but the routed experts), each named for
    /// messages ("token embedding", "layer 3 attention q", "layer 3 router", ...).
    pub fn matrices<'a>(&'a self) -> Vec<(String, &'a Mat)> {
        let mut out = vec![
            ("token embedding".to_string(), &self.embd),
            ("output".to_string(), &self.output),
        ];
        let glu = |out: &mut Vec<(String, &'a Mat)>, what: String, w: &'a GluWeights| {
            for (n, m) in [("gate", &w.gate), ("up", &w.up), ("down", &w.down)] {
                out.push((format!("{what} {n}"), m));
            }
        };
        for (il, l) in self.layers.iter().enumerate() {
            let named: Vec<(&str, &Mat)> = match &l.attn {
                PlanAttn::Gqa { w: a, .. } => {
                    vec![("q", &a.wq), ("k", &a.wk), ("v", &a.wv), ("o", &a.wo)]
                }
                PlanAttn::Mla { w: a, select, .. } => {
                    let mut v = vec![
                        ("q_a", &a.q_a),
                        ("q_b", &a.q_b),
                        ("kv_a", &a.kv_a),
                        ("k_b", &a.k_b),
                        ("v_b", &a.v_b),
                        ("o", &a.out),
                    ];
                    if let MlaSelect::Indexer(ix) = select {
                        v.extend([
                            ("indexer q_b", &ix.q_b),
                            ("indexer k", &ix.k),
                            ("indexer proj", &ix.proj),
                        ]);
                    }
                    v
                }
                PlanAttn::Dsv4 { w: a, .. } => {
                    let mut v = vec![
                        ("q_a", &a.q_a),
                        ("q_b", &a.q_b),
                        ("kv", &a.kv),
                        ("o_a", &a.out_a),
                        ("o_b", &a.out_b),
                    ];
                    if let Some(c) = &a.comp {
                        v.extend([("compressor kv", &c.kv), ("compressor gate", &c.gate)]);
                    }
                    if let Some(ix) = &a.indexer {
                        v.extend([
                            ("indexer q_b", &ix.q_b),
                            ("indexer proj", &ix.proj),
                            ("indexer compressor kv", &ix.comp.kv),
                            ("indexer compressor gate", &ix.comp.gate),
                        ]);
                    }
                    v
                }
                PlanAttn::Kda { w: a, .. } => vec![
                    ("kda q", &a.q),
                    ("kda k", &a.k),
                    ("kda v", &a.v),
                    ("kda f_a", &a.f_a),
                    ("kda f_b", &a.f_b),
                    ("kda beta", &a.beta),
                    ("kda g_a", &a.g_a),
                    ("kda g_b", &a.g_b),
                    ("kda o", &a.out),
                ],
                // (k_b and v_b are stacked per head, not whole matrices.)
                PlanAttn::Delta { w: a, .. } => vec![
                    ("delta qkv", &a.qkv),
                    ("delta gate", &a.gate),
                    ("delta beta", &a.beta),
                    ("delta alpha", &a.alpha),
                    ("delta o", &a.out),
                ],
                PlanAttn::Qsa { w: a, .. } => vec![
                    ("q", &a.wq),
                    ("k", &a.wk),
                    ("v", &a.wv),
                    ("o", &a.wo),
                    ("indexer q", &a.idx_q),
                    ("indexer k", &a.idx_k),
                ],
                PlanAttn::Pooled { w: a, .. } => {
                    let mut v = vec![
                        ("q_a", &a.q_a),
                        ("q_b", &a.q_b),
                        ("kv_a", &a.kv_a),
                        ("o", &a.out),
                    ];
                    if let Some(ix) = &a.indexer {
                        v.extend([
                            ("indexer q_b", &ix.q_b),
                            ("indexer k", &ix.k),
                            ("indexer proj", &ix.proj),
                            ("indexer gate", &ix.gate),
                        ]);
                    }
                    v
                }
            };
            if let Some(hc) = &l.hc_lowrank {
                for (half, w) in ["attention", "feed-forward"].iter().zip(hc.iter()) {
                    out.push((format!("layer {il} {half} mixer down"), &w.down));
                    out.push((format!("layer {il} {half} mixer up"), &w.up));
                    if let Some(m) = &w.inject {
                        out.push((format!("layer {il} {half} mixer inject"), m));
                    }
                }
            }
            if let Some(pw) = &l.ple {
                out.push((format!("layer {il} PLE key"), &pw.key));
                out.push((format!("layer {il} PLE value"), &pw.value));
            }
            if let Some(hc) = &l.hc {
                out.push((
                    format!("layer {il} attention hyper-connection"),
                    &hc[0].proj,
                ));
                out.push((
                    format!("layer {il} feed-forward hyper-connection"),
                    &hc[1].proj,
                ));
            }
            for (n, m) in named {
                out.push((format!("layer {il} attention {n}"), m));
            }
            match &l.ffn {
                PlanFfn::Dense { w, .. } => glu(&mut out, format!("layer {il} ffn"), w),
                PlanFfn::Moe { moe, shared, .. } => {
                    out.push((format!("layer {il} router"), &moe.router_w));
                    if let Some(sh) = shared {
                        glu(&mut out, format!("layer {il} shared expert"), &sh.w);
                        if let Some(g) = &sh.gate {
                            out.push((format!("layer {il} shared expert gate"), g));
                        }
                    }
                }
            }
        }
        if let Some(PlanHyper {
            head: HyperHead::Learned(w),
            ..
        }) = &self.hyper
        {
            out.push(("output hyper-connection".to_string(), &w.proj));
        }
        if let Some(lr) = &self.lowrank {
            out.push(("output mixer down".to_string(), &lr.head.down));
            out.push(("output mixer up".to_string(), &lr.head.up));
        }
        out
    }
}

impl PlanShared {
    /// An ungated shared expert.
    pub fn new(w: GluWeights, act: Activation) -> PlanShared {
        PlanShared { w, act, gate: None }
    }
}

impl PlanLayer {
    /// A pre-norm block with none of the extras (post-norms, hyper-connection mixes, a PLE
    /// layer), which an architecture that has them sets with struct update syntax.
    pub fn new(attn_norm: Vec<f32>, attn: PlanAttn, ffn_norm: Vec<f32>, ffn: PlanFfn) -> PlanLayer {
        PlanLayer {
            attn_norm,
            attn,
            post_attn_norm: None,
            ffn_norm,
            ffn,
            post_ffn_norm: None,
            hc: None,
            hc_lowrank: None,
            ple: None,
        }
    }
}

/// One block: `x += post_attn(attn(attn_norm(x)))`, then `x += post_ffn(ffn(ffn_norm(x)))`.
#[derive(Debug, Clone)]
pub struct PlanLayer {
    pub attn_norm: Vec<f32>,
    pub attn: PlanAttn,
    /// RMS norm applied to the attention output before the residual add (Gemma).
    pub post_attn_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub ffn: PlanFfn,
    /// RMS norm applied to the feed-forward output before the residual add (Gemma).
    pub post_ffn_norm: Option<Vec<f32>>,
    /// The hyper-connection mixes around the attention and feed-forward halves (with
    /// [`DecoderPlan::hyper`]; None for a plain residual).
    pub hc: Option<Box<[HcWeights; 2]>>,
    /// The low-rank mixers of the two halves (with [`DecoderPlan::lowrank`]).
    pub hc_lowrank: Option<Box<[hyper_lowrank::HcWeights; 2]>>,
    /// The PLE layer applied to the streams before this layer (with [`DecoderPlan::ple`]).
    pub ple: Option<Box<PleWeights>>,
}

/// The attention half of a block.
#[derive(Debug, Clone)]
pub enum PlanAttn {
    /// Grouped-query attention ([`crate::blocks::attention::gqa`]) with NEOX RoPE.
    Gqa {
        w: GqaWeights,
        /// NEOX RoPE inverse frequencies of this layer.
        inv_freq: Vec<f32>,
        /// Sliding window in positions (None = global attention).
        window: Option<usize>,
    },
    /// Multi-head latent attention ([`crate::blocks::mla::attention`]; interleaved-pair
    /// RoPE on the rope slices, the latent cache row `[c | k_rope]`) over the positions
    /// `select` names.
    Mla {
        w: Box<MlaWeights>,
        shape: MlaShape,
        select: MlaSelect,
    },
    /// DeepSeek V4 attention ([`crate::blocks::dsv4_attention::attention`]: q-LoRA, one
    /// shared key/value latent, partial RoPE, sinks, a sliding window plus compressed rows
    /// (ratio 4 with the lightning indexer, or 128), grouped low-rank output).
    Dsv4 {
        w: Box<Dsv4AttnWeights>,
        shape: Dsv4Shape,
    },
    /// Kimi delta attention ([`crate::blocks::kda::kda`]: a recurrent state per head, a
    /// short convolution).
    Kda { w: Box<KdaWeights>, shape: KdaShape },
    /// NoPE latent attention with a pooled sparse indexer
    /// ([`crate::blocks::mla_pooled::pooled_attention`]; a shared layer reuses the previous
    /// full layer's selection).
    Pooled {
        w: Box<PooledWeights>,
        shape: PooledShape,
    },
    /// Gated DeltaNet ([`crate::blocks::deltanet::delta_net`]: a recurrent state per head,
    /// a short convolution).
    Delta {
        w: Box<DeltaWeights>,
        shape: DeltaShape,
    },
    /// QSA indexed attention ([`crate::blocks::qsa::qsa`]: GQA over the KV cache with a
    /// block-pooled indexer), NEOX RoPE by `inv_freq`.
    Qsa {
        w: Box<QsaWeights>,
        shape: QsaShape,
        inv_freq: Vec<f32>,
    },
}

/// The positions an MLA layer's queries attend to.
#[derive(Debug, Clone)]
pub enum MlaSelect {
    /// Every visible position (a plain MLA decoder).
    All,
    /// The top-k of the layer's own DSA lightning indexer
    /// ([`crate::blocks::dsa_indexer::select`]; every visible position while they fit).
    Indexer(Box<IndexerWeights>),
    /// The most recent indexer layer's selection (GLM's IndexShare "shared" layers; every
    /// visible position before any indexer layer).
    Previous,
}

impl PlanAttn {
    /// Whether the layer keeps state that only continues or restarts at position 0 (a
    /// window, a compressor carry, a recurrence: DeepSeek V4, KDA, pooled attention,
    /// DeltaNet and QSA's pooled keys).
    pub(crate) fn sequential(&self) -> bool {
        matches!(
            self,
            PlanAttn::Dsv4 { .. }
                | PlanAttn::Kda { .. }
                | PlanAttn::Pooled { .. }
                | PlanAttn::Delta { .. }
                | PlanAttn::Qsa { .. }
        )
    }
}

/// The feed-forward half of a block.
#[derive(Debug, Clone)]
pub enum PlanFfn {
    Dense {
        w: GluWeights,
        act: Activation,
    },
    /// The architecture's routed layer (`moe`: router - softmax, biased or hashed
    /// ([`crate::blocks::moe::Router`]; a hashed one reads the batch's token ids) - over
    /// `n_expert` GLU experts, top-`k`, their shapes and activation), plus an unscaled
    /// shared expert when given.
    Moe {
        moe: Box<MoeWeights>,
        /// Stacked gate, up, down (units' parts 0, 1, 2 of the streamable group).
        experts: [Stacked; 3],
        shared: Option<Box<PlanShared>>,
    },
}

impl PlanFfn {
    /// The routed layer `moe` (`experts` its stacked gate, up and down) with an optional
    /// shared expert. The router lookahead link (`moe.next`) is kept: the CPU decoder
    /// hands the next layer's predicted units to the expert source in decode; a device
    /// backend that reads experts its own way may ignore it.
    pub fn moe(moe: &MoeWeights, experts: &[Stacked; 3], shared: Option<PlanShared>) -> PlanFfn {
        PlanFfn::Moe {
            moe: Box::new(moe.clone()),
            experts: experts.clone(),
            shared: shared.map(Box::new),
        }
    }
}

/// A backend that evaluates a [`DecoderPlan`] on its device (the plan is given when the
/// backend is built). Keeps whatever per-sequence state it needs in `state.device`.
pub trait DeviceForward: Send + Sync {
    /// Evaluate `batch` (positions continuing `state`), update the sequence's state (the
    /// caller advances its length) and return the logits of `rows`
    /// (`[rows.len(), n_vocab]`), as [`crate::decoder::CpuDecoder::forward`] does.
    fn forward(
        &self,
        env: &Env<'_>,
        batch: &Batch<'_>,
        state: &mut SeqState,
        rows: &[usize],
    ) -> Result<Vec<f32>, ModelError>;

    /// Short name for start-up lines and statistics.
    fn name(&self) -> &'static str;
}
