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

    /// Drop `range` of the file from this process's mapping and from the page cache, so the
    /// next access really reads storage (measure mode). Pages mapped into a process are
    /// immune to `posix_fadvise(DONTNEED)`; `madvise(MADV_DONTNEED)` unmaps them from this
    /// mapping first. Returns the time spent.
    pub fn evict(&self, range: std::ops::Range<usize>) -> std::io::Result<std::time::Duration> {
        let t = std::time::Instant::now();
        if let Some(map) = &self.map {
            let end = range.end.min(map.len());
            if range.start < end {
                let page = crate::pagecache::page_size() as usize;
                let start = range.start / page * page;
                // SAFETY: MADV_DONTNEED on a read-only, file-backed private mapping only
                // drops this process's page-table entries for the range; later reads fault
                // the same file bytes back in (from the page cache or storage). No slice
                // handed out by `bytes()` can observe a change, because the file content is
                // unchanged and the mapping stays valid.
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
