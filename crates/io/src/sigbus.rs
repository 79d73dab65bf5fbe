//! Turning SIGBUS on a model file's memory map into a clear error.
//!
//! Owns: a small table of the live maps (start, length, a message naming the file) and a
//! SIGBUS handler, installed once, that looks the faulting address up in it. A file that
//! is truncated (or replaced in place) while sluice runs makes every access to a page past
//! its new end raise SIGBUS; instead of dying by the signal with no word (rc 135), the
//! process writes `error: FILE: the model file changed while sluice was running ...` and
//! exits with status 1. A fault outside every registered map restores the default action
//! and returns, so the fault repeats and the process dies by SIGBUS as before.
//!
//! Only async-signal-safe operations run in the handler: atomic loads, `write(2)`,
//! `_exit(2)`, `sigaction(2)`.

use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::sync::Once;

/// One registered map. `len == 0`: the slot holds nothing the handler may use.
struct Slot {
    used: AtomicBool,
    start: AtomicUsize,
    len: AtomicUsize,
    msg: AtomicPtr<u8>,
    msg_len: AtomicUsize,
}

impl Slot {
    const fn new() -> Slot {
        Slot {
            used: AtomicBool::new(false),
            start: AtomicUsize::new(0),
            len: AtomicUsize::new(0),
            msg: AtomicPtr::new(std::ptr::null_mut()),
            msg_len: AtomicUsize::new(0),
        }
    }
}

/// Maps guarded at once (a process maps one model; tests map a few at a time). A map that
/// finds no free slot is simply not guarded.
const SLOTS: usize = 64;
static TABLE: [Slot; SLOTS] = [const { Slot::new() }; SLOTS];
static INSTALL: Once = Once::new();

/// Exit status after a guarded SIGBUS (an ordinary error exit, never a signal).
pub const EXIT_STATUS: i32 = 1;

/// Guard `start..start + len` (a live map of `path`): a SIGBUS inside it ends the process
/// with a message naming `path`. Returns the slot to pass to [`unregister`].
pub(crate) fn register(start: usize, len: usize, path: &std::path::Path) -> Option<usize> {
    INSTALL.call_once(install);
    let msg = format!(
        "\nerror: {}: the model file changed while sluice was running (truncated or rewritten in place: reading its memory map raised SIGBUS); stopping\n",
        path.display()
    );
    // Leaked on purpose: the handler may read it at any time, even after unregistering.
    let msg: &'static mut [u8] = Box::leak(msg.into_bytes().into_boxed_slice());
    for (i, s) in TABLE.iter().enumerate() {
        if s.used
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            s.msg.store(msg.as_mut_ptr(), Ordering::Release);
            s.msg_len.store(msg.len(), Ordering::Release);
            s.start.store(start, Ordering::Release);
            s.len.store(len, Ordering::Release);
            return Some(i);
        }
    }
    None
}

/// Stop guarding the map in `slot` (before it is unmapped).
pub(crate) fn unregister(slot: usize) {
    let s = &TABLE[slot];
    s.len.store(0, Ordering::Release);
    s.used.store(false, Ordering::Release);
}

fn install() {
    // SAFETY: a zeroed sigaction is a valid "no flags, empty mask" value; sa_sigaction is set
    // to a handler of the SA_SIGINFO signature before the struct is used. sigaction only
    // replaces this process's SIGBUS disposition (nothing else in sluice handles SIGBUS).
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = handler as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut());
    }
}

extern "C" fn handler(_sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo_t for a SA_SIGINFO handler; si_addr is the
    // faulting address for SIGBUS.
    let addr = unsafe { (*info).si_addr() } as usize;
    for s in &TABLE {
        let len = s.len.load(Ordering::Acquire);
        let start = s.start.load(Ordering::Acquire);
        if len > 0 && addr >= start && addr - start < len {
            let msg = s.msg.load(Ordering::Acquire);
            let n = s.msg_len.load(Ordering::Acquire);
            // SAFETY: msg points to a leaked (never freed) buffer of n bytes; write(2) and
            // _exit(2) are async-signal-safe.
            unsafe {
                libc::write(2, msg.cast(), n);
                libc::_exit(EXIT_STATUS);
            }
        }
    }
    // Not one of ours: back to the default action; returning re-runs the faulting access,
    // which then ends the process by SIGBUS as if no handler had been installed.
    // SAFETY: as in `install`; SIG_DFL is a valid disposition.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = libc::SIG_DFL;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGBUS, &sa, std::ptr::null_mut());
    }
}
