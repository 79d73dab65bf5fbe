//! How `run` answers signals.
//!
//! Owns [`RunSignals`]: Ctrl-C (SIGINT) stops the current answer and a second one while it
//! is stopping exits 130 (the chat goes on after one); SIGTERM and SIGHUP end the command:
//! the answer stops at the next prefill chunk or token (so a routing trace or a logits
//! dump is finished, never half-written) and `run` exits 143, at once when it sits idle
//! at the chat prompt, and at once on a second one. `timeout` and `kill` stop `run` with
//! one signal, as they stop any other program.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{Context, Result};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

/// The flags the signal thread sets; `run` polls them between chunks and tokens.
#[derive(Clone)]
pub struct RunSignals {
    /// Stop the current answer (any of the three signals).
    pub stop: Arc<AtomicBool>,
    /// End the command (SIGTERM, SIGHUP).
    terminate: Arc<AtomicBool>,
    /// Waiting for the user's next line: nothing to finish, so a SIGTERM exits now.
    idle: Arc<AtomicBool>,
}

impl RunSignals {
    /// Install the handlers (before loading, so an early signal is seen too).
    pub fn install() -> Result<RunSignals> {
        let s = RunSignals {
            stop: Arc::new(AtomicBool::new(false)),
            terminate: Arc::new(AtomicBool::new(false)),
            idle: Arc::new(AtomicBool::new(false)),
        };
        let mut signals =
            Signals::new([SIGINT, SIGTERM, SIGHUP]).context("cannot install signal handlers")?;
        let t = s.clone();
        std::thread::Builder::new()
            .name("sluice-signals".into())
            .spawn(move || {
                for sig in signals.forever() {
                    if sig == SIGINT {
                        if t.stop.swap(true, Ordering::SeqCst) {
                            std::process::exit(130);
                        }
                    } else {
                        if t.terminate.swap(true, Ordering::SeqCst) || t.idle.load(Ordering::SeqCst)
                        {
                            std::process::exit(143);
                        }
                        t.stop.store(true, Ordering::SeqCst);
                    }
                }
            })
            .context("cannot start the signal thread")?;
        Ok(s)
    }

    /// SIGTERM or SIGHUP was received: end after what is being finished.
    pub fn terminating(&self) -> bool {
        self.terminate.load(Ordering::SeqCst)
    }

    /// Mark waiting for input (a SIGTERM then exits at once) or working.
    pub fn set_idle(&self, idle: bool) {
        self.idle.store(idle, Ordering::SeqCst);
        if idle && self.terminating() {
            std::process::exit(143);
        }
    }
}
