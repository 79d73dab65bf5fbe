//! Synthetic GLM-5.x (`glm-dsa`) files: every trunk tensor llama.cpp's converter writes for
//! the real model (MLA with q-LoRA, the latent `attn_kv_a_mqa`, per-head `attn_k_b` /
//! `attn_v_b`, the DSA indexer on "full" layers only, dense leading layers, sigmoid routers
//! with a selection bias, shared expert), with the keys of ../shared/models/glm5.md 3.1
//! (`attention.indexer.types` written explicitly), in the tensor types of the real releases:
//!
//! - `iq2xxs` (antirez's GLM-5.2 IQ2_XXS file): routed gate/up/down IQ2_XXS; attention,
//!   indexer, dense and shared FFN, embedding and output Q8_0; router and norms F32.
//! - `q2` (antirez's Q2_K file): routed experts Q2_K, the rest as above.
//!
//! No MTP block is written (`nextn_predict_layers` 0): the engine never runs it.
//!
//! Owns: the glm-dsa presets ([`GlmDsaShape`]) and the file plan ([`plan`]); the block
//! fillers, writer and vocabulary are the crate's.

use std::path::Path;

use sluice_gguf::{GgmlType, GgufWriter, MetaArray, MetaType, MetaValue, TensorSpec};

use crate::blocks::Fill;
use crate::{Plan, PlannedTensor, SynthError, Vocab};

/// Every dimension of a glm-dsa model.
#[derive(Debug, Clone, PartialEq)]
pub struct GlmDsaShape {
    pub layers: usize,
    pub hidden: usize,
    /// Vocabulary size; `None` = the tokenizer's token count.
    pub vocab: Option<usize>,
    pub heads: usize,
    pub q_lora: usize,
    pub kv_lora: usize,
    pub nope: usize,
    pub rope: usize,
    pub v_dim: usize,
    pub dense_layers: usize,
    pub dense_ff: usize,
    pub experts: usize,
    pub top_k: usize,
    pub expert_ff: usize,
    pub index_heads: usize,
    pub index_head_dim: usize,
    pub index_top_k: usize,
    pub context: usize,
    pub rope_base: f32,
}

/// Named glm-dsa shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GlmDsaPreset {
    /// GLM-5.2 / 5.3 (744B): 78 layers (3 dense), hidden 6144, vocab 154880, 64 MLA heads
    /// (q_lora 2048, kv_lora 512, nope 192 + rope 64, v 256), 256 experts of 2048 (top-8),
    /// indexer 32 x 128 top-2048 with the 5.2 IndexShare pattern, context 1M, RoPE base 8e6.
    Glm52,
    /// The same structure shrunk for tests: hidden 256, 4 layers (1 dense), 4 heads, 16
    /// experts of 256 (top-2), indexer 8 x 64 top-8 (rows multiples of 256 where IQ2_XXS /
    /// Q2_K need it).
    Tiny,
}

impl GlmDsaPreset {
    pub const NAMES: [&'static str; 2] = ["glm-5.2", "glm-dsa-tiny"];

    pub fn from_name(name: &str) -> Option<GlmDsaPreset> {
        match name {
            "glm-5.2" | "glm-5.3" => Some(GlmDsaPreset::Glm52),
            "glm-dsa-tiny" => Some(GlmDsaPreset::Tiny),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            GlmDsaPreset::Glm52 => "glm-5.2",
            GlmDsaPreset::Tiny => "glm-dsa-tiny",
        }
    }

    pub fn shape(self) -> GlmDsaShape {
        match self {
            GlmDsaPreset::Glm52 => GlmDsaShape {
                layers: 78,
                hidden: 6144,
                vocab: Some(154_880),
                heads: 64,
                q_lora: 2048,
                kv_lora: 512,
                nope: 192,
                rope: 64,
                v_dim: 256,
                dense_layers: 3,
                dense_ff: 12_288,
                experts: 256,
                top_k: 8,
                expert_ff: 2048,
                index_heads: 32,
                index_head_dim: 128,
                index_top_k: 2048,
                context: 1_048_576,
                rope_base: 8e6,
            },
            GlmDsaPreset::Tiny => GlmDsaShape {
                layers: 4,
                hidden: 256,
                vocab: None,
                heads: 4,
                q_lora: 128,
                kv_lora: 64,
                nope: 32,
                rope: 32,
                v_dim: 64,
                dense_layers: 1,
                dense_ff: 512,
                experts: 16,
                top_k: 2,
                expert_ff: 256,
                index_heads: 8,
                index_head_dim: 64,
                index_top_k: 8,
                context: 4096,
                rope_base: 8e6,
            },
        }
    }
}

/// Routed-expert layout of the real releases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GlmDsaQuant {
    /// IQ2_XXS gate/up/down.
    Iq2xxs,
    /// Q2_K gate/up/down.
    Q2,
}

impl GlmDsaQuant {
    pub fn from_name(name: &str) -> Option<GlmDsaQuant> {
        match name.to_ascii_lowercase().as_str() {
            "iq2xxs" | "iq2_xxs" => Some(GlmDsaQuant::Iq2xxs),
            "q2" | "q2_k" => Some(GlmDsaQuant::Q2),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            GlmDsaQuant::Iq2xxs => "iq2xxs",
            GlmDsaQuant::Q2 => "q2",
        }
    }

    fn experts(self) -> GgmlType {
        match self {
            GlmDsaQuant::Iq2xxs => GgmlType::IQ2_XXS,
            GlmDsaQuant::Q2 => GgmlType::Q2_K,
        }
    }

    /// `general.file_type` (llama.cpp `llama_ftype`).
    fn file_type(self) -> u32 {
        match self {
            GlmDsaQuant::Iq2xxs => 19, // MOSTLY_IQ2_XXS
            GlmDsaQuant::Q2 => 10,     // MOSTLY_Q2_K
        }
    }
}

/// What to generate.
#[derive(Debug, Clone)]
pub struct GlmDsaConfig {
    pub shape: GlmDsaShape,
    pub quant: GlmDsaQuant,
    pub seed: u64,
    /// `general.name`.
    pub name: String,
}

/// The GLM-5.2 IndexShare pattern (llama.cpp `GLM_5_2_DEFAULT_INDEXER_TYPES`): full on layers
/// 0, 1 and every 4th from 2.
pub fn indexer_types(layers: usize) -> Vec<bool> {
    (0..layers)
        .map(|il| il < 2 || (il - 2).is_multiple_of(4))
        .collect()
}

impl GlmDsaShape {
    fn validate(&self, quant: GlmDsaQuant, n_vocab: usize) -> Result<(), SynthError> {
        let bad = |w: String| Err(SynthError::Config(w));
        let dims = [
            ("layers", self.layers),
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("experts", self.experts),
            ("top-k", self.top_k),
            ("expert-ff", self.expert_ff),
            ("vocab", n_vocab),
        ];
        if let Some((n, _)) = dims.iter().find(|(_, v)| *v == 0) {
            return bad(format!("--{n} must be > 0"));
        }
        if self.top_k > self.experts {
            return bad(format!(
                "--top-k {} exceeds --experts {}",
                self.top_k, self.experts
            ));
        }
        let ty = quant.experts();
        for (what, len) in [
            ("expert gate/up rows (hidden)", self.hidden),
            ("expert down rows (expert-ff)", self.expert_ff),
        ] {
            if !crate::blocks::fits(ty, len) {
                return bad(format!(
                    "{what} of {len} are not a multiple of {ty}'s {} values per block",
                    crate::blocks::block_geometry(ty).1
                ));
            }
        }
        Ok(())
    }
}

/// Lay out a glm-dsa file for `cfg` with `vocab`'s tokenizer (padded to `shape.vocab`).
pub fn plan(cfg: &GlmDsaConfig, mut vocab: Vocab) -> Result<Plan, SynthError> {
    let s = &cfg.shape;
    if let Some(n) = s.vocab {
        vocab.pad_to(n)?;
    }
    let n_vocab = vocab.n_tokens;
    s.validate(cfg.quant, n_vocab)?;
    let dense = s.dense_layers.min(s.layers);
    let full = indexer_types(s.layers);
    let a = "glm-dsa";
    let u = |v: usize| MetaValue::U32(v as u32);
    let f = MetaValue::F32;
    let mut metadata: Vec<(String, MetaValue)> = vec![
        ("general.architecture".into(), MetaValue::Str(a.into())),
        ("general.type".into(), MetaValue::Str("model".into())),
        ("general.name".into(), MetaValue::Str(cfg.name.clone())),
        (format!("{a}.block_count"), u(s.layers)),
        (format!("{a}.context_length"), u(s.context)),
        (format!("{a}.embedding_length"), u(s.hidden)),
        (format!("{a}.feed_forward_length"), u(s.dense_ff)),
        (format!("{a}.attention.head_count"), u(s.heads)),
        (format!("{a}.attention.head_count_kv"), u(1)),
        (format!("{a}.rope.freq_base"), f(s.rope_base)),
        (format!("{a}.attention.layer_norm_rms_epsilon"), f(1e-5)),
        (format!("{a}.expert_count"), u(s.experts)),
        (format!("{a}.expert_used_count"), u(s.top_k)),
        (format!("{a}.expert_group_count"), u(1)),
        (format!("{a}.expert_group_used_count"), u(1)),
        (format!("{a}.attention.key_length"), u(s.kv_lora + s.rope)),
        (format!("{a}.attention.value_length"), u(s.kv_lora)),
        (format!("{a}.leading_dense_block_count"), u(dense)),
        (format!("{a}.vocab_size"), u(n_vocab)),
        (format!("{a}.attention.q_lora_rank"), u(s.q_lora)),
        (format!("{a}.attention.kv_lora_rank"), u(s.kv_lora)),
        (format!("{a}.attention.key_length_mla"), u(s.nope + s.rope)),
        (format!("{a}.attention.value_length_mla"), u(s.v_dim)),
        (format!("{a}.expert_feed_forward_length"), u(s.expert_ff)),
        (format!("{a}.expert_shared_count"), u(1)),
        (format!("{a}.expert_weights_scale"), f(2.5)),
        (format!("{a}.expert_weights_norm"), MetaValue::Bool(true)),
        (format!("{a}.expert_gating_func"), u(2)),
        (format!("{a}.rope.dimension_count"), u(s.rope)),
        (format!("{a}.nextn_predict_layers"), u(0)),
        (
            format!("{a}.attention.indexer.head_count"),
            u(s.index_heads),
        ),
        (
            format!("{a}.attention.indexer.key_length"),
            u(s.index_head_dim),
        ),
        (format!("{a}.attention.indexer.top_k"), u(s.index_top_k)),
        (
            format!("{a}.attention.indexer.types"),
            MetaValue::Array(MetaArray {
                elem_type: MetaType::Bool,
                values: full.iter().map(|&b| MetaValue::Bool(b)).collect(),
            }),
        ),
        (
            "general.file_type".into(),
            MetaValue::U32(cfg.quant.file_type()),
        ),
        ("general.quantization_version".into(), MetaValue::U32(2)),
    ];
    metadata.extend(vocab.metadata);

    let (e, v, x) = (s.hidden as u64, n_vocab as u64, s.experts as u64);
    let (nh, ql, kl) = (s.heads as u64, s.q_lora as u64, s.kv_lora as u64);
    let (nope, rope, vd) = (s.nope as u64, s.rope as u64, s.v_dim as u64);
    let (ff, dff) = (s.expert_ff as u64, s.dense_ff as u64);
    let (ixh, ixd) = (s.index_heads as u64, s.index_head_dim as u64);
    let sigma = |fan_in: u64| 1.0 / (fan_in as f32).sqrt();
    let ex_ty = cfg.quant.experts();
    let mut tensors: Vec<PlannedTensor> = Vec::new();
    let mut fallbacks = Vec::new();
    // A matrix in `ty`; rows that are not whole blocks fall back to Q8_0 (32-blocks), then F16.
    let mut mat = |t: &mut Vec<PlannedTensor>, name: String, dims: &[u64], ty: GgmlType, sg| {
        let ty = if crate::blocks::fits(ty, dims[0] as usize) {
            ty
        } else if crate::blocks::fits(GgmlType::Q8_0, dims[0] as usize) {
            fallbacks.push(format!("{name}: Q8_0 (rows of {})", dims[0]));
            GgmlType::Q8_0
        } else {
            fallbacks.push(format!("{name}: F16 (rows of {})", dims[0]));
            GgmlType::F16
        };
        t.push(PlannedTensor {
            spec: TensorSpec::new(name, dims, ty),
            fill: Fill::Random { sigma: sg },
            row_scale: None,
        });
    };
    let small = |name: String, dims: &[u64], sg: f32| PlannedTensor {
        spec: TensorSpec::new(name, dims, GgmlType::F32),
        fill: Fill::Random { sigma: sg },
        row_scale: None,
    };
    let ones = |name: String, len: u64| PlannedTensor {
        spec: TensorSpec::new(name, &[len], GgmlType::F32),
        fill: Fill::Ones,
        row_scale: None,
    };
    let q8 = GgmlType::Q8_0;
    let t = &mut tensors;
    mat(t, "token_embd.weight".into(), &[e, v], q8, 1.0);
    for (il, &is_full) in full.iter().enumerate() {
        let n = |t: &str| format!("blk.{il}.{t}.weight");
        t.push(ones(n("attn_norm"), e));
        mat(t, n("attn_q_a"), &[e, ql], q8, sigma(e));
        t.push(ones(n("attn_q_a_norm"), ql));
        mat(t, n("attn_q_b"), &[ql, nh * (nope + rope)], q8, sigma(ql));
        mat(t, n("attn_kv_a_mqa"), &[e, kl + rope], q8, sigma(e));
        t.push(ones(n("attn_kv_a_norm"), kl));
        mat(t, n("attn_k_b"), &[nope, kl, nh], q8, sigma(nope));
        mat(t, n("attn_v_b"), &[kl, vd, nh], q8, sigma(kl));
        mat(t, n("attn_output"), &[nh * vd, e], q8, sigma(nh * vd));
        if is_full {
            mat(t, n("indexer.attn_q_b"), &[ql, ixh * ixd], q8, sigma(ql));
            mat(t, n("indexer.attn_k"), &[e, ixd], q8, sigma(e));
            t.push(small(n("indexer.proj"), &[e, ixh], sigma(e)));
            t.push(ones(n("indexer.k_norm"), ixd));
            t.push(small(format!("blk.{il}.indexer.k_norm.bias"), &[ixd], 0.01));
        }
        t.push(ones(n("ffn_norm"), e));
        if il < dense {
            mat(t, n("ffn_gate"), &[e, dff], q8, sigma(e));
            mat(t, n("ffn_up"), &[e, dff], q8, sigma(e));
            mat(t, n("ffn_down"), &[dff, e], q8, sigma(dff));
            continue;
        }
        t.push(small(n("ffn_gate_inp"), &[e, x], sigma(e)));
        t.push(small(format!("blk.{il}.exp_probs_b.bias"), &[x], 0.01));
        mat(t, n("ffn_gate_exps"), &[e, ff, x], ex_ty, sigma(e));
        mat(t, n("ffn_up_exps"), &[e, ff, x], ex_ty, sigma(e));
        mat(t, n("ffn_down_exps"), &[ff, e, x], ex_ty, sigma(ff));
        mat(t, n("ffn_gate_shexp"), &[e, ff], q8, sigma(e));
        mat(t, n("ffn_up_shexp"), &[e, ff], q8, sigma(e));
        mat(t, n("ffn_down_shexp"), &[ff, e], q8, sigma(ff));
    }
    t.push(ones("output_norm.weight".into(), e));
    mat(t, "output.weight".into(), &[e, v], q8, sigma(e));

    let specs: Vec<TensorSpec> = tensors.iter().map(|t| t.spec.clone()).collect();
    let layout = GgufWriter::new(
        std::io::sink(),
        Path::new("<synth plan>"),
        &metadata,
        &specs,
    )?
    .layout()
    .clone();
    Ok(Plan {
        metadata,
        tensors,
        layout,
        seed: cfg.seed,
        fallbacks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn glm52_preset_sizes() {
        let full = indexer_types(78);
        assert_eq!(full.iter().filter(|&&b| b).count(), 21);
        let cfg = GlmDsaConfig {
            shape: GlmDsaPreset::Glm52.shape(),
            quant: GlmDsaQuant::Iq2xxs,
            seed: 1,
            name: "t".into(),
        };
        let plan = plan(&cfg, Vocab::builtin()).unwrap();
        // 75 MoE layers x 256 experts x 3 IQ2_XXS matrices of 6144 x 2048 (66 B / 256).
        let per = 3 * 6144 * 2048 / 256 * 66;
        assert_eq!(plan.role_bytes().routed_experts, 75 * 256 * per);
        assert!(plan.fallbacks.is_empty(), "{:?}", plan.fallbacks);
    }
}
