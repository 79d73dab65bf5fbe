//! Thread-count defaults and the persistent compute pool.
//!
//! Owns: counting physical cores (the default `--threads`), building the rayon pool
//! every forward pass runs in (`pool.install(|| ...)`; its thread count sizes
//! [`sluice_kernels::pool`], the persistent pool the hot path dispatches to), and small
//! helpers that spread element-wise work over that pool ([`for_each_chunk`], [`map`]).

use std::collections::HashSet;
use std::sync::Mutex;

use sluice_kernels::pool;

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

/// `f(i, piece)` for every `chunk`-element piece `i` of `data`, on the compute pool in
/// tasks of at least `min_pieces` pieces (`usize::MAX`: on this thread). Each piece is
/// written by exactly one call, so results never depend on the thread count.
pub fn for_each_chunk<T: Send>(
    data: &mut [T],
    chunk: usize,
    min_pieces: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    let chunk = chunk.max(1);
    let pieces = data.len().div_ceil(chunk);
    let per = pieces.div_ceil(pool::threads() * 4).max(min_pieces.max(1));
    if per >= pieces {
        data.chunks_mut(chunk)
            .enumerate()
            .for_each(|(i, p)| f(i, p));
        return;
    }
    let tasks: Vec<Mutex<&mut [T]>> = data.chunks_mut(per * chunk).map(Mutex::new).collect();
    pool::run(tasks.len(), &|_, c| {
        let mut t = tasks[c].lock().unwrap_or_else(|p| p.into_inner());
        for (i, p) in t.chunks_mut(chunk).enumerate() {
            f(c * per + i, p);
        }
    });
}

/// `(0..n).map(f)` computed on the compute pool when `n >= min_len` (else on this
/// thread), in index order.
pub fn map<T: Send>(n: usize, min_len: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    if n < min_len.max(2) {
        return (0..n).map(f).collect();
    }
    let slots: Vec<Mutex<Option<T>>> = (0..n).map(|_| Mutex::new(None)).collect();
    pool::run(n, &|_, i| {
        let v = f(i);
        *slots[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(v);
    });
    slots
        .into_iter()
        .map(|s| {
            s.into_inner()
                .unwrap_or_else(|p| p.into_inner())
                .expect("every index computed")
        })
        .collect()
}
