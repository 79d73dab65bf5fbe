//! IO statistics: cheap atomic counters shared by the backends, and the `IoStats` snapshot
//! with derived rates (effective queue depth, delivered GB/s).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Instant;

/// Snapshot of an engine's counters since open.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct IoStats {
    /// `submit` calls.
    pub dispatches: u64,
    /// Segment reads started (an expert's gate/up/down = 3 tasks).
    pub tasks: u64,
    /// Sum of requested segment lengths.
    pub bytes_requested: u64,
    /// Bytes actually transferred, including alignment overhead.
    pub bytes_read: u64,
    /// Wall time during which at least one read was in flight.
    pub busy_ns: u64,
    /// Sum of per-read durations (overlapping reads each count).
    pub sum_task_ns: u64,
    /// Wall time since the engine was opened.
    pub wall_ns: u64,
    /// Requests completed with an error.
    pub errors: u64,
    /// `hint_willneed` calls actually issued to the kernel.
    pub hints: u64,
    /// O_DIRECT is in effect.
    pub direct: bool,
    /// O_DIRECT was asked for but the file system refused it (buffered reads instead).
    pub direct_refused: bool,
    /// io_uring was asked for but refused by the kernel (pread pool instead).
    pub uring_fallback: bool,
}

impl IoStats {
    /// Average reads in flight while busy: sum_task_ns / busy_ns.
    pub fn effective_queue_depth(&self) -> f64 {
        if self.busy_ns == 0 {
            0.0
        } else {
            self.sum_task_ns as f64 / self.busy_ns as f64
        }
    }

    /// Delivered bandwidth while busy, GB/s (1e9 bytes): bytes_read / busy_ns.
    pub fn delivered_gbps(&self) -> f64 {
        if self.busy_ns == 0 {
            0.0
        } else {
            self.bytes_read as f64 / self.busy_ns as f64
        }
    }

    /// Bandwidth one read sees on average, GB/s: bytes_read / sum_task_ns.
    pub fn per_task_gbps(&self) -> f64 {
        if self.sum_task_ns == 0 {
            0.0
        } else {
            self.bytes_read as f64 / self.sum_task_ns as f64
        }
    }

    /// Fraction of wall time with a read in flight.
    pub fn busy_fraction(&self) -> f64 {
        if self.wall_ns == 0 {
            0.0
        } else {
            self.busy_ns as f64 / self.wall_ns as f64
        }
    }
}

impl std::fmt::Display for IoStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "dispatches {} tasks {} requested {:.1} MiB read {:.1} MiB busy {:.3} s \
             ({:.0}% of wall) qd {:.2} delivered {:.2} GB/s per-task {:.2} GB/s errors {} \
             direct {}{}{}",
            self.dispatches,
            self.tasks,
            self.bytes_requested as f64 / (1 << 20) as f64,
            self.bytes_read as f64 / (1 << 20) as f64,
            self.busy_ns as f64 * 1e-9,
            self.busy_fraction() * 100.0,
            self.effective_queue_depth(),
            self.delivered_gbps(),
            self.per_task_gbps(),
            self.errors,
            self.direct,
            if self.direct_refused {
                " (O_DIRECT refused)"
            } else {
                ""
            },
            if self.uring_fallback {
                " (io_uring refused)"
            } else {
                ""
            },
        )
    }
}

struct Busy {
    active: u64,
    since: Instant,
}

/// Live counters, shared between the caller and the IO threads.
pub(crate) struct Counters {
    opened: Instant,
    pub dispatches: AtomicU64,
    pub tasks: AtomicU64,
    pub bytes_requested: AtomicU64,
    pub bytes_read: AtomicU64,
    pub sum_task_ns: AtomicU64,
    pub errors: AtomicU64,
    pub hints: AtomicU64,
    busy_ns: AtomicU64,
    busy: Mutex<Busy>,
    pub direct: AtomicBool,
    pub direct_refused: AtomicBool,
    pub uring_fallback: AtomicBool,
}

impl Counters {
    pub fn new() -> Counters {
        let now = Instant::now();
        Counters {
            opened: now,
            dispatches: AtomicU64::new(0),
            tasks: AtomicU64::new(0),
            bytes_requested: AtomicU64::new(0),
            bytes_read: AtomicU64::new(0),
            sum_task_ns: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            hints: AtomicU64::new(0),
            busy_ns: AtomicU64::new(0),
            busy: Mutex::new(Busy {
                active: 0,
                since: now,
            }),
            direct: AtomicBool::new(false),
            direct_refused: AtomicBool::new(false),
            uring_fallback: AtomicBool::new(false),
        }
    }

    /// A segment read starts; returns its start time.
    pub fn task_start(&self) -> Instant {
        let now = Instant::now();
        self.tasks.fetch_add(1, Relaxed);
        let mut b = self.busy.lock().unwrap_or_else(|p| p.into_inner());
        if b.active == 0 {
            b.since = now;
        }
        b.active += 1;
        now
    }

    /// A segment read started at `start` ends.
    pub fn task_end(&self, start: Instant) {
        let now = Instant::now();
        self.sum_task_ns
            .fetch_add(now.duration_since(start).as_nanos() as u64, Relaxed);
        let mut b = self.busy.lock().unwrap_or_else(|p| p.into_inner());
        b.active = b.active.saturating_sub(1);
        if b.active == 0 {
            self.busy_ns
                .fetch_add(now.duration_since(b.since).as_nanos() as u64, Relaxed);
        }
    }

    pub fn snapshot(&self) -> IoStats {
        let now = Instant::now();
        let busy_ns = {
            let b = self.busy.lock().unwrap_or_else(|p| p.into_inner());
            let open = if b.active > 0 {
                now.duration_since(b.since).as_nanos() as u64
            } else {
                0
            };
            self.busy_ns.load(Relaxed) + open
        };
        IoStats {
            dispatches: self.dispatches.load(Relaxed),
            tasks: self.tasks.load(Relaxed),
            bytes_requested: self.bytes_requested.load(Relaxed),
            bytes_read: self.bytes_read.load(Relaxed),
            busy_ns,
            sum_task_ns: self.sum_task_ns.load(Relaxed),
            wall_ns: now.duration_since(self.opened).as_nanos() as u64,
            errors: self.errors.load(Relaxed),
            hints: self.hints.load(Relaxed),
            direct: self.direct.load(Relaxed),
            direct_refused: self.direct_refused.load(Relaxed),
            uring_fallback: self.uring_fallback.load(Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_is_union_and_sum_counts_overlap() {
        let c = Counters::new();
        let a = c.task_start();
        let b = c.task_start();
        std::thread::sleep(std::time::Duration::from_millis(20));
        c.task_end(a);
        c.task_end(b);
        let s = c.snapshot();
        assert_eq!(s.tasks, 2);
        assert!(s.busy_ns >= 20_000_000);
        // Two fully overlapping reads: sum of task times is about twice the busy time.
        assert!(s.sum_task_ns >= 2 * 20_000_000);
        let qd = s.effective_queue_depth();
        assert!(qd > 1.5 && qd <= 2.0 + 1e-9, "qd {qd}");
        assert!(s.wall_ns >= s.busy_ns);
    }
}
