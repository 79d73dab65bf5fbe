//! Flags and helpers shared by the commands that load a model (run, perplexity, bench).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use sluice_engine::Model;

/// Where the model is and how many threads compute.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// Path to the model (.gguf).
    #[arg(short = 'm', long = "model", value_name = "FILE")]
    pub model: PathBuf,
    /// Compute threads (default: the number of physical cores).
    #[arg(short = 't', long = "threads", value_name = "N", default_value_t = 0)]
    pub threads: usize,
    /// Context size in tokens (capped at the model's trained context).
    #[arg(short = 'c', long = "ctx", value_name = "N", default_value_t = 4096)]
    pub ctx: usize,
    /// Prompt tokens evaluated per forward pass during prefill.
    #[arg(short = 'b', long = "batch", value_name = "N", default_value_t = 256)]
    pub batch: usize,
}

/// A loaded model with its compute pool.
pub struct Loaded {
    pub model: Model,
    pub pool: rayon::ThreadPool,
    pub load_secs: f64,
}

impl ModelArgs {
    pub fn load(&self) -> Result<Loaded> {
        if self.batch == 0 {
            anyhow::bail!("--batch must be at least 1");
        }
        let t0 = Instant::now();
        if !self.model.exists() {
            anyhow::bail!("{}: no such file", self.model.display());
        }
        let model = Model::load(&self.model)?;
        let pool = sluice_engine::threads::compute_pool(self.threads)
            .context("cannot start the compute threads")?;
        Ok(Loaded {
            model,
            pool,
            load_secs: t0.elapsed().as_secs_f64(),
        })
    }
}
