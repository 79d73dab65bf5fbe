//! Writing a planned synthetic model: free-space check, temporary file, parallel generation,
//! a writer thread, and the rename into place.
//!
//! Owns: the byte stream of a [`Plan`] (deterministic for its seed whatever the thread
//! count or batch size: every chunk's bytes depend only on (seed, tensor index, chunk
//! index)), and the guarantee that no half-written file is left behind.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;

use rayon::prelude::*;
use sluice_gguf::GgufWriter;

use super::blocks::{block_geometry, fill_chunk, Rng};
use super::{Plan, SynthError, SPACE_MARGIN};

/// Bytes generated per chunk (rounded down to whole blocks): the unit of determinism.
const CHUNK_BYTES: usize = 1 << 20;
/// Bytes generated in parallel and handed to the writer thread at once.
const BATCH_BYTES: usize = 32 << 20;
/// Written data is synced and dropped from the page cache every this many bytes, so a file
/// larger than RAM does not push everything else out of the cache.
const DROP_EVERY: u64 = 1 << 30;

/// Refuse when `available` bytes cannot hold `needed` plus [`SPACE_MARGIN`].
pub fn check_free_space(path: &Path, needed: u64, available: u64) -> Result<(), SynthError> {
    if needed
        .checked_add(SPACE_MARGIN)
        .is_none_or(|total| available < total)
    {
        return Err(SynthError::NoSpace {
            path: path.to_path_buf(),
            needed,
            available,
        });
    }
    Ok(())
}

/// The directory a new file at `path` goes into.
fn parent_dir(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Bytes available to an unprivileged user on the file system that would hold `path`.
pub fn available_space(path: &Path) -> Result<u64, SynthError> {
    let dir = parent_dir(path);
    let st = rustix::fs::statvfs(dir).map_err(|e| SynthError::Io {
        path: dir.to_path_buf(),
        what: "statvfs (free space)".into(),
        source: e.into(),
    })?;
    Ok(st.f_bavail.saturating_mul(st.f_frsize))
}

/// The temporary name `path` is written under: `<path>.tmp`.
pub fn temp_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_os_string();
    s.push(".tmp");
    PathBuf::from(s)
}

/// Removes the file on drop unless disarmed.
struct RemoveOnDrop(Option<PathBuf>);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// A file writer that every [`DROP_EVERY`] bytes syncs and drops what it wrote from the
/// page cache.
struct CacheDropping {
    file: File,
    written: u64,
    dropped: u64,
}

impl Write for CacheDropping {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.file.write(buf)?;
        self.written += n as u64;
        if self.written - self.dropped >= DROP_EVERY {
            self.file.sync_data()?;
            sluice_io::pagecache::drop_page_cache_fd(&self.file, self.dropped..self.written)?;
            self.dropped = self.written;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

/// Options of [`write`].
pub struct WriteOptions<'a> {
    /// Replace an existing file.
    pub force: bool,
    /// Called with the bytes written so far (from the writer thread).
    pub progress: &'a (dyn Fn(u64) + Sync),
    /// Set (e.g. by a Ctrl-C handler) to stop; the temporary file is then removed.
    pub cancel: &'a AtomicBool,
}

/// Write `plan` to `path`: check free space, write `<path>.tmp`, sync, rename. On any error
/// or cancellation the temporary file is removed.
pub fn write(plan: &Plan, path: &Path, opts: &WriteOptions) -> Result<(), SynthError> {
    if path.exists() && !opts.force {
        return Err(SynthError::Exists {
            path: path.to_path_buf(),
        });
    }
    check_free_space(path, plan.file_size(), available_space(path)?)?;
    let tmp = temp_path(path);
    let io = |what: &str, p: &Path| {
        let p = p.to_path_buf();
        let what = what.to_string();
        move |source| SynthError::Io {
            path: p,
            what,
            source,
        }
    };
    let file = File::create(&tmp).map_err(io("creating", &tmp))?;
    let mut guard = RemoveOnDrop(Some(tmp.clone()));
    let out = BufWriter::with_capacity(
        4 << 20,
        CacheDropping {
            file,
            written: 0,
            dropped: 0,
        },
    );
    let out = write_to(plan, out, &tmp, opts.progress, opts.cancel)?;
    let out = out.into_inner().map_err(|e| SynthError::Io {
        path: tmp.clone(),
        what: "flushing".into(),
        source: e.into_error(),
    })?;
    out.file.sync_all().map_err(io("syncing", &tmp))?;
    let _ = sluice_io::pagecache::drop_page_cache_fd(&out.file, out.dropped..u64::MAX);
    drop(out);
    if opts.cancel.load(Ordering::SeqCst) {
        return Err(SynthError::Interrupted { path: tmp });
    }
    std::fs::rename(&tmp, path).map_err(io("renaming the temporary file into place", &tmp))?;
    guard.0 = None;
    Ok(())
}

/// Stream `plan`'s bytes (header, then each tensor) into `out`. Tensor data is generated
/// on the current rayon pool while a writer thread writes the previous batch.
pub fn write_to<W: Write + Send>(
    plan: &Plan,
    out: W,
    path: &Path,
    progress: &(dyn Fn(u64) + Sync),
    cancel: &AtomicBool,
) -> Result<W, SynthError> {
    let specs: Vec<_> = plan.tensors.iter().map(|t| t.spec.clone()).collect();
    let mut w = GgufWriter::new(out, path, &plan.metadata, &specs)?;
    let header_bytes = w.layout().data_offset;
    let (full_tx, full_rx) = mpsc::sync_channel::<Vec<u8>>(1);
    let (free_tx, free_rx) = mpsc::channel::<Vec<u8>>();
    std::thread::scope(|scope| {
        let writer = scope.spawn(move || -> Result<W, SynthError> {
            let mut done = header_bytes;
            progress(done);
            for buf in full_rx {
                w.write_data(&buf)?;
                done += buf.len() as u64;
                progress(done);
                let _ = free_tx.send(buf);
            }
            Ok(w.finish()?)
        });
        let generated = generate(plan, &full_tx, &free_rx, cancel);
        drop(full_tx);
        let written = writer
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p));
        let interrupted = || SynthError::Interrupted {
            path: path.to_path_buf(),
        };
        if generated.is_err() && cancel.load(Ordering::SeqCst) {
            return Err(interrupted());
        }
        // Otherwise a failed send means the writer failed: its error says why.
        let out = written?;
        generated.map_err(|()| interrupted())?;
        Ok(out)
    })
}

/// Generate every tensor's bytes in batches and send them in order. `Err(())` when
/// cancelled or when the writer hung up (it failed; its error is reported instead).
fn generate(
    plan: &Plan,
    full_tx: &mpsc::SyncSender<Vec<u8>>,
    free_rx: &mpsc::Receiver<Vec<u8>>,
    cancel: &AtomicBool,
) -> Result<(), ()> {
    let mut allocated = 0usize;
    for (ti, (t, info)) in plan.tensors.iter().zip(&plan.layout.tensors).enumerate() {
        let (block_bytes, block_elems) = block_geometry(info.ty);
        let chunk = (CHUNK_BYTES / block_bytes) * block_bytes;
        let n_bytes = info.n_bytes as usize;
        let n_chunks = n_bytes.div_ceil(chunk);
        let per_batch = (BATCH_BYTES / chunk).max(1);
        let row_len = info.dims[0] as usize;
        let mut c0 = 0;
        while c0 < n_chunks {
            if cancel.load(Ordering::Relaxed) {
                return Err(());
            }
            let c1 = (c0 + per_batch).min(n_chunks);
            let len = (c1 * chunk).min(n_bytes) - c0 * chunk;
            // At most three buffers: one filling, one queued, one being written.
            let mut buf = match free_rx.try_recv() {
                Ok(b) => b,
                Err(_) if allocated < 3 => {
                    allocated += 1;
                    Vec::new()
                }
                Err(_) => free_rx.recv().map_err(|_| ())?,
            };
            buf.clear();
            buf.resize(len, 0);
            buf.par_chunks_mut(chunk).enumerate().for_each(|(i, out)| {
                let c = (c0 + i) as u64;
                let mut rng = Rng::new(&[plan.seed, ti as u64, c]);
                let first_elem = c * (chunk / block_bytes * block_elems) as u64;
                let rows = t.row_scale.as_deref().map(|s| (s, row_len, first_elem));
                fill_chunk(info.ty, t.fill, &mut rng, out, rows);
            });
            full_tx.send(buf).map_err(|_| ())?;
            c0 = c1;
        }
    }
    Ok(())
}
