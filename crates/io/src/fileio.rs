//! Low-level file helpers shared by the backends: opening with O_DIRECT (and the reported
//! fallback to buffered IO), the positional read loop with short-read / EINTR handling,
//! best-effort IO priority, and one-time warnings.

use crate::aligned::{AlignedBuf, ALIGN};
use crate::request::{IoError, Segment};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

pub(crate) static WARNED_URING: AtomicBool = AtomicBool::new(false);
pub(crate) static WARNED_DIRECT: AtomicBool = AtomicBool::new(false);

/// Print `msg` to stderr the first time only (per flag, per process).
pub(crate) fn warn_once(flag: &AtomicBool, msg: &str) {
    if !flag.swap(true, Ordering::Relaxed) {
        eprintln!("{msg}");
    }
}

/// An opened model file and whether O_DIRECT is in effect.
pub(crate) struct Opened {
    pub file: File,
    pub direct: bool,
    pub direct_refused: bool,
    pub len: u64,
}

fn open_plain(path: &Path, flags: i32) -> std::io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(flags)
        .open(path)
}

/// Open `path` read-only, with O_DIRECT if `direct`. If the file system refuses O_DIRECT
/// (EINVAL at open, or at a probe read of the first block), reopen buffered, warn once and
/// set `direct_refused`.
pub(crate) fn open_file(path: &Path, direct: bool) -> Result<Opened, IoError> {
    let open_err = |source| IoError::Open {
        path: path.to_path_buf(),
        source,
    };
    let buffered = || -> Result<Opened, IoError> {
        let file = open_plain(path, libc::O_CLOEXEC).map_err(open_err)?;
        let len = file_len(&file, path)?;
        Ok(Opened {
            file,
            direct: false,
            direct_refused: false,
            len,
        })
    };
    if !direct {
        return buffered();
    }
    let refused = |why: &str| -> Result<Opened, IoError> {
        warn_once(
            &WARNED_DIRECT,
            &format!(
                "sluice-io: {}: O_DIRECT refused ({why}); reading through the page cache",
                path.display()
            ),
        );
        let mut o = buffered()?;
        o.direct_refused = true;
        Ok(o)
    };
    let file = match open_plain(path, libc::O_CLOEXEC | libc::O_DIRECT) {
        Ok(f) => f,
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => return refused(&e.to_string()),
        Err(e) => return Err(open_err(e)),
    };
    let len = file_len(&file, path)?;
    if len > 0 {
        // Some file systems accept the flag at open and fail every read: probe one block.
        let mut probe = AlignedBuf::new(ALIGN);
        if let Err(e) = pread_once(&file, probe.as_mut_slice(), 0) {
            if e.raw_os_error() == Some(libc::EINVAL) {
                return refused(&format!("probe read: {e}"));
            }
        }
    }
    Ok(Opened {
        file,
        direct: true,
        direct_refused: false,
        len,
    })
}

pub(crate) fn file_len(file: &File, path: &Path) -> Result<u64, IoError> {
    file.metadata()
        .map(|m| m.len())
        .map_err(|source| IoError::Sys {
            path: path.to_path_buf(),
            what: "fstat",
            source,
        })
}

/// One pread, EINTR/EAGAIN retried.
fn pread_once(file: &File, dst: &mut [u8], offset: u64) -> std::io::Result<usize> {
    loop {
        // SAFETY: dst is a valid writable slice of dst.len() bytes for the duration of the call.
        let n = unsafe {
            libc::pread(
                file.as_raw_fd(),
                dst.as_mut_ptr().cast(),
                dst.len(),
                offset as libc::off_t,
            )
        };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) | Some(libc::EAGAIN) => continue,
            _ => return Err(e),
        }
    }
}

/// Where the next read of an aligned span resumes after `done` bytes arrived. With O_DIRECT
/// the position must stay block-aligned, so a partial block is read again.
pub(crate) fn resume_pos(done: usize, direct: bool) -> usize {
    if direct {
        done / ALIGN * ALIGN
    } else {
        done
    }
}

/// Read segment `seg`'s aligned span (`file_start`, `span`) into `dst` (exactly `span`
/// bytes long). Continues after short reads until the segment's bytes are all in; EOF
/// before that is an error. Returns bytes transferred (including re-reads and overhead).
pub(crate) fn read_span(
    file: &File,
    path: &Path,
    seg: &Segment,
    file_start: u64,
    dst: &mut [u8],
    direct: bool,
) -> Result<u64, IoError> {
    let needed = (seg.offset + seg.len as u64 - file_start) as usize;
    let mut done = 0usize;
    let mut transferred = 0u64;
    while done < needed {
        let pos = resume_pos(done, direct);
        let n = pread_once(file, &mut dst[pos..], file_start + pos as u64).map_err(|source| {
            IoError::Read {
                path: path.to_path_buf(),
                offset: seg.offset,
                len: seg.len,
                source,
            }
        })?;
        transferred += n as u64;
        if pos + n <= done {
            return Err(IoError::UnexpectedEof {
                path: path.to_path_buf(),
                offset: seg.offset,
                len: seg.len,
                file_end: file_start + (pos + n) as u64,
            });
        }
        done = pos + n;
    }
    Ok(transferred)
}

/// Best-effort: IO priority best-effort class, level 0 (highest) for the calling thread.
/// Failures are ignored on purpose (priority is an optimisation, never a requirement).
pub(crate) fn set_high_io_priority() {
    const IOPRIO_WHO_PROCESS: libc::c_long = 1;
    const IOPRIO_CLASS_BE: libc::c_long = 2;
    // SAFETY: gettid and ioprio_set take plain integers and touch no memory of ours.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid);
        let _ = libc::syscall(
            libc::SYS_ioprio_set,
            IOPRIO_WHO_PROCESS,
            tid,
            IOPRIO_CLASS_BE << 13,
        );
    }
}
