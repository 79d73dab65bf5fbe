//! Read-ahead hints: `posix_fadvise(WILLNEED)` issued from a background thread (spawned on
//! first use), so the caller (the compute thread) never pays the syscall. Switchable.

use crate::stats::Counters;
use crossbeam_channel::{Receiver, Sender};
use std::fs::File;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

type Worker = (Sender<Range<u64>>, JoinHandle<()>);

/// Owns the hint thread of one engine.
pub(crate) struct Hinter {
    file: Arc<File>,
    counters: Arc<Counters>,
    on: AtomicBool,
    worker: Mutex<Option<Worker>>,
}

impl Hinter {
    pub fn new(file: Arc<File>, counters: Arc<Counters>) -> Hinter {
        Hinter {
            file,
            counters,
            on: AtomicBool::new(true),
            worker: Mutex::new(None),
        }
    }

    pub fn set(&self, on: bool) {
        self.on.store(on, Relaxed);
    }

    /// Queue a WILLNEED hint for `range`; returns at once.
    pub fn hint(&self, range: Range<u64>) {
        if !self.on.load(Relaxed) || range.is_empty() {
            return;
        }
        let mut w = self.worker.lock().unwrap_or_else(|p| p.into_inner());
        if w.is_none() {
            let (tx, rx) = crossbeam_channel::unbounded();
            let file = self.file.clone();
            let counters = self.counters.clone();
            let spawned = std::thread::Builder::new()
                .name("sluice-io-hint".into())
                .spawn(move || hint_loop(&file, &counters, rx));
            match spawned {
                Ok(h) => *w = Some((tx, h)),
                Err(_) => return, // hints are optional: no thread, no hint
            }
        }
        if let Some((tx, _)) = w.as_ref() {
            let _ = tx.send(range);
        }
    }
}

fn hint_loop(file: &File, counters: &Counters, rx: Receiver<Range<u64>>) {
    for r in rx {
        // SAFETY: posix_fadvise only reads its integer arguments; the fd is open (Arc<File>).
        let rc = unsafe {
            libc::posix_fadvise(
                file.as_raw_fd(),
                r.start as libc::off_t,
                (r.end - r.start) as libc::off_t,
                libc::POSIX_FADV_WILLNEED,
            )
        };
        if rc == 0 {
            counters.hints.fetch_add(1, Relaxed);
        }
    }
}

impl Drop for Hinter {
    fn drop(&mut self) {
        let w = self.worker.get_mut().unwrap_or_else(|p| p.into_inner());
        if let Some((tx, h)) = w.take() {
            drop(tx);
            let _ = h.join();
        }
    }
}
