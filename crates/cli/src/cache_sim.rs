//! `sluice cache-sim TRACE --budget SIZE [--policy next,lru,...]`: replays a routing trace
//! (recorded with `--record-routing`) against cache budgets and prints misses, hit rate and
//! GB read for each policy next to the hindsight-rate yardstick and Belady's optimum; writes
//! popularity profiles for `--preload-profile` (`--write-profile`); with `--horizon`, the
//! known-future yardstick (Belady within the next N tokens or layers, `next` beyond).
//!
//! Owns: flag definitions and output only; the simulation is
//! `sluice_engine::tier::sim`, profiles `sluice_engine::tier::profile`.

use std::path::PathBuf;

use anyhow::{bail, Context};
use sluice_engine::tier::sim::{
    format_report_with, simulate_belady, simulate_horizon_requests, simulate_oracle_rate,
    simulate_preloaded,
};
use sluice_engine::tier::{parse_size_bytes, PolicyKind, Profile, RoutingTrace};

#[derive(Debug, clap::Args)]
pub struct CacheSimArgs {
    /// Routing trace written by `--record-routing FILE`.
    pub trace: PathBuf,
    /// Cache budget(s), comma-separated: bytes with units (4G, 512MiB, 1.5GB; K/M/G/T and
    /// KiB..TiB are powers of 1024, KB..TB powers of 1000) or a share of all routed-expert
    /// bytes (25%). Optional with --write-profile.
    #[arg(long, value_delimiter = ',')]
    pub budget: Vec<String>,
    /// Policies to compare, comma-separated: next (expected next use, rates halving every
    /// 64 tokens; next:N every N), xl (next with the next selection predicted from the
    /// layer's previous set and the current token's last 2 layers; xl:J from J layers),
    /// lru, lfu (counts halve every 16 tokens), lfu:N, lru2.
    #[arg(long, value_delimiter = ',', default_value = "next,xl,lru,lfu,lru2")]
    pub policy: Vec<String>,
    /// Yardsticks with a known future, comma-separated: N (tokens) or NL (layer visits),
    /// e.g. `1,4,16,8L`: Belady's rule for the experts requested within that horizon,
    /// `next`'s for the rest (how far ahead a policy would need to know the routing).
    #[arg(long, value_delimiter = ',')]
    pub horizon: Vec<String>,
    /// Skip Belady's optimum and the hindsight-rate yardstick.
    #[arg(long)]
    pub no_belady: bool,
    /// Write the trace's popularity profile (selections per token of every expert) to
    /// FILE, for `--preload-profile`.
    #[arg(long, value_name = "FILE")]
    pub write_profile: Option<PathBuf>,
    /// Count the profile over tokens A..B of the trace only (e.g. `0..500`, to replay the
    /// rest with `--preload-profile`).
    #[arg(long, value_name = "A..B")]
    pub profile_tokens: Option<String>,
    /// Warm each replay's cache from this profile first (as `--preload-profile` does at
    /// start); the warm-up's reads are not counted.
    #[arg(long, value_name = "FILE")]
    pub preload_profile: Option<PathBuf>,
    /// Replay only tokens from this one on (e.g. the tokens a profile was not made from).
    #[arg(long, default_value_t = 0)]
    pub skip_tokens: usize,
}

pub fn main(args: CacheSimArgs) -> anyhow::Result<()> {
    let mut trace = RoutingTrace::read(&args.trace)?;
    if let Some(out) = &args.write_profile {
        let range = match &args.profile_tokens {
            None => None,
            Some(r) => {
                let (a, b) = r
                    .split_once("..")
                    .and_then(|(a, b)| Some((a.parse::<usize>().ok()?, b.parse::<usize>().ok()?)))
                    .with_context(|| format!("--profile-tokens {r}: expected A..B"))?;
                if a >= b || b > trace.n_tokens() {
                    bail!(
                        "--profile-tokens {r}: the trace has {} tokens",
                        trace.n_tokens()
                    );
                }
                Some(a..b)
            }
        };
        let p = Profile::from_trace(&trace, range);
        p.write(out)?;
        eprintln!(
            "profile of {} experts over {} tokens written to {}",
            p.rates.len(),
            p.tokens,
            out.display()
        );
        if args.budget.is_empty() {
            return Ok(());
        }
    }
    if args.budget.is_empty() {
        bail!("--budget is required (unless --write-profile is given)");
    }
    if args.skip_tokens > 0 {
        trace = trace
            .skip_tokens(args.skip_tokens)
            .with_context(|| format!("--skip-tokens {}", args.skip_tokens))?;
    }
    let profile = match &args.preload_profile {
        None => None,
        Some(p) => {
            let prof = Profile::read(p)?;
            prof.check(p, trace.header.n_layer, trace.header.n_expert)?;
            Some(prof)
        }
    };
    let total = trace.header.total_expert_bytes();
    let per_token = (trace.header.moe_layers().len() * trace.header.top_k as usize) as u64;
    let horizons = args
        .horizon
        .iter()
        .map(|h| {
            let t = h.trim().to_ascii_lowercase();
            let (num, unit) = match t.strip_suffix('l') {
                Some(n) => (n, u64::from(trace.header.top_k)),
                None => (t.as_str(), per_token),
            };
            num.parse::<u64>()
                .map(|n| (h.trim().to_string(), n * unit))
                .with_context(|| format!("--horizon {h}: expected N (tokens) or NL (layers)"))
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let kinds = args
        .policy
        .iter()
        .map(|p| PolicyKind::from_name(p))
        .collect::<Result<Vec<_>, _>>()?;
    for (i, b) in args.budget.iter().enumerate() {
        let budget = parse_size_bytes(b, Some(total)).context("--budget")?;
        let results = kinds
            .iter()
            .map(|&k| {
                simulate_preloaded(&trace, budget, k.build(), profile.as_ref()).map(|mut r| {
                    r.policy = k.label();
                    r
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .with_context(|| format!("budget {b}"))?;
        let mut results = results;
        for (label, reqs) in &horizons {
            let mut r = simulate_horizon_requests(&trace, budget, *reqs)
                .with_context(|| format!("budget {b}"))?;
            r.policy = format!("horizon:{label}");
            results.push(r);
        }
        let (oracle, belady) = if args.no_belady {
            (None, None)
        } else {
            (
                Some(simulate_oracle_rate(&trace, budget).with_context(|| format!("budget {b}"))?),
                Some(simulate_belady(&trace, budget).with_context(|| format!("budget {b}"))?),
            )
        };
        if i > 0 {
            println!();
        }
        if let Some(p) = &args.preload_profile {
            println!("preloaded from {} (warm-up reads not counted)", p.display());
        }
        print!(
            "{}",
            format_report_with(&trace, budget, &results, oracle.as_ref(), belady.as_ref())
        );
    }
    Ok(())
}
