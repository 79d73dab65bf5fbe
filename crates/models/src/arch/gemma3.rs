//! Gemma 3 (`gemma3`, dense): embeddings scaled by sqrt(n_embd); GQA with q/k norms where
//! every sixth layer is global and the others slide over a window with their own RoPE base
//! (10 000, unscaled); GeGLU FFN; RMS norms before and after both halves of each block.
//! The CPU runs its [`DecoderPlan`] (`crate::decoder::CpuDecoder`).

use sluice_gguf::GgufFile;
use sluice_io::MappedFile;
use sluice_tier::StreamableGroups;

use super::{Architecture, GqaHparams};
use crate::blocks::attention::{AttnShape, GqaWeights};
use crate::blocks::ffn::{Activation, GluWeights};
use crate::config::{Hparams, ModelConfig};
use crate::ops::rope_inv_freq;
use crate::plan::{DecoderPlan, PlanAttn, PlanFfn, PlanLayer};
use crate::state::SeqState;
use crate::weights::{Mat, Tensors};
use crate::ModelError;

const NAME: &str = "gemma3";
/// Every `SWA_PATTERN`-th layer is global; the others use the sliding window.
const SWA_PATTERN: usize = 6;
const ROPE_BASE_SWA: f32 = 10_000.0;

struct Layer {
    attn_norm: Vec<f32>,
    attn: GqaWeights,
    post_attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    ffn: GluWeights,
    post_ffn_norm: Vec<f32>,
}

pub struct Gemma3 {
    cfg: ModelConfig,
    shape: AttnShape,
    rope_global: Vec<f32>,
    rope_swa: Vec<f32>,
    /// Sliding window in tokens (0 = every layer global).
    sliding_window: usize,
    token_embd: Mat,
    output_norm: Vec<f32>,
    output: Mat,
    layers: Vec<Layer>,
}

pub fn load(file: &GgufFile, map: &MappedFile) -> Result<Box<dyn Architecture>, ModelError> {
    let hp = Hparams::new(file, NAME);
    let g = GqaHparams::read(&hp)?;
    let (n_embd, n_layer, shape) = (g.n_embd, g.n_layer, g.shape);
    let n_vocab = hp.n_vocab()?;
    let n_ctx_train = hp.context_length(4096)?;
    let sliding_window = hp.positions("attention.sliding_window", Some(0), n_ctx_train)?;
    let cfg = ModelConfig {
        arch: NAME,
        n_layer,
        n_embd,
        n_vocab,
        n_ctx_train,
        n_expert: 0,
        n_expert_used: 0,
        kv_bytes_per_pos: g.kv_bytes_per_pos(),
        state_bytes: 0,
    };
    let t = Tensors::new(file, map);
    let e = n_embd;
    let (token_embd, output) = t.embd_and_output(n_vocab, e)?;
    let mut layers = Vec::with_capacity(n_layer);
    for il in 0..n_layer {
        let n = |s: &str| format!("blk.{il}.{s}.weight");
        layers.push(Layer {
            attn_norm: t.vec(&n("attn_norm"), e)?,
            attn: GqaWeights::load(&t, il, &shape, e)?,
            post_attn_norm: t.vec(&n("post_attention_norm"), e)?,
            ffn_norm: t.vec(&n("ffn_norm"), e)?,
            ffn: GluWeights::load(&t, il, "", e, None)?,
            post_ffn_norm: t.vec(&n("post_ffw_norm"), e)?,
        });
    }
    Ok(Box::new(Gemma3 {
        shape,
        rope_global: rope_inv_freq(shape.head_dim, g.rope_base, g.rope_scale),
        rope_swa: rope_inv_freq(shape.head_dim, ROPE_BASE_SWA, 1.0),
        sliding_window,
        output_norm: t.vec("output_norm.weight", e)?,
        token_embd,
        output,
        layers,
        cfg,
    }))
}

impl Gemma3 {
    /// Whether layer `il` uses sliding-window attention.
    fn is_swa_layer(&self, il: usize) -> bool {
        self.sliding_window > 0 && (il % SWA_PATTERN) < SWA_PATTERN - 1
    }
}

impl Architecture for Gemma3 {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn groups(&self) -> StreamableGroups {
        StreamableGroups::default()
    }

    fn new_state(&self, n_ctx: usize) -> SeqState {
        SeqState::new(self.shape.kv_cache(self.cfg.n_layer, n_ctx))
    }

    fn plan(&self) -> DecoderPlan {
        let layers = self
            .layers
            .iter()
            .enumerate()
            .map(|(il, l)| {
                let swa = self.is_swa_layer(il);
                PlanLayer {
                    post_attn_norm: Some(l.post_attn_norm.clone()),
                    post_ffn_norm: Some(l.post_ffn_norm.clone()),
                    ..PlanLayer::new(
                        l.attn_norm.clone(),
                        PlanAttn::Gqa {
                            w: l.attn.clone(),
                            inv_freq: if swa {
                                self.rope_swa.clone()
                            } else {
                                self.rope_global.clone()
                            },
                            window: swa.then_some(self.sliding_window),
                        },
                        l.ffn_norm.clone(),
                        PlanFfn::Dense {
                            w: l.ffn.clone(),
                            act: Activation::GeluTanh,
                        },
                    )
                }
            })
            .collect();
        DecoderPlan {
            embd_scale: (self.cfg.n_embd as f32).sqrt(),
            ..DecoderPlan::new(
                &self.cfg,
                self.shape,
                self.token_embd.clone(),
                self.output_norm.clone(),
                self.output.clone(),
                layers,
            )
        }
    }
}
