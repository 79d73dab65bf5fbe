//! `sluice perplexity`: llama-perplexity's number, computed by sluice.

use std::path::PathBuf;

use anyhow::{Context, Result};
use sluice_engine::text::tokenizer::Tokenizer;

use crate::common::ModelArgs;

/// Perplexity of a text file, chunked and scored as llama.cpp's llama-perplexity does.
#[derive(clap::Args, Debug)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Text file to score.
    #[arg(short = 'f', long = "file", value_name = "TEXT")]
    pub file: PathBuf,
}

pub fn main(args: PerplexityArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("{}: cannot read the text file", args.file.display()))?;
    let loaded = args.model.load()?;
    let model = &loaded.model;
    let tok = Tokenizer::from_gguf(&model.gguf)?;
    let tokens = tok.encode(&text, true, false);
    let n_ctx = args.model.ctx;
    if tokens.len() < 2 * n_ctx {
        anyhow::bail!(
            "{}: {} tokens, need at least 2 x ctx = {} (lower --ctx)",
            args.file.display(),
            tokens.len(),
            2 * n_ctx
        );
    }
    if n_ctx > model.cfg.n_ctx_train {
        anyhow::bail!(
            "--ctx {n_ctx} exceeds the model's context {}",
            model.cfg.n_ctx_train
        );
    }
    eprintln!(
        "perplexity: {} tokens, {} chunks of {}",
        tokens.len(),
        tokens.len() / n_ctx,
        n_ctx
    );
    let bos = if tok.add_bos() { tok.bos() } else { None };
    let t0 = std::time::Instant::now();
    let mut session = loaded.session(&args.model);
    let res = sluice_engine::eval::perplexity(&mut session, &tokens, n_ctx, bos, |i, _n, est| {
        eprint!("[{i}]{est:.4},");
    })?;
    eprintln!();
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "Final estimate: PPL = {:.4} ({} tokens scored, {:.1} s, {:.1} tok/s)",
        res.ppl,
        res.scored,
        secs,
        (res.per_chunk.len() * n_ctx) as f64 / secs
    );
    Ok(())
}
