//! The engine: load a model as the user asked, and generate with it.
//!
//! Owns: [`load`] (`LoadOptions` -> a loaded model with its compute pool, the streaming
//! tier set up and checked against this machine's memory: the budget plan, the minimum,
//! the resident-weight lock), [`device`] (the CPU or a CUDA GPU found at run time,
//! attached by the same load), [`weights`] (the resident weights moved into huge-page RAM at
//! load), [`session`] (one sequence: prefill, decode, sampling, stop
//! conditions, timing, snapshots for prefix reuse), [`sampler`] and [`eval`]
//! (perplexity, `.npy` files). `run`, `bench`, `perplexity` and the server are thin
//! layers over these. The crates below it are re-exported for convenience.

pub mod device;
pub mod eval;
pub mod load;
pub mod sampler;
pub mod session;
pub mod weights;

pub use sluice_models as models;
pub use sluice_models::{Logits, Model, ModelError, SeqState, Snapshot};
pub use sluice_text as text;
pub use sluice_tier as tier;

/// Errors of loading and planning (model errors pass through typed).
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Stream(#[from] sluice_tier::StreamError),
    /// A flag or option value that cannot work; `flag` names it as the user typed it.
    #[error("{flag}: {what}")]
    Option { flag: &'static str, what: String },
    #[error("cannot start {threads} compute threads: {source}")]
    Threads {
        threads: usize,
        source: rayon::ThreadPoolBuildError,
    },
    #[error("{0}")]
    Memory(String),
    /// A caller's hook failed (printing, measure mode, a dump).
    #[error("{0}")]
    Hook(#[source] crate::session::HookError),
}
