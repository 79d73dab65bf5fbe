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

use super::blocks::{block_geometry, fill_chunk, Fill, Rng};
use super::{Plan, SynthError, SPACE_MARGIN};

/// Bytes generated per chunk (rounded down to whole blocks): the unit of determinism.
const CHUNK_BYTES: usize = 1 << 20;
/// Bytes generated in parallel and handed to the writer thread at once.
const BATCH_BYTES: usize = 32 << 20;
/// Every this many bytes, the last [`DROP_WINDOW`] bytes written are advised out of the page
/// cache (`POSIX_FADV_DONTNEED`: Linux starts writeback of the dirty pages and drops the
/// clean ones), so writeback overlaps generation and a file larger than RAM does not push
/// everything else out of the cache.
const DROP_EVERY: u64 = 256 << 20;
const DROP_WINDOW: u64 = 2 << 30;

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

/// A fresh temporary name for writing `path`: `<path>.<pid>.<n>.tmp`, unique per process
/// and call, so two writers of the same output never share a temporary file (it is also
/// created exclusively).
pub fn temp_path(path: &Path) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let mut s = path.as_os_str().to_os_string();
    s.push(format!(".{}.{n}.tmp", std::process::id()));
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

/// A file writer that keeps its own pages out of the page cache (see [`DROP_EVERY`]).
struct CacheDropping {
    file: File,
    written: u64,
    /// `written` at the last advice.
    advised: u64,
}

impl Write for CacheDropping {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.file.write(buf)?;
        self.written += n as u64;
        if self.written - self.advised >= DROP_EVERY {
            let start = self.written.saturating_sub(DROP_WINDOW);
            sluice_io::pagecache::drop_page_cache_fd(&self.file, start..self.written)?;
            self.advised = self.written;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

/// An O_DIRECT file writer: bytes are staged in a 4096-aligned buffer written whole (DMA, no
/// page-cache copy); the last partial block is written zero-padded and the file truncated.
struct DirectFile {
    file: File,
    buf: sluice_io::AlignedBuf,
    len: usize,
    /// Bytes accepted so far (the file's final size).
    total: u64,
}

impl DirectFile {
    const STAGE: usize = 16 << 20;

    fn flush_stage(&mut self, pad: bool) -> std::io::Result<()> {
        let n = if pad {
            let n = self.len.next_multiple_of(sluice_io::ALIGN);
            self.buf.as_mut_slice()[self.len..n].fill(0);
            n
        } else {
            self.len
        };
        self.file.write_all(&self.buf.as_slice()[..n])?;
        self.len = 0;
        Ok(())
    }

    fn finish(mut self) -> std::io::Result<File> {
        if self.len > 0 {
            self.flush_stage(true)?;
        }
        self.file.set_len(self.total)?;
        Ok(self.file)
    }
}

impl Write for DirectFile {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        let cap = self.buf.capacity();
        let n = data.len().min(cap - self.len);
        self.buf.as_mut_slice()[self.len..self.len + n].copy_from_slice(&data[..n]);
        self.len += n;
        self.total += n as u64;
        if self.len == cap {
            self.flush_stage(false)?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Where the bytes go: O_DIRECT when the file system takes it, else buffered writes that
/// advise their pages out of the cache.
enum Sink {
    Direct(DirectFile),
    Buffered(BufWriter<CacheDropping>),
}

impl Write for Sink {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        match self {
            Sink::Direct(d) => d.write(data),
            Sink::Buffered(b) => b.write(data),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Sink::Direct(d) => d.flush(),
            Sink::Buffered(b) => b.flush(),
        }
    }
}

impl Sink {
    /// Create `path` (exclusively: it must not exist), O_DIRECT if the file system allows.
    fn create(path: &Path) -> std::io::Result<Sink> {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)?;
        match rustix::fs::fcntl_setfl(&file, rustix::fs::OFlags::DIRECT) {
            Ok(()) => Ok(Sink::Direct(DirectFile {
                file,
                buf: sluice_io::AlignedBuf::new(DirectFile::STAGE),
                len: 0,
                total: 0,
            })),
            Err(_) => Ok(Sink::Buffered(BufWriter::with_capacity(
                4 << 20,
                CacheDropping {
                    file,
                    written: 0,
                    advised: 0,
                },
            ))),
        }
    }

    /// Write what is staged, sync, and leave nothing of the file in the page cache.
    fn finish(self) -> std::io::Result<()> {
        let file = match self {
            Sink::Direct(d) => d.finish()?,
            Sink::Buffered(b) => b.into_inner().map_err(|e| e.into_error())?.file,
        };
        file.sync_all()?;
        let _ = sluice_io::pagecache::drop_page_cache_fd(&file, 0..u64::MAX);
        Ok(())
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

/// [`write`] replacing any existing file, without progress reports or a way to cancel
/// (tests, and files a program writes for itself).
pub fn write_replacing(plan: &Plan, path: &Path) -> Result<(), SynthError> {
    let cancel = AtomicBool::new(false);
    write(
        plan,
        path,
        &WriteOptions {
            force: true,
            progress: &|_| {},
            cancel: &cancel,
        },
    )
}

/// Write `plan` to `path`: check free space, write `<path>.tmp`, sync, rename. On any error
/// or cancellation the temporary file is removed.
pub fn write(plan: &Plan, path: &Path, opts: &WriteOptions) -> Result<(), SynthError> {
    // Only a regular file is ever replaced: renaming over a device node, a FIFO or a
    // directory would destroy it (or fail after all the work).
    if std::fs::metadata(path).is_ok_and(|m| !m.is_file()) {
        return Err(SynthError::NotRegular {
            path: path.to_path_buf(),
        });
    }
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
    let sink = Sink::create(&tmp).map_err(io("creating", &tmp))?;
    let mut guard = RemoveOnDrop(Some(tmp.clone()));
    let sink = write_to(plan, sink, &tmp, opts.progress, opts.cancel)?;
    sink.finish().map_err(io("finishing (flush, sync)", &tmp))?;
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
            // Every byte is overwritten below: only grow (zeroing) when needed.
            if buf.len() < len {
                buf.resize(len, 0);
            }
            buf.truncate(len);
            buf.par_chunks_mut(chunk).enumerate().for_each(|(i, out)| {
                let c = (c0 + i) as u64;
                let mut rng = Rng::new(&[plan.seed, ti as u64, c]);
                let first_elem = c * (chunk / block_bytes * block_elems) as u64;
                let rows = t.row_scale.as_deref().map(|s| (s, row_len, first_elem));
                if matches!(t.fill, Fill::HashTable { .. }) {
                    // Its values depend on the element index.
                    crate::blocks::fill_ds4(info.ty, t.fill, &mut rng, out, first_elem);
                } else {
                    fill_chunk(info.ty, t.fill, &mut rng, out, rows);
                }
            });
            full_tx.send(buf).map_err(|_| ())?;
            c0 = c1;
        }
    }
    Ok(())
}
