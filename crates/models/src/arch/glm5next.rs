//! GLM-5.3-Flash (`glm5-next` as upstream llama.cpp's converter writes it, `glm5next` as
//! unsloth's files spell it; keys are read with the file's own prefix): a 4-stream
//! hyper-connection residual (mHC, DeepSeek V4's, closed by an unweighted mean of the
//! streams), Kimi Delta Attention on the layers with `attention.head_count_kv` 0, NoPE latent
//! attention with a pooled sparse indexer on the others (head_count_kv 1), dense SwiGLU
//! leading layers and sigmoid-routed MoE (selection bias, normalised weights times the routed
//! scale, one shared expert), every SwiGLU clamped (`swiglu_clamp_*`). A trailing MTP block
//! (`nextn_predict_layers`) is loaded past and never run; its experts are described so they
//! stay on disk. Specification: ../shared/models/glm5.md sections 2.B, 3.
//!
//! Key aliases: `attention.indexer.kpool` falls back to `attention.indexer.block_size` (the
//! unmerged PR #27752 converter); a scalar or missing `attention.head_count_kv` means the
//! default layout (KDA unless `il % 4 == 3`); `kda.gate_lower_bound` missing selects the
//! softplus gate, as llama.cpp does.
//!
//! The CPU runs its [`DecoderPlan`] (`crate::decoder::CpuDecoder`, whose state holds the KDA
//! states and the latent / indexer rows).

use sluice_gguf::{GgufFile, MetaValue};
use sluice_io::MappedFile;
use sluice_tier::StreamableGroups;

use super::Architecture;
use crate::blocks::attention::AttnShape;
use crate::blocks::ffn::{Activation, GluWeights};
use crate::blocks::hyper::{HcShape, HcWeights};
use crate::blocks::kda::{KdaShape, KdaWeights};
use crate::blocks::mla_pooled::{PooledIndexer, PooledShape, PooledWeights};
use crate::blocks::moe::{expert_group, link_lookahead, MoeWeights, Router, ScoreFn, UnitMat};
use crate::config::{Hparams, ModelConfig};
use crate::kv::KvCache;
use crate::plan::{DecoderPlan, HyperHead, PlanAttn, PlanFfn, PlanHyper, PlanLayer, PlanShared};
use crate::state::SeqState;
use crate::weights::{Mat, Stacked, Tensors};
use crate::ModelError;

/// The two spellings of the architecture name.
pub const NAMES: [&str; 2] = ["glm5-next", "glm5next"];

enum Mixer {
    Kda(Box<KdaWeights>),
    Pooled(Box<PooledWeights>),
}

enum Ffn {
    Dense(GluWeights),
    Moe {
        moe: MoeWeights,
        experts: Box<[Stacked; 3]>,
        shared: GluWeights,
    },
}

struct Layer {
    hc_attn: HcWeights,
    hc_ffn: HcWeights,
    attn_norm: Vec<f32>,
    mixer: Mixer,
    ffn_norm: Vec<f32>,
    ffn: Ffn,
    /// Clamp of the dense / shared SwiGLU.
    act_sh: Activation,
}

pub struct Glm5Next {
    cfg: ModelConfig,
    hc: HcShape,
    kda: KdaShape,
    pooled: PooledShape,
    rms_eps: f32,
    token_embd: Mat,
    output_norm: Vec<f32>,
    output: Mat,
    layers: Vec<Layer>,
    /// Routed experts of the MTP block(s), never run, described so they stream.
    mtp_experts: Vec<(usize, [Stacked; 3])>,
}

fn clamp_act(limit: f32) -> Activation {
    if limit > 1e-6 {
        Activation::SiluClamped { limit }
    } else {
        Activation::Silu
    }
}

pub fn load(file: &GgufFile, map: &MappedFile) -> Result<Box<dyn Architecture>, ModelError> {
    Ok(Box::new(load_glm5next(file, map)?))
}

/// Which of the `n_layer` layers are KDA: `head_count_kv` 0 (a per-layer array), else the
/// default layout (three KDA layers, then one pooled-attention layer).
fn kda_layers(hp: &Hparams<'_>, name: &str, n_layer: usize) -> Result<Vec<bool>, ModelError> {
    let recurrent = match hp.file.get(&format!("{name}.attention.head_count_kv")) {
        Some(MetaValue::Array(a)) => {
            let v: Option<Vec<u64>> = a.values.iter().map(MetaValue::as_u64).collect();
            let v = v.ok_or_else(|| {
                hp.bad(format!("{name}.attention.head_count_kv must hold integers"))
            })?;
            if v.len() < n_layer {
                return Err(hp.bad(format!(
                    "{name}.attention.head_count_kv has {} entries for {n_layer} layers",
                    v.len()
                )));
            }
            v[..n_layer].iter().map(|&x| x == 0).collect()
        }
        _ => (0..n_layer).map(|i| i % 4 != 3).collect(),
    };
    Ok(recurrent)
}

/// The pooled layers' indexer types (true = full, computing its own selection; default
/// every layer), and the check that a shared layer has an earlier full one to reuse.
fn indexer_types(
    hp: &Hparams<'_>,
    name: &str,
    n_layer: usize,
    recurrent: &[bool],
) -> Result<Vec<bool>, ModelError> {
    let full = match hp.array("attention.indexer.types") {
        None => vec![true; n_layer],
        Some(v) => {
            let b: Option<Vec<bool>> = v
                .iter()
                .map(|x| x.as_bool().or_else(|| x.as_u64().map(|u| u != 0)))
                .collect();
            let b = b.ok_or_else(|| {
                hp.bad(format!("{name}.attention.indexer.types must hold booleans"))
            })?;
            if b.len() == 1 {
                vec![b[0]; n_layer]
            } else if b.len() >= n_layer {
                b[..n_layer].to_vec()
            } else {
                return Err(hp.bad(format!(
                    "{name}.attention.indexer.types has {} entries for {n_layer} layers",
                    b.len()
                )));
            }
        }
    };
    // A shared layer reuses the previous DSA layer's selection: that layer must be full
    // or shared in turn, and the first DSA layer must be full.
    if let Some(il) = (0..n_layer).find(|&i| !recurrent[i] && !full[i]) {
        if !(0..il).any(|j| !recurrent[j] && full[j]) {
            return Err(hp.bad(format!(
                "layer {il} shares the indexer selection but no earlier layer computes one"
            )));
        }
    }
    Ok(full)
}

/// Load with the concrete type.
pub fn load_glm5next(file: &GgufFile, map: &MappedFile) -> Result<Glm5Next, ModelError> {
    let found = file.architecture()?;
    let name =
        NAMES
            .iter()
            .copied()
            .find(|n| *n == found)
            .ok_or_else(|| ModelError::BadConfig {
                path: file.path.clone(),
                what: format!("architecture {found} is not glm5-next / glm5next"),
            })?;
    let hp = Hparams::new(file, name);
    let e = hp.u("embedding_length")?;
    let n_block = hp.block_count()?;
    let n_mtp = hp.u_or("nextn_predict_layers", 0)?;
    if n_block == 0 || e == 0 || n_mtp >= n_block {
        return Err(hp.bad(format!(
            "block_count {n_block}, embedding_length {e} must be > 0 and nextn_predict_layers {n_mtp} < block_count"
        )));
    }
    let n_layer = n_block - n_mtp;
    let n_ctx_train = hp.context_length(1 << 20)?;
    hp.no_rope_scaling()?;
    let n_head = hp.u("attention.head_count")?;
    let rms_eps = hp.f_nonneg_or("attention.layer_norm_rms_epsilon", 1e-5)?;
    let ln_eps = hp.f_nonneg_or("attention.layer_norm_epsilon", 1e-6)?;
    if n_head == 0 {
        return Err(hp.bad(format!("{name}.attention.head_count must be > 0")));
    }
    let recurrent = kda_layers(&hp, name, n_layer)?;
    let rot = hp.u_or("rope.dimension_count", 0)?;
    if rot != 0 {
        return Err(hp.bad(format!(
            "{name}.rope.dimension_count is {rot}; GLM-5.3-Flash attention has no RoPE (0)"
        )));
    }
    let kda_sh = KdaShape {
        n_head,
        head_dim: hp.u("kda.head_dim")?,
        conv_kernel: hp.u("ssm.conv_kernel")?,
        rms_eps,
        lower_bound: if hp.has("kda.gate_lower_bound") {
            Some(hp.f_or("kda.gate_lower_bound", -5.0)?)
        } else {
            None
        },
    };
    if kda_sh.head_dim == 0 || kda_sh.conv_kernel == 0 {
        return Err(hp.bad("kda.head_dim and ssm.conv_kernel must be > 0".into()));
    }
    let kpool = if hp.has("attention.indexer.kpool") {
        hp.u("attention.indexer.kpool")?
    } else {
        hp.u("attention.indexer.block_size")?
    };
    let sh = PooledShape {
        n_head,
        q_lora: hp.u("attention.q_lora_rank")?,
        kv_lora: hp.u("attention.kv_lora_rank")?,
        head_k: hp.u("attention.key_length_mla")?,
        head_v: hp.u("attention.value_length_mla")?,
        rms_eps,
        idx_heads: hp.u("attention.indexer.head_count")?,
        idx_dim: hp.u("attention.indexer.key_length")?,
        top_k: hp.positions("attention.indexer.top_k", None, n_ctx_train)?,
        kpool,
        select_tail: hp.b_or("attention.indexer.kpool_select_tail", true)?,
        ln_eps,
    };
    if sh.kpool < 2 || !sh.top_k.is_multiple_of(sh.kpool) || sh.idx_heads == 0 || sh.idx_dim == 0 {
        return Err(hp.bad(format!(
            "indexer kpool {} must be > 1 and divide top_k {}; head_count and key_length > 0",
            sh.kpool, sh.top_k
        )));
    }
    if sh.q_lora == 0 || sh.kv_lora == 0 || sh.head_k == 0 || sh.head_v == 0 {
        return Err(hp.bad(
            "q_lora_rank, kv_lora_rank, key_length_mla, value_length_mla must be > 0".into(),
        ));
    }
    let full = indexer_types(&hp, name, n_layer, &recurrent)?;
    let n_hc = hp.u("hyper_connection.count")?;
    let hc = HcShape {
        n_hc,
        n_embd: e,
        sinkhorn_iters: hp.iterations("hyper_connection.sinkhorn_iterations", 20)?,
        eps: hp.f_nonneg_or("hyper_connection.epsilon", 1e-6)?,
        rms_eps,
    };
    if n_hc < 2 {
        return Err(hp.bad(format!("hyper_connection.count {n_hc} must be >= 2")));
    }
    let n_expert = hp.u("expert_count")?;
    let k = hp.u("expert_used_count")?;
    if n_expert == 0 || k == 0 || k > n_expert {
        return Err(hp.bad(format!(
            "expert_used_count {k} must be in 1..=expert_count {n_expert}"
        )));
    }
    let gating = hp.u_or("expert_gating_func", 2)?;
    if gating != 2 && gating != 0 {
        return Err(hp.bad(format!(
            "{name}.expert_gating_func is {gating}; GLM-5.3-Flash routes with sigmoid (2)"
        )));
    }
    let n_dense = hp.u_or("leading_dense_block_count", 0)?.min(n_layer);
    let n_ff_exp = hp.u("expert_feed_forward_length")?;
    let n_shared = hp.u_or("expert_shared_count", 1)?;
    let n_ff_sh = hp.u_or("expert_shared_feed_forward_length", n_ff_exp * n_shared)?;
    let w_scale = hp.f_pos_or("expert_weights_scale", 1.0)?;
    let w_norm = hp.b_or("expert_weights_norm", false)?;
    let clamp_exp = hp.per_layer_f32("swiglu_clamp_exp", n_block, Some(vec![0.0; n_block]))?;
    let clamp_sh = if hp.has("swiglu_clamp_shexp") {
        hp.per_layer_f32("swiglu_clamp_shexp", n_block, Some(vec![0.0; n_block]))?
    } else {
        clamp_exp.clone()
    };
    let n_vocab = hp.n_vocab()?;

    let t = Tensors::new(file, map);
    let n_mix = (2 + n_hc) * n_hc;
    let inner = kda_sh.inner();
    let mut layers = Vec::with_capacity(n_layer);
    for il in 0..n_layer {
        let n = |s: &str| format!("blk.{il}.{s}.weight");
        let hc_w = |p: &str| -> Result<HcWeights, ModelError> {
            Ok(HcWeights {
                proj: t.mat(&n(&format!("{p}_fn")), n_mix, n_hc * e)?,
                base: t.vec(&n(&format!("{p}_base")), n_mix)?,
                scale: t.vec(&n(&format!("{p}_scale")), 3)?,
            })
        };
        let mixer = if recurrent[il] {
            let d = kda_sh.head_dim;
            Mixer::Kda(Box::new(KdaWeights {
                q: t.mat(&n("attn_q"), inner, e)?,
                k: t.mat(&n("attn_k"), inner, e)?,
                v: t.mat(&n("attn_v"), inner, e)?,
                conv_q: t.vec_shaped(&n("ssm_conv1d_q"), &[kda_sh.conv_kernel, inner])?,
                conv_k: t.vec_shaped(&n("ssm_conv1d_k"), &[kda_sh.conv_kernel, inner])?,
                conv_v: t.vec_shaped(&n("ssm_conv1d_v"), &[kda_sh.conv_kernel, inner])?,
                f_a: t.mat(&n("ssm_f_a"), d, e)?,
                f_b: t.mat(&n("ssm_f_b"), inner, d)?,
                dt_bias: t.vec(&format!("blk.{il}.ssm_dt.bias"), inner)?,
                a: t.vec(&format!("blk.{il}.ssm_a"), n_head)?,
                beta: t.mat(&n("ssm_beta"), n_head, e)?,
                g_a: t.mat(&n("ssm_g_a"), d, e)?,
                g_b: t.mat(&n("ssm_g_b"), inner, d)?,
                norm: t.vec(&n("ssm_norm"), d)?,
                out: t.mat(&n("attn_output"), e, inner)?,
            }))
        } else {
            let indexer = if full[il] {
                let (ih, id) = (sh.idx_heads, sh.idx_dim);
                Some(PooledIndexer {
                    q_b: t.mat(&n("indexer.attn_q_b"), ih * id, sh.q_lora)?,
                    k: t.mat(&n("indexer.attn_k"), id, e)?,
                    k_norm: t.vec(&n("indexer.k_norm"), id)?,
                    k_norm_b: t.vec(&format!("blk.{il}.indexer.k_norm.bias"), id)?,
                    proj: t.mat(&n("indexer.proj"), ih, e)?,
                    gate: t.mat(&n("indexer_compressor_gate"), id, e)?,
                    ape: t.vec_shaped(&n("indexer_compressor_ape"), &[id, sh.kpool])?,
                })
            } else {
                None
            };
            Mixer::Pooled(Box::new(PooledWeights {
                q_a: t.mat(&n("attn_q_a"), sh.q_lora, e)?,
                q_a_norm: t.vec(&n("attn_q_a_norm"), sh.q_lora)?,
                q_b: t.mat(&n("attn_q_b"), n_head * sh.head_k, sh.q_lora)?,
                kv_a: t.mat(&n("attn_kv_a_mqa"), sh.kv_lora, e)?,
                kv_a_norm: t.vec(&n("attn_kv_a_norm"), sh.kv_lora)?,
                k_b: t.stacked(&n("attn_k_b"), sh.kv_lora, sh.head_k, n_head)?,
                v_b: t.stacked(&n("attn_v_b"), sh.head_v, sh.kv_lora, n_head)?,
                out: t.mat(&n("attn_output"), e, n_head * sh.head_v)?,
                indexer,
            }))
        };
        let ffn = if il < n_dense {
            Ffn::Dense(GluWeights::load(&t, il, "", e, None)?)
        } else {
            let experts = t.glu_experts(il, e, Some(n_ff_exp), n_expert)?;
            Ffn::Moe {
                moe: MoeWeights {
                    router_w: t.mat(&n("ffn_gate_inp"), n_expert, e)?,
                    router: Router::Biased {
                        score: ScoreFn::Sigmoid,
                        bias: t.vec(&format!("blk.{il}.exp_probs_b.bias"), n_expert)?,
                        norm: w_norm,
                        scale: w_scale,
                    },
                    n_expert,
                    k,
                    gate: UnitMat::from(&experts[0]),
                    up: UnitMat::from(&experts[1]),
                    down: UnitMat::from(&experts[2]),
                    act: clamp_act(clamp_exp[il]),
                    next: None,
                },
                shared: GluWeights::load(&t, il, "_shexp", e, Some(n_ff_sh))?,
                experts: Box::new(experts),
            }
        };
        layers.push(Layer {
            hc_attn: hc_w("hc_attn")?,
            hc_ffn: hc_w("hc_ffn")?,
            attn_norm: t.vec(&n("attn_norm"), e)?,
            mixer,
            ffn_norm: t.vec(&n("ffn_norm"), e)?,
            ffn,
            act_sh: clamp_act(clamp_sh[il]),
        });
    }
    link_lookahead(
        layers
            .iter_mut()
            .enumerate()
            .filter_map(|(il, l)| match &mut l.ffn {
                Ffn::Moe { moe, .. } => Some((il, moe, &l.ffn_norm[..])),
                _ => None,
            }),
    );
    let mtp_experts = t.mtp_glu_experts(n_layer..n_block, e, Some(n_ff_exp), n_expert)?;
    let (token_embd, output) = t.embd_and_output(n_vocab, e)?;
    let n_dsa = recurrent.iter().filter(|r| !**r).count();
    let cfg = ModelConfig {
        arch: name,
        n_layer,
        n_embd: e,
        n_vocab,
        n_ctx_train,
        n_expert,
        n_expert_used: k,
        kv_bytes_per_pos: (n_dsa * sh.bytes_per_pos()) as u64,
        state_bytes: ((n_layer - n_dsa) * kda_sh.state_bytes()) as u64,
    };
    Ok(Glm5Next {
        cfg,
        hc,
        kda: kda_sh,
        pooled: sh,
        rms_eps,
        token_embd,
        output_norm: t.vec("output_norm.weight", e)?,
        output,
        layers,
        mtp_experts,
    })
}

impl Glm5Next {
    /// Whether each layer is a KDA (true) or pooled-DSA latent-attention layer.
    pub fn kda_layers(&self) -> Vec<bool> {
        self.layers
            .iter()
            .map(|l| matches!(l.mixer, Mixer::Kda(_)))
            .collect()
    }

    /// Bytes of the fixed (context-independent) KDA state of one sequence.
    pub fn recurrent_state_bytes(&self) -> usize {
        self.kda_layers().iter().filter(|x| **x).count() * self.kda.state_bytes()
    }
}

impl Architecture for Glm5Next {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The model as a decoder plan: KDA or pooled latent attention per layer (their
    /// recurrent state and rows kept by the CPU decoder, a shared pooled layer reusing the
    /// previous full one's selection), dense or MoE halves with the clamped SwiGLU, inside
    /// the hyper-connection residual closed by the streams' mean.
    fn plan(&self) -> DecoderPlan {
        let layers = self
            .layers
            .iter()
            .map(|l| PlanLayer {
                hc: Some(Box::new([l.hc_attn.clone(), l.hc_ffn.clone()])),
                ..PlanLayer::new(
                    l.attn_norm.clone(),
                    match &l.mixer {
                        Mixer::Kda(w) => PlanAttn::Kda {
                            w: w.clone(),
                            shape: self.kda,
                        },
                        Mixer::Pooled(w) => PlanAttn::Pooled {
                            w: w.clone(),
                            shape: self.pooled,
                        },
                    },
                    l.ffn_norm.clone(),
                    match &l.ffn {
                        Ffn::Dense(w) => PlanFfn::Dense {
                            w: w.clone(),
                            act: l.act_sh,
                        },
                        Ffn::Moe {
                            moe,
                            experts,
                            shared,
                        } => PlanFfn::moe(
                            moe,
                            experts,
                            Some(PlanShared::new(shared.clone(), l.act_sh)),
                        ),
                    },
                )
            })
            .collect();
        let ps = &self.pooled;
        // The pooled layers' latent attention as a kernel sees it, absorbed: one KV head of
        // `kv_lora` keys (no RoPE part) whose values are those keys, the score scale of the
        // `head_k`-wide query heads.
        let shape = AttnShape {
            n_head: ps.n_head,
            n_head_kv: 1,
            head_dim: ps.kv_lora,
            head_dim_v: ps.kv_lora,
            scale: 1.0 / (ps.head_k as f32).sqrt(),
            rms_eps: self.rms_eps,
        };
        DecoderPlan {
            hyper: Some(PlanHyper {
                shape: self.hc,
                head: HyperHead::Mean,
            }),
            ..DecoderPlan::new(
                &self.cfg,
                shape,
                self.token_embd.clone(),
                self.output_norm.clone(),
                self.output.clone(),
                layers,
            )
        }
    }

    fn groups(&self) -> StreamableGroups {
        let layers = self.layers.iter().map(|l| match &l.ffn {
            Ffn::Moe { experts, .. } => Some(&**experts),
            Ffn::Dense(_) => None,
        });
        StreamableGroups {
            experts: expert_group(self.cfg.n_expert, layers, &self.mtp_experts),
            row_tables: Vec::new(),
        }
    }

    fn new_state(&self, n_ctx: usize) -> SeqState {
        // The KV cache only counts positions (and carries the f16 choice); the KDA states
        // and the latent / indexer rows live in the CPU decoder's state (`Model::new_state`).
        SeqState::new(KvCache::new(0, 0, 0, n_ctx))
    }
}
