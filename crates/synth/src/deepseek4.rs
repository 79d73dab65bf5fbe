//! Synthetic DeepSeek V4 (`deepseek4`) files: every tensor llama.cpp's converter writes for
//! the real model (hyper-connections, q-LoRA attention with one shared K=V head, grouped
//! low-rank output, CSA/HCA compressors and the lightning indexer per `compress_ratios`,
//! hash-routed layers with a token-id table, biased sqrt-softplus routers, shared expert,
//! the hyper-connection head), in the tensor types of the real releases:
//!
//! - `q2` (antirez's q2 file): routed gate/up IQ2_XXS, down Q2_K; attention, shared expert
//!   and output Q8_0; token embedding, hyper-connection, router, compressor and indexer F16;
//!   norms, sinks, biases and hyper-connection base/scale F32; the hash table I32.
//! - `mxfp4` (the converter's own output, bartowski-style): routed experts MXFP4, the rest
//!   as above.
//!
//! Owns: the deepseek4 presets ([`Dsv4Shape`]) and the file plan ([`plan`]). The block
//! fillers of the types only this layout uses (IQ2_XXS, Q2_K, MXFP4, F16, the I32 hash
//! table) are in `blocks.rs` with the others; the writer, vocabulary and free-space check
//! are the crate's.

use std::path::Path;

use sluice_gguf::{GgmlType, GgufWriter, MetaArray, MetaType, MetaValue, TensorSpec};

pub use crate::blocks::hash_expert;
use crate::blocks::Fill;
use crate::{Plan, PlannedTensor, SynthError, Vocab};

/// Every dimension of a deepseek4 model.
#[derive(Debug, Clone, PartialEq)]
pub struct Dsv4Shape {
    pub layers: usize,
    pub hidden: usize,
    /// Vocabulary size; `None` = the tokenizer's token count.
    pub vocab: Option<usize>,
    pub heads: usize,
    pub head_dim: usize,
    pub rope_dim: usize,
    pub q_lora: usize,
    pub o_groups: usize,
    pub o_lora: usize,
    pub window: usize,
    pub experts: usize,
    pub top_k: usize,
    pub expert_ff: usize,
    pub hash_layers: usize,
    pub index_heads: usize,
    pub index_head_dim: usize,
    pub index_top_k: usize,
    pub context: usize,
}

/// Named deepseek4 shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dsv4Preset {
    /// DeepSeek V4 Flash: 43 layers, hidden 4096, vocab 129280, 64 heads of 512 (one K=V
    /// head), 256 experts of 2048 (top-6), 3 hash layers, indexer 64 x 128 top-512.
    Flash,
    /// The same structure shrunk for tests: hidden 256, 4 heads of 128, 16 experts of 256
    /// (top-2), 1 hash layer, window 16 (every row a multiple of 256 where the q2 types need it).
    Tiny,
}

impl Dsv4Preset {
    pub const NAMES: [&'static str; 2] = ["deepseek-v4-flash", "deepseek4-tiny"];

    pub fn from_name(name: &str) -> Option<Dsv4Preset> {
        match name {
            "deepseek-v4-flash" => Some(Dsv4Preset::Flash),
            "deepseek4-tiny" => Some(Dsv4Preset::Tiny),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dsv4Preset::Flash => "deepseek-v4-flash",
            Dsv4Preset::Tiny => "deepseek4-tiny",
        }
    }

    pub fn shape(self) -> Dsv4Shape {
        let flash = Dsv4Shape {
            layers: 43,
            hidden: 4096,
            vocab: Some(129_280),
            heads: 64,
            head_dim: 512,
            rope_dim: 64,
            q_lora: 1024,
            o_groups: 8,
            o_lora: 1024,
            window: 128,
            experts: 256,
            top_k: 6,
            expert_ff: 2048,
            hash_layers: 3,
            index_heads: 64,
            index_head_dim: 128,
            index_top_k: 512,
            context: 1_048_576,
        };
        match self {
            Dsv4Preset::Flash => flash,
            Dsv4Preset::Tiny => Dsv4Shape {
                layers: 4,
                hidden: 256,
                vocab: None,
                heads: 4,
                head_dim: 128,
                rope_dim: 32,
                q_lora: 256,
                o_groups: 2,
                o_lora: 256,
                window: 16,
                experts: 16,
                top_k: 2,
                expert_ff: 256,
                hash_layers: 1,
                index_heads: 2,
                index_head_dim: 64,
                index_top_k: 8,
                context: 4096,
            },
        }
    }
}

/// Routed-expert layout of the real releases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dsv4Quant {
    /// IQ2_XXS gate/up, Q2_K down.
    Q2,
    /// MXFP4 gate/up/down.
    Mxfp4,
}

impl Dsv4Quant {
    pub fn from_name(name: &str) -> Option<Dsv4Quant> {
        match name.to_ascii_lowercase().as_str() {
            "q2" => Some(Dsv4Quant::Q2),
            "mxfp4" => Some(Dsv4Quant::Mxfp4),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dsv4Quant::Q2 => "q2",
            Dsv4Quant::Mxfp4 => "mxfp4",
        }
    }

    /// (gate/up, down) types.
    fn experts(self) -> (GgmlType, GgmlType) {
        match self {
            Dsv4Quant::Q2 => (GgmlType::IQ2_XXS, GgmlType::Q2_K),
            Dsv4Quant::Mxfp4 => (GgmlType::MXFP4, GgmlType::MXFP4),
        }
    }

    /// `general.file_type` (llama.cpp `llama_ftype`).
    fn file_type(self) -> u32 {
        match self {
            Dsv4Quant::Q2 => 19,    // MOSTLY_IQ2_XXS
            Dsv4Quant::Mxfp4 => 38, // MOSTLY_MXFP4_MOE
        }
    }
}

/// What to generate.
#[derive(Debug, Clone)]
pub struct Dsv4Config {
    pub shape: Dsv4Shape,
    pub quant: Dsv4Quant,
    pub seed: u64,
    /// `general.name`.
    pub name: String,
}

/// The real schedule: layers 0-1 sliding only, then CSA (4) on even and HCA (128) on odd
/// layers (layer 42, the last, is CSA).
pub fn compress_ratios(layers: usize) -> Vec<u32> {
    (0..layers)
        .map(|i| match i {
            0 | 1 => 0,
            i if i % 2 == 0 => 4,
            _ => 128,
        })
        .collect()
}

impl Dsv4Shape {
    fn validate(&self, quant: Dsv4Quant, n_vocab: usize) -> Result<(), SynthError> {
        let bad = |w: String| Err(SynthError::Config(w));
        let dims = [
            ("layers", self.layers),
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("head-dim", self.head_dim),
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
        if self.hash_layers > self.layers {
            return bad(format!(
                "{} hash layers but only {} layers",
                self.hash_layers, self.layers
            ));
        }
        if !(self.heads * self.head_dim).is_multiple_of(self.o_groups) {
            return bad("heads x head-dim must be a multiple of the output groups".into());
        }
        let (gu, down) = quant.experts();
        for (what, ty, len) in [
            ("expert gate/up rows (hidden)", gu, self.hidden),
            ("expert down rows (expert-ff)", down, self.expert_ff),
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

/// Lay out a deepseek4 file for `cfg` with `vocab`'s tokenizer (padded to `shape.vocab`).
pub fn plan(cfg: &Dsv4Config, mut vocab: Vocab) -> Result<Plan, SynthError> {
    let s = &cfg.shape;
    if let Some(n) = s.vocab {
        vocab.pad_to(n)?;
    }
    let n_vocab = vocab.n_tokens;
    s.validate(cfg.quant, n_vocab)?;
    let ratios = compress_ratios(s.layers);
    let hc = 4usize;
    let a = "deepseek4";
    let u = |v: usize| MetaValue::U32(v as u32);
    let f = MetaValue::F32;
    let mut metadata: Vec<(String, MetaValue)> = vec![
        ("general.architecture".into(), MetaValue::Str(a.into())),
        ("general.type".into(), MetaValue::Str("model".into())),
        ("general.name".into(), MetaValue::Str(cfg.name.clone())),
        (format!("{a}.block_count"), u(s.layers)),
        (format!("{a}.context_length"), u(s.context)),
        (format!("{a}.embedding_length"), u(s.hidden)),
        (format!("{a}.vocab_size"), u(n_vocab)),
        (format!("{a}.attention.head_count"), u(s.heads)),
        (format!("{a}.attention.head_count_kv"), u(1)),
        (format!("{a}.attention.key_length"), u(s.head_dim)),
        (format!("{a}.attention.value_length"), u(s.head_dim)),
        (format!("{a}.rope.dimension_count"), u(s.rope_dim)),
        (format!("{a}.rope.freq_base"), f(10_000.0)),
        (
            format!("{a}.rope.scaling.type"),
            MetaValue::Str("yarn".into()),
        ),
        (format!("{a}.rope.scaling.factor"), f(16.0)),
        (
            format!("{a}.rope.scaling.original_context_length"),
            u(65_536),
        ),
        (format!("{a}.rope.scaling.yarn_beta_fast"), f(32.0)),
        (format!("{a}.rope.scaling.yarn_beta_slow"), f(1.0)),
        (
            format!("{a}.attention.compress_rope_freq_base"),
            f(160_000.0),
        ),
        (format!("{a}.attention.layer_norm_rms_epsilon"), f(1e-6)),
        (format!("{a}.attention.q_lora_rank"), u(s.q_lora)),
        (format!("{a}.attention.sliding_window"), u(s.window)),
        (format!("{a}.attention.output_group_count"), u(s.o_groups)),
        (format!("{a}.attention.output_lora_rank"), u(s.o_lora)),
        (
            format!("{a}.attention.compress_ratios"),
            MetaValue::Array(MetaArray {
                elem_type: MetaType::I32,
                values: ratios.iter().map(|&r| MetaValue::I32(r as i32)).collect(),
            }),
        ),
        (
            format!("{a}.attention.indexer.head_count"),
            u(s.index_heads),
        ),
        (
            format!("{a}.attention.indexer.key_length"),
            u(s.index_head_dim),
        ),
        (format!("{a}.attention.indexer.top_k"), u(s.index_top_k)),
        (format!("{a}.expert_count"), u(s.experts)),
        (format!("{a}.expert_used_count"), u(s.top_k)),
        (format!("{a}.expert_shared_count"), u(1)),
        (format!("{a}.expert_feed_forward_length"), u(s.expert_ff)),
        (format!("{a}.expert_weights_scale"), f(1.5)),
        (format!("{a}.expert_weights_norm"), MetaValue::Bool(true)),
        (format!("{a}.expert_gating_func"), u(4)),
        (
            format!("{a}.swiglu_clamp_exp"),
            MetaValue::Array(MetaArray {
                elem_type: MetaType::F32,
                values: vec![MetaValue::F32(10.0); s.layers],
            }),
        ),
        (format!("{a}.hyper_connection.count"), u(hc)),
        (format!("{a}.hyper_connection.sinkhorn_iterations"), u(20)),
        (format!("{a}.hyper_connection.epsilon"), f(1e-6)),
        (format!("{a}.hash_layer_count"), u(s.hash_layers)),
        (format!("{a}.leading_dense_block_count"), u(0)),
        (
            "general.file_type".into(),
            MetaValue::U32(cfg.quant.file_type()),
        ),
        ("general.quantization_version".into(), MetaValue::U32(2)),
    ];
    metadata.extend(vocab.metadata);

    let (e, v, x) = (s.hidden as u64, n_vocab as u64, s.experts as u64);
    let (hd, ff, ql) = (s.head_dim as u64, s.expert_ff as u64, s.q_lora as u64);
    let (og, ol) = (s.o_groups as u64, s.o_lora as u64);
    let (ixh, ixd) = (s.index_heads as u64, s.index_head_dim as u64);
    let hcu = hc as u64;
    let mix = ((2 + hc) * hc) as u64;
    let sigma = |fan_in: u64| 1.0 / (fan_in as f32).sqrt();
    let (gu_ty, down_ty) = cfg.quant.experts();
    let mut tensors: Vec<PlannedTensor> = Vec::new();
    let mut fallbacks = Vec::new();
    // A matrix in `ty` (Q8_0 falls back to F16 when its rows are not whole blocks).
    let mut mat = |t: &mut Vec<PlannedTensor>, name: String, dims: &[u64], ty: GgmlType, sg| {
        let ty = if crate::blocks::fits(ty, dims[0] as usize) {
            ty
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
    let (q8, f16) = (GgmlType::Q8_0, GgmlType::F16);
    let t = &mut tensors;
    mat(t, "token_embd.weight".into(), &[e, v], f16, 1.0);
    for (il, &ratio) in ratios.iter().enumerate() {
        let n = |t: &str| format!("blk.{il}.{t}.weight");
        for hcn in ["hc_attn", "hc_ffn"] {
            mat(
                t,
                n(&format!("{hcn}_fn")),
                &[hcu * e, mix],
                f16,
                sigma(hcu * e),
            );
            t.push(small(n(&format!("{hcn}_base")), &[mix], 0.1));
            t.push(small(n(&format!("{hcn}_scale")), &[3], 0.1));
        }
        t.push(ones(n("attn_norm"), e));
        mat(t, n("attn_q_a"), &[e, ql], q8, sigma(e));
        t.push(ones(n("attn_q_a_norm"), ql));
        mat(t, n("attn_q_b"), &[ql, s.heads as u64 * hd], q8, sigma(ql));
        mat(t, n("attn_kv"), &[e, hd], q8, sigma(e));
        t.push(ones(n("attn_kv_a_norm"), hd));
        t.push(small(n("attn_sinks"), &[s.heads as u64], 0.1));
        let og_in = s.heads as u64 * hd / og;
        mat(t, n("attn_output_a"), &[og_in, og * ol], q8, sigma(og_in));
        mat(t, n("attn_output_b"), &[og * ol, e], q8, sigma(og * ol));
        if ratio != 0 {
            let coff = if ratio == 4 { 2 } else { 1 };
            let r = u64::from(ratio);
            mat(t, n("attn_compressor_kv"), &[e, coff * hd], f16, sigma(e));
            mat(t, n("attn_compressor_gate"), &[e, coff * hd], f16, sigma(e));
            mat(t, n("attn_compressor_ape"), &[coff * hd, r], f16, 0.1);
            t.push(ones(n("attn_compressor_norm"), hd));
        }
        if ratio == 4 {
            mat(t, n("indexer.attn_q_b"), &[ql, ixh * ixd], f16, sigma(ql));
            mat(t, n("indexer.proj"), &[e, ixh], f16, sigma(e));
            mat(t, n("indexer_compressor_kv"), &[e, 2 * ixd], f16, sigma(e));
            mat(
                t,
                n("indexer_compressor_gate"),
                &[e, 2 * ixd],
                f16,
                sigma(e),
            );
            mat(t, n("indexer_compressor_ape"), &[2 * ixd, 4], f16, 0.1);
            t.push(ones(n("indexer_compressor_norm"), ixd));
        }
        t.push(ones(n("ffn_norm"), e));
        mat(t, n("ffn_gate_inp"), &[e, x], f16, sigma(e));
        if il < s.hash_layers {
            t.push(PlannedTensor {
                spec: TensorSpec::new(n("ffn_gate_tid2eid"), &[s.top_k as u64, v], GgmlType::I32),
                fill: Fill::HashTable {
                    n_expert: s.experts as u32,
                    k: s.top_k as u32,
                    salt: cfg.seed ^ (il as u64).wrapping_mul(0x9E37_79B9),
                },
                row_scale: None,
            });
        } else {
            t.push(small(format!("blk.{il}.exp_probs_b.bias"), &[x], 0.01));
        }
        mat(t, n("ffn_gate_exps"), &[e, ff, x], gu_ty, sigma(e));
        mat(t, n("ffn_up_exps"), &[e, ff, x], gu_ty, sigma(e));
        mat(t, n("ffn_down_exps"), &[ff, e, x], down_ty, sigma(ff));
        mat(t, n("ffn_gate_shexp"), &[e, ff], q8, sigma(e));
        mat(t, n("ffn_up_shexp"), &[e, ff], q8, sigma(e));
        mat(t, n("ffn_down_shexp"), &[ff, e], q8, sigma(ff));
    }
    mat(
        t,
        "output_hc_fn.weight".into(),
        &[hcu * e, hcu],
        f16,
        sigma(hcu * e),
    );
    t.push(small("output_hc_base.weight".into(), &[hcu], 0.1));
    t.push(small("output_hc_scale.weight".into(), &[1], 0.1));
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
