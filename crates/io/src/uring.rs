//! io_uring backend: one ring thread keeps up to `depth` segment reads in flight. Requests
//! arrive over a channel; an eventfd read armed in the ring wakes the thread when one does.
//! Short reads resume (block-aligned under O_DIRECT); EINTR/EAGAIN resubmit.

use crate::aligned::AlignedBuf;
use crate::completion::Completions;
use crate::fileio::{open_file, resume_pos, set_high_io_priority};
use crate::hint::Hinter;
use crate::pool::admit;
use crate::request::{layout, IoConfig, IoEngine, IoError, Layout1, ReadDone, ReadReq, Segment};
use crate::stats::{Counters, IoStats};
use crossbeam_channel::{Receiver, Sender};
use io_uring::{opcode, types, IoUring};
use std::collections::VecDeque;
use std::fs::File;
use std::mem::ManuallyDrop;
use std::ops::Range;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

/// Largest single read handed to the kernel (block-aligned); longer spans continue.
const MAX_CHUNK: usize = 1 << 30;
const WAKE: u64 = u64::MAX;

/// Why the uring engine did not open.
pub(crate) enum UringOpenError {
    /// The kernel refused io_uring (ENOSYS, EPERM, seccomp, missing opcode): fall back.
    Refused(String),
    Io(IoError),
}

struct Incoming {
    tag: u64,
    segments: Vec<Segment>,
    layout: Vec<Layout1>,
    buf: AlignedBuf,
}

pub(crate) struct UringEngine {
    path: PathBuf,
    counters: Arc<Counters>,
    req_tx: Option<Sender<Incoming>>,
    wake: Arc<OwnedFd>,
    shutdown: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    completions: Completions,
    hinter: Hinter,
}

impl UringEngine {
    pub fn open(path: &Path, cfg: &IoConfig) -> Result<UringEngine, UringOpenError> {
        if std::env::var_os("SLUICE_IO_DISABLE_URING").is_some() {
            return Err(UringOpenError::Refused(
                "disabled by SLUICE_IO_DISABLE_URING".into(),
            ));
        }
        let depth = cfg.depth.min(4096);
        let entries = (depth + 1).next_power_of_two() as u32;
        let ring = IoUring::new(entries).map_err(|e| UringOpenError::Refused(e.to_string()))?;
        let mut probe = io_uring::Probe::new();
        ring.submitter()
            .register_probe(&mut probe)
            .map_err(|e| UringOpenError::Refused(format!("probe: {e}")))?;
        if !probe.is_supported(opcode::Read::CODE) {
            return Err(UringOpenError::Refused(
                "kernel lacks IORING_OP_READ".into(),
            ));
        }
        let o = open_file(path, cfg.direct).map_err(UringOpenError::Io)?;
        let counters = Arc::new(Counters::new());
        counters.direct.store(o.direct, Relaxed);
        counters.direct_refused.store(o.direct_refused, Relaxed);
        // SAFETY: eventfd takes integers only; the returned fd is checked and then owned.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if efd < 0 {
            return Err(UringOpenError::Io(IoError::Sys {
                path: path.to_path_buf(),
                what: "eventfd",
                source: std::io::Error::last_os_error(),
            }));
        }
        // SAFETY: efd is a fresh, valid fd that nothing else owns.
        let wake = Arc::new(unsafe { OwnedFd::from_raw_fd(efd) });
        let file = Arc::new(o.file);
        let completions = Completions::new();
        let (req_tx, req_rx) = crossbeam_channel::unbounded();
        let shutdown = Arc::new(AtomicBool::new(false));
        let mut ring_thread = RingThread {
            ring: ManuallyDrop::new(ring),
            leak: false,
            path: path.to_path_buf(),
            file: file.clone(),
            direct: o.direct,
            depth,
            max_bytes: cfg.inflight_bytes,
            bytes_in_flight: 0,
            ioprio: if cfg.high_priority { 2 << 13 } else { 0 },
            counters: counters.clone(),
            done_tx: completions.sender(),
            req_rx,
            wake: wake.clone(),
            wake_buf: Box::new(0u64),
            shutdown: shutdown.clone(),
            reqs: Vec::new(),
            free_reqs: Vec::new(),
            ops: Vec::new(),
            free_ops: Vec::new(),
            pending: VecDeque::new(),
            in_flight: 0,
        };
        let high = cfg.high_priority;
        let thread = std::thread::Builder::new()
            .name("sluice-io-uring".into())
            .spawn(move || {
                if high {
                    set_high_io_priority();
                }
                ring_thread.run();
            })
            .map_err(|source| {
                UringOpenError::Io(IoError::Sys {
                    path: path.to_path_buf(),
                    what: "spawn ring thread",
                    source,
                })
            })?;
        Ok(UringEngine {
            path: path.to_path_buf(),
            counters: counters.clone(),
            req_tx: Some(req_tx),
            wake,
            shutdown,
            thread: Some(thread),
            completions,
            hinter: Hinter::new(file, counters),
        })
    }

    fn poke(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live local to our own eventfd.
        let _ = unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }
}

impl IoEngine for UringEngine {
    fn submit(&self, req: ReadReq) -> Result<(), IoError> {
        let tx = self.req_tx.as_ref().ok_or_else(|| IoError::Shutdown {
            path: self.path.clone(),
        })?;
        self.completions.submitted();
        let msg = match admit(&self.counters, &self.path, &req) {
            Ok(layout) => Incoming {
                tag: req.tag,
                segments: req.segments,
                layout,
                buf: req.buf,
            },
            Err(e) => {
                self.counters.errors.fetch_add(1, Relaxed);
                let placed = layout(&req.segments).iter().map(|l| l.placed).collect();
                let _ = self.completions.sender().send(ReadDone {
                    tag: req.tag,
                    buf: req.buf,
                    placed,
                    result: Err(e),
                });
                return Ok(());
            }
        };
        if tx.send(msg).is_err() {
            self.completions.unsubmitted();
            return Err(IoError::Shutdown {
                path: self.path.clone(),
            });
        }
        self.poke();
        Ok(())
    }

    fn wait_one(&self) -> Option<ReadDone> {
        self.completions.wait_one()
    }

    fn try_complete(&self) -> Option<ReadDone> {
        self.completions.try_complete()
    }

    fn stats(&self) -> IoStats {
        self.counters.snapshot()
    }

    fn name(&self) -> &'static str {
        "uring"
    }

    fn hint_willneed(&self, range: Range<u64>) {
        self.hinter.hint(range);
    }

    fn set_hints(&self, on: bool) {
        self.hinter.set(on);
    }
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        self.shutdown.store(true, Relaxed);
        self.req_tx.take();
        self.poke();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct ReqSlot {
    tag: u64,
    segments: Vec<Segment>,
    layout: Vec<Layout1>,
    base: *mut u8,
    buf: AlignedBuf,
    remaining: usize,
    error: Option<IoError>,
}

// SAFETY: `base` points into `buf`'s heap block, owned by this slot; the slot is only used
// on the ring thread (it is created there), so this impl just lets the thread be spawned.
unsafe impl Send for ReqSlot {}

struct Op {
    req: usize,
    seg: usize,
    /// Bytes of the span known to be in the buffer.
    done: usize,
    /// Where the read in flight started (span-relative).
    pos: usize,
    /// Bytes the read in flight asked for.
    len: usize,
    start: Instant,
}

struct RingThread {
    /// Dropped in `Drop` unless `leak` (reads may still be in the kernel after a ring failure).
    ring: ManuallyDrop<IoUring>,
    leak: bool,
    path: PathBuf,
    file: Arc<File>,
    direct: bool,
    depth: usize,
    /// Cap on `bytes_in_flight` (0: none); see `IoConfig::inflight_bytes`.
    max_bytes: usize,
    /// Bytes of the reads in the kernel.
    bytes_in_flight: usize,
    ioprio: u16,
    counters: Arc<Counters>,
    done_tx: Sender<ReadDone>,
    req_rx: Receiver<Incoming>,
    wake: Arc<OwnedFd>,
    wake_buf: Box<u64>,
    shutdown: Arc<AtomicBool>,
    reqs: Vec<Option<ReqSlot>>,
    free_reqs: Vec<usize>,
    ops: Vec<Option<Op>>,
    free_ops: Vec<usize>,
    /// Ops waiting for a ring entry.
    pending: VecDeque<usize>,
    /// Segment reads in the kernel (the wake read excluded).
    in_flight: usize,
}

impl RingThread {
    fn run(&mut self) {
        let mut wake_armed = false;
        loop {
            self.take_requests();
            if !wake_armed && !self.shutdown.load(Relaxed) {
                self.arm_wake();
                wake_armed = true;
            }
            while self.in_flight < self.depth {
                let Some(&op) = self.pending.front() else {
                    break;
                };
                if self.max_bytes > 0
                    && self.in_flight > 0
                    && self.bytes_in_flight + self.op_len(op) > self.max_bytes
                {
                    break;
                }
                self.pending.pop_front();
                self.push_op(op);
            }
            if !wake_armed && self.in_flight == 0 && self.pending.is_empty() {
                // Shut down: nothing in the kernel points into our buffers any more.
                if self.req_rx.is_empty() {
                    return;
                }
                continue;
            }
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EINTR) | Some(libc::EBUSY) | Some(libc::EAGAIN)
                    ) => {}
                Err(e) => {
                    // The ring itself failed: fail everything rather than hang.
                    self.fail_all(&e);
                    return;
                }
            }
            let cqes: Vec<(u64, i32)> = self
                .ring
                .completion()
                .map(|c| (c.user_data(), c.result()))
                .collect();
            for (ud, res) in cqes {
                if ud == WAKE {
                    wake_armed = false;
                } else {
                    self.on_complete(ud as usize, res);
                }
            }
        }
    }

    fn take_requests(&mut self) {
        while let Ok(inc) = self.req_rx.try_recv() {
            self.add_request(inc);
        }
    }

    fn add_request(&mut self, mut inc: Incoming) {
        let work: Vec<usize> = (0..inc.layout.len())
            .filter(|&i| inc.layout[i].span > 0)
            .collect();
        if work.is_empty() {
            self.send_done(inc.tag, inc.buf, &inc.layout, None);
            return;
        }
        let slot = ReqSlot {
            tag: inc.tag,
            base: inc.buf.as_mut_ptr(),
            segments: inc.segments,
            layout: inc.layout,
            buf: inc.buf,
            remaining: work.len(),
            error: None,
        };
        let r = match self.free_reqs.pop() {
            Some(i) => {
                self.reqs[i] = Some(slot);
                i
            }
            None => {
                self.reqs.push(Some(slot));
                self.reqs.len() - 1
            }
        };
        for seg in work {
            let op = Op {
                req: r,
                seg,
                done: 0,
                pos: 0,
                len: 0,
                start: Instant::now(),
            };
            let o = match self.free_ops.pop() {
                Some(i) => {
                    self.ops[i] = Some(op);
                    i
                }
                None => {
                    self.ops.push(Some(op));
                    self.ops.len() - 1
                }
            };
            self.pending.push_back(o);
        }
    }

    fn arm_wake(&mut self) {
        let e = opcode::Read::new(
            types::Fd(self.wake.as_raw_fd()),
            (&mut *self.wake_buf as *mut u64).cast(),
            8,
        )
        .build()
        .user_data(WAKE);
        self.push_sqe(&e);
    }

    fn push_sqe(&mut self, e: &io_uring::squeue::Entry) {
        loop {
            // SAFETY: every entry points into memory that outlives its completion: segment
            // buffers stay in `reqs` until their last op completes, `wake_buf` lives as long
            // as the ring, and the thread never exits with reads in the kernel.
            if unsafe { self.ring.submission().push(e) }.is_ok() {
                return;
            }
            // Queue full (cannot happen: entries > depth): flush and retry.
            let _ = self.ring.submit();
        }
    }

    /// Bytes op `o`'s next read asks for (0 for a finished op).
    fn op_len(&self, o: usize) -> usize {
        let Some(op) = self.ops[o].as_ref() else {
            return 0;
        };
        let l = self.reqs[op.req]
            .as_ref()
            .expect("op of a live request")
            .layout[op.seg];
        (l.span - op.pos).min(MAX_CHUNK)
    }

    /// First submission (starts the task clock) or resubmission of op `o`.
    fn push_op(&mut self, o: usize) {
        let len = self.op_len(o);
        let Some(op) = self.ops[o].as_mut() else {
            return;
        };
        let req = self.reqs[op.req].as_ref().expect("op of a live request");
        let l = req.layout[op.seg];
        if op.done == 0 && op.pos == 0 {
            op.start = self.counters.task_start();
        }
        let pos = op.pos;
        op.len = len;
        // SAFETY: buf_pos + pos < buf_pos + span <= capacity (checked at admit).
        let ptr = unsafe { req.base.add(l.buf_pos + pos) };
        let e = opcode::Read::new(types::Fd(self.file.as_raw_fd()), ptr, len as u32)
            .offset(l.file_start + pos as u64)
            .ioprio(self.ioprio)
            .build()
            .user_data(o as u64);
        self.push_sqe(&e);
        self.in_flight += 1;
        self.bytes_in_flight += len;
    }

    fn on_complete(&mut self, o: usize, res: i32) {
        self.in_flight -= 1;
        let Some(op) = self.ops[o].as_mut() else {
            return;
        };
        self.bytes_in_flight -= op.len;
        let req = self.reqs[op.req].as_ref().expect("op of a live request");
        let seg = req.segments[op.seg];
        let l = req.layout[op.seg];
        let needed = (seg.offset + seg.len as u64 - l.file_start) as usize;
        let outcome: Option<Result<(), IoError>> = if res < 0 {
            let errno = -res;
            if errno == libc::EINTR || errno == libc::EAGAIN {
                None // resubmit the same read
            } else {
                Some(Err(IoError::Read {
                    path: self.path.clone(),
                    offset: seg.offset,
                    len: seg.len,
                    source: std::io::Error::from_raw_os_error(errno),
                }))
            }
        } else {
            let n = res as usize;
            self.counters.bytes_read.fetch_add(n as u64, Relaxed);
            let end = op.pos + n;
            if end >= needed {
                Some(Ok(()))
            } else if end <= op.done {
                Some(Err(IoError::UnexpectedEof {
                    path: self.path.clone(),
                    offset: seg.offset,
                    len: seg.len,
                    file_end: l.file_start + end as u64,
                }))
            } else {
                op.done = end;
                op.pos = resume_pos(end, self.direct);
                None
            }
        };
        match outcome {
            None => self.push_op(o),
            Some(r) => {
                let op = self.ops[o].take().expect("live op");
                self.free_ops.push(o);
                self.counters.task_end(op.start);
                self.segment_done(op.req, r);
            }
        }
    }

    fn segment_done(&mut self, r: usize, res: Result<(), IoError>) {
        let slot = self.reqs[r].as_mut().expect("live request");
        if let Err(e) = res {
            slot.error.get_or_insert(e);
        }
        slot.remaining -= 1;
        if slot.remaining == 0 {
            let s = self.reqs[r].take().expect("live request");
            self.free_reqs.push(r);
            self.send_done(s.tag, s.buf, &s.layout, s.error);
        }
    }

    fn send_done(&self, tag: u64, buf: AlignedBuf, layout: &[Layout1], err: Option<IoError>) {
        if err.is_some() {
            self.counters.errors.fetch_add(1, Relaxed);
        }
        let _ = self.done_tx.send(ReadDone {
            tag,
            buf,
            placed: layout.iter().map(|l| l.placed).collect(),
            result: err.map_or(Ok(()), Err),
        });
    }

    /// The ring failed as a whole. Wait is impossible, so fail pending ops and any request
    /// without reads in the kernel; requests with reads in flight are leaked (never freed
    /// while the kernel may still write into them).
    fn fail_all(&mut self, e: &std::io::Error) {
        while let Some(o) = self.pending.pop_front() {
            if let Some(op) = self.ops[o].take() {
                let req = self.reqs[op.req].as_ref().expect("live request");
                let seg = req.segments[op.seg];
                let err = IoError::Read {
                    path: self.path.clone(),
                    offset: seg.offset,
                    len: seg.len,
                    source: std::io::Error::new(e.kind(), format!("io_uring_enter: {e}")),
                };
                self.segment_done(op.req, Err(err));
            }
        }
        if self.in_flight > 0 {
            for slot in self.reqs.drain(..).flatten() {
                std::mem::forget(slot);
            }
            // Leak the ring too: closing it would not wait for the kernel's reads.
            self.leak = true;
        }
    }
}

impl Drop for RingThread {
    fn drop(&mut self) {
        if self.leak {
            // The armed wake read may still target this box: never free it.
            std::mem::forget(std::mem::take(&mut self.wake_buf));
        } else {
            // SAFETY: dropped exactly once, here; nothing uses the ring afterwards, and the
            // run loop only returns normally with no reads in the kernel.
            unsafe { ManuallyDrop::drop(&mut self.ring) };
        }
    }
}
