//! Helpers shared by the CLI integration tests: a scratch directory and the built binary.

use std::path::PathBuf;
use std::process::{Command, Output};

/// A fresh scratch directory for one test (per test binary, by process id).
pub fn tmp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("sluice-cli-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Run the built `sluice` binary.
pub fn sluice(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .output()
        .unwrap()
}
