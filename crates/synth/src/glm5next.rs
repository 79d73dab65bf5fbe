//! `sluice synth --preset glm-5.3-flash`: random-weight files of the real GLM-5.3-Flash shape
//! (`glm5-next` as upstream llama.cpp's converter names every key and tensor), without the
//! MTP block.
//!
//! Owns: the real dimensions (../shared/models/glm5.md sections 1.2 and 3), the metadata and
//! the tensor list. `--layers N` keeps the layer pattern (KDA unless `il % 4 == 3`, the
//! first `min(3, N - 1)` layers dense) and shrinks the file per layer; `--experts` shrinks the
//! routed experts per MoE layer (for a small file llama.cpp can load). Small parameters stay
//! F32 as the converter forces them (hyper-connections, `ssm_a`, `ssm_dt`, the selection
//! bias, the k-pool compressor, norms, convolutions, the router).

use sluice_gguf::{GgmlType, MetaArray, MetaType, MetaValue, TensorSpec};

use crate::blocks::Fill;
use crate::{type_for, Plan, PlannedTensor, SynthError, Vocab};

/// The real model's dimensions.
pub const HIDDEN: usize = 4096;
pub const VOCAB: usize = 154_880;
pub const LAYERS: usize = 45;
pub const DENSE: usize = 3;
pub const FF: usize = 12_288;
pub const EXPERTS: usize = 288;
pub const TOP_K: usize = 8;
pub const EXPERT_FF: usize = 2048;
pub const HEADS: usize = 64;
pub const KDA_DIM: usize = 128;
pub const Q_LORA: usize = 1536;
pub const KV_LORA: usize = 512;
pub const HEAD_K: usize = 256;
pub const HEAD_V: usize = 256;
pub const IDX_HEADS: usize = 32;
pub const IDX_DIM: usize = 128;
pub const IDX_TOPK: usize = 2048;
pub const KPOOL: usize = 4;
pub const STREAMS: usize = 4;

/// The dimensions of a file: the real model's ([`G5Shape::flash`]) or a smaller one with
/// the same structure (tests whose kernels need particular sizes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct G5Shape {
    pub hidden: usize,
    pub vocab: usize,
    /// Leading dense layers (at most `layers - 1` are written) and their width.
    pub dense: usize,
    pub ff: usize,
    pub top_k: usize,
    pub expert_ff: usize,
    pub heads: usize,
    pub kda_dim: usize,
    pub q_lora: usize,
    pub kv_lora: usize,
    pub head_k: usize,
    pub head_v: usize,
    pub idx_heads: usize,
    pub idx_dim: usize,
    pub idx_topk: usize,
    pub kpool: usize,
    pub streams: usize,
}

impl G5Shape {
    /// GLM-5.3-Flash's own dimensions.
    pub fn flash() -> G5Shape {
        G5Shape {
            hidden: HIDDEN,
            vocab: VOCAB,
            dense: DENSE,
            ff: FF,
            top_k: TOP_K,
            expert_ff: EXPERT_FF,
            heads: HEADS,
            kda_dim: KDA_DIM,
            q_lora: Q_LORA,
            kv_lora: KV_LORA,
            head_k: HEAD_K,
            head_v: HEAD_V,
            idx_heads: IDX_HEADS,
            idx_dim: IDX_DIM,
            idx_topk: IDX_TOPK,
            kpool: KPOOL,
            streams: STREAMS,
        }
    }
}

/// What to generate.
#[derive(Debug, Clone)]
pub struct G5SynthConfig {
    pub shape: G5Shape,
    pub layers: usize,
    pub experts: usize,
    /// Large matrices (experts, attention, embeddings).
    pub quant: GgmlType,
    pub seed: u64,
    pub name: String,
}

fn arr(elem_type: MetaType, values: Vec<MetaValue>) -> MetaValue {
    MetaValue::Array(MetaArray { elem_type, values })
}

/// Whether layer `il` is a KDA layer (the release layout).
pub fn is_kda(il: usize) -> bool {
    il % 4 != 3
}

/// Lay out the file.
pub fn plan(cfg: &G5SynthConfig, mut vocab: Vocab) -> Result<Plan, SynthError> {
    let nl = cfg.layers;
    let sh = &cfg.shape;
    if nl < 2 {
        return Err(SynthError::Config(
            "--layers must be >= 2 (a dense layer and a MoE layer)".into(),
        ));
    }
    let nx = cfg.experts;
    if nx < sh.top_k {
        return Err(SynthError::Config(format!(
            "--experts must be >= top-k {}",
            sh.top_k
        )));
    }
    vocab.pad_to(sh.vocab)?;
    let a = "glm5-next";
    let dense = sh.dense.min(nl - 1);
    let u = |v: usize| MetaValue::U32(v as u32);
    let f = MetaValue::F32;
    let per_layer_f = |v: f32| arr(MetaType::F32, vec![MetaValue::F32(v); nl]);
    let mut metadata: Vec<(String, MetaValue)> = vec![
        ("general.architecture".into(), MetaValue::Str(a.into())),
        ("general.type".into(), MetaValue::Str("model".into())),
        ("general.name".into(), MetaValue::Str(cfg.name.clone())),
        (format!("{a}.block_count"), u(nl)),
        (format!("{a}.context_length"), u(1 << 20)),
        (format!("{a}.embedding_length"), u(sh.hidden)),
        (format!("{a}.feed_forward_length"), u(sh.ff)),
        (format!("{a}.attention.head_count"), u(sh.heads)),
        (
            format!("{a}.attention.head_count_kv"),
            arr(
                MetaType::I32,
                (0..nl)
                    .map(|i| MetaValue::I32(if is_kda(i) { 0 } else { 1 }))
                    .collect(),
            ),
        ),
        (format!("{a}.attention.layer_norm_rms_epsilon"), f(1e-5)),
        (format!("{a}.expert_count"), u(nx)),
        (format!("{a}.expert_used_count"), u(sh.top_k)),
        (format!("{a}.expert_group_count"), u(1)),
        (format!("{a}.expert_group_used_count"), u(1)),
        (
            "general.file_type".into(),
            MetaValue::U32(crate::file_type(cfg.quant)),
        ),
        (format!("{a}.vocab_size"), u(sh.vocab)),
        (format!("{a}.attention.layer_norm_epsilon"), f(1e-6)),
        (format!("{a}.ssm.conv_kernel"), u(4)),
        (format!("{a}.kda.head_dim"), u(sh.kda_dim)),
        (format!("{a}.kda.gate_lower_bound"), f(-5.0)),
        (format!("{a}.attention.q_lora_rank"), u(sh.q_lora)),
        (format!("{a}.attention.kv_lora_rank"), u(sh.kv_lora)),
        (format!("{a}.rope.dimension_count"), u(0)),
        (format!("{a}.attention.key_length"), u(sh.kv_lora)),
        (format!("{a}.attention.value_length"), u(sh.kv_lora)),
        (format!("{a}.attention.key_length_mla"), u(sh.head_k)),
        (format!("{a}.attention.value_length_mla"), u(sh.head_v)),
        (format!("{a}.attention.indexer.head_count"), u(sh.idx_heads)),
        (format!("{a}.attention.indexer.key_length"), u(sh.idx_dim)),
        (format!("{a}.attention.indexer.top_k"), u(sh.idx_topk)),
        (format!("{a}.attention.indexer.kpool"), u(sh.kpool)),
        (
            format!("{a}.attention.indexer.kpool_select_tail"),
            MetaValue::Bool(true),
        ),
        (format!("{a}.hyper_connection.count"), u(sh.streams)),
        (format!("{a}.hyper_connection.sinkhorn_iterations"), u(20)),
        (format!("{a}.hyper_connection.epsilon"), f(1e-6)),
        (format!("{a}.leading_dense_block_count"), u(dense)),
        (format!("{a}.expert_feed_forward_length"), u(sh.expert_ff)),
        (format!("{a}.expert_shared_count"), u(1)),
        (format!("{a}.expert_weights_scale"), f(2.5)),
        (format!("{a}.expert_weights_norm"), MetaValue::Bool(true)),
        (format!("{a}.expert_gating_func"), u(2)),
        (format!("{a}.swiglu_clamp_exp"), per_layer_f(10.0)),
        (format!("{a}.swiglu_clamp_shexp"), per_layer_f(10.0)),
        ("general.quantization_version".into(), MetaValue::U32(2)),
    ];
    metadata.extend(vocab.metadata);

    let mut tensors: Vec<PlannedTensor> = Vec::new();
    let mut fallbacks = Vec::new();
    let e = sh.hidden as u64;
    let sigma = |fan_in: u64| 1.0 / (fan_in as f32).sqrt();
    let mut mat = |t: &mut Vec<PlannedTensor>, name: String, dims: &[u64], sigma: f32| {
        let ty = type_for(cfg.quant, dims[0] as usize);
        if ty != cfg.quant {
            fallbacks.push(format!("{name}: {ty} (rows of {})", dims[0]));
        }
        t.push(PlannedTensor {
            spec: TensorSpec::new(name, dims, ty),
            fill: Fill::Random { sigma },
            row_scale: None,
        });
    };
    let f32t = |name: String, dims: &[u64], fill: Fill| PlannedTensor {
        spec: TensorSpec::new(name, dims, GgmlType::F32),
        fill,
        row_scale: None,
    };
    let ones = Fill::Ones;
    let t = &mut tensors;
    mat(t, "token_embd.weight".into(), &[e, sh.vocab as u64], 1.0);
    let n_mix = ((2 + sh.streams) * sh.streams) as u64;
    let (inner, kd) = ((sh.heads * sh.kda_dim) as u64, sh.kda_dim as u64);
    for il in 0..nl {
        let n = |x: &str| format!("blk.{il}.{x}.weight");
        for p in ["hc_attn", "hc_ffn"] {
            t.push(f32t(
                n(&format!("{p}_fn")),
                &[sh.streams as u64 * e, n_mix],
                Fill::Random { sigma: 0.02 },
            ));
            t.push(f32t(n(&format!("{p}_base")), &[n_mix], Fill::Const(0.0)));
            t.push(f32t(n(&format!("{p}_scale")), &[3], ones));
        }
        t.push(f32t(n("attn_norm"), &[e], ones));
        t.push(f32t(n("ffn_norm"), &[e], ones));
        if is_kda(il) {
            for x in ["attn_q", "attn_k", "attn_v"] {
                mat(t, n(x), &[e, inner], sigma(e));
            }
            for x in ["ssm_conv1d_q", "ssm_conv1d_k", "ssm_conv1d_v"] {
                t.push(f32t(n(x), &[4, 1, inner, 1], Fill::Random { sigma: 0.5 }));
            }
            mat(t, n("ssm_f_a"), &[e, kd], sigma(e));
            mat(t, n("ssm_f_b"), &[kd, inner], sigma(kd));
            mat(t, n("ssm_g_a"), &[e, kd], sigma(e));
            mat(t, n("ssm_g_b"), &[kd, inner], sigma(kd));
            t.push(f32t(
                n("ssm_beta"),
                &[e, sh.heads as u64],
                Fill::Random { sigma: sigma(e) },
            ));
            t.push(f32t(
                format!("blk.{il}.ssm_a"),
                &[sh.heads as u64],
                Fill::Const(-1.0),
            ));
            t.push(f32t(
                format!("blk.{il}.ssm_dt.bias"),
                &[inner],
                Fill::Random { sigma: 0.5 },
            ));
            t.push(f32t(n("ssm_norm"), &[kd], ones));
            mat(t, n("attn_output"), &[inner, e], sigma(inner));
        } else {
            let (ql, kvl) = (sh.q_lora as u64, sh.kv_lora as u64);
            let (h, hk, hv) = (sh.heads as u64, sh.head_k as u64, sh.head_v as u64);
            let (ih, id) = (sh.idx_heads as u64, sh.idx_dim as u64);
            mat(t, n("attn_q_a"), &[e, ql], sigma(e));
            t.push(f32t(n("attn_q_a_norm"), &[ql], ones));
            mat(t, n("attn_q_b"), &[ql, h * hk], sigma(ql));
            mat(t, n("attn_kv_a_mqa"), &[e, kvl], sigma(e));
            t.push(f32t(n("attn_kv_a_norm"), &[kvl], ones));
            mat(t, n("attn_k_b"), &[hk, kvl, h], sigma(hk));
            mat(t, n("attn_v_b"), &[kvl, hv, h], sigma(kvl));
            mat(t, n("attn_output"), &[h * hv, e], sigma(h * hv));
            mat(t, n("indexer.attn_q_b"), &[ql, ih * id], sigma(ql));
            mat(t, n("indexer.attn_k"), &[e, id], sigma(e));
            t.push(f32t(n("indexer.k_norm"), &[id], ones));
            t.push(f32t(
                format!("blk.{il}.indexer.k_norm.bias"),
                &[id],
                Fill::Const(0.0),
            ));
            mat(t, n("indexer.proj"), &[e, ih], sigma(e));
            t.push(f32t(
                n("indexer_compressor_gate"),
                &[e, id],
                Fill::Random { sigma: sigma(e) },
            ));
            t.push(f32t(
                n("indexer_compressor_ape"),
                &[id, sh.kpool as u64],
                Fill::Random { sigma: 0.5 },
            ));
        }
        if il < dense {
            let ff = sh.ff as u64;
            mat(t, n("ffn_gate"), &[e, ff], sigma(e));
            mat(t, n("ffn_up"), &[e, ff], sigma(e));
            mat(t, n("ffn_down"), &[ff, e], sigma(ff));
        } else {
            let (x, ff) = (nx as u64, sh.expert_ff as u64);
            t.push(f32t(
                n("ffn_gate_inp"),
                &[e, x],
                Fill::Random { sigma: sigma(e) },
            ));
            t.push(f32t(
                format!("blk.{il}.exp_probs_b.bias"),
                &[x],
                Fill::Const(0.0),
            ));
            mat(t, n("ffn_gate_exps"), &[e, ff, x], sigma(e));
            mat(t, n("ffn_down_exps"), &[ff, e, x], sigma(ff));
            mat(t, n("ffn_up_exps"), &[e, ff, x], sigma(e));
            mat(t, n("ffn_gate_shexp"), &[e, ff], sigma(e));
            mat(t, n("ffn_up_shexp"), &[e, ff], sigma(e));
            mat(t, n("ffn_down_shexp"), &[ff, e], sigma(ff));
        }
    }
    t.push(f32t("output_norm.weight".into(), &[e], ones));
    mat(t, "output.weight".into(), &[e, sh.vocab as u64], sigma(e));
    Plan::from_parts(metadata, tensors, cfg.seed, fallbacks)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The full preset has the llama.cpp tensor inventory minus the 29 MTP tensors
    /// (1412 - 29, ../shared/models/glm5.md section 3.2) and the spec's routed bytes at
    /// Q8_0 (section 5.1: 25.50 MiB per expert, 42 MoE layers x 288 = 301.2 GiB).
    #[test]
    fn full_preset_matches_the_release_inventory() {
        let cfg = G5SynthConfig {
            shape: G5Shape::flash(),
            layers: LAYERS,
            experts: EXPERTS,
            quant: GgmlType::Q8_0,
            seed: 0,
            name: "t".into(),
        };
        let plan = plan(&cfg, Vocab::builtin()).unwrap();
        assert_eq!(plan.layout.tensors.len(), 1412 - 29);
        let routed = plan.role_bytes().routed_experts;
        assert_eq!(routed, 42 * 288 * 3 * (4096 * 2048 / 32 * 34));
        let gib = routed as f64 / (1u64 << 30) as f64;
        assert!((gib - 301.2).abs() < 0.05, "{gib}");
    }
}
