//! The `sluice` binary: flag definitions and glue over the library crates.

#[allow(dead_code)] // cache_sim::main is wired into the subcommands by the coordinator
mod cache_sim;

fn main() {
    println!("sluice {}", env!("CARGO_PKG_VERSION"));
}
