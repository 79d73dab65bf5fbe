//! DeepSeek V4 (`deepseek4`, as llama.cpp's converter writes it): a 4-stream
//! hyper-connection residual around every attention and MoE block; attention with q-LoRA,
//! one shared key/value latent, partial interleaved RoPE, sinks and a grouped low-rank
//! output, per layer kind (`attention.compress_ratios`) sliding-window only, CSA (ratio 4,
//! lightning indexer) or HCA (ratio 128); MoE with sqrt-softplus scores, a selection bias,
//! a clamped SwiGLU and a shared expert; the first `hash_layer_count` layers pick their
//! experts from a token-id table. A trailing MTP block (`nextn_predict_layers`) is loaded
//! past and ignored. Specification: ../shared/models/deepseek4.md. The CPU runs its
//! [`DecoderPlan`] (`crate::decoder::CpuDecoder`, whose state holds each layer's window,
//! compressor carry and compressed rows); the hash-routed layers' experts are named from the
//! token ids ([`Architecture::certain_units`]) for prefetch.

use sluice_gguf::{GgmlType, GgufFile};
use sluice_io::MappedFile;
use sluice_tier::StreamableGroups;

use super::Architecture;
use crate::blocks::attention::AttnShape;
use crate::blocks::dsv4_attention::{
    plain_inv_freq, yarn_inv_freq, CompressorWeights, Dsv4AttnWeights, Dsv4Shape, IndexerWeights,
};
use crate::blocks::ffn::{Activation, GluWeights};
use crate::blocks::hyper::{HcShape, HcWeights};
use crate::blocks::moe::{expert_group, link_lookahead, MoeWeights, Router, ScoreFn, UnitMat};
use crate::config::{Hparams, ModelConfig, RopeScaling};
use crate::kv::KvCache;
use crate::plan::{DecoderPlan, HyperHead, PlanAttn, PlanFfn, PlanHyper, PlanLayer, PlanShared};
use crate::state::SeqState;
use crate::weights::{Mat, Stacked, Tensors};
use crate::ModelError;

const NAME: &str = "deepseek4";

struct Layer {
    ratio: usize,
    hc_attn: HcWeights,
    hc_ffn: HcWeights,
    attn_norm: Vec<f32>,
    attn: Dsv4AttnWeights,
    ffn_norm: Vec<f32>,
    moe: MoeWeights,
    shared: GluWeights,
    shared_act: Activation,
    experts: [Stacked; 3],
}

pub struct DeepSeek4 {
    cfg: ModelConfig,
    shape: Dsv4Shape,
    hc: HcShape,
    token_embd: Mat,
    output_norm: Vec<f32>,
    output: Mat,
    hc_head: HcWeights,
    layers: Vec<Layer>,
    /// Routed experts of the MTP block(s), never run, described so they stream (stay on disk).
    mtp_experts: Vec<(usize, [Stacked; 3])>,
}

/// The hash layers' token -> expert table (`[k, n_vocab]` I32, every id >= 0).
fn read_i32_table(
    t: &Tensors<'_>,
    name: &str,
    k: usize,
    n_vocab: usize,
) -> Result<Vec<u32>, ModelError> {
    let info = t.info(name)?;
    if info.ty != GgmlType::I32 {
        return Err(t.bad(name, format!("expected type I32, found {}", info.ty)));
    }
    if info.dims.len() != 2 || info.dims[0] as usize != k || info.dims[1] as usize != n_vocab {
        return Err(t.bad(
            name,
            format!("expected shape [{k}, {n_vocab}], found {:?}", info.dims),
        ));
    }
    let bytes = &t.map.bytes()[t.range(info)];
    bytes
        .chunks_exact(4)
        .map(|b| {
            let v = i32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            u32::try_from(v).map_err(|_| t.bad(name, format!("negative expert id {v}")))
        })
        .collect()
}

/// `attention.compress_ratios`: one of 0, 4, 128 for each of the `n_layer` layers.
fn compress_ratios(hp: &Hparams<'_>, n_layer: usize) -> Result<Vec<usize>, ModelError> {
    let v = hp
        .array("attention.compress_ratios")
        .ok_or_else(|| hp.bad(format!("{NAME}.attention.compress_ratios is missing")))?;
    let r: Option<Vec<usize>> = v.iter().map(|x| x.as_u64().map(|u| u as usize)).collect();
    let r = r.ok_or_else(|| {
        hp.bad(format!(
            "{NAME}.attention.compress_ratios must hold integers >= 0"
        ))
    })?;
    if r.len() < n_layer {
        return Err(hp.bad(format!(
            "{NAME}.attention.compress_ratios has {} entries for {n_layer} layers",
            r.len()
        )));
    }
    if let Some(bad) = r.iter().find(|x| ![0, 4, 128].contains(*x)) {
        return Err(hp.bad(format!(
            "{NAME}.attention.compress_ratios holds {bad}; only 0, 4 and 128 are defined"
        )));
    }
    Ok(r)
}

/// The compressed layers' RoPE table: `attention.compress_rope_freq_base`, with YaRN when
/// the file says so.
fn compressed_rope(hp: &Hparams<'_>, n_rot: usize, rope_base: f32) -> Result<Vec<f32>, ModelError> {
    let compress_base = hp.f_pos_or("attention.compress_rope_freq_base", rope_base)?;
    // YaRN on the compressed layers when the file says so, or (no type written) when it
    // carries a scaling factor other than 1; factors below 1 are refused (YaRN extends).
    let yarn = match hp.rope_scaling(&["none", "yarn"], Some("yarn"))? {
        RopeScaling::Yarn(f) if f < 1.0 => {
            return Err(hp.bad(format!(
                "{NAME}.rope.scaling.factor is {f}; YaRN needs a factor >= 1"
            )))
        }
        RopeScaling::Yarn(f) => Some(f),
        _ => None,
    };
    let rope = if let Some(factor) = yarn {
        let orig = hp.u_or("rope.scaling.original_context_length", 65_536)?;
        if orig == 0 {
            return Err(hp.bad(format!(
                "{NAME}.rope.scaling.original_context_length must be > 0"
            )));
        }
        yarn_inv_freq(
            n_rot,
            compress_base,
            factor,
            orig as f32,
            hp.f_pos_or("rope.scaling.yarn_beta_fast", 32.0)?,
            hp.f_pos_or("rope.scaling.yarn_beta_slow", 1.0)?,
        )
    } else {
        plain_inv_freq(n_rot, compress_base)
    };
    Ok(rope)
}

/// Layer `il`'s KV compressor `{pre}_*` (`attn_compressor` or `indexer_compressor`) of
/// `ratio` over rows of `hd`, from inputs of `e`.
fn load_compressor(
    t: &Tensors<'_>,
    il: usize,
    pre: &str,
    ratio: usize,
    hd: usize,
    e: usize,
) -> Result<CompressorWeights, ModelError> {
    let coff = if ratio == 4 { 2 } else { 1 };
    let n = |s: &str| format!("blk.{il}.{pre}_{s}.weight");
    Ok(CompressorWeights {
        ratio,
        head_dim: hd,
        coff,
        kv: t.mat(&n("kv"), coff * hd, e)?,
        gate: t.mat(&n("gate"), coff * hd, e)?,
        ape: t.vec_shaped(&n("ape"), &[coff * hd, ratio])?,
        norm: t.vec(&n("norm"), hd)?,
    })
}

/// Layer `il`'s router: the token-id table of a hash layer (every id below `n_expert`),
/// else the bias of the biased sqrt-softplus router.
#[allow(clippy::too_many_arguments)]
fn load_router(
    t: &Tensors<'_>,
    il: usize,
    hashed: bool,
    k: usize,
    n_vocab: usize,
    n_expert: usize,
    w_norm: bool,
    w_scale: f32,
) -> Result<Router, ModelError> {
    let n = |s: &str| format!("blk.{il}.{s}.weight");
    let router = if hashed {
        Router::Hash {
            table: read_i32_table(t, &n("ffn_gate_tid2eid"), k, n_vocab)?,
            score: ScoreFn::SqrtSoftplus,
            norm: w_norm,
            scale: w_scale,
        }
    } else {
        Router::Biased {
            score: ScoreFn::SqrtSoftplus,
            bias: t.vec(&format!("blk.{il}.exp_probs_b.bias"), n_expert)?,
            norm: w_norm,
            scale: w_scale,
        }
    };
    if let Router::Hash { table, .. } = &router {
        if let Some(&bad) = table.iter().find(|&&x| x as usize >= n_expert) {
            return Err(t.bad(
                &n("ffn_gate_tid2eid"),
                format!("names expert {bad}; the layer has {n_expert}"),
            ));
        }
    }
    Ok(router)
}

/// The decoder layers and the trailing MTP block(s) of `n_block` blocks: the MTP blocks
/// (`nextn_predict_layers`) sit after the main layers when the file carries them.
fn split_mtp(
    hp: &Hparams<'_>,
    file: &GgufFile,
    n_block: usize,
) -> Result<(usize, usize), ModelError> {
    let n_mtp = hp.u_or("nextn_predict_layers", 0)?;
    let n_layer = if n_mtp > 0
        && n_mtp < n_block
        && file
            .tensor(&format!("blk.{}.nextn.eh_proj.weight", n_block - n_mtp))
            .is_some()
    {
        n_block - n_mtp
    } else {
        n_block
    };
    Ok((n_layer, n_block - n_layer))
}

/// SiLU, clamped at `limit` when the file sets one (> 0).
fn clamped_silu(limit: f32) -> Activation {
    if limit > 0.0 {
        Activation::SiluClamped { limit }
    } else {
        Activation::Silu
    }
}

pub fn load(file: &GgufFile, map: &MappedFile) -> Result<Box<dyn Architecture>, ModelError> {
    let hp = Hparams::new(file, NAME);
    let n_embd = hp.u("embedding_length")?;
    let n_head = hp.u("attention.head_count")?;
    let n_head_kv = hp.u_or("attention.head_count_kv", 1)?;
    let head_dim = hp.u("attention.key_length")?;
    let head_dim_v = hp.u_or("attention.value_length", head_dim)?;
    let n_block = hp.block_count()?;
    let rms_eps = hp.f_or("attention.layer_norm_rms_epsilon", 1e-6)?;
    let rope_base = hp.f_or("rope.freq_base", 10_000.0)?;
    let n_rot = hp.u("rope.dimension_count")?;
    let n_ctx_train = hp.context_length(4096)?;
    if n_embd == 0 {
        return Err(hp.bad("embedding_length must be > 0".into()));
    }
    super::check_attention(&hp, n_head, n_head_kv, head_dim, rms_eps, rope_base)?;
    if n_head_kv != 1 {
        return Err(hp.bad(format!(
            "{NAME}.attention.head_count_kv is {n_head_kv}; DeepSeek V4 has one shared key/value head"
        )));
    }
    if head_dim_v != head_dim {
        return Err(hp.bad(format!(
            "{NAME}.attention.value_length {head_dim_v} must equal key_length {head_dim} (K = V)"
        )));
    }
    if n_rot == 0 || !n_rot.is_multiple_of(2) || n_rot > head_dim {
        return Err(hp.bad(format!(
            "{NAME}.rope.dimension_count {n_rot} must be even, > 0 and <= key_length {head_dim}"
        )));
    }
    let (n_layer, n_mtp) = split_mtp(&hp, file, n_block)?;

    let ratios = compress_ratios(&hp, n_layer)?;
    let n_hc = hp.u("hyper_connection.count")?;
    if n_hc != 4 {
        return Err(hp.bad(format!(
            "{NAME}.hyper_connection.count is {n_hc}; DeepSeek V4 uses 4 streams"
        )));
    }
    let hc = HcShape {
        n_hc,
        n_embd,
        sinkhorn_iters: hp.iterations("hyper_connection.sinkhorn_iterations", 20)?,
        eps: hp.f_nonneg_or("hyper_connection.epsilon", 1e-6)?,
        rms_eps,
    };
    let q_lora = hp.u("attention.q_lora_rank")?;
    let window = hp.positions("attention.sliding_window", None, n_ctx_train)?;
    let o_groups = hp.u("attention.output_group_count")?;
    let o_lora = hp.u("attention.output_lora_rank")?;
    if window == 0
        || q_lora == 0
        || o_lora == 0
        || o_groups == 0
        || !n_head.is_multiple_of(o_groups)
    {
        return Err(hp.bad(format!(
            "sliding_window {window}, q_lora_rank {q_lora}, output_lora_rank {o_lora} must be > 0 \
             and head_count {n_head} a multiple of output_group_count {o_groups}"
        )));
    }
    let n_expert = hp.u("expert_count")?;
    let k = hp.u("expert_used_count")?;
    if n_expert == 0 || k == 0 || k > n_expert {
        return Err(hp.bad(format!(
            "expert_used_count {k} must be in 1..=expert_count {n_expert}"
        )));
    }
    let gating = hp.u_or("expert_gating_func", 4)?;
    if gating != 4 {
        return Err(hp.bad(format!(
            "{NAME}.expert_gating_func is {gating}; DeepSeek V4 uses 4 (sqrt-softplus)"
        )));
    }
    let n_ff = hp.u("expert_feed_forward_length")?;
    let n_shared = hp.u_or("expert_shared_count", 1)?;
    let w_scale = hp.f_pos_or("expert_weights_scale", 1.0)?;
    let w_norm = hp.b_or("expert_weights_norm", true)?;
    let n_hash = hp.u_or("hash_layer_count", 0)?;
    if n_hash > n_layer {
        return Err(hp.bad(format!(
            "{NAME}.hash_layer_count {n_hash} exceeds the {n_layer} layers"
        )));
    }
    let clamp_exp = hp.per_layer_f32("swiglu_clamp_exp", n_layer, Some(vec![0.0; n_layer]))?;
    let clamp_sh = hp.per_layer_f32("swiglu_clamp_shexp", n_layer, Some(clamp_exp.clone()))?;
    let rope_compress = compressed_rope(&hp, n_rot, rope_base)?;
    let rope_main = plain_inv_freq(n_rot, rope_base);
    let (ix_heads, ix_dim, ix_topk) = (
        hp.u_or("attention.indexer.head_count", 0)?,
        hp.u_or("attention.indexer.key_length", 0)?,
        hp.positions("attention.indexer.top_k", Some(0), n_ctx_train)?,
    );
    if ratios[..n_layer].contains(&4) && (ix_heads == 0 || ix_dim < n_rot || ix_topk == 0) {
        return Err(hp.bad(format!(
            "CSA layers need attention.indexer.head_count > 0, key_length >= {n_rot} and top_k > 0 \
             (found {ix_heads}, {ix_dim}, {ix_topk})"
        )));
    }
    let n_vocab = hp.n_vocab()?;
    // Compressed rows per position (f32 storage): CSA rows every 4 tokens (head_dim) plus
    // indexer rows (indexer key_length), HCA rows every 128 tokens. The raw window is a fixed
    // `n_layer * window * head_dim * 4` bytes whatever the context.
    let per_pos: f64 = ratios[..n_layer]
        .iter()
        .map(|&r| match r {
            4 => (head_dim + ix_dim) as f64 / 4.0,
            128 => head_dim as f64 / 128.0,
            _ => 0.0,
        })
        .sum::<f64>()
        * 4.0;
    let cfg = ModelConfig {
        arch: NAME,
        n_layer,
        n_embd,
        n_vocab,
        n_ctx_train,
        n_expert,
        n_expert_used: k,
        kv_bytes_per_pos: per_pos.ceil() as u64,
        state_bytes: [window, head_dim, 4]
            .iter()
            .fold(n_layer as u64, |a, &b| a.saturating_mul(b as u64)),
    };
    let shape = Dsv4Shape {
        n_embd,
        n_head,
        head_dim,
        n_rot,
        q_lora,
        o_groups,
        o_lora,
        window,
        rms_eps,
    };

    let t = Tensors::new(file, map);
    let e = n_embd;
    let hc_w = |p: &str, n_out: usize, n_scale: usize| -> Result<HcWeights, ModelError> {
        Ok(HcWeights {
            proj: t.mat(&format!("{p}_fn.weight"), n_out, n_hc * e)?,
            base: t.vec(&format!("{p}_base.weight"), n_out)?,
            scale: t.vec(&format!("{p}_scale.weight"), n_scale)?,
        })
    };
    let n_mix = (2 + n_hc) * n_hc;
    let mut layers = Vec::with_capacity(n_layer);
    for il in 0..n_layer {
        let n = |s: &str| format!("blk.{il}.{s}.weight");
        let ratio = ratios[il];
        let rope = if ratio == 0 {
            rope_main.clone()
        } else {
            rope_compress.clone()
        };
        let comp = if ratio == 0 {
            None
        } else {
            Some(load_compressor(
                &t,
                il,
                "attn_compressor",
                ratio,
                head_dim,
                e,
            )?)
        };
        let indexer = if ratio == 4 {
            Some(IndexerWeights {
                n_head: ix_heads,
                head_dim: ix_dim,
                top_k: ix_topk,
                q_b: t.mat(&n("indexer.attn_q_b"), ix_heads * ix_dim, q_lora)?,
                proj: t.mat(&n("indexer.proj"), ix_heads, e)?,
                comp: load_compressor(&t, il, "indexer_compressor", 4, ix_dim, e)?,
            })
        } else {
            None
        };
        let experts = t.glu_experts(il, e, Some(n_ff), n_expert)?;
        let router = load_router(&t, il, il < n_hash, k, n_vocab, n_expert, w_norm, w_scale)?;
        let n_ff_sh = n_ff * n_shared;
        layers.push(Layer {
            ratio,
            hc_attn: hc_w(&format!("blk.{il}.hc_attn"), n_mix, 3)?,
            hc_ffn: hc_w(&format!("blk.{il}.hc_ffn"), n_mix, 3)?,
            attn_norm: t.vec(&n("attn_norm"), e)?,
            attn: Dsv4AttnWeights {
                q_a: t.mat(&n("attn_q_a"), q_lora, e)?,
                q_a_norm: t.vec(&n("attn_q_a_norm"), q_lora)?,
                q_b: t.mat(&n("attn_q_b"), n_head * head_dim, q_lora)?,
                kv: t.mat(&n("attn_kv"), head_dim, e)?,
                kv_norm: t.vec(&n("attn_kv_a_norm"), head_dim)?,
                sinks: t.vec(&n("attn_sinks"), n_head)?,
                out_a: t.mat(
                    &n("attn_output_a"),
                    o_groups * o_lora,
                    n_head * head_dim / o_groups,
                )?,
                out_b: t.mat(&n("attn_output_b"), e, o_groups * o_lora)?,
                comp,
                indexer,
                rope,
                rope_compress: rope_compress.clone(),
            },
            ffn_norm: t.vec(&n("ffn_norm"), e)?,
            moe: MoeWeights {
                router_w: t.mat(&n("ffn_gate_inp"), n_expert, e)?,
                router,
                n_expert,
                k,
                gate: UnitMat::from(&experts[0]),
                up: UnitMat::from(&experts[1]),
                down: UnitMat::from(&experts[2]),
                act: clamped_silu(clamp_exp[il]),
                next: None,
            },
            shared: GluWeights::load(&t, il, "_shexp", e, Some(n_ff_sh))?,
            shared_act: clamped_silu(clamp_sh[il]),
            experts,
        });
    }
    link_lookahead(
        layers
            .iter_mut()
            .enumerate()
            .map(|(il, l)| (il, &mut l.moe, &l.ffn_norm[..])),
    );
    let mtp_experts = t.mtp_glu_experts(n_layer..n_layer + n_mtp, e, Some(n_ff), n_expert)?;
    let output = t.mat("output.weight", n_vocab, e)?;
    Ok(Box::new(DeepSeek4 {
        cfg,
        shape,
        hc,
        token_embd: t.mat("token_embd.weight", n_vocab, e)?,
        output_norm: t.vec("output_norm.weight", e)?,
        output,
        hc_head: HcWeights {
            proj: t.mat("output_hc_fn.weight", n_hc, n_hc * e)?,
            base: t.vec("output_hc_base.weight", n_hc)?,
            scale: t.vec("output_hc_scale.weight", 1)?,
        },
        layers,
        mtp_experts,
    }))
}

impl DeepSeek4 {
    /// Layer kinds in order (0 sliding only, 4 CSA, 128 HCA).
    pub fn compress_ratios(&self) -> Vec<usize> {
        self.layers.iter().map(|l| l.ratio).collect()
    }
}

impl Architecture for DeepSeek4 {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn groups(&self) -> StreamableGroups {
        let layers = self.layers.iter().map(|l| Some(&l.experts));
        StreamableGroups {
            experts: expert_group(self.cfg.n_expert, layers, &self.mtp_experts),
            row_tables: Vec::new(),
        }
    }

    fn new_state(&self, n_ctx: usize) -> SeqState {
        // The KV cache only counts positions (and carries the f16 choice); the rows live in
        // the CPU decoder's state (`Model::new_state`), per layer kind.
        SeqState::new(KvCache::new(0, 0, 0, n_ctx))
    }

    /// The model as a decoder plan: every layer DeepSeek V4 attention (its sliding window,
    /// compressor and indexer state kept by the CPU decoder) and a MoE half with a hashed
    /// or biased router and a shared expert, inside the 4-stream hyper-connection residual.
    fn plan(&self) -> DecoderPlan {
        let s = &self.shape;
        let layers = self
            .layers
            .iter()
            .map(|l| PlanLayer {
                hc: Some(Box::new([l.hc_attn.clone(), l.hc_ffn.clone()])),
                ..PlanLayer::new(
                    l.attn_norm.clone(),
                    PlanAttn::Dsv4 {
                        w: Box::new(l.attn.clone()),
                        shape: *s,
                    },
                    l.ffn_norm.clone(),
                    PlanFfn::moe(
                        &l.moe,
                        &l.experts,
                        Some(PlanShared::new(l.shared.clone(), l.shared_act)),
                    ),
                )
            })
            .collect();
        // One shared key/value latent per position, as a kernel would see it.
        let shape = AttnShape {
            n_head: s.n_head,
            n_head_kv: 1,
            head_dim: s.head_dim,
            head_dim_v: s.head_dim,
            scale: 1.0 / (s.head_dim as f32).sqrt(),
            rms_eps: s.rms_eps,
        };
        DecoderPlan {
            hyper: Some(PlanHyper {
                shape: self.hc,
                head: HyperHead::Learned(self.hc_head.clone()),
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

    /// The hash-routed layers' experts follow from the token ids alone.
    fn certain_units(&self, tokens: &[u32]) -> Vec<(usize, Vec<usize>)> {
        let mut out = Vec::new();
        for (il, l) in self.layers.iter().enumerate() {
            let Router::Hash { table, .. } = &l.moe.router else {
                continue;
            };
            let k = l.moe.k;
            let mut units: Vec<usize> = tokens
                .iter()
                .filter_map(|&t| table.get(t as usize * k..(t as usize + 1) * k))
                .flatten()
                .map(|&x| x as usize)
                .collect();
            units.sort_unstable();
            units.dedup();
            out.push((il, units));
        }
        out
    }
}
