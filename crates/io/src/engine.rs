//! `open_engine`: picks a backend for a configuration and applies the documented
//! fallbacks (io_uring -> pread, O_DIRECT -> buffered), never silently. The types it
//! speaks are in `request.rs`.

use crate::request::{Backend, IoConfig, IoEngine, IoError};
use std::path::Path;

/// Open an engine on `path`. Uring falls back to pread with a one-time warning if the kernel
/// refuses io_uring; O_DIRECT falls back to buffered IO with a one-time warning and
/// `IoStats::direct_refused` set.
pub fn open_engine(path: &Path, cfg: &IoConfig) -> Result<Box<dyn IoEngine>, IoError> {
    if cfg.depth == 0 || cfg.threads == 0 {
        return Err(IoError::Config(format!(
            "depth ({}) and threads ({}) must be at least 1",
            cfg.depth, cfg.threads
        )));
    }
    match cfg.backend {
        Backend::Mmap => Ok(Box::new(crate::pool::PoolEngine::open_mmap(path, cfg)?)),
        Backend::Pread => Ok(Box::new(crate::pool::PoolEngine::open_pread(path, cfg)?)),
        Backend::Uring => match crate::uring::UringEngine::open(path, cfg) {
            Ok(e) => Ok(Box::new(e)),
            Err(crate::uring::UringOpenError::Refused(reason)) => {
                crate::fileio::warn_once(
                    &crate::fileio::WARNED_URING,
                    &format!("sluice-io: io_uring unavailable ({reason}); using the pread pool"),
                );
                let mut e = crate::pool::PoolEngine::open_pread(path, cfg)?;
                e.mark_uring_fallback();
                Ok(Box::new(e))
            }
            Err(crate::uring::UringOpenError::Io(e)) => Err(e),
        },
    }
}
