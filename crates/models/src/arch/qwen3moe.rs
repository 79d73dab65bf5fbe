//! Qwen3 MoE (`qwen3moe`): GQA with per-head q/k RMS norms and NEOX RoPE, then a softmax
//! router over routed SwiGLU experts (top-k, optionally renormalised). No shared expert.
//! The CPU runs its [`DecoderPlan`] (`crate::decoder::CpuDecoder`).

use sluice_gguf::GgufFile;
use sluice_io::MappedFile;
use sluice_tier::StreamableGroups;

use super::{Architecture, GqaHparams};
use crate::blocks::attention::{AttnShape, GqaWeights};
use crate::blocks::ffn::Activation;
use crate::blocks::moe::{expert_group, link_lookahead, MoeWeights, Router, UnitMat};
use crate::config::{Hparams, ModelConfig};
use crate::ops::rope_inv_freq;
use crate::plan::{DecoderPlan, PlanAttn, PlanFfn, PlanLayer};
use crate::state::SeqState;
use crate::weights::{Mat, Stacked, Tensors};
use crate::ModelError;

const NAME: &str = "qwen3moe";

struct Layer {
    attn_norm: Vec<f32>,
    attn: GqaWeights,
    ffn_norm: Vec<f32>,
    moe: MoeWeights,
    /// Stacked gate, up, down tensors (the streamable units).
    experts: [Stacked; 3],
}

pub struct Qwen3Moe {
    cfg: ModelConfig,
    shape: AttnShape,
    rope: Vec<f32>,
    token_embd: Mat,
    output_norm: Vec<f32>,
    output: Mat,
    layers: Vec<Layer>,
}

pub fn load(file: &GgufFile, map: &MappedFile) -> Result<Box<dyn Architecture>, ModelError> {
    let hp = Hparams::new(file, NAME);
    let g = GqaHparams::read(&hp)?;
    let (n_embd, n_layer, shape) = (g.n_embd, g.n_layer, g.shape);
    let n_expert = hp.u_or("expert_count", 0)?;
    let k = hp.u_or("expert_used_count", 0)?;
    let norm = hp.b_or("expert_weights_norm", true)?;
    if n_expert == 0 || k == 0 || k > n_expert {
        return Err(hp.bad(format!(
            "expert_used_count {k} must be in 1..=expert_count {n_expert}"
        )));
    }
    let n_vocab = hp.n_vocab()?;
    let cfg = ModelConfig {
        arch: NAME,
        n_layer,
        n_embd,
        n_vocab,
        n_ctx_train: hp.context_length(4096)?,
        n_expert,
        n_expert_used: k,
        kv_bytes_per_pos: g.kv_bytes_per_pos(),
        state_bytes: 0,
    };
    let t = Tensors::new(file, map);
    let e = n_embd;
    let (token_embd, output) = t.embd_and_output(n_vocab, e)?;
    let mut layers = Vec::with_capacity(n_layer);
    for il in 0..n_layer {
        let n = |s: &str| format!("blk.{il}.{s}.weight");
        let [gate, up, down] = t.glu_experts(il, e, None, n_expert)?;
        layers.push(Layer {
            attn_norm: t.vec(&n("attn_norm"), e)?,
            attn: GqaWeights::load(&t, il, &shape, e)?,
            ffn_norm: t.vec(&n("ffn_norm"), e)?,
            moe: MoeWeights {
                router_w: t.mat(&n("ffn_gate_inp"), n_expert, e)?,
                router: Router::Softmax { norm },
                n_expert,
                k,
                gate: UnitMat::from(&gate),
                up: UnitMat::from(&up),
                down: UnitMat::from(&down),
                act: Activation::Silu,
                next: None,
            },
            experts: [gate, up, down],
        });
    }
    link_lookahead(
        layers
            .iter_mut()
            .enumerate()
            .map(|(il, l)| (il, &mut l.moe, &l.ffn_norm[..])),
    );
    Ok(Box::new(Qwen3Moe {
        shape,
        rope: rope_inv_freq(shape.head_dim, g.rope_base, g.rope_scale),
        output_norm: t.vec("output_norm.weight", e)?,
        token_embd,
        output,
        layers,
        cfg,
    }))
}

impl Architecture for Qwen3Moe {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn groups(&self) -> StreamableGroups {
        StreamableGroups {
            experts: expert_group(
                self.cfg.n_expert,
                self.layers.iter().map(|l| Some(&l.experts)),
                &[],
            ),
            row_tables: Vec::new(),
        }
    }

    fn new_state(&self, n_ctx: usize) -> SeqState {
        SeqState::new(self.shape.kv_cache(self.cfg.n_layer, n_ctx))
    }

    fn plan(&self) -> DecoderPlan {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                PlanLayer::new(
                    l.attn_norm.clone(),
                    PlanAttn::Gqa {
                        w: l.attn.clone(),
                        inv_freq: self.rope.clone(),
                        window: None,
                    },
                    l.ffn_norm.clone(),
                    PlanFfn::moe(&l.moe, &l.experts, None),
                )
            })
            .collect();
        DecoderPlan::new(
            &self.cfg,
            self.shape,
            self.token_embd.clone(),
            self.output_norm.clone(),
            self.output.clone(),
            layers,
        )
    }
}
