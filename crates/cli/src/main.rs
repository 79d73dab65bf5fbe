//! The `sluice` binary: flag definitions and glue over the library crates.
//!
//! `main` only parses the command line and dispatches; each subcommand lives in its own
//! module (`inspect.rs`, `run.rs`, ...) exposing its clap `Args` and an entry function.

mod bench;
mod cache_sim;
mod common;
mod inspect;
mod measure;
mod pack;
mod perplexity;
mod run;
mod serve;
mod signals;
mod synth;

use std::error::Error;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// sluice: run Mixture-of-Experts models larger than RAM, streaming experts from the SSD.
#[derive(Parser)]
#[command(
    name = "sluice",
    version,
    about = "Mixture-of-Experts inference from SSD"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt, or chat interactively.
    Run(run::RunArgs),
    /// Serve the model over HTTP (OpenAI- and Anthropic-compatible API).
    Serve(serve::ServeArgs),
    /// Perplexity of a text file (as llama.cpp's llama-perplexity computes it).
    Perplexity(perplexity::PerplexityArgs),
    /// Prompt-processing and decode speed (median of repeated runs).
    Bench(bench::BenchArgs),
    /// Replay a routing trace (--record-routing) against cache budgets and policies,
    /// next to Belady's optimum.
    CacheSim(cache_sim::CacheSimArgs),
    /// Write a packed-experts sidecar (each expert's matrices contiguous, 4 KiB aligned)
    /// for one-read-per-expert streaming; the model file is not modified.
    Pack(pack::PackArgs),
    /// Show a GGUF file's header: metadata, tensors, and bytes by role.
    Inspect(inspect::Args),
    /// Write a random-weight GGUF of a real architecture's shape (qwen3moe presets), for
    /// benchmarking expert streaming on models larger than RAM; llama.cpp loads it too.
    Synth(synth::SynthArgs),
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return clap_error(e),
    };
    let result = match cli.command {
        Command::Run(a) => run::main(a),
        Command::Serve(a) => serve::main(a),
        Command::Perplexity(a) => perplexity::main(a),
        Command::Bench(a) => bench::main(a),
        Command::Inspect(args) => inspect::run(args),
        Command::CacheSim(a) => cache_sim::main(a),
        Command::Pack(a) => pack::main(a),
        Command::Synth(a) => synth::main(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is::<common::Interrupted>() => ExitCode::from(130),
        Err(e) if e.is::<common::Terminated>() => ExitCode::from(143),
        // A reader that closed stdout (`sluice inspect --json | head -c 100`) ends the
        // command quietly, as it would end `cat`: the output nobody reads is not an error.
        Err(e) if common::is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes on one line, skipping causes already quoted by their parent.
fn one_line(e: &anyhow::Error) -> String {
    let mut msg = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !msg.contains(&c) {
            msg.push_str(": ");
            msg.push_str(&c);
        }
    }
    msg.replace('\n', " ")
}

/// Clap's errors, with a bad flag value said on one line as `--flag value: why` (the form
/// every other sluice error takes); help and version print as usual.
fn clap_error(e: clap::Error) -> ExitCode {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if e.kind() == ErrorKind::ValueValidation || e.kind() == ErrorKind::InvalidValue {
        let get = |k| match e.get(k) {
            Some(ContextValue::String(s)) => Some(s.clone()),
            _ => None,
        };
        if let (Some(arg), Some(value)) =
            (get(ContextKind::InvalidArg), get(ContextKind::InvalidValue))
        {
            let flag = arg.split_whitespace().next().unwrap_or(&arg).to_string();
            let why = e
                .source()
                .map(|s| s.to_string())
                .or_else(|| {
                    e.get(ContextKind::ValidValue)
                        .map(|v| format!("expected one of {v}"))
                })
                .unwrap_or_else(|| "invalid value".to_string());
            eprintln!("error: {flag} {value}: {why} (see --help)");
            return ExitCode::from(2);
        }
    }
    let _ = e.print();
    ExitCode::from(if e.use_stderr() { 2 } else { 0 })
}
