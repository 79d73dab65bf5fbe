//! The `sluice` binary: flag definitions and glue over the library crates.

mod bench;
mod common;
mod perplexity;
mod run;

use clap::{Parser, Subcommand};

/// sluice: run Mixture-of-Experts models larger than RAM, streaming experts from the SSD.
#[derive(Parser, Debug)]
#[command(name = "sluice", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Generate text from a prompt, or chat interactively.
    Run(run::RunArgs),
    /// Perplexity of a text file (as llama.cpp's llama-perplexity computes it).
    Perplexity(perplexity::PerplexityArgs),
    /// Prompt-processing and decode speed (median of repeated runs).
    Bench(bench::BenchArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(a) => run::main(a),
        Command::Perplexity(a) => perplexity::main(a),
        Command::Bench(a) => bench::main(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
