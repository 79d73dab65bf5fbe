//! The `sluice` binary: flag definitions and glue over the library crates.

fn main() {
    println!("sluice {}", env!("CARGO_PKG_VERSION"));
}
