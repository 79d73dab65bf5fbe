//! The page-locked staging ring for uploads of VRAM-tier misses whose bytes lie in pageable
//! host memory (the model's memory map, the page cache behind it).
//!
//! Owns: [`StagingConfig`] (its size, slots and copy threads; `SLUICE_CUDA_STAGING*`),
//! [`StagingRing`] (a few page-locked host buffers, `cuMemHostAlloc`, never more than the
//! configured total: the file itself is never pinned), the small pool of copy threads that
//! fill a slot from the memory map in parallel tasks, and [`Staging`], the ring a decoder's
//! VRAM unit cache allocates on its first miss.
//!
//! A copy from pageable memory runs at ~6 GB/s (the driver stages it through its own small
//! pinned buffer, one thread); from page-locked memory at ~50 GB/s and truly asynchronously.
//! So each miss's parts are queued as pieces of the current slot ([`StagingRing::stage`]);
//! when the slot is full (or the caller flushes), the threads copy its pieces in tasks of
//! at most [`TASK_BYTES`], then the slot goes to the device in one asynchronous copy per
//! run of contiguous destination bytes on the copy stream, and an event is recorded after
//! them. The next slot is filled while that one is sent; a slot is refilled only once its
//! event has completed. The bytes that reach VRAM are the source's bytes: the ring never
//! changes what is computed.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use cudarc::driver::{result, CudaContext, CudaEvent, CudaStream, DriverError, PinnedHostSlice};

/// Copy tasks of at most this many bytes (one thread's share of a slot at a time).
pub(crate) const TASK_BYTES: usize = 512 << 10;

/// The staging ring's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagingConfig {
    /// Page-locked bytes in all (split evenly between the slots).
    pub bytes: usize,
    pub slots: usize,
    /// Copy threads besides the caller's.
    pub threads: usize,
}

impl Default for StagingConfig {
    fn default() -> Self {
        StagingConfig {
            bytes: 64 << 20,
            slots: 4,
            threads: 8,
        }
    }
}

impl StagingConfig {
    /// From the environment: `SLUICE_CUDA_STAGING=0` turns the ring off (uploads straight
    /// from pageable memory); `SLUICE_CUDA_STAGING_MB`, `_SLOTS`, `_THREADS` shape it.
    pub fn from_env() -> Option<StagingConfig> {
        if std::env::var("SLUICE_CUDA_STAGING").is_ok_and(|v| v == "0") {
            return None;
        }
        let var = |name: &str| {
            std::env::var(name)
                .ok()
                .and_then(|v| v.parse::<usize>().ok())
        };
        let d = StagingConfig::default();
        Some(StagingConfig {
            bytes: var("SLUICE_CUDA_STAGING_MB").map_or(d.bytes, |mb| mb << 20),
            slots: var("SLUICE_CUDA_STAGING_SLOTS").unwrap_or(d.slots),
            threads: var("SLUICE_CUDA_STAGING_THREADS").unwrap_or(d.threads),
        })
    }

    /// Bytes of one slot (at least a page).
    fn slot_bytes(&self) -> usize {
        (self.bytes / self.slots.max(1)).max(4096)
    }
}

/// A piece of the slot being filled: `len` bytes from host address `src` to slot offset
/// `off`, bound for device address `dst` inside the allocation starting at `alloc`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Piece {
    pub(crate) src: usize,
    pub(crate) off: usize,
    pub(crate) len: usize,
    pub(crate) dst: u64,
    pub(crate) alloc: u64,
}

/// The host copies of a slot's pieces: (source, slot offset, length), each at most `task`
/// bytes.
pub(crate) fn tasks(pieces: &[Piece], task: usize) -> Vec<(usize, usize, usize)> {
    let mut out = Vec::new();
    for p in pieces {
        let mut o = 0;
        while o < p.len {
            let n = task.min(p.len - o);
            out.push((p.src + o, p.off + o, n));
            o += n;
        }
    }
    out
}

/// The device copies of a slot: (slot offset, length, destination), one per run of pieces
/// whose slot bytes and destination bytes both follow on inside one device allocation (the
/// driver refuses a copy across two allocations, even adjacent ones).
pub(crate) fn sends(pieces: &[Piece]) -> Vec<(usize, usize, u64)> {
    let mut out: Vec<(usize, usize, u64)> = Vec::new();
    let mut last_alloc = None;
    for p in pieces {
        match out.last_mut() {
            Some(r)
                if last_alloc == Some(p.alloc)
                    && r.0 + r.1 == p.off
                    && r.2 + r.1 as u64 == p.dst =>
            {
                r.1 += p.len
            }
            _ => out.push((p.off, p.len, p.dst)),
        }
        last_alloc = Some(p.alloc);
    }
    out
}

/// A host copy the pool runs: `len` bytes from `src` to `dst` (addresses).
#[derive(Clone, Copy)]
struct Task {
    src: usize,
    dst: usize,
    len: usize,
}

#[derive(Default)]
struct PoolState {
    tasks: Vec<Task>,
    /// Tasks queued and not finished.
    left: usize,
    quit: bool,
}

#[derive(Default)]
struct PoolShared {
    st: Mutex<PoolState>,
    work: Condvar,
    done: Condvar,
}

impl PoolShared {
    fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Take a queued task (None: none queued).
    fn take(&self) -> Option<Task> {
        self.lock().tasks.pop()
    }

    fn finish(&self) {
        let mut s = self.lock();
        s.left -= 1;
        if s.left == 0 {
            self.done.notify_all();
        }
    }
}

/// Run one task.
///
/// # Safety
/// `src` readable and `dst` writable for `len` bytes, not overlapping, no one else writing
/// `dst` meanwhile ([`CopyPool::run`]'s contract).
unsafe fn copy_task(t: Task) {
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(t.src as *const u8, t.dst as *mut u8, t.len) };
}

/// Threads that copy host bytes; the caller of [`CopyPool::run`] copies too.
struct CopyPool {
    shared: Arc<PoolShared>,
    threads: Vec<JoinHandle<()>>,
}

impl CopyPool {
    fn new(n: usize) -> CopyPool {
        let shared = Arc::new(PoolShared::default());
        let threads = (0..n)
            .filter_map(|i| {
                let sh = shared.clone();
                std::thread::Builder::new()
                    .name(format!("cuda-staging-{i}"))
                    .spawn(move || loop {
                        let t = {
                            let mut s = sh.lock();
                            loop {
                                if let Some(t) = s.tasks.pop() {
                                    break t;
                                }
                                if s.quit {
                                    return;
                                }
                                s = sh.work.wait(s).unwrap_or_else(|p| p.into_inner());
                            }
                        };
                        // SAFETY: queued by `run`, whose caller keeps both ranges valid and
                        // unshared until every task it queued is finished.
                        unsafe { copy_task(t) };
                        sh.finish();
                    })
                    .ok()
            })
            .collect();
        CopyPool { shared, threads }
    }

    /// Copy every task; returns when all are done.
    ///
    /// # Safety
    /// Each task's source is readable and its destination writable for its length until
    /// this returns; destinations do not overlap each other or any source, and nothing
    /// else writes them meanwhile.
    unsafe fn run(&self, tasks: &[Task]) {
        if tasks.is_empty() {
            return;
        }
        {
            let mut s = self.shared.lock();
            s.left += tasks.len();
            s.tasks.extend_from_slice(tasks);
        }
        self.shared.work.notify_all();
        while let Some(t) = self.shared.take() {
            // SAFETY: this function's contract.
            unsafe { copy_task(t) };
            self.shared.finish();
        }
        let mut s = self.shared.lock();
        while s.left > 0 {
            s = self.shared.done.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }
}

impl Drop for CopyPool {
    fn drop(&mut self) {
        self.shared.lock().quit = true;
        self.shared.work.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// One page-locked buffer of the ring and the event recorded after its last device copy.
struct Slot {
    host: PinnedHostSlice<u8>,
    /// `host`'s address.
    ptr: usize,
    sent: CudaEvent,
}

/// The ring (see the module header).
pub(crate) struct StagingRing {
    slots: Vec<Slot>,
    slot_bytes: usize,
    /// The slot being filled, and the bytes its pieces take.
    cur: usize,
    fill: usize,
    pieces: Vec<Piece>,
    pool: CopyPool,
}

impl StagingRing {
    pub(crate) fn new(ctx: &Arc<CudaContext>, cfg: StagingConfig) -> Result<Self, DriverError> {
        let slot_bytes = cfg.slot_bytes();
        let mut slots = Vec::with_capacity(cfg.slots.max(1));
        for _ in 0..cfg.slots.max(1) {
            // SAFETY: the slot's bytes are only read by device copies of pieces the copy
            // threads wrote first (`send`).
            let mut host = unsafe { ctx.alloc_pinned_with_flags::<u8>(slot_bytes, 0) }?;
            let ptr = host.as_mut_ptr()? as usize;
            slots.push(Slot {
                host,
                ptr,
                sent: ctx.new_event(None)?,
            });
        }
        Ok(StagingRing {
            slots,
            slot_bytes,
            cur: 0,
            fill: 0,
            pieces: Vec::new(),
            pool: CopyPool::new(cfg.threads),
        })
    }

    /// Page-locked bytes the ring holds.
    pub(crate) fn bytes(&self) -> u64 {
        self.slots.iter().map(|s| s.host.num_bytes() as u64).sum()
    }

    /// Queue `src` for device address `alloc + at` (sending full slots on `stream` on the
    /// way); `alloc`: the start of the device allocation `src` goes into.
    ///
    /// # Safety
    /// `src` stays readable, and `[alloc + at, alloc + at + src.len())` inside one device
    /// allocation made on (or ordered before) `stream`, until the next
    /// [`StagingRing::flush`] or [`StagingRing::abandon`] returns.
    pub(crate) unsafe fn stage(
        &mut self,
        stream: &CudaStream,
        src: &[u8],
        alloc: u64,
        at: usize,
    ) -> Result<(), String> {
        let dst = alloc + at as u64;
        let mut done = 0;
        while done < src.len() {
            if self.fill == self.slot_bytes {
                self.flush(stream)?;
            }
            let n = (self.slot_bytes - self.fill).min(src.len() - done);
            self.pieces.push(Piece {
                src: src.as_ptr() as usize + done,
                off: self.fill,
                len: n,
                dst: dst + done as u64,
                alloc,
            });
            self.fill += n;
            done += n;
        }
        Ok(())
    }

    /// Send the slot being filled (nothing if it is empty): wait until its previous copies
    /// are done, copy its pieces in on the threads, queue its device copies on `stream`
    /// and record its event; the next slot is filled next.
    pub(crate) fn flush(&mut self, stream: &CudaStream) -> Result<(), String> {
        if self.pieces.is_empty() {
            return Ok(());
        }
        let slot = &self.slots[self.cur];
        let what = |op: &str, e: DriverError| format!("staging slot {}: {op}: {e}", self.cur);
        slot.sent.synchronize().map_err(|e| what("waiting", e))?;
        let tasks: Vec<Task> = tasks(&self.pieces, TASK_BYTES)
            .into_iter()
            .map(|(src, off, len)| Task {
                src,
                dst: slot.ptr + off,
                len,
            })
            .collect();
        // SAFETY: the sources are readable until `flush` returns (`stage`'s contract); the
        // destinations are disjoint ranges of this slot (pieces never overlap), which no
        // device copy reads any more (its event completed above).
        unsafe { self.pool.run(&tasks) };
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| what("binding", e))?;
        for (off, len, dst) in sends(&self.pieces) {
            // SAFETY: the slot's bytes [off, off + len) were written above and stay
            // untouched until the event recorded below completes; the destination is
            // allocated on or before this stream (`stage`'s contract).
            unsafe {
                let src = std::slice::from_raw_parts((slot.ptr + off) as *const u8, len);
                result::memcpy_htod_async(dst, src, stream.cu_stream())
                    .map_err(|e| what(&format!("{len} bytes from {off} to {dst:#x}"), e))?;
            }
        }
        slot.sent.record(stream).map_err(|e| what("event", e))?;
        self.cur = (self.cur + 1) % self.slots.len();
        self.fill = 0;
        self.pieces.clear();
        Ok(())
    }

    /// Forget the pieces not sent (after an error: their sources may be gone).
    pub(crate) fn abandon(&mut self) {
        self.pieces.clear();
        self.fill = 0;
    }
}

impl Drop for StagingRing {
    fn drop(&mut self) {
        // The page-locked buffers are freed after this: no device copy may still read them.
        for s in &self.slots {
            let _ = s.sent.synchronize();
        }
    }
}

/// A VRAM unit cache's staging: its configuration, and the ring once a miss needed it.
pub(crate) struct Staging {
    cfg: Option<StagingConfig>,
    ring: Option<StagingRing>,
    /// Why the ring could not be allocated (uploads then come from pageable memory).
    pub(crate) failed: Option<String>,
}

impl Staging {
    pub(crate) fn new(cfg: Option<StagingConfig>) -> Staging {
        Staging {
            cfg,
            ring: None,
            failed: None,
        }
    }

    /// The ring (allocated on first use; None when off or refused).
    pub(crate) fn ring(&mut self, ctx: &Arc<CudaContext>) -> Option<&mut StagingRing> {
        let cfg = self.cfg?;
        if self.ring.is_none() && self.failed.is_none() {
            match StagingRing::new(ctx, cfg) {
                Ok(r) => self.ring = Some(r),
                Err(e) => {
                    eprintln!(
                        "cuda: staging ring of {} bytes: {e}; uploads from pageable memory",
                        cfg.bytes
                    );
                    self.failed = Some(e.to_string());
                }
            }
        }
        self.ring.as_mut()
    }

    /// Page-locked bytes the ring holds (0 before its first use).
    pub(crate) fn bytes(&self) -> u64 {
        self.ring.as_ref().map_or(0, |r| r.bytes())
    }
}

impl crate::forward::GpuDecoder {
    /// Uploads of VRAM-tier misses from pageable memory through a staging ring of this
    /// shape (None: straight from pageable memory). Replaces what the environment chose
    /// ([`StagingConfig::from_env`]); the ring is allocated at the next miss. Nothing to do
    /// for experts resident in VRAM.
    pub fn set_staging(&self, cfg: Option<StagingConfig>) {
        if let Some(units) = &self.units {
            let mut uc = crate::forward::lock(units);
            uc.staging = Staging::new(cfg);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(src: usize, off: usize, len: usize, dst: u64) -> Piece {
        // Allocations of 1000 bytes at multiples of 1000.
        Piece {
            src,
            off,
            len,
            dst,
            alloc: dst / 1000 * 1000,
        }
    }

    #[test]
    fn tasks_cover_each_piece_in_bounded_runs() {
        let p = [piece(1000, 0, 10, 0), piece(5000, 10, 3, 77)];
        assert_eq!(
            tasks(&p, 4),
            vec![(1000, 0, 4), (1004, 4, 4), (1008, 8, 2), (5000, 10, 3)]
        );
        assert!(tasks(&[], 4).is_empty());
    }

    #[test]
    fn sends_merge_only_runs_contiguous_in_the_slot_and_on_the_device() {
        // A unit's three parts follow on in VRAM: one send; the next unit elsewhere: another;
        // a unit in the allocation right after the previous one's end: another too.
        let p = [
            piece(0, 0, 10, 500),
            piece(90, 10, 5, 510),
            piece(40, 15, 5, 515),
            piece(0, 20, 8, 9000),
            piece(0, 28, 2, 9100),
            piece(0, 30, 900, 9102),
            piece(0, 930, 4, 10002),
        ];
        let want = vec![
            (0, 20, 500),
            (20, 8, 9000),
            (28, 902, 9100),
            (930, 4, 10002),
        ];
        assert_eq!(sends(&p), want);
    }

    #[test]
    fn the_pool_copies_every_task_with_and_without_threads() {
        for threads in [0, 1, 3] {
            let pool = CopyPool::new(threads);
            let src: Vec<u8> = (0..100_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
            let mut dst = vec![0u8; src.len()];
            let t: Vec<Task> = tasks(&[piece(src.as_ptr() as usize, 0, src.len(), 0)], 999)
                .into_iter()
                .map(|(s, off, len)| Task {
                    src: s,
                    dst: dst.as_mut_ptr() as usize + off,
                    len,
                })
                .collect();
            // SAFETY: `src` and `dst` are distinct live vectors of the tasks' extent.
            unsafe { pool.run(&t) };
            assert!(dst == src, "{threads} threads");
        }
    }
}
