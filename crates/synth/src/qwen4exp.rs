//! `sluice synth --preset qwen3.8-flash-next`: random-weight files of the real Qwen3.8-Flash-Next
//! shape (`qwen4exp` as llama.cpp's converter names every key and tensor), with the 51B-row
//! n-gram PLE table in a popular format, for measuring how the table is read.
//!
//! Owns: the real dimensions (../shared/models/qwen4exp.md section 1), the PLE hash constants
//! computed from the published recipe (splitmix64 multipliers, the first primes >= 2e7,
//! padded row count), the metadata and the tensor list. `--layers N` keeps the layer pattern
//! (every 4th a QSA layer, PLE on layer 1) and shrinks everything per layer; the table keeps
//! its full size (its rows are addressed by the hash).

use sluice_gguf::{GgmlType, MetaArray, MetaType, MetaValue, TensorSpec};

use crate::blocks::Fill;
use crate::{type_for, Plan, PlannedTensor, SynthError, Vocab};

/// The real model's dimensions.
pub const HIDDEN: usize = 2560;
pub const STREAMS: usize = 4;
pub const HC_RANK: usize = 320;
pub const VOCAB: usize = 248_320;
pub const EOS: u32 = 248_044;
pub const EXPERTS: usize = 512;
pub const TOP_K: usize = 10;
pub const EXPERT_FF: usize = 640;
pub const LAYERS: usize = 48;
pub const HEADS: usize = 24;
pub const KV_HEADS: usize = 2;
pub const HEAD_DIM: usize = 256;
pub const GDN_K_HEADS: usize = 16;
pub const GDN_V_HEADS: usize = 48;
pub const GDN_DIM: usize = 128;
pub const IDX_HEADS: usize = 4;
pub const IDX_DIM: usize = 128;
pub const IDX_BUDGET: usize = 2048;
pub const IDX_RATIO: usize = 4;
pub const NGRAM: usize = 3;
pub const HEADS_PER_NGRAM: usize = 8;
pub const NGRAM_BASE: u64 = 20_000_000;
pub const PLE_SEED: u64 = 1234;

/// The dimensions of a file: the real model's ([`Q4Shape::flash_next`]) or a smaller one
/// with the same structure (tests whose kernels need particular sizes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Q4Shape {
    pub hidden: usize,
    pub streams: usize,
    pub hc_rank: usize,
    /// Vocabulary rows (the tokenizer's padded to this) and the PLE hash's EOS id.
    pub vocab: usize,
    pub eos: u32,
    pub experts: usize,
    pub top_k: usize,
    pub expert_ff: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub gdn_k_heads: usize,
    pub gdn_v_heads: usize,
    pub gdn_dim: usize,
    pub idx_heads: usize,
    pub idx_dim: usize,
    pub idx_budget: usize,
    pub idx_ratio: usize,
    /// The PLE table's head sizes are the primes from here up (the table's row count).
    pub ngram_base: u64,
}

impl Q4Shape {
    /// Qwen3.8-Flash-Next's own dimensions.
    pub fn flash_next() -> Q4Shape {
        Q4Shape {
            hidden: HIDDEN,
            streams: STREAMS,
            hc_rank: HC_RANK,
            vocab: VOCAB,
            eos: EOS,
            experts: EXPERTS,
            top_k: TOP_K,
            expert_ff: EXPERT_FF,
            heads: HEADS,
            kv_heads: KV_HEADS,
            head_dim: HEAD_DIM,
            gdn_k_heads: GDN_K_HEADS,
            gdn_v_heads: GDN_V_HEADS,
            gdn_dim: GDN_DIM,
            idx_heads: IDX_HEADS,
            idx_dim: IDX_DIM,
            idx_budget: IDX_BUDGET,
            idx_ratio: IDX_RATIO,
            ngram_base: NGRAM_BASE,
        }
    }
}

/// What to generate.
#[derive(Debug, Clone)]
pub struct Q4SynthConfig {
    pub shape: Q4Shape,
    pub layers: usize,
    /// Large matrices (experts, attention, embeddings, mixers).
    pub quant: GgmlType,
    /// The PLE table: Q4_0 (ggml-org), Q8_0 (unsloth UD-Q5/Q6) or F32.
    pub ple_quant: GgmlType,
    pub seed: u64,
    pub name: String,
}

fn splitmix64(v: u64) -> u64 {
    let v = v.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let v = (v ^ (v >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    let v = (v ^ (v >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    v ^ (v >> 31)
}

/// The n-gram hash multipliers for `vocab` (PLE layer index 0).
pub fn multipliers(vocab: u64, ngram: usize, seed: u64) -> Vec<u64> {
    let half = ((i64::MAX as u64 / vocab.max(1)) / 2).max(1);
    (0..ngram as u64)
        .map(|i| {
            let v = seed.wrapping_add(0x9E37_79B9_7F4A_7C15u64.wrapping_mul(i + 1));
            2 * (splitmix64(v) % half) + 1
        })
        .collect()
}

fn is_prime(n: u64) -> bool {
    if n < 2 {
        return false;
    }
    if n.is_multiple_of(2) {
        return n == 2;
    }
    let mut d = 3;
    while d * d <= n {
        if n.is_multiple_of(d) {
            return false;
        }
        d += 2;
    }
    true
}

/// The first `n` primes >= `base` (each head's sub-table size).
pub fn head_primes(base: u64, n: usize) -> Vec<u64> {
    let mut out = Vec::with_capacity(n);
    let mut p = base;
    while out.len() < n {
        if is_prime(p) {
            out.push(p);
        }
        p += 1;
    }
    out
}

fn arr(elem_type: MetaType, values: Vec<MetaValue>) -> MetaValue {
    MetaValue::Array(MetaArray { elem_type, values })
}

/// Adds one large matrix (name, ggml dims, sigma).
type MatFn<'a> = dyn FnMut(&mut Vec<PlannedTensor>, String, &[u64], f32) + 'a;

/// Lay out the file.
pub fn plan(cfg: &Q4SynthConfig, mut vocab: Vocab) -> Result<Plan, SynthError> {
    let nl = cfg.layers;
    let sh = &cfg.shape;
    if nl < 2 {
        return Err(SynthError::Config(
            "--layers must be >= 2 (the PLE layer is layer 1)".into(),
        ));
    }
    if ![GgmlType::F32, GgmlType::Q8_0, GgmlType::Q4_0].contains(&cfg.ple_quant) {
        return Err(SynthError::Config(format!(
            "--ple-quant {} is not one of F32, Q8_0, Q4_0",
            cfg.ple_quant
        )));
    }
    vocab.pad_to(sh.vocab)?;
    let a = "qwen4exp";
    let u = |v: usize| MetaValue::U32(v as u32);
    let nh = (NGRAM - 1) * HEADS_PER_NGRAM;
    let sizes = head_primes(sh.ngram_base, nh);
    let offsets: Vec<u64> = sizes
        .iter()
        .scan(0u64, |acc, &s| {
            let o = *acc;
            *acc += s;
            Some(o)
        })
        .collect();
    let total: u64 = sizes.iter().sum();
    let rows = total.div_ceil(128) * 128;
    let row_w = sh.hidden / nh;
    let recurrent: Vec<bool> = (0..nl).map(|i| (i + 1) % 4 != 0).collect();
    let u64s = |v: &[u64]| {
        arr(
            MetaType::U64,
            v.iter().map(|&x| MetaValue::U64(x)).collect(),
        )
    };
    let mut metadata: Vec<(String, MetaValue)> = vec![
        ("general.architecture".into(), MetaValue::Str(a.into())),
        ("general.type".into(), MetaValue::Str("model".into())),
        ("general.name".into(), MetaValue::Str(cfg.name.clone())),
        (format!("{a}.block_count"), u(nl)),
        (format!("{a}.context_length"), u(262_144)),
        (format!("{a}.embedding_length"), u(sh.hidden)),
        (format!("{a}.attention.head_count"), u(sh.heads)),
        (format!("{a}.attention.head_count_kv"), u(sh.kv_heads)),
        (
            format!("{a}.rope.dimension_sections"),
            arr(
                MetaType::I32,
                [11, 11, 10, 0].iter().map(|&x| MetaValue::I32(x)).collect(),
            ),
        ),
        (format!("{a}.rope.freq_base"), MetaValue::F32(1e7)),
        (
            format!("{a}.attention.layer_norm_rms_epsilon"),
            MetaValue::F32(1e-6),
        ),
        (format!("{a}.expert_count"), u(sh.experts)),
        (format!("{a}.expert_used_count"), u(sh.top_k)),
        (format!("{a}.attention.key_length"), u(sh.head_dim)),
        (format!("{a}.attention.value_length"), u(sh.head_dim)),
        (
            "general.file_type".into(),
            MetaValue::U32(crate::file_type(cfg.quant)),
        ),
        (format!("{a}.expert_feed_forward_length"), u(sh.expert_ff)),
        (
            format!("{a}.expert_shared_feed_forward_length"),
            u(sh.expert_ff),
        ),
        (format!("{a}.ssm.conv_kernel"), u(4)),
        (format!("{a}.ssm.state_size"), u(sh.gdn_dim)),
        (format!("{a}.ssm.group_count"), u(sh.gdn_k_heads)),
        (format!("{a}.ssm.time_step_rank"), u(sh.gdn_v_heads)),
        (
            format!("{a}.ssm.inner_size"),
            u(sh.gdn_v_heads * sh.gdn_dim),
        ),
        (
            format!("{a}.attention.recurrent_layers"),
            arr(
                MetaType::Bool,
                recurrent.iter().map(|&b| MetaValue::Bool(b)).collect(),
            ),
        ),
        (format!("{a}.full_attention_interval"), u(4)),
        (format!("{a}.rope.dimension_count"), u(sh.head_dim / 4)),
        (format!("{a}.hyper_connection.count"), u(sh.streams)),
        (format!("{a}.hyper_connection.low_rank"), u(sh.hc_rank)),
        (format!("{a}.attention.indexer.head_count"), u(sh.idx_heads)),
        (format!("{a}.attention.indexer.key_length"), u(sh.idx_dim)),
        (format!("{a}.attention.indexer.top_k"), u(sh.idx_budget)),
        (
            format!("{a}.attention.compress_ratios"),
            arr(
                MetaType::I32,
                recurrent
                    .iter()
                    .map(|&r| MetaValue::I32(if r { 0 } else { sh.idx_ratio as i32 }))
                    .collect(),
            ),
        ),
        (
            format!("{a}.ple.layers"),
            arr(MetaType::I32, vec![MetaValue::I32(1)]),
        ),
        (format!("{a}.ple.ngram_size"), u(NGRAM)),
        (format!("{a}.ple.heads_per_ngram"), u(HEADS_PER_NGRAM)),
        (format!("{a}.ple.conv_kernel"), u(4)),
        (format!("{a}.ple.eos_token_id"), MetaValue::U32(sh.eos)),
        (format!("{a}.embedding_length_per_layer_input"), u(row_w)),
        (
            format!("{a}.ple.layer_multipliers"),
            u64s(&multipliers(sh.vocab as u64, NGRAM, PLE_SEED)),
        ),
        (format!("{a}.ple.head_offsets"), u64s(&offsets)),
        (format!("{a}.ple.head_vocab_sizes"), u64s(&sizes)),
        ("general.quantization_version".into(), MetaValue::U32(2)),
    ];
    metadata.extend(vocab.metadata);

    let mut tensors: Vec<PlannedTensor> = Vec::new();
    let mut fallbacks = Vec::new();
    let (e, d, r) = (
        sh.hidden as u64,
        (sh.streams * sh.hidden) as u64,
        sh.hc_rank as u64,
    );
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
    let hc = |t: &mut Vec<PlannedTensor>, mat: &mut MatFn<'_>, p: &str, inject: bool| {
        t.push(f32t(format!("{p}_norm.weight"), &[d], ones));
        mat(t, format!("{p}_down.weight"), &[d, r], sigma(d));
        mat(t, format!("{p}_up.weight"), &[r, d], sigma(r));
        if inject {
            t.push(f32t(
                format!("{p}_inject.weight"),
                &[d, sh.streams as u64],
                Fill::Random { sigma: sigma(d) },
            ));
        }
    };
    for (il, &rec) in recurrent.iter().enumerate() {
        let n = |x: &str| format!("blk.{il}.{x}.weight");
        hc(t, &mut mat, &format!("blk.{il}.hc_attn"), true);
        if rec {
            let cd = (2 * sh.gdn_k_heads * sh.gdn_dim + sh.gdn_v_heads * sh.gdn_dim) as u64;
            let vd = (sh.gdn_v_heads * sh.gdn_dim) as u64;
            let hv = sh.gdn_v_heads as u64;
            t.push(f32t(format!("blk.{il}.ssm_a"), &[hv], Fill::Const(-1.0)));
            t.push(f32t(n("ssm_conv1d"), &[4, cd], Fill::Random { sigma: 0.5 }));
            t.push(f32t(
                format!("blk.{il}.ssm_dt.bias"),
                &[hv],
                Fill::Random { sigma: 0.5 },
            ));
            t.push(f32t(
                n("ssm_alpha"),
                &[e, hv],
                Fill::Random { sigma: sigma(e) },
            ));
            t.push(f32t(
                n("ssm_beta"),
                &[e, hv],
                Fill::Random { sigma: sigma(e) },
            ));
            mat(t, n("attn_qkv"), &[e, cd], sigma(e));
            mat(t, n("attn_gate"), &[e, vd], sigma(e));
            t.push(f32t(n("ssm_norm"), &[sh.gdn_dim as u64], ones));
            mat(t, n("ssm_out"), &[vd, e], sigma(vd));
        } else {
            let (q, kv) = (
                (sh.heads * sh.head_dim) as u64,
                (sh.kv_heads * sh.head_dim) as u64,
            );
            mat(t, n("attn_q"), &[e, 2 * q], sigma(e));
            mat(t, n("attn_k"), &[e, kv], sigma(e));
            mat(t, n("attn_v"), &[e, kv], sigma(e));
            mat(t, n("attn_output"), &[q, e], sigma(q));
            t.push(f32t(n("attn_q_norm"), &[sh.head_dim as u64], ones));
            t.push(f32t(n("attn_k_norm"), &[sh.head_dim as u64], ones));
            mat(
                t,
                n("indexer.q_proj"),
                &[e, (sh.idx_heads * sh.idx_dim) as u64],
                sigma(e),
            );
            mat(t, n("indexer.k_proj"), &[e, sh.idx_dim as u64], sigma(e));
            t.push(f32t(n("indexer.q_norm"), &[sh.idx_dim as u64], ones));
            t.push(f32t(n("indexer.k_norm"), &[sh.idx_dim as u64], ones));
        }
        if il == 1 {
            mat(t, n("ple_key"), &[e, d], sigma(e));
            mat(t, n("ple_value"), &[e, e], sigma(e));
            for x in ["ple_norm_key", "ple_norm_query", "ple_norm_conv"] {
                t.push(f32t(n(x), &[d], ones));
            }
            t.push(f32t(n("ple_conv1d"), &[4, d], Fill::Random { sigma: 0.5 }));
        }
        hc(t, &mut mat, &format!("blk.{il}.hc_ffn"), true);
        let (x, ff) = (sh.experts as u64, sh.expert_ff as u64);
        t.push(f32t(
            n("ffn_gate_inp"),
            &[e, x],
            Fill::Random { sigma: sigma(e) },
        ));
        mat(t, n("ffn_gate_exps"), &[e, ff, x], sigma(e));
        mat(t, n("ffn_down_exps"), &[ff, e, x], sigma(ff));
        mat(t, n("ffn_up_exps"), &[e, ff, x], sigma(e));
        t.push(f32t(
            n("ffn_gate_inp_shexp"),
            &[e, 1],
            Fill::Random { sigma: sigma(e) },
        ));
        mat(t, n("ffn_gate_shexp"), &[e, ff], sigma(e));
        mat(t, n("ffn_up_shexp"), &[e, ff], sigma(e));
        mat(t, n("ffn_down_shexp"), &[ff, e], sigma(ff));
    }
    hc(t, &mut mat, "output_hc", false);
    mat(t, "output.weight".into(), &[e, sh.vocab as u64], sigma(e));
    t.push(PlannedTensor {
        spec: TensorSpec::new(
            "per_layer_token_embd.weight",
            &[row_w as u64, rows],
            cfg.ple_quant,
        ),
        fill: Fill::Random { sigma: 1.0 },
        row_scale: None,
    });
    Plan::from_parts(metadata, tensors, cfg.seed, fallbacks)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The constants the released GGUF files carry (spec section 1.2).
    #[test]
    fn hash_constants_match_the_released_files() {
        assert_eq!(
            multipliers(VOCAB as u64, 3, PLE_SEED),
            [23703573157769, 20109073645365, 8052911324071]
        );
        let p = head_primes(NGRAM_BASE, 16);
        assert_eq!(p[0], 20000003);
        assert_eq!(p[15], 20000171);
        assert_eq!(p.iter().sum::<u64>(), 320_001_446);
    }
}
