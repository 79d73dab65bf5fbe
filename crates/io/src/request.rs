//! The IO vocabulary every backend speaks: segments, requests and completions, the
//! configuration, errors, the `IoEngine` trait, and buffer layout (`required_capacity`,
//! placement). Backends (fileio, pool, uring) depend on this module; `engine.rs`, which
//! picks a backend, depends on them.

use crate::aligned::{AlignedBuf, ALIGN};
use crate::stats::IoStats;
use std::ops::Range;
use std::path::PathBuf;

/// A file byte range, any alignment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Segment {
    pub offset: u64,
    pub len: usize,
}

/// One read request: all `segments` land in `buf` (see [`required_capacity`]).
#[derive(Debug)]
pub struct ReadReq {
    pub tag: u64,
    pub segments: Vec<Segment>,
    pub buf: AlignedBuf,
}

/// A finished request. The buffer always comes back, also on error.
/// `placed[i]` = byte offset of segment i's first byte in `buf` (valid when `result` is Ok).
#[derive(Debug)]
pub struct ReadDone {
    pub tag: u64,
    pub buf: AlignedBuf,
    pub placed: Vec<usize>,
    pub result: Result<(), IoError>,
}

impl ReadDone {
    /// The bytes of segment `i` (None if out of range or the read failed).
    pub fn segment_bytes(&self, segments: &[Segment], i: usize) -> Option<&[u8]> {
        self.result.as_ref().ok()?;
        let s = segments.get(i)?;
        let p = *self.placed.get(i)?;
        self.buf.as_slice().get(p..p + s.len)
    }
}

/// Which backend reads the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// io_uring with one submission thread (falls back to `Pread` if the kernel refuses).
    Uring,
    /// A pool of reader threads doing positional reads.
    Pread,
    /// Copy out of a read-only memory map (the baseline; never O_DIRECT).
    Mmap,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Uring => "uring",
            Backend::Pread => "pread",
            Backend::Mmap => "mmap",
        }
    }
}

impl std::str::FromStr for Backend {
    type Err = IoError;
    fn from_str(s: &str) -> Result<Backend, IoError> {
        match s {
            "uring" | "io_uring" => Ok(Backend::Uring),
            "pread" => Ok(Backend::Pread),
            "mmap" => Ok(Backend::Mmap),
            other => Err(IoError::Config(format!(
                "unknown IO backend {other:?}, expected uring, pread or mmap"
            ))),
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Engine configuration. `Default`: uring, O_DIRECT on, depth 32, 8 MiB in flight, 4..8
/// threads, high priority.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IoConfig {
    pub backend: Backend,
    /// O_DIRECT for pread/uring (ignored by mmap). Refusal falls back to buffered, reported.
    pub direct: bool,
    /// io_uring: reads in flight at once (ring size).
    pub depth: usize,
    /// io_uring: bytes in flight at once, 0 = no cap (only `depth`). A small cap makes the
    /// disk serve requests in the order they were submitted (each unit's reads finish
    /// before the next unit's start) instead of all together at the end, so the caller
    /// can compute on the first landed unit while later ones load. At least one read is
    /// always in flight, however large.
    pub inflight_bytes: usize,
    /// pread/mmap: number of reader threads.
    pub threads: usize,
    /// Best-effort ioprio best-effort class level 0 on the IO threads.
    pub high_priority: bool,
}

impl Default for IoConfig {
    fn default() -> IoConfig {
        let threads = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(4)
            .clamp(4, 8);
        IoConfig {
            backend: Backend::Uring,
            direct: true,
            depth: 32,
            // Measured on the 30B-A3B Q8_0 synthetic at a 10% budget (issue 12): 8 MiB
            // lowered the share of decode waiting for IO from ~41% to ~35%.
            inflight_bytes: 8 << 20,
            threads,
            high_priority: true,
        }
    }
}

/// Everything that can go wrong in the IO engine. Each names the file, and for reads the
/// segment's offset and length.
#[derive(Debug, thiserror::Error)]
pub enum IoError {
    #[error("{path}: cannot open: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: read of {len} bytes at offset {offset} failed: {source}")]
    Read {
        path: PathBuf,
        offset: u64,
        len: usize,
        source: std::io::Error,
    },
    #[error("{path}: read of {len} bytes at offset {offset} hit end of file at {file_end}")]
    UnexpectedEof {
        path: PathBuf,
        offset: u64,
        len: usize,
        file_end: u64,
    },
    #[error("{path}: request {tag} needs a buffer of {needed} bytes, got {capacity}")]
    BufferTooSmall {
        path: PathBuf,
        tag: u64,
        needed: usize,
        capacity: usize,
    },
    #[error("{path}: {what}: {source}")]
    Sys {
        path: PathBuf,
        what: &'static str,
        source: std::io::Error,
    },
    #[error("{path}: IO engine is shut down")]
    Shutdown { path: PathBuf },
    #[error("IO configuration: {0}")]
    Config(String),
}

/// The IO engine. Submissions complete in any order; each completion returns its buffer.
pub trait IoEngine: Send + Sync {
    /// Queue a request. Non-blocking. Per-request problems (buffer too small, EOF, read
    /// errors) come back in `ReadDone::result` with the buffer; `Err` only if the engine
    /// can no longer run reads (its worker threads are gone).
    fn submit(&self, req: ReadReq) -> Result<(), IoError>;
    /// Block until any submitted request completes; None if none is in flight.
    fn wait_one(&self) -> Option<ReadDone>;
    /// A completed request if one is ready, without blocking.
    fn try_complete(&self) -> Option<ReadDone>;
    /// Snapshot of counters since open.
    fn stats(&self) -> IoStats;
    /// Backend actually in use ("uring", "pread", "mmap").
    fn name(&self) -> &'static str;
    /// Ask the kernel to start reading `range` into the page cache (posix_fadvise WILLNEED).
    /// Issued from a background thread, never on the caller's. No-op when hints are off.
    fn hint_willneed(&self, _range: Range<u64>) {}
    /// Switch `hint_willneed` on or off (on by default).
    fn set_hints(&self, _on: bool) {}
}

/// Bytes of the 4096-aligned range enclosing `s` (0 for an empty segment).
pub(crate) fn aligned_span(s: &Segment) -> (u64, usize) {
    if s.len == 0 {
        return (s.offset, 0);
    }
    let a = ALIGN as u64;
    let start = s.offset / a * a;
    let end = (s.offset + s.len as u64).div_ceil(a) * a;
    (start, (end - start) as usize)
}

/// Buffer capacity a request with these segments needs: the sum of the enclosing aligned
/// ranges, each placed at an aligned position, in segment order.
pub fn required_capacity(segments: &[Segment]) -> usize {
    segments.iter().map(|s| aligned_span(s).1).sum()
}

/// Per segment: (aligned file start, aligned length, position of the aligned range in buf,
/// placed = position of the segment's first byte in buf).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Layout1 {
    pub file_start: u64,
    pub span: usize,
    pub buf_pos: usize,
    pub placed: usize,
}

pub(crate) fn layout(segments: &[Segment]) -> Vec<Layout1> {
    let mut pos = 0usize;
    segments
        .iter()
        .map(|s| {
            let (file_start, span) = aligned_span(s);
            let l = Layout1 {
                file_start,
                span,
                buf_pos: pos,
                placed: pos + (s.offset - file_start) as usize,
            };
            pos += span;
            l
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_places_segments_at_aligned_positions() {
        let segs = [
            Segment {
                offset: 5000,
                len: 100,
            }, // [4096, 8192)
            Segment { offset: 0, len: 0 },
            Segment {
                offset: 8190,
                len: 4,
            }, // [4096, 12288)
        ];
        assert_eq!(required_capacity(&segs), 4096 + 8192);
        let l = layout(&segs);
        assert_eq!((l[0].file_start, l[0].span, l[0].placed), (4096, 4096, 904));
        assert_eq!(l[1].span, 0);
        assert_eq!(
            (l[2].file_start, l[2].span, l[2].buf_pos, l[2].placed),
            (4096, 8192, 4096, 4096 + 4094)
        );
    }
}
