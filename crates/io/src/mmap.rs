//! Read-only memory maps of model files.

use std::fs::File;
use std::path::{Path, PathBuf};

/// Why a file could not be mapped.
#[derive(Debug, thiserror::Error)]
pub enum MapError {
    #[error("{path}: cannot open: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: cannot map: {source}")]
    Map {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// A whole file mapped read-only. An empty file maps to an empty slice.
pub struct MappedFile {
    path: PathBuf,
    file: File,
    map: Option<memmap2::Mmap>,
    /// The SIGBUS guard's slot for this map (see `sigbus.rs`).
    guard: Option<usize>,
    /// Byte ranges of the map now backed by anonymous copies ([`MappedFile::copy_into_ram`]),
    /// sorted, disjoint, page-aligned.
    copied: Vec<std::ops::Range<usize>>,
}

impl Drop for MappedFile {
    fn drop(&mut self) {
        if let Some(slot) = self.guard.take() {
            crate::sigbus::unregister(slot);
        }
    }
}

impl MappedFile {
    /// Map `path` read-only.
    pub fn open(path: &Path) -> Result<MappedFile, MapError> {
        let file = File::open(path).map_err(|source| MapError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        let len = file
            .metadata()
            .map_err(|source| MapError::Open {
                path: path.to_path_buf(),
                source,
            })?
            .len();
        if len == 0 {
            return Ok(MappedFile {
                path: path.to_path_buf(),
                file,
                map: None,
                guard: None,
                copied: Vec::new(),
            });
        }
        // SAFETY: the map is read-only and private to this process. Model files are not
        // expected to change while sluice runs; if another process truncates the file,
        // access past the new end raises SIGBUS, which is the documented hazard of every
        // mmap-based model loader (llama.cpp included): the SIGBUS guard registered below
        // turns it into an error message naming the file and exit status 1. Callers
        // validate offsets against the length seen here before touching bytes.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| MapError::Map {
            path: path.to_path_buf(),
            source,
        })?;
        let guard = crate::sigbus::register(map.as_ptr() as usize, map.len(), path);
        Ok(MappedFile {
            path: path.to_path_buf(),
            file,
            map: Some(map),
            guard,
            copied: Vec::new(),
        })
    }

    /// Pin `range` of the mapping in RAM (`mlock`): its pages are read now and can no longer
    /// be reclaimed, whatever else needs memory. Used for the weights every token needs
    /// when the experts stream, so a large expert cache cannot push them out of the page
    /// cache. Fails (e.g. RLIMIT_MEMLOCK) without side effects worth undoing.
    pub fn lock(&self, range: std::ops::Range<usize>) -> std::io::Result<()> {
        let Some(map) = &self.map else {
            return Ok(());
        };
        let end = range.end.min(map.len());
        if range.start >= end {
            return Ok(());
        }
        let page = crate::pagecache::page_size() as usize;
        let start = range.start / page * page;
        // SAFETY: the pointer and length lie inside this live mapping (start is rounded down
        // to a page boundary within it, end is clamped to its length); mlock only changes
        // residency, never the bytes.
        let rc = unsafe { libc::mlock(map.as_ptr().add(start).cast(), end - start) };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Move the page-aligned interior of each of `ranges` (byte offsets into the map) into
    /// anonymous memory advised for transparent huge pages (see `anon.rs` for why: decode
    /// reads every resident weight per token, and 2 MiB pages keep the TLB and the hardware
    /// prefetchers on them). The bytes stay the same and stay at the same addresses; they no
    /// longer come from (or count as) page cache, and [`MappedFile::evict`] leaves them be.
    /// Returns the bytes moved. On an error the range being moved keeps its file pages
    /// (those moved before it stay moved: both are correct).
    pub fn copy_into_ram(&mut self, ranges: &[std::ops::Range<usize>]) -> std::io::Result<u64> {
        let Some(map) = &self.map else {
            return Ok(0);
        };
        let page = crate::pagecache::page_size() as usize;
        let base = map.as_ptr() as usize;
        let mut moved = 0u64;
        for r in ranges {
            let start = r.start.next_multiple_of(page);
            let end = r.end.min(map.len()) / page * page;
            if start >= end || self.copied.iter().any(|c| c.start < end && start < c.end) {
                continue;
            }
            // SAFETY: `start..end` is page-aligned and inside this live private mapping of
            // `self.file`, whose byte `start` is at `base + start`; `&mut self` means no
            // slice from `bytes()` is alive while the pages are swapped.
            unsafe {
                crate::anon::replace_with_anonymous_copy(
                    &self.file,
                    base + start,
                    end - start,
                    start as u64,
                )?
            };
            self.copied.push(start..end);
            self.copied.sort_by_key(|c| c.start);
            moved += (end - start) as u64;
        }
        Ok(moved)
    }

    /// Bytes of the map moved into anonymous memory by [`MappedFile::copy_into_ram`].
    pub fn copied_bytes(&self) -> u64 {
        self.copied.iter().map(|r| (r.end - r.start) as u64).sum()
    }

    /// Drop `range` of the file from this process's mapping and from the page cache, so the
    /// next access really reads storage (measure mode). Pages mapped into a process are
    /// immune to `posix_fadvise(DONTNEED)`; `madvise(MADV_DONTNEED)` unmaps them from this
    /// mapping first. Returns the time spent.
    pub fn evict(&self, range: std::ops::Range<usize>) -> std::io::Result<std::time::Duration> {
        let t = std::time::Instant::now();
        if let Some(map) = &self.map {
            let page = crate::pagecache::page_size() as usize;
            let start = range.start / page * page;
            let end = range.end.min(map.len());
            for (start, end) in file_backed_parts(start..end, &self.copied) {
                // SAFETY: MADV_DONTNEED on a read-only, file-backed private mapping only
                // drops this process's page-table entries for the range; later reads fault
                // the same file bytes back in (from the page cache or storage). No slice
                // handed out by `bytes()` can observe a change, because the file content is
                // unchanged and the mapping stays valid. The anonymous copies are left out
                // (`file_backed_parts`): there the same advice would zero the bytes.
                unsafe {
                    map.unchecked_advise_range(
                        memmap2::UncheckedAdvice::DontNeed,
                        start,
                        end - start,
                    )?;
                }
            }
        }
        crate::pagecache::drop_page_cache_fd(&self.file, range.start as u64..range.end as u64)?;
        Ok(t.elapsed())
    }

    /// The mapped bytes.
    pub fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }

    /// The file this map was made from.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The parts of `range` outside every one of `copied` (sorted, disjoint), as (start, end).
fn file_backed_parts(
    range: std::ops::Range<usize>,
    copied: &[std::ops::Range<usize>],
) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut pos = range.start;
    for c in copied {
        if c.end <= pos || c.start >= range.end {
            continue;
        }
        if c.start > pos {
            out.push((pos, c.start));
        }
        pos = pos.max(c.end);
    }
    if pos < range.end {
        out.push((pos, range.end));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A scratch file of `len` patterned bytes, removed on drop.
    struct Scratch(std::path::PathBuf);
    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
    fn file_of(name: &str, len: usize) -> (Scratch, Vec<u8>) {
        let bytes: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4096) as u8).collect();
        let path = std::env::temp_dir().join(format!("sluice-io-{}-{name}", std::process::id()));
        let mut f = std::fs::File::create(&path).unwrap();
        f.write_all(&bytes).unwrap();
        f.sync_all().unwrap();
        (Scratch(path), bytes)
    }

    #[test]
    fn file_backed_parts_are_the_complement() {
        let c = [10..20, 30..40];
        assert_eq!(
            file_backed_parts(0..50, &c),
            vec![(0, 10), (20, 30), (40, 50)]
        );
        assert_eq!(file_backed_parts(12..35, &c), vec![(20, 30)]);
        assert_eq!(file_backed_parts(12..18, &c), vec![]);
        assert_eq!(file_backed_parts(0..5, &c), vec![(0, 5)]);
    }

    #[test]
    fn copied_ranges_keep_the_bytes_and_survive_evict() {
        let page = crate::pagecache::page_size() as usize;
        // 5 MiB + a bit: one range spans a whole 2 MiB-aligned stretch, the ends are not
        // page-aligned.
        let (f, want) = file_of("evict", 5 * 1024 * 1024 + 123);
        let mut m = MappedFile::open(&f.0).unwrap();
        let ranges = [100..3 * 1024 * 1024 + 77, 4 * 1024 * 1024 + 5..want.len()];
        let moved = m.copy_into_ram(&ranges).unwrap();
        let inner = |r: &std::ops::Range<usize>| {
            (r.end.min(want.len()) / page * page).saturating_sub(r.start.next_multiple_of(page))
        };
        assert_eq!(moved as usize, ranges.iter().map(inner).sum::<usize>());
        assert_eq!(m.copied_bytes(), moved);
        assert!(m.bytes() == &want[..], "bytes changed by the copy");
        // Again: nothing moves twice.
        assert_eq!(m.copy_into_ram(&ranges).unwrap(), 0);
        // Evict everything: the file-backed pages fault back, the copies must not be
        // zeroed (MADV_DONTNEED on anonymous memory would do that).
        m.evict(0..want.len()).unwrap();
        assert!(m.bytes() == &want[..], "bytes changed by evict");
    }

    #[test]
    fn copied_ranges_are_anonymous() {
        let (f, want) = file_of("anon", 3 * 1024 * 1024);
        let mut m = MappedFile::open(&f.0).unwrap();
        let whole = 0..want.len();
        m.copy_into_ram(std::slice::from_ref(&whole)).unwrap();
        // The file's pages are no longer mapped: truncating the file would raise SIGBUS on
        // a file map; the copy reads on.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&f.0)
            .unwrap()
            .set_len(0)
            .unwrap();
        assert!(m.bytes() == &want[..]);
    }
}
