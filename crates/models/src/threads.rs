//! Thread-count defaults and the persistent compute pool.
//!
//! Owns: counting physical cores (the default `--threads`) and building the rayon pool
//! every kernel call runs on (`pool.install(|| ...)`).

use std::collections::HashSet;

/// Physical cores of this machine (hyper-threads counted once); falls back to the
/// logical CPU count when `/proc/cpuinfo` does not say.
pub fn physical_cores() -> usize {
    let logical = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") else {
        return logical;
    };
    let mut cores = HashSet::new();
    let mut phys = String::new();
    for line in info.lines() {
        if let Some((k, v)) = line.split_once(':') {
            match k.trim() {
                "physical id" => phys = v.trim().to_string(),
                "core id" => {
                    cores.insert((phys.clone(), v.trim().to_string()));
                }
                _ => {}
            }
        }
    }
    if cores.is_empty() {
        logical
    } else {
        cores.len().min(logical)
    }
}

/// A pool of `n` compute threads (`n == 0` means physical cores).
pub fn compute_pool(n: usize) -> Result<rayon::ThreadPool, rayon::ThreadPoolBuildError> {
    let n = if n == 0 { physical_cores() } else { n };
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .thread_name(|i| format!("sluice-compute-{i}"))
        .build()
}
