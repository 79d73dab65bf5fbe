//! What every architecture tells the rest of the engine about its shape, and the reader
//! of `<arch>.*` metadata keys the architectures share.
//!
//! Owns: [`ModelConfig`] (the fields sessions, the memory plan, the expert tier and the
//! CLI need, whatever the architecture) and [`Hparams`] (typed getters with defaults and
//! checks of the `<arch>.` keys, errors naming file and key). Architecture-specific
//! hyper-parameters live in each architecture's module.

use sluice_gguf::GgufFile;

use crate::ModelError;

/// The architecture-independent description of a loaded model.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    /// `general.architecture`.
    pub arch: &'static str,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_vocab: usize,
    /// Context length the model was trained for (the default `--ctx`).
    pub n_ctx_train: usize,
    /// Routed experts per MoE layer (0 for dense models).
    pub n_expert: usize,
    /// Experts each token uses per MoE layer.
    pub n_expert_used: usize,
    /// KV-cache bytes per position at f32 (all layers), for the memory plan.
    pub kv_bytes_per_pos: u64,
    /// Bytes of per-sequence state whatever the context (recurrent states of linear-attention
    /// layers, fixed attention windows), counted once per sequence and per snapshot.
    pub state_bytes: u64,
}

/// Typed access to `<arch>.*` keys of one file.
pub struct Hparams<'a> {
    pub file: &'a GgufFile,
    pub arch: &'static str,
}

impl<'a> Hparams<'a> {
    pub fn new(file: &'a GgufFile, arch: &'static str) -> Hparams<'a> {
        Hparams { file, arch }
    }

    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }

    pub fn has(&self, k: &str) -> bool {
        self.file.get(&self.key(k)).is_some()
    }

    /// A required unsigned integer.
    pub fn u(&self, k: &str) -> Result<usize, ModelError> {
        Ok(self.file.get_u64(&self.key(k))? as usize)
    }

    /// An unsigned integer, `d` when absent.
    pub fn u_or(&self, k: &str, d: usize) -> Result<usize, ModelError> {
        if self.has(k) {
            self.u(k)
        } else {
            Ok(d)
        }
    }

    /// A float, `d` when absent; must be finite.
    pub fn f_or(&self, k: &str, d: f32) -> Result<f32, ModelError> {
        let v = if self.has(k) {
            self.file.get_f32(&self.key(k))?
        } else {
            d
        };
        if !v.is_finite() {
            return Err(self.bad(format!(
                "{} is {v}; it must be a finite number",
                self.key(k)
            )));
        }
        Ok(v)
    }

    /// A boolean, `d` when absent.
    pub fn b_or(&self, k: &str, d: bool) -> Result<bool, ModelError> {
        if self.has(k) {
            Ok(self.file.get_bool(&self.key(k))?)
        } else {
            Ok(d)
        }
    }

    /// The vocabulary size: `<arch>.vocab_size`, else the token embedding's rows.
    pub fn n_vocab(&self) -> Result<usize, ModelError> {
        if self.has("vocab_size") {
            return self.u("vocab_size");
        }
        self.file
            .tensor("token_embd.weight")
            .and_then(|t| t.dims.get(1).copied())
            .map(|v| v as usize)
            .ok_or_else(|| ModelError::MissingTensor {
                path: self.file.path.clone(),
                name: "token_embd.weight".into(),
            })
    }

    /// Linear RoPE position scale from `rope.scaling.factor` (1.0 = none).
    pub fn rope_linear_scale(&self) -> Result<f32, ModelError> {
        let f = self.f_or("rope.scaling.factor", 1.0)?;
        Ok(if f > 0.0 { 1.0 / f } else { 1.0 })
    }

    /// An error naming the file.
    pub fn bad(&self, what: String) -> ModelError {
        ModelError::BadConfig {
            path: self.file.path.clone(),
            what,
        }
    }
}
