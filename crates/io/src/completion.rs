//! Completion queue shared by the backends: finished requests wait here for `wait_one` /
//! `try_complete`, with an in-flight count so `wait_one` never blocks on nothing.

use crate::request::ReadDone;
use crossbeam_channel::{Receiver, Sender};
use std::sync::atomic::{AtomicUsize, Ordering::AcqRel, Ordering::Acquire};

pub(crate) struct Completions {
    tx: Sender<ReadDone>,
    rx: Receiver<ReadDone>,
    /// Submitted requests not yet claimed by a waiter.
    unclaimed: AtomicUsize,
}

impl Completions {
    pub fn new() -> Completions {
        let (tx, rx) = crossbeam_channel::unbounded();
        Completions {
            tx,
            rx,
            unclaimed: AtomicUsize::new(0),
        }
    }

    /// A sender for the IO threads.
    pub fn sender(&self) -> Sender<ReadDone> {
        self.tx.clone()
    }

    /// Count one more request in flight (before it can possibly complete).
    pub fn submitted(&self) {
        self.unclaimed.fetch_add(1, AcqRel);
    }

    /// Undo `submitted` for a request that was never queued.
    pub fn unsubmitted(&self) {
        self.unclaimed.fetch_sub(1, AcqRel);
    }

    fn claim(&self) -> bool {
        self.unclaimed
            .fetch_update(AcqRel, Acquire, |n| n.checked_sub(1))
            .is_ok()
    }

    pub fn wait_one(&self) -> Option<ReadDone> {
        if !self.claim() {
            return None;
        }
        // We own one claim on a request that was submitted and will be completed: the IO
        // threads always send a ReadDone (errors included) before they exit.
        self.rx.recv().ok()
    }

    pub fn try_complete(&self) -> Option<ReadDone> {
        if !self.claim() {
            return None;
        }
        match self.rx.try_recv() {
            Ok(d) => Some(d),
            Err(_) => {
                self.submitted();
                None
            }
        }
    }
}
