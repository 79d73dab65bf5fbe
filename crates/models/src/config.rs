//! What every architecture tells the rest of the engine about its shape, and the reader
//! of `<arch>.*` metadata keys the architectures share.
//!
//! Owns: [`ModelConfig`] (the fields sessions, the memory plan, the expert tier and the
//! CLI need, whatever the architecture) and [`Hparams`] (typed getters with defaults and
//! checks of the `<arch>.` keys, errors naming file and key), including the bounds every
//! size, count and float a file sets is checked against before anything is allocated or
//! iterated from it ([`MAX_INT`], [`MAX_CONTEXT`], [`MAX_ITERATIONS`], the block count
//! against the tensors, windows against the context, finite positive floats, known RoPE
//! scaling types) and the vocabulary's agreement with the tokenizer.
//! Architecture-specific hyper-parameters live in each architecture's module.

use sluice_gguf::{GgufFile, MetaValue};

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

/// The largest value any integer hyper-parameter may have (sizes, counts, ids): far above
/// every real model's (vocabularies of 262,144, contexts of 10M), far below what would
/// make a product of two of them overflow or an allocation of one of them fail.
pub const MAX_INT: usize = 1 << 26;

/// The longest `context_length` a file may declare (16,777,216 positions; the longest real
/// one is 10M). Windows and top-k selections are bounded by the file's context.
pub const MAX_CONTEXT: usize = 1 << 24;

/// The most iterations a file may ask any loop to run (e.g. Sinkhorn normalisation, 20 in
/// DeepSeek V4 and GLM-5.3-Flash).
pub const MAX_ITERATIONS: usize = 1000;

/// RoPE scaling as a file declares it (`rope.scaling.type` and `rope.scaling.factor`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// No scaling (`none`, or no type and no factor other than 1).
    None,
    /// `linear`: positions divided by the factor.
    Linear(f32),
    /// `yarn` with its factor.
    Yarn(f32),
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

    /// The values of an array key (a scalar key reads as one value); `None` when absent.
    pub fn array(&self, k: &str) -> Option<Vec<MetaValue>> {
        match self.file.get(&self.key(k)) {
            Some(MetaValue::Array(a)) => Some(a.values.clone()),
            Some(v) => Some(vec![v.clone()]),
            None => None,
        }
    }

    /// A per-layer float array key for `n` layers: a scalar (or one-element array)
    /// applies to every layer; `default` when absent (`None`: the key is required).
    pub fn per_layer_f32(
        &self,
        k: &str,
        n: usize,
        default: Option<Vec<f32>>,
    ) -> Result<Vec<f32>, ModelError> {
        let key = self.key(k);
        let Some(v) = self.array(k) else {
            return default.ok_or_else(|| self.bad(format!("{key} is missing")));
        };
        let vals: Option<Vec<f32>> = v
            .iter()
            .map(|x| x.as_f32().filter(|f| f.is_finite()))
            .collect();
        let vals = vals.ok_or_else(|| self.bad(format!("{key} must hold finite numbers")))?;
        match vals.len() {
            1 => Ok(vec![vals[0]; n]),
            l if l >= n => Ok(vals),
            l => Err(self.bad(format!("{key} has {l} entries for {n} layers"))),
        }
    }

    /// A required unsigned integer, at most [`MAX_INT`].
    pub fn u(&self, k: &str) -> Result<usize, ModelError> {
        let v = self.file.get_u64(&self.key(k))?;
        if v > MAX_INT as u64 {
            return Err(self.bad(format!(
                "{} is {v}; sluice accepts at most {MAX_INT} for a size or count",
                self.key(k)
            )));
        }
        Ok(v as usize)
    }

    /// `block_count`: > 0 and at most the file's tensor count (every layer has tensors), so
    /// nothing is allocated per layer for layers the file cannot hold.
    pub fn block_count(&self) -> Result<usize, ModelError> {
        let n = self.u("block_count")?;
        let max = self.file.tensors.len();
        if n == 0 || n > max {
            return Err(self.bad(format!(
                "{} is {n}; it must be in 1..={max} (the file has {max} tensors)",
                self.key("block_count")
            )));
        }
        Ok(n)
    }

    /// `context_length` (`d` when absent): in 1..=[`MAX_CONTEXT`].
    pub fn context_length(&self, d: usize) -> Result<usize, ModelError> {
        let n = self.u_or("context_length", d)?;
        if n == 0 || n > MAX_CONTEXT {
            return Err(self.bad(format!(
                "{} is {n}; it must be in 1..={MAX_CONTEXT}",
                self.key("context_length")
            )));
        }
        Ok(n)
    }

    /// An iteration count (`d` when absent): in 1..=[`MAX_ITERATIONS`].
    pub fn iterations(&self, k: &str, d: usize) -> Result<usize, ModelError> {
        let n = self.u_or(k, d)?;
        if n == 0 || n > MAX_ITERATIONS {
            return Err(self.bad(format!(
                "{} is {n}; it must be in 1..={MAX_ITERATIONS}",
                self.key(k)
            )));
        }
        Ok(n)
    }

    /// A size in positions (a window, a top-k; required when `d` is None) at most `n_ctx`,
    /// the file's context length (a sequence never holds more).
    pub fn positions(&self, k: &str, d: Option<usize>, n_ctx: usize) -> Result<usize, ModelError> {
        let n = match d {
            Some(d) => self.u_or(k, d)?,
            None => self.u(k)?,
        };
        if n > n_ctx {
            return Err(self.bad(format!(
                "{} is {n}; it must be at most the context length {n_ctx}",
                self.key(k)
            )));
        }
        Ok(n)
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

    /// A finite float > 0 (`d` when absent): RoPE bases, scaling factors.
    pub fn f_pos_or(&self, k: &str, d: f32) -> Result<f32, ModelError> {
        let v = self.f_or(k, d)?;
        if v <= 0.0 {
            return Err(self.bad(format!(
                "{} is {v}; it must be a finite number > 0",
                self.key(k)
            )));
        }
        Ok(v)
    }

    /// A finite float >= 0 (`d` when absent): norm epsilons.
    pub fn f_nonneg_or(&self, k: &str, d: f32) -> Result<f32, ModelError> {
        let v = self.f_or(k, d)?;
        if v < 0.0 {
            return Err(self.bad(format!(
                "{} is {v}; it must be a finite number >= 0",
                self.key(k)
            )));
        }
        Ok(v)
    }

    /// `rope.scaling.type` and `rope.scaling.factor`, refused unless the type is one of
    /// `supported` (a subset of `none`, `linear`, `yarn`) and the factor finite and > 0.
    /// No type: `none`, unless a factor other than 1 is written, then `implied` (the
    /// architecture's reading of a bare factor; `None` refuses it).
    pub fn rope_scaling(
        &self,
        supported: &[&str],
        implied: Option<&str>,
    ) -> Result<RopeScaling, ModelError> {
        let factor = self.f_pos_or("rope.scaling.factor", 1.0)?;
        let tk = self.key("rope.scaling.type");
        let ty = match self.file.get(&tk) {
            Some(v) => v
                .as_str()
                .ok_or_else(|| self.bad(format!("{tk} must be a string")))?,
            None if factor == 1.0 => "none",
            None => implied.ok_or_else(|| {
                self.bad(format!(
                    "{} is {factor} without {tk}; {} has no RoPE scaling",
                    self.key("rope.scaling.factor"),
                    self.arch
                ))
            })?,
        };
        if !supported.contains(&ty) {
            return Err(self.bad(format!(
                "{tk} is '{ty}'; {} supports {}",
                self.arch,
                supported.join(", ")
            )));
        }
        Ok(match ty {
            "linear" => RopeScaling::Linear(factor),
            "yarn" => RopeScaling::Yarn(factor),
            _ => RopeScaling::None,
        })
    }

    /// A boolean, `d` when absent.
    pub fn b_or(&self, k: &str, d: bool) -> Result<bool, ModelError> {
        if self.has(k) {
            Ok(self.file.get_bool(&self.key(k))?)
        } else {
            Ok(d)
        }
    }

    /// The vocabulary size: `<arch>.vocab_size`, else the token embedding's rows. When the
    /// file has a tokenizer (`tokenizer.ggml.tokens`), its token count must equal it, as
    /// llama.cpp requires (converters pad the token list to the embedding's rows), so the
    /// architectures' `[n_vocab, n_embd]` embedding and output checks bind the tokenizer to
    /// both.
    pub fn n_vocab(&self) -> Result<usize, ModelError> {
        let n = if self.has("vocab_size") {
            self.u("vocab_size")?
        } else {
            self.file
                .tensor("token_embd.weight")
                .and_then(|t| t.dims.get(1).copied())
                .map(|v| v as usize)
                .ok_or_else(|| ModelError::MissingTensor {
                    path: self.file.path.clone(),
                    name: "token_embd.weight".into(),
                })?
        };
        if let Some(v) = self.file.get("tokenizer.ggml.tokens") {
            let tokens = v
                .as_array()
                .ok_or_else(|| {
                    self.bad(format!(
                        "tokenizer.ggml.tokens is a {}; it must be an array of strings",
                        v.type_description()
                    ))
                })?
                .values
                .len();
            if tokens != n {
                let what = if self.has("vocab_size") {
                    format!("{} {n}", self.key("vocab_size"))
                } else {
                    format!("token_embd.weight's {n} rows")
                };
                return Err(self.bad(format!(
                    "tokenizer.ggml.tokens has {tokens} tokens for {what}; they must be equal"
                )));
            }
        }
        Ok(n)
    }

    /// Linear RoPE position scale (1.0 = none) for an architecture that implements `none`
    /// and `linear` scaling only (a bare factor means linear).
    pub fn rope_linear_scale(&self) -> Result<f32, ModelError> {
        // llama.cpp divides positions by the factor whatever the type says.
        self.rope_scaling(&["none", "linear"], Some("linear"))?;
        Ok(1.0 / self.f_pos_or("rope.scaling.factor", 1.0)?)
    }

    /// Refuse RoPE scaling keys an architecture without RoPE scaling would ignore.
    pub fn no_rope_scaling(&self) -> Result<(), ModelError> {
        self.rope_scaling(&["none"], None).map(|_| ())
    }

    /// An error naming the file.
    pub fn bad(&self, what: String) -> ModelError {
        ModelError::BadConfig {
            path: self.file.path.clone(),
            what,
        }
    }
}
