//! `sluice perplexity`: llama-perplexity's number, computed by sluice.

use std::path::PathBuf;

use anyhow::{Context, Result};
use sluice_engine::text::tokenizer::Tokenizer;

use crate::common::{read_text_file, ModelArgs, PrintStats};

/// Smallest --ctx that scores at least one token per chunk (the second half minus the last).
const MIN_CTX: usize = 4;

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
    if args.model.ctx < MIN_CTX {
        anyhow::bail!(
            "--ctx {}: perplexity needs at least {MIN_CTX} (it scores the second half of each chunk)",
            args.model.ctx
        );
    }
    let text = read_text_file(&args.file).context("-f")?;
    let mut loaded = args.model.load()?;
    let model = &loaded.model;
    let tok = Tokenizer::from_gguf(&model.gguf)?;
    let tokens = tok.encode(&text, true, false);
    // --ctx is capped at the model's trained context, as its help says.
    let n_ctx = args.model.ctx.min(model.cfg.n_ctx_train);
    if n_ctx < args.model.ctx {
        eprintln!(
            "--ctx {} capped at the model's context {n_ctx}",
            args.model.ctx
        );
    }
    if tokens.len() < 2 * n_ctx {
        anyhow::bail!(
            "{}: {} tokens, need at least 2 x ctx = {} (lower --ctx)",
            args.file.display(),
            tokens.len(),
            2 * n_ctx
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
    if !res.ppl.is_finite() || res.scored == 0 {
        anyhow::bail!(
            "perplexity is {} ({} tokens scored): not a result",
            res.ppl,
            res.scored
        );
    }
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "Final estimate: PPL = {:.4} ({} tokens scored, {:.1} s, {:.1} tok/s)",
        res.ppl,
        res.scored,
        secs,
        (res.per_chunk.len() * n_ctx) as f64 / secs
    );
    if args.model.stream.stats {
        loaded.print_stats(secs);
    }
    drop(session);
    loaded.finish()
}
