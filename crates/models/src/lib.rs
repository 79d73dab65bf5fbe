//! Models: shared blocks, one module per architecture, and per-sequence state.
//!
//! Owns: turning a GGUF file into a [`Model`] (the registered [`arch::Architecture`] for
//! its `general.architecture`) and evaluating tokens with it: [`blocks`] (attention, GLU,
//! MoE with routers, embedding/head, ...), [`arch`] (the six architectures: keys, tensors,
//! plans), [`kv`] and [`state`] (what a sequence carries, snapshots; [`state_codec`] their byte
//! form), [`compute`] (the
//! interface blocks reach kernels through), [`expert`] (the resident expert source),
//! [`plan`] (an architecture's decoder as data: the one description the CPU and device
//! backends run), [`decoder`] (the CPU decoder that runs a plan with the blocks). Streaming
//! experts is `sluice-tier`'s.

pub mod arch;
pub mod blocks;
pub mod compute;
pub mod config;
pub mod decoder;
pub mod expert;
pub mod kv;
pub mod model;
pub mod ops;
pub mod plan;
pub mod state;
pub mod state_codec;
pub mod threads;
pub mod weights;

use std::path::PathBuf;

pub use config::ModelConfig;
pub use model::{Logits, Model};
pub use state::{SeqState, Snapshot};

/// Everything that can go wrong loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] sluice_gguf::GgufError),
    #[error(transparent)]
    Map(#[from] sluice_io::MapError),
    #[error(transparent)]
    Kernel(#[from] sluice_kernels::KernelError),
    #[error(transparent)]
    Stream(#[from] sluice_tier::StreamError),
    #[error("{path}: architecture '{found}' is not supported; sluice knows: {}", arch::known().join(", "))]
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
    #[error("token id {id} is out of range: the vocabulary has {n_vocab} tokens")]
    TokenOutOfRange { id: u32, n_vocab: usize },
    #[error("{0}")]
    Compute(String),
    /// NaN or Inf in the activations: broken weights or hyper-parameters, or a file that
    /// changed under the running process. Never silently turned into tokens.
    #[error("{}: non-finite values (NaN or Inf) at position {position}, first in {stage}: the model's weights or hyper-parameters are broken (or the file changed while sluice ran); stopping", .path.display())]
    NonFinite {
        path: PathBuf,
        position: usize,
        stage: blocks::Stage,
    },
}
