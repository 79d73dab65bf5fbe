//! Reading rows of a big per-layer-embedding (PLE) table that may stay on disk.
//!
//! Owns: [`PleSource`] (row ids in, the rows' raw bytes out, plus early hints), its three
//! implementations chosen by [`PleIo`] — [`RamPle`] (mapped, read once at load and locked,
//! no per-row hints), [`MmapPle`] (page cache, optional WILLNEED hints for the rows of the
//! next tokens), [`DirectPle`] (O_DIRECT reads through the IO engine at depth, rows
//! deduplicated, 4 KiB pages deduplicated and sorted by offset, a small row cache) — and
//! [`PleStats`] for `--stats`. Every source returns the same bytes, so logits never depend
//! on the mode.

use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Instant;

use sluice_io::{
    open_engine, required_capacity, AlignedBuf, Backend, IoConfig, IoEngine, IoStats, MappedFile,
    ReadReq, Segment, ALIGN,
};

use crate::groups::RowTable;
use crate::source::StreamError;

/// How PLE rows are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PleIo {
    /// A locked RAM copy (read once at load).
    Ram,
    /// Through the page cache (memory map), with optional WILLNEED hints.
    Mmap,
    /// Unbuffered reads at queue depth, with a row cache.
    #[default]
    Direct,
}

impl PleIo {
    pub fn name(self) -> &'static str {
        match self {
            PleIo::Ram => "ram",
            PleIo::Mmap => "mmap",
            PleIo::Direct => "direct",
        }
    }
}

impl std::str::FromStr for PleIo {
    type Err = String;
    fn from_str(s: &str) -> Result<PleIo, String> {
        match s {
            "ram" => Ok(PleIo::Ram),
            "mmap" => Ok(PleIo::Mmap),
            "direct" => Ok(PleIo::Direct),
            o => Err(format!(
                "unknown PLE IO mode {o:?}: expected ram, mmap or direct"
            )),
        }
    }
}

/// PLE reading options (`--ple-io`, `--no-ple-prefetch`, `--ple-inflight`, `--ple-row-cache`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PleOptions {
    pub io: PleIo,
    /// `mmap`: WILLNEED hints for the rows of the next tokens.
    pub prefetch: bool,
    /// `direct`: reads in flight.
    pub inflight: usize,
    /// `direct`: row cache size in bytes (0 = off).
    pub row_cache_bytes: u64,
}

impl Default for PleOptions {
    fn default() -> PleOptions {
        PleOptions {
            io: PleIo::Direct,
            prefetch: true,
            inflight: 64,
            row_cache_bytes: 64 << 20,
        }
    }
}

/// Counters of a PLE source since open.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PleStats {
    /// Rows asked for (with repeats).
    pub rows: u64,
    /// Row bytes delivered.
    pub bytes: u64,
    /// Rows served by the row cache (`direct`).
    pub cache_hits: u64,
    /// Read requests issued (`direct`: one per run of adjacent 4 KiB pages).
    pub reads: u64,
    /// Bytes those reads transferred (page aligned).
    pub read_bytes: u64,
    /// WILLNEED hints queued (`mmap`).
    pub hints: u64,
    /// Time the forward pass waited for rows, ns.
    pub wait_ns: u64,
    /// The IO engine's own counters (`direct`: syscalls = tasks, effective queue depth).
    pub io: Option<IoStats>,
    /// Bytes the block device holding the file read since the source opened (device-wide:
    /// every reader on that device counts), when the kernel says.
    pub device_read_bytes: Option<u64>,
}

/// Where PLE rows come from.
pub trait PleSource: Send + Sync {
    /// `ids.len()` rows' raw bytes, in order, into `out` (`ids.len() * row_bytes`).
    fn read_rows(&self, ids: &[u64], out: &mut [u8]) -> Result<(), StreamError>;
    /// The rows of tokens just known (issued as early as possible; may do nothing).
    fn prefetch(&self, _ids: &[u64]) {}
    fn stats(&self) -> PleStats;
    fn mode(&self) -> PleIo;
}

/// Open the source `opts` asks for over `table` of the file at `path`. Returns it and a
/// line saying what is in effect (e.g. a lock that failed).
pub fn open_ple(
    path: &Path,
    table: &RowTable,
    opts: &PleOptions,
) -> Result<(Box<dyn PleSource>, String), StreamError> {
    let size = table.row_bytes * table.n_rows;
    match opts.io {
        PleIo::Ram => {
            let map = MappedFile::open(path).map_err(|e| StreamError::Config(e.to_string()))?;
            let r = table.range();
            let t = Instant::now();
            let avail = mem_available();
            if avail.is_some_and(|a| size > a / 10 * 9) {
                // Locking more than the machine has would thrash it (or get the process
                // killed) before failing: say so and read it through the page cache.
                let note = format!(
                    "PLE table: ram asked for, but the table ({:.2} GiB) does not fit in available memory ({:.2} GiB); not locked, read through the page cache",
                    size as f64 / (1u64 << 30) as f64,
                    avail.unwrap_or(0) as f64 / (1u64 << 30) as f64
                );
                return Ok((
                    Box::new(RamPle {
                        inner: MmapPle::with_map(map, table.clone(), None, false),
                    }),
                    note,
                ));
            }
            let note = match map.lock(r.start as usize..r.end as usize) {
                Ok(()) => format!(
                    "PLE table: ram ({:.2} GiB read and locked in {:.1} s)",
                    size as f64 / (1u64 << 30) as f64,
                    t.elapsed().as_secs_f64()
                ),
                Err(e) => format!(
                    "PLE table: ram, but locking {:.2} GiB failed ({e}); continuing unlocked",
                    size as f64 / (1u64 << 30) as f64
                ),
            };
            Ok((
                Box::new(RamPle {
                    inner: MmapPle::with_map(map, table.clone(), None, false),
                }),
                note,
            ))
        }
        PleIo::Mmap => {
            let map = MappedFile::open(path).map_err(|e| StreamError::Config(e.to_string()))?;
            let hinter = if opts.prefetch {
                let cfg = IoConfig {
                    backend: Backend::Mmap,
                    direct: false,
                    depth: 1,
                    inflight_bytes: 0,
                    threads: 1,
                    high_priority: false,
                };
                Some(open_engine(path, &cfg)?)
            } else {
                None
            };
            let note = format!(
                "PLE table: mmap (page cache), row hints {}",
                if opts.prefetch { "on" } else { "off" }
            );
            Ok((
                Box::new(MmapPle::with_map(map, table.clone(), hinter, opts.prefetch)),
                note,
            ))
        }
        PleIo::Direct => {
            let cfg = IoConfig {
                backend: Backend::Uring,
                direct: true,
                depth: opts.inflight.max(1),
                inflight_bytes: 0,
                threads: 2,
                high_priority: false,
            };
            let engine = open_engine(path, &cfg)?;
            let st = engine.stats();
            let note = format!(
                "PLE table: direct ({}, O_DIRECT {}, {} in flight, row cache {} rows)",
                engine.name(),
                if st.direct { "on" } else { "off (refused)" },
                opts.inflight.max(1),
                opts.row_cache_bytes / table.row_bytes.max(1)
            );
            Ok((
                Box::new(DirectPle {
                    engine,
                    table: table.clone(),
                    inflight: opts.inflight.max(1),
                    state: Mutex::new(DirectState {
                        cache: RowCache::new(
                            (opts.row_cache_bytes / table.row_bytes.max(1)) as usize,
                        ),
                        runs: Vec::new(),
                        rows: Vec::new(),
                        bufs: Vec::new(),
                        in_flight: 0,
                        ready: HashMap::new(),
                    }),
                    counters: Counters::at_open(path),
                }),
                note,
            ))
        }
    }
}

/// MemAvailable from /proc/meminfo, bytes.
fn mem_available() -> Option<u64> {
    let m = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = m
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

#[derive(Default)]
struct Counters {
    /// The file and its device's read bytes at open.
    device: Option<(std::path::PathBuf, u64)>,
    rows: AtomicU64,
    bytes: AtomicU64,
    hits: AtomicU64,
    reads: AtomicU64,
    read_bytes: AtomicU64,
    hints: AtomicU64,
    wait_ns: AtomicU64,
}

impl Counters {
    fn at_open(path: &Path) -> Counters {
        Counters {
            device: sluice_io::block_device_read_bytes(path)
                .ok()
                .map(|b| (path.to_path_buf(), b)),
            ..Counters::default()
        }
    }

    fn snapshot(&self, io: Option<IoStats>) -> PleStats {
        PleStats {
            rows: self.rows.load(Relaxed),
            bytes: self.bytes.load(Relaxed),
            cache_hits: self.hits.load(Relaxed),
            reads: self.reads.load(Relaxed),
            read_bytes: self.read_bytes.load(Relaxed),
            hints: self.hints.load(Relaxed),
            wait_ns: self.wait_ns.load(Relaxed),
            io,
            device_read_bytes: self.device.as_ref().and_then(|(p, at)| {
                sluice_io::block_device_read_bytes(p)
                    .ok()
                    .map(|now| now.saturating_sub(*at))
            }),
        }
    }
}

fn check_ids(table: &RowTable, ids: &[u64], out: &[u8]) -> Result<(), StreamError> {
    if let Some(&bad) = ids.iter().find(|&&i| i >= table.n_rows) {
        return Err(StreamError::Config(format!(
            "PLE row {bad} is outside {} ({} rows)",
            table.name, table.n_rows
        )));
    }
    if out.len() != ids.len() * table.row_bytes as usize {
        return Err(StreamError::Config(
            "PLE output buffer of the wrong size".into(),
        ));
    }
    Ok(())
}

/// Rows through a memory map (the page cache).
pub struct MmapPle {
    map: MappedFile,
    table: RowTable,
    hinter: Option<Box<dyn IoEngine>>,
    hints_on: bool,
    counters: Counters,
}

impl MmapPle {
    fn with_map(
        map: MappedFile,
        table: RowTable,
        hinter: Option<Box<dyn IoEngine>>,
        hints_on: bool,
    ) -> MmapPle {
        let map_path = map.path().to_path_buf();
        MmapPle {
            map,
            table,
            hinter,
            hints_on,
            counters: Counters::at_open(&map_path),
        }
    }
}

impl PleSource for MmapPle {
    fn read_rows(&self, ids: &[u64], out: &mut [u8]) -> Result<(), StreamError> {
        check_ids(&self.table, ids, out)?;
        let t = Instant::now();
        let rb = self.table.row_bytes as usize;
        let bytes = self.map.bytes();
        for (&id, dst) in ids.iter().zip(out.chunks_mut(rb)) {
            let s = (self.table.start + id * self.table.row_bytes) as usize;
            dst.copy_from_slice(&bytes[s..s + rb]);
        }
        let c = &self.counters;
        c.rows.fetch_add(ids.len() as u64, Relaxed);
        c.bytes.fetch_add(out.len() as u64, Relaxed);
        c.wait_ns.fetch_add(t.elapsed().as_nanos() as u64, Relaxed);
        Ok(())
    }

    fn prefetch(&self, ids: &[u64]) {
        let Some(h) = self.hinter.as_ref().filter(|_| self.hints_on) else {
            return;
        };
        for &id in ids.iter().filter(|&&i| i < self.table.n_rows) {
            let s = self.table.start + id * self.table.row_bytes;
            h.hint_willneed(s..s + self.table.row_bytes);
            self.counters.hints.fetch_add(1, Relaxed);
        }
    }

    fn stats(&self) -> PleStats {
        self.counters.snapshot(None)
    }

    fn mode(&self) -> PleIo {
        PleIo::Mmap
    }
}

/// Rows from the locked mapping (`ram`): no hints, ever (a locked table needs none, and a
/// per-row WILLNEED became ZFS prefetch storms in Strata's measurements).
pub struct RamPle {
    inner: MmapPle,
}

impl PleSource for RamPle {
    fn read_rows(&self, ids: &[u64], out: &mut [u8]) -> Result<(), StreamError> {
        self.inner.read_rows(ids, out)
    }
    fn stats(&self) -> PleStats {
        self.inner.stats()
    }
    fn mode(&self) -> PleIo {
        PleIo::Ram
    }
}

/// A FIFO row cache.
struct RowCache {
    cap: usize,
    rows: HashMap<u64, Box<[u8]>>,
    order: VecDeque<u64>,
}

impl RowCache {
    fn new(cap: usize) -> RowCache {
        RowCache {
            cap,
            rows: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    fn insert(&mut self, id: u64, row: &[u8]) {
        if self.cap == 0 || self.rows.contains_key(&id) {
            return;
        }
        if self.rows.len() >= self.cap {
            if let Some(old) = self.order.pop_front() {
                self.rows.remove(&old);
            }
        }
        self.rows.insert(id, row.into());
        self.order.push_back(id);
    }
}

/// Rows by unbuffered reads at queue depth.
pub struct DirectPle {
    engine: Box<dyn IoEngine>,
    table: RowTable,
    inflight: usize,
    state: Mutex<DirectState>,
    counters: Counters,
}

/// Everything behind the reader's lock: the row cache, reads in flight (issued by
/// `prefetch`, collected by the next `read_rows`) and the rows they brought.
struct DirectState {
    cache: RowCache,
    /// Runs of adjacent pages (first page, pages) of the reads in flight, by tag.
    runs: Vec<(u64, u64)>,
    /// Missing rows whose pages those reads cover.
    rows: Vec<u64>,
    bufs: Vec<Option<AlignedBuf>>,
    in_flight: usize,
    /// Rows read ahead and not yet asked for.
    ready: HashMap<u64, Vec<u8>>,
}

impl DirectPle {
    /// Issue reads for the rows of `ids` that are neither cached nor ready; with `limit`,
    /// at most that many in flight (waiting for completions as needed), else all at once.
    fn issue(
        &self,
        st: &mut DirectState,
        ids: &[u64],
        limit: Option<usize>,
    ) -> Result<(), StreamError> {
        let mut missing: Vec<u64> = ids
            .iter()
            .copied()
            .filter(|id| !st.cache.rows.contains_key(id) && !st.ready.contains_key(id))
            .collect();
        missing.sort_unstable();
        missing.dedup();
        if missing.is_empty() {
            return Ok(());
        }
        // The 4 KiB pages of the missing rows, deduplicated, sorted, merged into runs.
        let a = ALIGN as u64;
        let mut pages: Vec<u64> = Vec::new();
        for &id in &missing {
            let s = self.table.start + id * self.table.row_bytes;
            pages.extend(s / a..(s + self.table.row_bytes).div_ceil(a));
        }
        pages.sort_unstable();
        pages.dedup();
        let first_tag = st.runs.len();
        for p in pages {
            let mine = st.runs.len() > first_tag;
            match st.runs.last_mut() {
                Some((f, n)) if mine && *f + *n == p => *n += 1,
                _ => st.runs.push((p, 1)),
            }
        }
        st.rows.extend(missing);
        for tag in first_tag..st.runs.len() {
            while limit.is_some_and(|l| st.in_flight >= l) {
                self.complete_one(st)?;
            }
            let (f, n) = st.runs[tag];
            // The table's end need not be page aligned (nor the file's).
            let end = ((f + n) * a).min(self.table.range().end);
            let segments = vec![Segment {
                offset: f * a,
                len: (end - f * a) as usize,
            }];
            let buf = AlignedBuf::new(required_capacity(&segments));
            st.bufs.push(None);
            self.engine.submit(ReadReq {
                tag: tag as u64,
                segments,
                buf,
            })?;
            st.in_flight += 1;
            self.counters.reads.fetch_add(1, Relaxed);
            self.counters.read_bytes.fetch_add(n * a, Relaxed);
        }
        Ok(())
    }

    fn complete_one(&self, st: &mut DirectState) -> Result<(), StreamError> {
        let done = self.engine.wait_one().ok_or(StreamError::LostRead)?;
        st.in_flight -= 1;
        done.result?;
        let slot = st
            .bufs
            .get_mut(done.tag as usize)
            .ok_or(StreamError::LostRead)?;
        *slot = Some(done.buf);
        Ok(())
    }

    /// Wait for every read in flight and move the rows they cover to `ready`.
    fn drain(&self, st: &mut DirectState) -> Result<(), StreamError> {
        while st.in_flight > 0 {
            self.complete_one(st)?;
        }
        let a = ALIGN as u64;
        let rb = self.table.row_bytes as usize;
        let rows = std::mem::take(&mut st.rows);
        let mut order: Vec<usize> = (0..st.runs.len()).collect();
        order.sort_by_key(|&i| st.runs[i].0);
        for id in rows {
            let s = self.table.start + id * self.table.row_bytes;
            let page = s / a;
            // The last run starting at or before the page holds it (runs of different
            // issues may overlap; then any holder will do: look further back).
            let runs = &st.runs;
            let k = order.partition_point(|&i| runs[i].0 <= page);
            let ri = order[..k]
                .iter()
                .rev()
                .copied()
                .find(|&i| (runs[i].0..runs[i].0 + runs[i].1).contains(&page))
                .ok_or(StreamError::LostRead)?;
            let (f, _) = st.runs[ri];
            let buf = st.bufs[ri].as_ref().ok_or(StreamError::LostRead)?;
            let off = (s - f * a) as usize;
            let row = buf.as_slice()[off..off + rb].to_vec();
            st.ready.insert(id, row);
        }
        st.runs.clear();
        st.bufs.clear();
        Ok(())
    }
}

impl PleSource for DirectPle {
    fn read_rows(&self, ids: &[u64], out: &mut [u8]) -> Result<(), StreamError> {
        check_ids(&self.table, ids, out)?;
        let t = Instant::now();
        let rb = self.table.row_bytes as usize;
        // One walk at a time: completions of the engine are not per caller.
        let mut st = state_lock(&self.state);
        let st = &mut *st;
        // Reads issued early (prefetch) first, then whatever is still missing.
        self.drain(st)?;
        self.issue(st, ids, Some(self.inflight))?;
        self.drain(st)?;
        for (&id, dst) in ids.iter().zip(out.chunks_mut(rb)) {
            if let Some(row) = st.ready.get(&id) {
                dst.copy_from_slice(row);
            } else if let Some(row) = st.cache.rows.get(&id) {
                dst.copy_from_slice(row);
                self.counters.hits.fetch_add(1, Relaxed);
            } else {
                return Err(StreamError::LostRead);
            }
        }
        for (id, row) in std::mem::take(&mut st.ready) {
            st.cache.insert(id, &row);
        }
        let c = &self.counters;
        c.rows.fetch_add(ids.len() as u64, Relaxed);
        c.bytes.fetch_add(out.len() as u64, Relaxed);
        c.wait_ns.fetch_add(t.elapsed().as_nanos() as u64, Relaxed);
        Ok(())
    }

    /// Issue the reads now (all at once; the engine keeps its depth), collect them in the
    /// next `read_rows`.
    fn prefetch(&self, ids: &[u64]) {
        let ids: Vec<u64> = ids
            .iter()
            .copied()
            .filter(|&i| i < self.table.n_rows)
            .collect();
        let mut st = state_lock(&self.state);
        // A failed early read is retried (and reported) by `read_rows`.
        if self.issue(&mut st, &ids, None).is_err() {
            let _ = self.drain(&mut st);
            st.ready.clear();
        }
    }

    fn stats(&self) -> PleStats {
        self.counters.snapshot(Some(self.engine.stats()))
    }

    fn mode(&self) -> PleIo {
        PleIo::Direct
    }
}

fn state_lock(m: &Mutex<DirectState>) -> std::sync::MutexGuard<'_, DirectState> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn three_modes_return_the_same_bytes() {
        let dir = std::env::temp_dir().join(format!("sluice-ple-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.bin");
        let (start, rb, n) = (1000u64, 90u64, 500u64);
        let data: Vec<u8> = (0..start + rb * n).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::File::create(&path)
            .unwrap()
            .write_all(&data)
            .unwrap();
        let table = RowTable {
            name: "t".into(),
            start,
            row_bytes: rb,
            n_rows: n,
        };
        let ids = [3u64, 499, 3, 0, 45, 46, 200, 45];
        let want: Vec<u8> = ids
            .iter()
            .flat_map(|&i| {
                data[(start + i * rb) as usize..(start + (i + 1) * rb) as usize].to_vec()
            })
            .collect();
        for io in [PleIo::Ram, PleIo::Mmap, PleIo::Direct] {
            for cache in [0, 4 * rb] {
                let opts = PleOptions {
                    io,
                    prefetch: true,
                    inflight: 2,
                    row_cache_bytes: cache,
                };
                let (src, _) = open_ple(&path, &table, &opts).unwrap();
                src.prefetch(&ids);
                for _ in 0..2 {
                    let mut out = vec![0u8; ids.len() * rb as usize];
                    src.read_rows(&ids, &mut out).unwrap();
                    assert_eq!(out, want, "{io:?} cache {cache}");
                }
                assert_eq!(src.stats().rows, 2 * ids.len() as u64);
                assert!(src.read_rows(&[n], &mut vec![0u8; rb as usize]).is_err());
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
