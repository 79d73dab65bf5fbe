//! Shared test helpers: temp files with known pseudo-random content (the oracle is the byte
//! vector the test wrote, never the engine), a tiny deterministic RNG, and engine configs.
#![allow(dead_code)]

use sluice_io::{Backend, IoConfig};
use std::io::Write;
use std::path::{Path, PathBuf};

/// splitmix64: deterministic, independent of the code under test.
pub struct Rng(pub u64);
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

pub fn content(len: usize, seed: u64) -> Vec<u8> {
    let mut r = Rng(seed);
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        v.extend_from_slice(&r.next().to_le_bytes());
    }
    v.truncate(len);
    v
}

/// A file deleted on drop.
pub struct TempFile {
    pub path: PathBuf,
    pub bytes: Vec<u8>,
}

impl TempFile {
    /// Write `len` known bytes to a fresh file in `dir` and fsync it.
    pub fn new_in(dir: &Path, name: &str, len: usize, seed: u64) -> TempFile {
        // Unique per file: tests of one binary run in parallel with equal names and seeds.
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = dir.join(format!(
            "sluice-io-test-{}-{n}-{seed}-{name}",
            std::process::id(),
        ));
        let bytes = content(len, seed);
        let mut f = std::fs::File::create(&path).expect("create temp file");
        f.write_all(&bytes).expect("write temp file");
        f.sync_all().expect("fsync temp file");
        TempFile { path, bytes }
    }

    pub fn new(name: &str, len: usize, seed: u64) -> TempFile {
        TempFile::new_in(&std::env::temp_dir(), name, len, seed)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

pub fn cfg(backend: Backend, direct: bool) -> IoConfig {
    IoConfig {
        backend,
        direct,
        depth: 16,
        inflight_bytes: 0,
        threads: 4,
        high_priority: true,
    }
}

/// True if `dir` is on tmpfs (where O_DIRECT is refused).
pub fn is_tmpfs(dir: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).unwrap();
    // SAFETY: statfs is plain old data; all-zero is a valid value.
    let mut s: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: c is a NUL-terminated path and s a live, writable statfs.
    let rc = unsafe { libc::statfs(c.as_ptr(), &mut s) };
    rc == 0 && s.f_type as i64 == 0x0102_1994
}
