//! `sluice cache-sim TRACE --budget SIZE [--policy lru,lfu,...]`: replays a routing trace
//! (recorded with `--record-routing`) against cache budgets and prints misses, hit rate and
//! GB read for each policy next to Belady's optimum.
//!
//! Owns: flag definitions and output only; the simulation is
//! `sluice_engine::tier::sim`.

use std::path::PathBuf;

use anyhow::Context;
use sluice_engine::tier::sim::{format_report, simulate_belady, simulate_kind};
use sluice_engine::tier::{parse_size_bytes, PolicyKind, RoutingTrace};

#[derive(Debug, clap::Args)]
pub struct CacheSimArgs {
    /// Routing trace written by `--record-routing FILE`.
    pub trace: PathBuf,
    /// Cache budget(s), comma-separated: bytes with units (4G, 512MiB, 1.5GB; K/M/G/T and
    /// KiB..TiB are powers of 1024, KB..TB powers of 1000) or a share of all routed-expert
    /// bytes (25%).
    #[arg(long, required = true, value_delimiter = ',')]
    pub budget: Vec<String>,
    /// Policies to compare, comma-separated: lru, lfu (counts halve every 16 tokens),
    /// lfu:N (every N tokens), lru2.
    #[arg(long, value_delimiter = ',', default_value = "lru,lfu,lru2")]
    pub policy: Vec<String>,
    /// Skip Belady's optimum.
    #[arg(long)]
    pub no_belady: bool,
}

pub fn main(args: CacheSimArgs) -> anyhow::Result<()> {
    let trace = RoutingTrace::read(&args.trace)?;
    let total = trace.header.total_expert_bytes();
    let kinds = args
        .policy
        .iter()
        .map(|p| PolicyKind::from_name(p))
        .collect::<Result<Vec<_>, _>>()?;
    for (i, b) in args.budget.iter().enumerate() {
        let budget = parse_size_bytes(b, Some(total)).context("--budget")?;
        let results = kinds
            .iter()
            .map(|&k| simulate_kind(&trace, budget, k))
            .collect::<Result<Vec<_>, _>>()
            .with_context(|| format!("budget {b}"))?;
        let belady = if args.no_belady {
            None
        } else {
            Some(simulate_belady(&trace, budget).with_context(|| format!("budget {b}"))?)
        };
        if i > 0 {
            println!();
        }
        print!(
            "{}",
            format_report(&trace, budget, &results, belady.as_ref())
        );
    }
    Ok(())
}
