//! Hyper-parameters of a model, read from GGUF metadata.
//!
//! Owns: the list of architectures sluice knows and the translation of each one's
//! `<arch>.*` keys into one [`ModelConfig`]. It does not touch tensor data.

use sluice_gguf::GgufFile;

use crate::EngineError;

/// The architectures sluice can run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Qwen3 MoE: GQA with q/k RMS norms, softmax router, SwiGLU routed experts.
    Qwen3Moe,
    /// Gemma 3 (dense): interleaved sliding-window / global attention, GeGLU, pre+post norms.
    Gemma3,
}

impl Arch {
    /// Names as they appear in `general.architecture`.
    pub const KNOWN: [&'static str; 2] = ["qwen3moe", "gemma3"];

    pub fn from_name(name: &str) -> Option<Arch> {
        match name {
            "qwen3moe" => Some(Arch::Qwen3Moe),
            "gemma3" => Some(Arch::Gemma3),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Gemma3 => "gemma3",
        }
    }
}

/// Everything the forward pass needs to know about the model's shape.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub arch: Arch,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    /// Per-head size of queries and keys.
    pub head_dim: usize,
    /// Per-head size of values.
    pub head_dim_v: usize,
    pub n_vocab: usize,
    /// Context length the model was trained for (the default `--ctx`).
    pub n_ctx_train: usize,
    pub rms_eps: f32,
    /// RoPE base of global-attention layers.
    pub rope_base: f32,
    /// RoPE base of sliding-window layers (Gemma 3 uses 10 000 there).
    pub rope_base_swa: f32,
    /// Linear RoPE position scale of global layers (1.0 = none).
    pub rope_scale: f32,
    /// Sliding window in tokens (0 = no sliding-window layers).
    pub sliding_window: usize,
    /// Every `swa_pattern`-th layer is global, the others slide (0 = all global).
    pub swa_pattern: usize,
    /// Multiplier on q before q.k (1/sqrt(head_dim) for both architectures here).
    pub attn_scale: f32,
    /// Routed experts (0 for dense models).
    pub n_expert: usize,
    pub n_expert_used: usize,
    /// Renormalise the top-k router weights to sum to 1.
    pub expert_weights_norm: bool,
}

impl ModelConfig {
    /// Read the hyper-parameters of `file`'s architecture.
    pub fn from_gguf(file: &GgufFile) -> Result<ModelConfig, EngineError> {
        let arch_name = file.architecture()?;
        let arch = Arch::from_name(arch_name).ok_or_else(|| EngineError::UnknownArch {
            path: file.path.clone(),
            found: arch_name.to_string(),
        })?;
        let a = arch.name();
        let key = |k: &str| format!("{a}.{k}");
        let u = |k: &str| -> Result<usize, EngineError> { Ok(file.get_u64(&key(k))? as usize) };
        let u_or = |k: &str, d: usize| -> Result<usize, EngineError> {
            match file.get(&key(k)) {
                None => Ok(d),
                Some(_) => u(k),
            }
        };
        let f_or = |k: &str, d: f32| -> Result<f32, EngineError> {
            match file.get(&key(k)) {
                None => Ok(d),
                Some(_) => Ok(file.get_f32(&key(k))?),
            }
        };
        let n_embd = u("embedding_length")?;
        let n_head = u("attention.head_count")?;
        let n_head_kv = u_or("attention.head_count_kv", n_head)?;
        let head_dim = u_or("attention.key_length", n_embd / n_head.max(1))?;
        let head_dim_v = u_or("attention.value_length", head_dim)?;
        let n_vocab = match file.get(&key("vocab_size")) {
            Some(_) => u("vocab_size")?,
            None => file
                .tensor("token_embd.weight")
                .and_then(|t| t.dims.get(1).copied())
                .ok_or_else(|| EngineError::MissingTensor {
                    path: file.path.clone(),
                    name: "token_embd.weight".into(),
                })? as usize,
        };
        let rope_scale = match file.get(&key("rope.scaling.factor")) {
            Some(_) => {
                let f = file.get_f32(&key("rope.scaling.factor"))?;
                if f > 0.0 {
                    1.0 / f
                } else {
                    1.0
                }
            }
            None => 1.0,
        };
        let (sliding_window, swa_pattern, rope_base_swa) = match arch {
            Arch::Gemma3 => (u_or("attention.sliding_window", 0)?, 6, 10_000.0),
            Arch::Qwen3Moe => (0, 0, 0.0),
        };
        let rope_base = f_or("rope.freq_base", 10_000.0)?;
        let cfg = ModelConfig {
            arch,
            n_layer: u("block_count")?,
            n_embd,
            n_head,
            n_head_kv,
            head_dim,
            head_dim_v,
            n_vocab,
            n_ctx_train: u_or("context_length", 4096)?,
            rms_eps: f_or("attention.layer_norm_rms_epsilon", 1e-6)?,
            rope_base,
            rope_base_swa: if rope_base_swa > 0.0 {
                rope_base_swa
            } else {
                rope_base
            },
            rope_scale,
            sliding_window,
            swa_pattern,
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            n_expert: u_or("expert_count", 0)?,
            n_expert_used: u_or("expert_used_count", 0)?,
            expert_weights_norm: match file.get(&key("expert_weights_norm")) {
                None => true,
                Some(_) => file.get_bool(&key("expert_weights_norm"))?,
            },
        };
        cfg.validate(file)?;
        Ok(cfg)
    }

    fn validate(&self, file: &GgufFile) -> Result<(), EngineError> {
        let bad = |what: String| EngineError::BadConfig {
            path: file.path.clone(),
            what,
        };
        if self.n_layer == 0 || self.n_embd == 0 || self.n_head == 0 || self.n_head_kv == 0 {
            return Err(bad(
                "block_count, embedding_length and head counts must be > 0".into(),
            ));
        }
        if !self.n_head.is_multiple_of(self.n_head_kv) {
            return Err(bad(format!(
                "head_count {} is not a multiple of head_count_kv {}",
                self.n_head, self.n_head_kv
            )));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return Err(bad(format!(
                "key_length {} must be even and > 0",
                self.head_dim
            )));
        }
        if self.arch == Arch::Qwen3Moe
            && (self.n_expert == 0 || self.n_expert_used == 0 || self.n_expert_used > self.n_expert)
        {
            return Err(bad(format!(
                "expert_used_count {} must be in 1..=expert_count {}",
                self.n_expert_used, self.n_expert
            )));
        }
        Ok(())
    }

    /// Whether layer `il` uses sliding-window attention.
    pub fn is_swa_layer(&self, il: usize) -> bool {
        self.sliding_window > 0
            && self.swa_pattern > 0
            && (il % self.swa_pattern) < self.swa_pattern - 1
    }
}
