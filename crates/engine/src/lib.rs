//! The inference engine: architectures, KV cache, expert tier, tokenizer, sampler.
//!
//! Owns: turning a GGUF file into a [`model::Model`] and evaluating tokens with it. The
//! file format is `sluice-gguf`'s, the kernels `sluice-kernels`', bytes off disk
//! `sluice-io`'s.

pub mod chat;
pub mod eval;
pub mod expert;
pub mod expert_tier;
pub mod kv;
pub mod model;
pub mod sampler;
pub mod streaming;
pub mod synth;
pub mod threads;
pub mod tokenizer;

use std::path::PathBuf;

pub use model::{Logits, Model};

/// Everything that can go wrong loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Gguf(#[from] sluice_gguf::GgufError),
    #[error(transparent)]
    Map(#[from] sluice_io::MapError),
    #[error(transparent)]
    Kernel(#[from] sluice_kernels::KernelError),
    #[error("{path}: architecture '{found}' is not supported; sluice knows: {}", model::config::Arch::KNOWN.join(", "))]
    UnknownArch { path: PathBuf, found: String },
    #[error("{path}: tensor '{name}' is missing")]
    MissingTensor { path: PathBuf, name: String },
    #[error("{path}: tensor '{name}': {what}")]
    BadTensor {
        path: PathBuf,
        name: String,
        what: String,
    },
    #[error("{path}: bad hyper-parameters: {what}")]
    BadConfig { path: PathBuf, what: String },
    #[error("context full: {needed} positions needed, the context holds {n_ctx} (raise --ctx or shorten the prompt)")]
    ContextFull { needed: usize, n_ctx: usize },
    #[error("expert streaming: {0}")]
    Stream(String),
    #[error("token id {id} is out of range: the vocabulary has {n_vocab} tokens")]
    TokenOutOfRange { id: u32, n_vocab: usize },
}
