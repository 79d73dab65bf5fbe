//! A persistent compute pool with cheap dispatch for the decode hot path.
//!
//! Owns: [`run`], which spreads `n` independent tasks over as many threads as the current
//! rayon pool has (the caller and `threads - 1` persistent helpers), and returns when every
//! task is done. Dispatch is one atomic store (plus one wake-up when helpers sleep); helpers
//! spin a short while ([`spin_budget`], `SLUICE_SPIN_US`, default 200 µs; pausing first,
//! then yielding) for the next job and then sleep on a condition variable, so a decode's dozens of small parallel regions
//! per layer cost no futex round trips, and an idle process costs no CPU.
//!
//! The caller never waits for a helper that has not joined the job: it runs tasks itself,
//! closes the job, and waits only for helpers inside it (a late or descheduled helper never
//! holds a token back, which matters on an oversubscribed machine). Tasks are handed out
//! by an atomic counter; which thread runs a task never changes what it computes, so
//! results are bit-identical for any thread count. A nested or concurrent call (the pool
//! busy) runs on rayon instead, with the same results.

use std::any::Any;
use std::collections::HashMap;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use rayon::prelude::*;

/// The task function: `f(worker, task)`; `worker < threads` names the running thread's
/// slot (for per-thread scratch), `task < n`.
type TaskFn<'a> = dyn Fn(usize, usize) + Sync + 'a;

/// How long helpers spin for the next job before sleeping (`SLUICE_SPIN_US`).
pub fn spin_budget() -> Duration {
    static SPIN: OnceLock<Duration> = OnceLock::new();
    *SPIN.get_or_init(|| {
        let us = std::env::var("SLUICE_SPIN_US")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(200);
        Duration::from_micros(us)
    })
}

/// The job being run: a pointer to the caller's task function (valid while the job is
/// open or any helper is inside it) and the task count.
#[derive(Clone, Copy)]
struct Job {
    f: *const TaskFn<'static>,
    n: usize,
}

struct Shared {
    /// `epoch * 2 + open`: helpers join a job only while its epoch is open.
    state: AtomicUsize,
    /// The current job; written by the caller only while the state is closed and no
    /// helper is inside (`active == 0`).
    job: Mutex<Option<Job>>,
    /// Next task index to hand out.
    next: AtomicUsize,
    /// Helpers inside the current job.
    active: AtomicUsize,
    /// Helpers asleep (or about to sleep) on `wake`.
    sleepers: AtomicUsize,
    sleep: Mutex<()>,
    wake: Condvar,
    /// A task panicked; the payload is re-raised on the caller.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    /// One dispatching caller at a time.
    busy: AtomicBool,
    threads: usize,
}

// SAFETY: `Job::f` points at a `Sync` closure that outlives every use (the caller does
// not return while the job is open or a helper is inside it); the rest are Sync types.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

/// A pool of `threads - 1` persistent helpers (the caller is the last thread).
struct Pool {
    shared: Arc<Shared>,
}

impl Pool {
    fn new(threads: usize) -> Pool {
        let shared = Arc::new(Shared {
            state: AtomicUsize::new(0),
            job: Mutex::new(None),
            next: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            sleep: Mutex::new(()),
            wake: Condvar::new(),
            panic: Mutex::new(None),
            busy: AtomicBool::new(false),
            threads,
        });
        for w in 1..threads {
            let s = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(format!("sluice-pool-{w}"))
                .spawn(move || helper(&s, w))
                .expect("spawn a compute pool thread");
        }
        Pool { shared }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Run tasks of the open job until none are left.
fn work(s: &Shared, job: Job, worker: usize) {
    // SAFETY: the caller keeps the closure alive until the job is closed and no helper is
    // inside it; this function runs only inside the job (caller, or a helper counted in
    // `active`).
    let f = unsafe { &*job.f };
    let r = catch_unwind(AssertUnwindSafe(|| loop {
        let i = s.next.fetch_add(1, SeqCst);
        if i >= job.n {
            break;
        }
        f(worker, i);
    }));
    if let Err(p) = r {
        // Stop handing out tasks; the caller re-raises.
        s.next.store(usize::MAX / 2, SeqCst);
        lock(&s.panic).get_or_insert(p);
    }
}

fn helper(s: &Shared, worker: usize) {
    HELPER_OF.with(|h| h.set(s.threads));
    let mut seen = 0usize;
    loop {
        // Wait for a state other than the last one seen that is open.
        let start = Instant::now();
        let mut spins = 0u32;
        let st = loop {
            let st = s.state.load(SeqCst);
            if st != seen && st & 1 == 1 {
                break st;
            }
            spins = spins.wrapping_add(1);
            // Past the first few thousand pauses, yield between checks: a helper waiting
            // on an oversubscribed machine then gives its core to whoever needs it.
            if spins > 4096 {
                std::thread::yield_now();
            }
            if spins.is_multiple_of(64) && start.elapsed() >= spin_budget() {
                // Sleep until a dispatcher sees us and notifies.
                let mut g = lock(&s.sleep);
                s.sleepers.fetch_add(1, SeqCst);
                loop {
                    let st = s.state.load(SeqCst);
                    if st != seen && st & 1 == 1 {
                        break;
                    }
                    g = s.wake.wait(g).unwrap_or_else(|p| p.into_inner());
                }
                s.sleepers.fetch_sub(1, SeqCst);
                drop(g);
                spins = 0;
                continue;
            }
            std::hint::spin_loop();
        };
        seen = st;
        // Join, then check the job is still the one seen (the caller may have closed it).
        s.active.fetch_add(1, SeqCst);
        if s.state.load(SeqCst) == st {
            let job = *lock(&s.job);
            if let Some(job) = job {
                work(s, job, worker);
            }
        }
        s.active.fetch_sub(1, SeqCst);
    }
}

/// Pools by thread count (tests run several counts in one process).
fn pool_for(threads: usize) -> Arc<Shared> {
    static POOLS: OnceLock<Mutex<HashMap<usize, Arc<Shared>>>> = OnceLock::new();
    let mut m = lock(POOLS.get_or_init(|| Mutex::new(HashMap::new())));
    let s = m
        .entry(threads)
        .or_insert_with(|| Pool::new(threads).shared);
    Arc::clone(s)
}

thread_local! {
    static LOCAL: std::cell::RefCell<Option<Arc<Shared>>> = const { std::cell::RefCell::new(None) };
    /// On a helper: its pool's thread count (0 elsewhere).
    static HELPER_OF: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Threads [`run`] spreads tasks over: the current rayon pool's (on a pool helper, its
/// pool's).
pub fn threads() -> usize {
    match HELPER_OF.with(|h| h.get()) {
        0 => rayon::current_num_threads().max(1),
        n => n,
    }
}

/// Run `f(worker, task)` for every `task < n` over [`threads`] threads and return when
/// all are done (a task's panic is re-raised here). `worker < threads()` is unique among
/// the tasks running at one time on this pool (per-thread scratch).
pub fn run(n: usize, f: &(dyn Fn(usize, usize) + Sync)) {
    let threads = threads();
    if n == 0 {
        return;
    }
    // One thread, one task, or a call from inside a task on a helper: this thread.
    if threads == 1 || n == 1 || HELPER_OF.with(|h| h.get()) != 0 {
        (0..n).for_each(|i| f(0, i));
        return;
    }
    let s = LOCAL.with(|l| {
        let mut l = l.borrow_mut();
        match &*l {
            Some(s) if s.threads == threads => Arc::clone(s),
            _ => {
                let s = pool_for(threads);
                *l = Some(Arc::clone(&s));
                s
            }
        }
    });
    if s.busy
        .compare_exchange(false, true, SeqCst, SeqCst)
        .is_err()
    {
        // Nested or concurrent use: rayon, with the rayon thread's index as the slot.
        (0..n).into_par_iter().for_each(|i| {
            let w = rayon::current_thread_index().unwrap_or(0) % threads;
            f(w, i)
        });
        return;
    }
    // SAFETY: only the lifetime is erased; the pointer is used only while this call has
    // not returned (the job is closed and `active == 0` before we return).
    let fp: *const TaskFn<'static> =
        unsafe { std::mem::transmute::<*const TaskFn<'_>, *const TaskFn<'static>>(f) };
    let job = Job { f: fp, n };
    *lock(&s.job) = Some(job);
    s.next.store(0, SeqCst);
    let open = s.state.load(SeqCst) + 1; // closed (even) -> open (odd)
    s.state.store(open, SeqCst);
    if s.sleepers.load(SeqCst) > 0 {
        let _g = lock(&s.sleep);
        s.wake.notify_all();
    }
    work(&s, job, 0);
    // Close: no helper joins after this; wait for those inside.
    s.state.store(open + 1, SeqCst);
    let mut spins = 0u32;
    while s.active.load(SeqCst) != 0 {
        spins = spins.wrapping_add(1);
        if spins > 1 << 12 {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    *lock(&s.job) = None;
    let p = lock(&s.panic).take();
    s.busy.store(false, SeqCst);
    if let Some(p) = p {
        resume_unwind(p);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sums(threads: usize, n: usize) -> Vec<u64> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let out: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
        pool.install(|| {
            for round in 0..50 {
                run(n, &|w, i| {
                    assert!(w < threads);
                    out[i].fetch_add(i * round + 1, SeqCst);
                });
            }
        });
        out.iter().map(|a| a.load(SeqCst) as u64).collect()
    }

    #[test]
    fn every_task_runs_once_at_any_thread_count() {
        let want: Vec<u64> = (0..97).map(|i| (i * 1225 + 50) as u64).collect();
        for t in [1, 2, 3, 4, 8] {
            assert_eq!(sums(t, 97), want, "threads {t}");
        }
    }

    #[test]
    fn nested_and_concurrent_calls_fall_back() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        let total = AtomicUsize::new(0);
        pool.install(|| {
            rayon::join(
                || {
                    run(8, &|_, _| {
                        run(4, &|_, _| {
                            total.fetch_add(1, SeqCst);
                        })
                    })
                },
                || {
                    run(5, &|_, _| {
                        total.fetch_add(100, SeqCst);
                    })
                },
            );
        });
        assert_eq!(total.load(SeqCst), 32 + 500);
    }

    #[test]
    fn a_task_panic_reaches_the_caller_and_the_pool_survives() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        pool.install(|| {
            let r = catch_unwind(|| run(16, &|_, i| assert!(i != 7, "task 7")));
            assert!(r.is_err());
            let n = AtomicUsize::new(0);
            run(16, &|_, _| {
                n.fetch_add(1, SeqCst);
            });
            assert_eq!(n.load(SeqCst), 16);
        });
    }
}
