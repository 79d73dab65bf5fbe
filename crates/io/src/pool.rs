//! Thread-pool backends: `pread` (positional reads, O_DIRECT by default) and `mmap` (copy
//! out of a read-only map, the baseline). Each request fans out into one task per segment so
//! an expert's parts load in parallel; the thread finishing the last segment completes it.

use crate::aligned::AlignedBuf;
use crate::completion::Completions;
use crate::fileio::{file_len, open_file, read_span, set_high_io_priority};
use crate::hint::Hinter;
use crate::request::{
    layout, required_capacity, IoConfig, IoEngine, IoError, Layout1, ReadDone, ReadReq, Segment,
};
use crate::stats::{Counters, IoStats};
use crossbeam_channel::Sender;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering::AcqRel, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

enum Source {
    Pread { direct: bool },
    Mmap { map: Option<memmap2::Mmap> },
}

struct Shared {
    path: PathBuf,
    file: Arc<File>,
    source: Source,
    counters: Arc<Counters>,
    done_tx: Sender<ReadDone>,
}

/// One request being read by the pool.
struct ReqState {
    tag: u64,
    segments: Vec<Segment>,
    layout: Vec<Layout1>,
    /// Start of the buffer's memory; the buffer itself stays in `buf` until completion.
    base: *mut u8,
    buf: Mutex<Option<AlignedBuf>>,
    remaining: AtomicUsize,
    error: Mutex<Option<IoError>>,
}

// SAFETY: `base` points into the AlignedBuf held in `buf`, which lives as long as the state;
// tasks write only their own disjoint span [buf_pos, buf_pos + span) through it, and the
// buffer is taken out only by the last task, after all writes (AcqRel on `remaining`).
unsafe impl Send for ReqState {}
// SAFETY: as above; all other fields are Sync.
unsafe impl Sync for ReqState {}

type Task = (Arc<ReqState>, usize);

/// The pread / mmap engine.
pub(crate) struct PoolEngine {
    shared: Arc<Shared>,
    name: &'static str,
    tasks: Option<Sender<Task>>,
    workers: Vec<JoinHandle<()>>,
    completions: Completions,
    hinter: Hinter,
}

impl PoolEngine {
    pub fn open_pread(path: &Path, cfg: &IoConfig) -> Result<PoolEngine, IoError> {
        let o = open_file(path, cfg.direct)?;
        let counters = Arc::new(Counters::new());
        counters.direct.store(o.direct, Relaxed);
        counters.direct_refused.store(o.direct_refused, Relaxed);
        Self::start(
            path,
            o.file,
            Source::Pread { direct: o.direct },
            counters,
            cfg,
            "pread",
        )
    }

    pub fn open_mmap(path: &Path, cfg: &IoConfig) -> Result<PoolEngine, IoError> {
        let o = open_file(path, false)?;
        let map = if o.len == 0 {
            None
        } else {
            // SAFETY: read-only private map of a model file. If another process truncates the
            // file, touching pages past the new end raises SIGBUS (the documented hazard of
            // every mmap loader); each copy re-checks the current length first to make that
            // window as small as possible.
            Some(
                unsafe { memmap2::Mmap::map(&o.file) }.map_err(|source| IoError::Sys {
                    path: path.to_path_buf(),
                    what: "mmap",
                    source,
                })?,
            )
        };
        Self::start(
            path,
            o.file,
            Source::Mmap { map },
            Arc::new(Counters::new()),
            cfg,
            "mmap",
        )
    }

    pub fn mark_uring_fallback(&mut self) {
        self.shared.counters.uring_fallback.store(true, Relaxed);
    }

    fn start(
        path: &Path,
        file: File,
        source: Source,
        counters: Arc<Counters>,
        cfg: &IoConfig,
        name: &'static str,
    ) -> Result<PoolEngine, IoError> {
        let completions = Completions::new();
        let file = Arc::new(file);
        let shared = Arc::new(Shared {
            path: path.to_path_buf(),
            file: file.clone(),
            source,
            counters: counters.clone(),
            done_tx: completions.sender(),
        });
        let (tx, rx) = crossbeam_channel::unbounded::<Task>();
        let mut workers = Vec::with_capacity(cfg.threads);
        for i in 0..cfg.threads {
            let rx = rx.clone();
            let sh = shared.clone();
            let high = cfg.high_priority;
            let h = std::thread::Builder::new()
                .name(format!("sluice-io-{name}-{i}"))
                .spawn(move || {
                    if high {
                        set_high_io_priority();
                    }
                    for (req, idx) in rx {
                        run_task(&sh, &req, idx);
                    }
                })
                .map_err(|source| IoError::Sys {
                    path: path.to_path_buf(),
                    what: "spawn reader thread",
                    source,
                })?;
            workers.push(h);
        }
        Ok(PoolEngine {
            shared,
            name,
            tasks: Some(tx),
            workers,
            completions,
            hinter: Hinter::new(file, counters),
        })
    }
}

/// Read one segment of `req`; the last segment to finish completes the request.
fn run_task(sh: &Shared, req: &ReqState, idx: usize) {
    let l = req.layout[idx];
    let seg = &req.segments[idx];
    // SAFETY: see ReqState: this task alone writes [buf_pos, buf_pos + span), which lies
    // within the buffer (capacity checked at submit), and the buffer outlives this call.
    let dst = unsafe { std::slice::from_raw_parts_mut(req.base.add(l.buf_pos), l.span) };
    let start = sh.counters.task_start();
    let r = match &sh.source {
        Source::Pread { direct } => read_span(&sh.file, &sh.path, seg, l.file_start, dst, *direct),
        Source::Mmap { map } => copy_from_map(sh, map.as_deref().unwrap_or(&[]), seg, &l, dst),
    };
    sh.counters.task_end(start);
    match r {
        Ok(n) => {
            sh.counters.bytes_read.fetch_add(n, Relaxed);
        }
        Err(e) => {
            let mut slot = req.error.lock().unwrap_or_else(|p| p.into_inner());
            slot.get_or_insert(e);
        }
    }
    if req.remaining.fetch_sub(1, AcqRel) == 1 {
        let buf = req.buf.lock().unwrap_or_else(|p| p.into_inner()).take();
        let err = req.error.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(buf) = buf {
            finish(sh, req.tag, buf, &req.layout, err);
        }
    }
}

fn copy_from_map(
    sh: &Shared,
    map: &[u8],
    seg: &Segment,
    l: &Layout1,
    dst: &mut [u8],
) -> Result<u64, IoError> {
    let seg_end = seg.offset + seg.len as u64;
    let now_len = file_len(&sh.file, &sh.path)?;
    let end_ok = (map.len() as u64).min(now_len);
    if seg_end > end_ok {
        return Err(IoError::UnexpectedEof {
            path: sh.path.clone(),
            offset: seg.offset,
            len: seg.len,
            file_end: end_ok,
        });
    }
    let copy_end = (l.file_start + l.span as u64).min(end_ok);
    let n = (copy_end - l.file_start) as usize;
    dst[..n].copy_from_slice(&map[l.file_start as usize..copy_end as usize]);
    Ok(n as u64)
}

fn finish(sh: &Shared, tag: u64, buf: AlignedBuf, layout: &[Layout1], err: Option<IoError>) {
    if err.is_some() {
        sh.counters.errors.fetch_add(1, Relaxed);
    }
    let _ = sh.done_tx.send(ReadDone {
        tag,
        buf,
        placed: layout.iter().map(|l| l.placed).collect(),
        result: err.map_or(Ok(()), Err),
    });
}

/// Submit-side checks shared with the uring backend: count the dispatch and validate the
/// buffer. Returns the layout, or the request back as an error completion.
pub(crate) fn admit(
    counters: &Counters,
    path: &Path,
    req: &ReadReq,
) -> Result<Vec<Layout1>, IoError> {
    counters.dispatches.fetch_add(1, Relaxed);
    counters.bytes_requested.fetch_add(
        req.segments.iter().map(|s| s.len as u64).sum::<u64>(),
        Relaxed,
    );
    let needed = required_capacity(&req.segments);
    if req.buf.capacity() < needed {
        return Err(IoError::BufferTooSmall {
            path: path.to_path_buf(),
            tag: req.tag,
            needed,
            capacity: req.buf.capacity(),
        });
    }
    Ok(layout(&req.segments))
}

impl IoEngine for PoolEngine {
    fn submit(&self, mut req: ReadReq) -> Result<(), IoError> {
        let sh = &self.shared;
        let tasks = self.tasks.as_ref().ok_or_else(|| IoError::Shutdown {
            path: sh.path.clone(),
        })?;
        self.completions.submitted();
        let layout = match admit(&sh.counters, &sh.path, &req) {
            Ok(l) => l,
            Err(e) => {
                finish(sh, req.tag, req.buf, &layout(&req.segments), Some(e));
                return Ok(());
            }
        };
        let work: Vec<usize> = (0..layout.len()).filter(|&i| layout[i].span > 0).collect();
        if work.is_empty() {
            finish(sh, req.tag, req.buf, &layout, None);
            return Ok(());
        }
        let base = req.buf.as_mut_ptr();
        let state = Arc::new(ReqState {
            tag: req.tag,
            segments: std::mem::take(&mut req.segments),
            layout,
            base,
            buf: Mutex::new(Some(req.buf)),
            remaining: AtomicUsize::new(work.len()),
            error: Mutex::new(None),
        });
        for i in work {
            if tasks.send((state.clone(), i)).is_err() {
                // Workers gone (cannot happen while `tasks` is Some); report, don't hang.
                self.completions.unsubmitted();
                return Err(IoError::Shutdown {
                    path: sh.path.clone(),
                });
            }
        }
        Ok(())
    }

    fn wait_one(&self) -> Option<ReadDone> {
        self.completions.wait_one()
    }

    fn try_complete(&self) -> Option<ReadDone> {
        self.completions.try_complete()
    }

    fn stats(&self) -> IoStats {
        self.shared.counters.snapshot()
    }

    fn name(&self) -> &'static str {
        self.name
    }

    fn hint_willneed(&self, range: Range<u64>) {
        self.hinter.hint(range);
    }

    fn set_hints(&self, on: bool) {
        self.hinter.set(on);
    }
}

impl Drop for PoolEngine {
    fn drop(&mut self) {
        // Closing the task channel lets each worker finish what is queued and exit; buffers
        // are only freed after every read into them has returned.
        self.tasks.take();
        for h in self.workers.drain(..) {
            let _ = h.join();
        }
    }
}
