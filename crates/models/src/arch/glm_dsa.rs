//! GLM-5 / 5.1 / 5.2 / 5.3 (`glm-dsa`, HF `GlmMoeDsaForCausalLM`, as llama.cpp's converter
//! writes it): plain pre-norm residual; multi-head latent attention ([`crate::blocks::mla`])
//! restricted per query to the top-k tokens of a DSA lightning indexer
//! ([`crate::blocks::dsa_indexer`]) on "full" layers, "shared" layers (IndexShare) reusing the
//! previous full layer's selection (`attention.indexer.types`; absent: all full below a
//! 1M-token context, else the GLM-5.2 pattern, as llama.cpp); the first
//! `leading_dense_block_count` layers dense SwiGLU, the rest MoE with sigmoid scores, a
//! selection-only bias, normalised weights times `expert_weights_scale`, and a shared expert.
//! A trailing MTP block (`nextn_predict_layers`) is loaded past and never run; its routed
//! experts are described so they stay on disk. Specification: ../shared/models/glm5.md 2.A.
//! The CPU runs its [`DecoderPlan`] (`crate::decoder::CpuDecoder`, whose state holds the
//! latent rows and indexer keys).

use sluice_gguf::{GgufFile, MetaValue};
use sluice_io::MappedFile;
use sluice_tier::StreamableGroups;

use super::Architecture;
use crate::blocks::attention::AttnShape;
use crate::blocks::dsa_indexer::IndexerWeights;
use crate::blocks::dsv4_attention::plain_inv_freq;
use crate::blocks::ffn::{Activation, GluWeights};
use crate::blocks::mla::{MlaShape, MlaWeights};
use crate::blocks::moe::{expert_group, link_lookahead, MoeWeights, Router, ScoreFn, UnitMat};
use crate::config::{Hparams, ModelConfig};
use crate::kv::KvCache;
use crate::plan::{DecoderPlan, MlaSelect, PlanAttn, PlanFfn, PlanLayer, PlanShared};
use crate::state::SeqState;
use crate::weights::{Mat, Stacked, Tensors};
use crate::ModelError;

const NAME: &str = "glm-dsa";

/// llama.cpp's `GLM_5_2_DEFAULT_INDEXER_TYPES`: full on layers 0, 1 and every 4th from 2.
fn glm52_full(il: usize) -> bool {
    il < 2 || (il - 2).is_multiple_of(4)
}

struct MoeFfn {
    moe: MoeWeights,
    shared: GluWeights,
    experts: [Stacked; 3],
}

enum Ffn {
    Dense(GluWeights),
    Moe(Box<MoeFfn>),
}

struct Layer {
    attn_norm: Vec<f32>,
    attn: MlaWeights,
    /// Some on "full" layers.
    indexer: Option<IndexerWeights>,
    ffn_norm: Vec<f32>,
    ffn: Ffn,
}

pub struct GlmDsa {
    cfg: ModelConfig,
    shape: MlaShape,
    rms_eps: f32,
    token_embd: Mat,
    output_norm: Vec<f32>,
    output: Mat,
    layers: Vec<Layer>,
    /// Routed experts of the MTP block(s), never run, described so they stream (stay on disk).
    mtp_experts: Vec<(usize, [Stacked; 3])>,
}

/// `attention.indexer.types` (bools, or integers 0/1), one per layer.
fn indexer_types(hp: &Hparams<'_>, n_layer: usize) -> Result<Option<Vec<bool>>, ModelError> {
    let key = format!("{NAME}.attention.indexer.types");
    let Some(v) = hp.file.get(&key) else {
        return Ok(None);
    };
    let vals: Vec<MetaValue> = match v {
        MetaValue::Array(a) => a.values.clone(),
        v => vec![v.clone()],
    };
    let b: Option<Vec<bool>> = vals
        .iter()
        .map(|x| x.as_bool().or_else(|| x.as_u64().map(|u| u != 0)))
        .collect();
    let b = b.ok_or_else(|| hp.bad(format!("{key} must hold booleans")))?;
    if b.len() < n_layer {
        return Err(hp.bad(format!(
            "{key} has {} entries for {n_layer} layers",
            b.len()
        )));
    }
    Ok(Some(b))
}

pub fn load(file: &GgufFile, map: &MappedFile) -> Result<Box<dyn Architecture>, ModelError> {
    let hp = Hparams::new(file, NAME);
    let t = Tensors::new(file, map);
    let e = hp.u("embedding_length")?;
    let n_head = hp.u("attention.head_count")?;
    let n_block = hp.block_count()?;
    let rms_eps = hp.f_or("attention.layer_norm_rms_epsilon", 1e-5)?;
    let rope_base = hp.f_or("rope.freq_base", 10_000.0)?;
    let n_rot = hp.u("rope.dimension_count")?;
    let n_ctx_train = hp.context_length(4096)?;
    hp.no_rope_scaling()?;
    let q_lora = hp.u("attention.q_lora_rank")?;
    let kv_lora = hp.u("attention.kv_lora_rank")?;
    if n_block == 0 || e == 0 || n_head == 0 || q_lora == 0 || kv_lora == 0 {
        return Err(hp.bad(
            "block_count, embedding_length, attention.head_count, q_lora_rank and kv_lora_rank \
             must be > 0"
                .into(),
        ));
    }
    super::check_attention(&hp, n_head, 1, 2, rms_eps, rope_base)?;
    // Head sizes: key_length_mla / value_length_mla (llama.cpp's MLA keys); older files
    // without them: from the q_b and v_b shapes.
    let hd = match hp.u_or("attention.key_length_mla", 0)? {
        0 => {
            t.info("blk.0.attn_q_b.weight")?
                .dims
                .get(1)
                .copied()
                .unwrap_or(0) as usize
                / n_head
        }
        v => v,
    };
    let v_dim = match hp.u_or("attention.value_length_mla", 0)? {
        0 => t
            .info("blk.0.attn_v_b.weight")?
            .dims
            .get(1)
            .copied()
            .unwrap_or(0) as usize,
        v => v,
    };
    if n_rot == 0 || !n_rot.is_multiple_of(2) || n_rot >= hd || v_dim == 0 {
        return Err(hp.bad(format!(
            "rope.dimension_count {n_rot} must be even, > 0 and < the MLA key length {hd}; \
             value length {v_dim} must be > 0"
        )));
    }
    let nope = hd - n_rot;
    // The MTP block(s) sit after the main layers when the file carries them.
    let n_mtp = hp.u_or("nextn_predict_layers", 0)?;
    let n_layer = if n_mtp > 0
        && n_mtp < n_block
        && t.has(&format!("blk.{}.nextn.eh_proj.weight", n_block - n_mtp))
    {
        n_block - n_mtp
    } else {
        n_block
    };
    let full = match indexer_types(&hp, n_layer)? {
        Some(b) => b,
        None if n_ctx_train < 1_048_576 => vec![true; n_layer],
        None => (0..n_layer).map(glm52_full).collect(),
    };
    if !full[0] {
        return Err(hp.bad(format!(
            "{NAME}.attention.indexer.types: layer 0 is shared, but a shared layer reuses an \
             earlier full layer's selection"
        )));
    }
    let (ix_heads, ix_dim, ix_topk) = (
        hp.u("attention.indexer.head_count")?,
        hp.u("attention.indexer.key_length")?,
        hp.positions("attention.indexer.top_k", None, n_ctx_train)?,
    );
    if ix_heads == 0 || ix_topk == 0 || ix_dim < n_rot {
        return Err(hp.bad(format!(
            "attention.indexer.head_count {ix_heads} and top_k {ix_topk} must be > 0 and \
             key_length {ix_dim} >= rope.dimension_count {n_rot}"
        )));
    }
    let ix_eps = hp.f_nonneg_or("attention.layer_norm_epsilon", 1e-6)?;
    let n_expert = hp.u("expert_count")?;
    let k = hp.u("expert_used_count")?;
    if n_expert == 0 || k == 0 || k > n_expert {
        return Err(hp.bad(format!(
            "expert_used_count {k} must be in 1..=expert_count {n_expert}"
        )));
    }
    let gating = hp.u_or("expert_gating_func", 2)?;
    let score = match gating {
        // 0 = none: llama.cpp takes sigmoid for glm-dsa.
        0 | 2 => ScoreFn::Sigmoid,
        1 => ScoreFn::Softmax,
        g => {
            return Err(hp.bad(format!(
                "{NAME}.expert_gating_func is {g}; glm-dsa uses 2 (sigmoid)"
            )))
        }
    };
    let n_shared = hp.u_or("expert_shared_count", 1)?;
    let w_scale = hp.f_pos_or("expert_weights_scale", 1.0)?;
    let w_norm = hp.b_or("expert_weights_norm", true)?;
    let n_dense = hp.u_or("leading_dense_block_count", 0)?.min(n_layer);
    let n_vocab = hp.n_vocab()?;
    let shape = MlaShape {
        n_head,
        q_lora,
        kv_lora,
        nope,
        rope: n_rot,
        v_dim,
        scale: 1.0 / (hd as f32).sqrt(),
        rms_eps,
    };
    let n_full = full[..n_layer].iter().filter(|&&f| f).count();
    let cfg = ModelConfig {
        arch: NAME,
        n_layer,
        n_embd: e,
        n_vocab,
        n_ctx_train,
        n_expert,
        n_expert_used: k,
        kv_bytes_per_pos: ((n_layer * shape.row() + n_full * ix_dim) * 4) as u64,
        // Latent rows and indexer keys grow with the context (kv_bytes_per_pos).
        state_bytes: 0,
    };
    let inv_freq = plain_inv_freq(n_rot, rope_base);
    let mut layers = Vec::with_capacity(n_layer);
    for (il, &is_full) in full.iter().enumerate().take(n_layer) {
        let n = |s: &str| format!("blk.{il}.{s}.weight");
        let attn = MlaWeights {
            q_a: t.mat(&n("attn_q_a"), q_lora, e)?,
            q_a_norm: t.vec(&n("attn_q_a_norm"), q_lora)?,
            q_b: t.mat(&n("attn_q_b"), n_head * hd, q_lora)?,
            kv_a: t.mat(&n("attn_kv_a_mqa"), kv_lora + n_rot, e)?,
            kv_a_norm: t.vec(&n("attn_kv_a_norm"), kv_lora)?,
            k_b: per_head(&t, &n("attn_k_b"), nope, kv_lora, n_head)?,
            v_b: per_head(&t, &n("attn_v_b"), kv_lora, v_dim, n_head)?,
            out: t.mat(&n("attn_output"), e, n_head * v_dim)?,
            inv_freq: inv_freq.clone(),
        };
        // Shared layers never read indexer weights (unsloth's files carry them everywhere).
        let indexer = if is_full {
            Some(IndexerWeights {
                n_head: ix_heads,
                head_dim: ix_dim,
                top_k: ix_topk,
                q_b: t.mat(&n("indexer.attn_q_b"), ix_heads * ix_dim, q_lora)?,
                k: t.mat(&n("indexer.attn_k"), ix_dim, e)?,
                k_norm: t.vec(&n("indexer.k_norm"), ix_dim)?,
                k_norm_bias: t.vec(&format!("blk.{il}.indexer.k_norm.bias"), ix_dim)?,
                k_norm_eps: ix_eps,
                proj: t.mat(&n("indexer.proj"), ix_heads, e)?,
            })
        } else {
            None
        };
        let ffn = if il < n_dense {
            Ffn::Dense(GluWeights::load(&t, il, "", e, None)?)
        } else {
            let experts = t.glu_experts(il, e, None, n_expert)?;
            let shared = GluWeights::load(&t, il, "_shexp", e, None)?;
            if n_shared == 0 {
                return Err(hp.bad(format!(
                    "{NAME}.expert_shared_count is 0 but blk.{il} has a shared expert"
                )));
            }
            Ffn::Moe(Box::new(MoeFfn {
                moe: MoeWeights {
                    router_w: t.mat(&n("ffn_gate_inp"), n_expert, e)?,
                    router: Router::Biased {
                        score,
                        bias: t.vec(&format!("blk.{il}.exp_probs_b.bias"), n_expert)?,
                        norm: w_norm,
                        scale: w_scale,
                    },
                    n_expert,
                    k,
                    gate: UnitMat::from(&experts[0]),
                    up: UnitMat::from(&experts[1]),
                    down: UnitMat::from(&experts[2]),
                    act: Activation::Silu,
                    next: None,
                },
                shared,
                experts,
            }))
        };
        layers.push(Layer {
            attn_norm: t.vec(&n("attn_norm"), e)?,
            attn,
            indexer,
            ffn_norm: t.vec(&n("ffn_norm"), e)?,
            ffn,
        });
    }
    link_lookahead(
        layers
            .iter_mut()
            .enumerate()
            .filter_map(|(il, l)| match &mut l.ffn {
                Ffn::Moe(m) => Some((il, &mut m.moe, &l.ffn_norm[..])),
                _ => None,
            }),
    );
    let mtp_experts = t.mtp_glu_experts(n_layer..n_block, e, None, n_expert)?;
    let (token_embd, output) = t.embd_and_output(n_vocab, e)?;
    Ok(Box::new(GlmDsa {
        cfg,
        shape,
        rms_eps,
        token_embd,
        output_norm: t.vec("output_norm.weight", e)?,
        output,
        layers,
        mtp_experts,
    }))
}

/// A per-head 3-D tensor `ne = [cols, rows, n_head]` as one `[n_head * rows, cols]` matrix.
fn per_head(
    t: &Tensors<'_>,
    name: &str,
    cols: usize,
    rows: usize,
    n_head: usize,
) -> Result<Mat, ModelError> {
    let info = t.info(name)?;
    let want = [cols as u64, rows as u64, n_head as u64];
    if info.dims.as_slice() != want {
        return Err(t.bad(
            name,
            format!("expected shape {want:?}, found {:?}", info.dims),
        ));
    }
    t.check_type(name, info.ty)?;
    Ok(Mat {
        ty: info.ty,
        rows: rows * n_head,
        cols,
        range: t.range(info),
    })
}

impl GlmDsa {
    /// Which layers run their own indexer ("full"; the others reuse the previous selection).
    pub fn indexer_full(&self) -> Vec<bool> {
        self.layers.iter().map(|l| l.indexer.is_some()).collect()
    }
}

impl Architecture for GlmDsa {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn groups(&self) -> StreamableGroups {
        let layers = self.layers.iter().map(|l| match &l.ffn {
            Ffn::Moe(m) => Some(&m.experts),
            Ffn::Dense(_) => None,
        });
        StreamableGroups {
            experts: expert_group(self.cfg.n_expert, layers, &self.mtp_experts),
            row_tables: Vec::new(),
        }
    }

    fn new_state(&self, n_ctx: usize) -> SeqState {
        // The KV cache only counts positions (and carries the f16 choice); the rows live in
        // the CPU decoder's state (`Model::new_state`).
        SeqState::new(KvCache::new(0, 0, 0, n_ctx))
    }

    /// The model as an MLA decoder whose full layers select positions with their DSA
    /// indexer and whose shared layers reuse the last selection (exact at any length).
    fn plan(&self) -> DecoderPlan {
        let layers = self
            .layers
            .iter()
            .map(|l| {
                PlanLayer::new(
                    l.attn_norm.clone(),
                    PlanAttn::Mla {
                        w: Box::new(l.attn.clone()),
                        shape: self.shape,
                        // Full layers run their indexer, shared ones reuse the last pick.
                        select: match &l.indexer {
                            Some(ix) => MlaSelect::Indexer(Box::new(ix.clone())),
                            None => MlaSelect::Previous,
                        },
                    },
                    l.ffn_norm.clone(),
                    match &l.ffn {
                        Ffn::Dense(w) => PlanFfn::Dense {
                            w: w.clone(),
                            act: Activation::Silu,
                        },
                        Ffn::Moe(m) => PlanFfn::moe(
                            &m.moe,
                            &m.experts,
                            Some(PlanShared::new(m.shared.clone(), Activation::Silu)),
                        ),
                    },
                )
            })
            .collect();
        let s = &self.shape;
        // Absorbed MLA as a kernel sees it: one KV head of `[c | k_rope]`, values `c`.
        let shape = AttnShape {
            n_head: s.n_head,
            n_head_kv: 1,
            head_dim: s.row(),
            head_dim_v: s.kv_lora,
            scale: s.scale,
            rms_eps: self.rms_eps,
        };
        DecoderPlan::new(
            &self.cfg,
            shape,
            self.token_embd.clone(),
            self.output_norm.clone(),
            self.output.clone(),
            layers,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glm52_pattern_has_21_full_layers() {
        let full: Vec<bool> = (0..78).map(glm52_full).collect();
        assert_eq!(full.iter().filter(|&&f| f).count(), 21);
        assert_eq!(
            &full[..8],
            &[true, true, true, false, false, false, true, false]
        );
    }
}
