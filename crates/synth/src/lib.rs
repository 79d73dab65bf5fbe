//! Synthetic models: random-weight GGUF files with a real architecture's shape (qwen3moe),
//! for benchmarking expert streaming on models larger than RAM, loadable by sluice and
//! llama.cpp alike.
//!
//! Owns: the presets and free dimensions ([`Shape`]), the file plan (metadata, tensor list
//! in llama.cpp's order and types, exact size, bytes by role: [`Plan`]), the free-space
//! check, and the streaming writer ([`write`]): tensor data generated in parallel chunks,
//! each determined by (seed, tensor index, chunk index), written in large pieces through
//! `GgufWriter` on a writer thread, to a temporary file renamed into place on success and
//! removed on any error or cancellation.

pub mod blocks;
pub mod deepseek4;
pub mod glm5next;
pub mod glm_dsa;
pub mod qwen4exp;
pub mod vocab;
mod write;

use std::path::{Path, PathBuf};

use sluice_gguf::{GgmlType, GgufError, GgufFile, GgufWriter, MetaValue, TensorSpec};

use blocks::{block_geometry, Fill, Rng};
pub use vocab::Vocab;
pub use write::{
    available_space, check_free_space, temp_path, write, write_replacing, write_to, WriteOptions,
};

/// Free space kept on top of the file's size.
pub const SPACE_MARGIN: u64 = 1 << 30;

/// Everything that can go wrong planning or writing a synthetic model.
#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("{path}: {what}: {source}")]
    Io {
        path: PathBuf,
        what: String,
        source: std::io::Error,
    },
    #[error(
        "{path}: not enough free space: the file needs {needed} bytes ({:.2} GiB) + {} GiB margin, \
         the file system has {available} bytes ({:.2} GiB) available",
        *needed as f64 / (1u64 << 30) as f64, SPACE_MARGIN >> 30, *available as f64 / (1u64 << 30) as f64
    )]
    NoSpace {
        path: PathBuf,
        needed: u64,
        available: u64,
    },
    #[error("{path}: vocabulary: {what}")]
    Vocab { path: PathBuf, what: String },
    #[error("bad synth configuration: {0}")]
    Config(String),
    #[error("{path}: not a regular file (a device, FIFO or directory); synth only writes or replaces regular files")]
    NotRegular { path: PathBuf },
    #[error("{path} exists (pass --force to replace it)")]
    Exists { path: PathBuf },
    #[error("interrupted; the partial file {path} was removed")]
    Interrupted { path: PathBuf },
}

/// A model shape: every dimension of a qwen3moe model.
#[derive(Debug, Clone, PartialEq)]
pub struct Shape {
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub experts: usize,
    pub top_k: usize,
    pub expert_ff: usize,
    /// `feed_forward_length` (the dense FFN size of the family; not used by the MoE layers).
    pub dense_ff: usize,
    /// Vocabulary size; `None` = the tokenizer's token count.
    pub vocab: Option<usize>,
    pub context: usize,
    pub rope_base: f32,
    pub rms_eps: f32,
}

/// Named shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// 2 layers, hidden 256, 8 experts of 256, top-2: for tests (every row a multiple of 256).
    Tiny,
    /// Qwen3-30B-A3B: 48 layers, hidden 2048, 32/4 heads of 128, 128 experts of 768, top-8.
    Qwen3_30bA3b,
    /// Qwen3-235B-A22B: 94 layers, hidden 4096, 64/4 heads of 128, 128 experts of 1536, top-8.
    Qwen3_235bA22b,
}

impl Preset {
    pub const NAMES: [&'static str; 3] = ["tiny", "qwen3-30b-a3b", "qwen3-235b-a22b"];

    pub fn from_name(name: &str) -> Option<Preset> {
        match name {
            "tiny" => Some(Preset::Tiny),
            "qwen3-30b-a3b" => Some(Preset::Qwen3_30bA3b),
            "qwen3-235b-a22b" => Some(Preset::Qwen3_235bA22b),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Preset::Tiny => "tiny",
            Preset::Qwen3_30bA3b => "qwen3-30b-a3b",
            Preset::Qwen3_235bA22b => "qwen3-235b-a22b",
        }
    }

    pub fn shape(self) -> Shape {
        let qwen3 = Shape {
            layers: 48,
            hidden: 2048,
            heads: 32,
            kv_heads: 4,
            head_dim: 128,
            experts: 128,
            top_k: 8,
            expert_ff: 768,
            dense_ff: 6144,
            vocab: None,
            context: 40960,
            rope_base: 1e6,
            rms_eps: 1e-6,
        };
        match self {
            Preset::Qwen3_30bA3b => qwen3,
            Preset::Qwen3_235bA22b => Shape {
                layers: 94,
                hidden: 4096,
                heads: 64,
                expert_ff: 1536,
                dense_ff: 12288,
                ..qwen3
            },
            Preset::Tiny => Shape {
                layers: 2,
                hidden: 256,
                heads: 4,
                kv_heads: 2,
                head_dim: 64,
                experts: 8,
                top_k: 2,
                expert_ff: 256,
                dense_ff: 512,
                context: 4096,
                ..qwen3
            },
        }
    }
}

/// What to generate.
#[derive(Debug, Clone)]
pub struct SynthConfig {
    pub shape: Shape,
    /// Type of the large matrices (attention, experts, embeddings/output).
    pub quant: GgmlType,
    /// 0 = every expert equally likely; larger = a Zipf-like popularity (see [`router_scales`]).
    pub router_skew: f32,
    pub seed: u64,
    /// `general.name`.
    pub name: String,
}

/// One tensor of the plan and how its values are drawn.
#[derive(Debug, Clone)]
pub struct PlannedTensor {
    pub spec: TensorSpec,
    pub fill: Fill,
    /// Router tensors: the per-expert row scale.
    pub row_scale: Option<Vec<f32>>,
}

/// The complete file: metadata, tensors, and the layout `GgufWriter` will produce.
#[derive(Debug, Clone)]
pub struct Plan {
    pub metadata: Vec<(String, MetaValue)>,
    pub tensors: Vec<PlannedTensor>,
    /// The header as the reader will see it (offsets, sizes, `file_size`).
    pub layout: GgufFile,
    pub seed: u64,
    /// Tensors written in a type other than the requested one (row length not a block multiple).
    pub fallbacks: Vec<String>,
}

/// Bytes of the plan by role (as `sluice inspect` counts them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RoleBytes {
    pub routed_experts: u64,
    pub embeddings: u64,
    pub resident: u64,
}

/// `general.file_type` (llama.cpp `llama_ftype`) for the main quant.
pub(crate) fn file_type(ty: GgmlType) -> u32 {
    match ty {
        GgmlType::F32 => 0,
        GgmlType::Q8_0 => 7,
        GgmlType::Q4_K => 14, // MOSTLY_Q4_K_S: every large matrix Q4_K
        GgmlType::Q6_K => 18,
        _ => 0,
    }
}

/// The quant types `synth` can write for the large matrices.
pub const QUANTS: [GgmlType; 4] = [
    GgmlType::F32,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q6_K,
];

/// The type a matrix with rows of `row_len` gets: `quant`, else Q8_0, else F32.
pub(crate) fn type_for(quant: GgmlType, row_len: usize) -> GgmlType {
    let fits = |ty: GgmlType| row_len.is_multiple_of(block_geometry(ty).1);
    [quant, GgmlType::Q8_0, GgmlType::F32]
        .into_iter()
        .find(|&t| fits(t))
        .unwrap_or(GgmlType::F32)
}

/// Router row scales of one layer: expert `e` gets `(1 + rank(e))^(-skew/2)`, with ranks a
/// seeded permutation per layer, normalised to RMS 1. A larger scale widens that expert's
/// router logit distribution, so it wins the top-k more often: with 128 experts, top-8 and
/// skew 1, the 8 most popular experts take about 30 % of the picks (uniform: 6 %).
pub fn router_scales(n_expert: usize, skew: f32, seed: u64, layer: usize) -> Vec<f32> {
    let mut order: Vec<usize> = (0..n_expert).collect();
    let mut rng = Rng::new(&[seed, 0x524F_5554, layer as u64]);
    for i in (1..n_expert).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    let mut s = vec![0.0f32; n_expert];
    for (rank, &e) in order.iter().enumerate() {
        s[e] = (1.0 + rank as f32).powf(-skew / 2.0);
    }
    let rms = (s.iter().map(|v| v * v).sum::<f32>() / n_expert.max(1) as f32).sqrt();
    s.iter_mut().for_each(|v| *v /= rms);
    s
}

impl Shape {
    fn validate(&self, n_vocab: usize) -> Result<(), SynthError> {
        let bad = |w: String| Err(SynthError::Config(w));
        let dims = [
            ("layers", self.layers),
            ("hidden", self.hidden),
            ("heads", self.heads),
            ("kv-heads", self.kv_heads),
            ("head-dim", self.head_dim),
            ("experts", self.experts),
            ("top-k", self.top_k),
            ("expert-ff", self.expert_ff),
            ("vocab", n_vocab),
        ];
        if let Some((n, _)) = dims.iter().find(|(_, v)| *v == 0) {
            return bad(format!("--{n} must be > 0"));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return bad(format!(
                "--heads {} is not a multiple of --kv-heads {}",
                self.heads, self.kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!("--head-dim {} must be even", self.head_dim));
        }
        if self.top_k > self.experts {
            return bad(format!(
                "--top-k {} exceeds --experts {}",
                self.top_k, self.experts
            ));
        }
        if self.experts > u16::MAX as usize {
            return bad(format!("--experts {} exceeds 65535", self.experts));
        }
        Ok(())
    }
}

impl Plan {
    /// Lay out the file for `cfg` with `vocab`'s tokenizer (padded to `shape.vocab`).
    pub fn new(cfg: &SynthConfig, mut vocab: Vocab) -> Result<Plan, SynthError> {
        let s = &cfg.shape;
        if let Some(n) = s.vocab {
            vocab.pad_to(n)?;
        }
        let n_vocab = vocab.n_tokens;
        s.validate(n_vocab)?;
        if !QUANTS.contains(&cfg.quant) {
            return Err(SynthError::Config(format!(
                "--quant {} is not one of F32, Q8_0, Q4_K, Q6_K",
                cfg.quant
            )));
        }
        if !(cfg.router_skew.is_finite() && cfg.router_skew >= 0.0) {
            return Err(SynthError::Config(format!(
                "--router-skew {} must be >= 0",
                cfg.router_skew
            )));
        }
        let a = "qwen3moe";
        let u = |v: usize| MetaValue::U32(v as u32);
        let mut metadata: Vec<(String, MetaValue)> = vec![
            ("general.architecture".into(), MetaValue::Str(a.into())),
            ("general.type".into(), MetaValue::Str("model".into())),
            ("general.name".into(), MetaValue::Str(cfg.name.clone())),
            (format!("{a}.block_count"), u(s.layers)),
            (format!("{a}.context_length"), u(s.context)),
            (format!("{a}.embedding_length"), u(s.hidden)),
            (format!("{a}.feed_forward_length"), u(s.dense_ff)),
            (format!("{a}.attention.head_count"), u(s.heads)),
            (format!("{a}.attention.head_count_kv"), u(s.kv_heads)),
            (format!("{a}.rope.freq_base"), MetaValue::F32(s.rope_base)),
            (
                format!("{a}.attention.layer_norm_rms_epsilon"),
                MetaValue::F32(s.rms_eps),
            ),
            (format!("{a}.expert_count"), u(s.experts)),
            (format!("{a}.expert_used_count"), u(s.top_k)),
            (format!("{a}.attention.key_length"), u(s.head_dim)),
            (format!("{a}.attention.value_length"), u(s.head_dim)),
            (
                "general.file_type".into(),
                MetaValue::U32(file_type(cfg.quant)),
            ),
            (format!("{a}.expert_feed_forward_length"), u(s.expert_ff)),
            ("general.quantization_version".into(), MetaValue::U32(2)),
        ];
        metadata.extend(vocab.metadata);

        let mut tensors: Vec<PlannedTensor> = Vec::new();
        let mut fallbacks = Vec::new();
        let (e, q, kv, ff, x) = (
            s.hidden as u64,
            (s.heads * s.head_dim) as u64,
            (s.kv_heads * s.head_dim) as u64,
            s.expert_ff as u64,
            s.experts as u64,
        );
        let sigma = |fan_in: u64| 1.0 / (fan_in as f32).sqrt();
        // A large matrix in the requested type (or the fallback its row length allows).
        let mut mat = |tensors: &mut Vec<PlannedTensor>, name: String, dims: &[u64], sigma: f32| {
            let ty = type_for(cfg.quant, dims[0] as usize);
            if ty != cfg.quant {
                fallbacks.push(format!("{name}: {ty} (rows of {})", dims[0]));
            }
            tensors.push(PlannedTensor {
                spec: TensorSpec::new(name, dims, ty),
                fill: Fill::Random { sigma },
                row_scale: None,
            });
        };
        let ones = |name: String, len: u64| PlannedTensor {
            spec: TensorSpec::new(name, &[len], GgmlType::F32),
            fill: Fill::Ones,
            row_scale: None,
        };
        // llama.cpp's convert_hf_to_gguf order: embeddings, per layer attention then MoE
        // (gate, down, up), final norm, output.
        let t = &mut tensors;
        mat(t, "token_embd.weight".into(), &[e, n_vocab as u64], 1.0);
        for il in 0..s.layers {
            let n = |t: &str| format!("blk.{il}.{t}.weight");
            t.push(ones(n("attn_norm"), e));
            mat(t, n("attn_q"), &[e, q], sigma(e));
            mat(t, n("attn_k"), &[e, kv], sigma(e));
            mat(t, n("attn_v"), &[e, kv], sigma(e));
            mat(t, n("attn_output"), &[q, e], sigma(q));
            t.push(ones(n("attn_q_norm"), s.head_dim as u64));
            t.push(ones(n("attn_k_norm"), s.head_dim as u64));
            t.push(ones(n("ffn_norm"), e));
            t.push(PlannedTensor {
                spec: TensorSpec::new(n("ffn_gate_inp"), &[e, x], GgmlType::F32),
                fill: Fill::Random { sigma: sigma(e) },
                row_scale: (cfg.router_skew > 0.0)
                    .then(|| router_scales(s.experts, cfg.router_skew, cfg.seed, il)),
            });
            mat(t, n("ffn_gate_exps"), &[e, ff, x], sigma(e));
            mat(t, n("ffn_down_exps"), &[ff, e, x], sigma(ff));
            mat(t, n("ffn_up_exps"), &[e, ff, x], sigma(e));
        }
        t.push(ones("output_norm.weight".into(), e));
        mat(t, "output.weight".into(), &[e, n_vocab as u64], sigma(e));

        Plan::from_parts(metadata, tensors, cfg.seed, fallbacks)
    }

    /// A plan from its metadata and tensors (the layout computed as the writer will).
    pub fn from_parts(
        metadata: Vec<(String, MetaValue)>,
        tensors: Vec<PlannedTensor>,
        seed: u64,
        fallbacks: Vec<String>,
    ) -> Result<Plan, SynthError> {
        let specs: Vec<TensorSpec> = tensors.iter().map(|t| t.spec.clone()).collect();
        let path = Path::new("<synth plan>");
        let layout = GgufWriter::new(std::io::sink(), path, &metadata, &specs)?
            .layout()
            .clone();
        Ok(Plan {
            metadata,
            tensors,
            layout,
            seed,
            fallbacks,
        })
    }

    /// The exact size of the file.
    pub fn file_size(&self) -> u64 {
        self.layout.file_size
    }

    /// Tensor bytes by role.
    pub fn role_bytes(&self) -> RoleBytes {
        let mut r = RoleBytes::default();
        for t in &self.layout.tensors {
            if t.name.ends_with("_exps.weight") {
                r.routed_experts += t.n_bytes;
            } else if t.name == "token_embd.weight" || t.name == "output.weight" {
                r.embeddings += t.n_bytes;
            } else {
                r.resident += t.n_bytes;
            }
        }
        r
    }

    /// Bytes of one expert of one layer (gate + up + down).
    pub fn one_expert_bytes(&self) -> u64 {
        let n_expert = ["qwen3moe", "deepseek4", "glm-dsa"]
            .iter()
            .find_map(|a| self.layout.get_u64(&format!("{a}.expert_count")).ok())
            .unwrap_or(1)
            .max(1);
        // The first layer with routed experts (glm-dsa's leading layers are dense).
        let first = (0..)
            .take_while(|il| {
                self.layout
                    .tensor(&format!("blk.{il}.attn_norm.weight"))
                    .is_some()
            })
            .find(|il| {
                self.layout
                    .tensor(&format!("blk.{il}.ffn_gate_exps.weight"))
                    .is_some()
            })
            .unwrap_or(0);
        ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]
            .iter()
            .filter_map(|t| self.layout.tensor(&format!("blk.{first}.{t}.weight")))
            .map(|t| t.n_bytes / n_expert)
            .sum()
    }
}
