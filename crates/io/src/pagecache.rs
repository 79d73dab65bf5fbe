//! Page-cache tools for honest measurement: drop a file range from the page cache
//! (posix_fadvise DONTNEED), count resident pages (cachestat, or mincore on a temporary
//! map), and read true storage traffic (/proc/self/io, the block device's sector counters).

use crate::request::IoError;
use std::fs::File;
use std::ops::Range;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn sys(path: &Path, what: &'static str, source: std::io::Error) -> IoError {
    IoError::Sys {
        path: path.to_path_buf(),
        what,
        source,
    }
}

fn open(path: &Path) -> Result<File, IoError> {
    File::open(path).map_err(|source| IoError::Open {
        path: path.to_path_buf(),
        source,
    })
}

/// Page size of this machine.
pub fn page_size() -> u64 {
    // SAFETY: sysconf reads a constant.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 {
        n as u64
    } else {
        4096
    }
}

/// Drop the clean cached pages of `range` (end `u64::MAX` = to the end of the file) of an
/// open file. Dirty pages are not dropped: fsync first. Returns the time spent.
pub fn drop_page_cache_fd(fd: impl AsFd, range: Range<u64>) -> std::io::Result<Duration> {
    let t = Instant::now();
    let len = if range.end == u64::MAX {
        0
    } else {
        range.end.saturating_sub(range.start)
    };
    // SAFETY: posix_fadvise only reads its integer arguments.
    let rc = unsafe {
        libc::posix_fadvise(
            fd.as_fd().as_raw_fd(),
            range.start as libc::off_t,
            len as libc::off_t,
            libc::POSIX_FADV_DONTNEED,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::from_raw_os_error(rc));
    }
    Ok(t.elapsed())
}

/// [`drop_page_cache_fd`] by path.
pub fn drop_page_cache(path: &Path, range: Range<u64>) -> Result<Duration, IoError> {
    let f = open(path)?;
    drop_page_cache_fd(&f, range).map_err(|e| sys(path, "posix_fadvise(DONTNEED)", e))
}

/// Resident pages of `range` (clipped to the file): (resident, total). Uses the cachestat
/// syscall where the kernel has it (6.5+), else mincore over a temporary map.
pub fn residency(path: &Path, range: Range<u64>) -> Result<(u64, u64), IoError> {
    match residency_cachestat(path, range.clone()) {
        Ok(r) => Ok(r),
        Err(IoError::Sys { source, .. })
            if matches!(
                source.raw_os_error(),
                Some(libc::ENOSYS) | Some(libc::EPERM) | Some(libc::EOPNOTSUPP)
            ) =>
        {
            residency_mincore(path, range)
        }
        Err(e) => Err(e),
    }
}

/// Clip `range` to the file and align its start down to a page: (aligned start, end).
fn clip(f: &File, path: &Path, range: Range<u64>) -> Result<(u64, u64), IoError> {
    let len = f.metadata().map_err(|e| sys(path, "fstat", e))?.len();
    let end = range.end.min(len);
    let ps = page_size();
    let start = (range.start / ps * ps).min(end);
    Ok((start, end))
}

/// Residency via `cachestat` (syscall 451).
pub fn residency_cachestat(path: &Path, range: Range<u64>) -> Result<(u64, u64), IoError> {
    #[repr(C)]
    struct CachestatRange {
        off: u64,
        len: u64,
    }
    #[repr(C)]
    #[derive(Default)]
    struct Cachestat {
        nr_cache: u64,
        nr_dirty: u64,
        nr_writeback: u64,
        nr_evicted: u64,
        nr_recently_evicted: u64,
    }
    const SYS_CACHESTAT: libc::c_long = 451;
    let f = open(path)?;
    let (start, end) = clip(&f, path, range)?;
    let total = (end - start).div_ceil(page_size());
    if total == 0 {
        return Ok((0, 0));
    }
    let r = CachestatRange {
        off: start,
        len: end - start,
    };
    let mut cs = Cachestat::default();
    // SAFETY: both pointers refer to live, correctly laid out (#[repr(C)]) locals; the
    // kernel writes only `cs`.
    let rc = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            f.as_raw_fd(),
            &r as *const CachestatRange,
            &mut cs as *mut Cachestat,
            0u32,
        )
    };
    if rc != 0 {
        return Err(sys(path, "cachestat", std::io::Error::last_os_error()));
    }
    Ok((cs.nr_cache.min(total), total))
}

/// Residency via mincore over a temporary read-only map (never touches the pages).
pub fn residency_mincore(path: &Path, range: Range<u64>) -> Result<(u64, u64), IoError> {
    let f = open(path)?;
    let (start, end) = clip(&f, path, range)?;
    let len = (end - start) as usize;
    if len == 0 {
        return Ok((0, 0));
    }
    // SAFETY: a read-only private map used only as an address range for mincore; its bytes
    // are never read, so truncation by another process cannot fault here.
    let map = unsafe { memmap2::MmapOptions::new().offset(start).len(len).map(&f) }
        .map_err(|e| sys(path, "mmap", e))?;
    let pages = len.div_ceil(page_size() as usize);
    let mut vec = vec![0u8; pages];
    // SAFETY: start is page-aligned so the map starts on a page; `vec` has one byte per page
    // of the `len`-byte mapping, as mincore requires.
    let rc = unsafe { libc::mincore(map.as_ptr() as *mut libc::c_void, len, vec.as_mut_ptr()) };
    if rc != 0 {
        return Err(sys(path, "mincore", std::io::Error::last_os_error()));
    }
    let resident = vec.iter().filter(|&&b| b & 1 != 0).count() as u64;
    Ok((resident, pages as u64))
}

/// Bytes this process caused to be fetched from storage (`read_bytes` in /proc/self/io).
pub fn proc_self_io_read_bytes() -> Result<u64, IoError> {
    let p = Path::new("/proc/self/io");
    let text = std::fs::read_to_string(p).map_err(|e| sys(p, "read", e))?;
    text.lines()
        .find_map(|l| l.strip_prefix("read_bytes:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| {
            sys(
                p,
                "parse",
                std::io::Error::new(std::io::ErrorKind::InvalidData, "no read_bytes line"),
            )
        })
}

/// The sysfs stat file of the block device holding `path` (a partition has its own).
pub fn block_device_stat_path(path: &Path) -> Result<PathBuf, IoError> {
    let md = std::fs::metadata(path).map_err(|e| sys(path, "stat", e))?;
    let dev = md.dev();
    let (maj, min) = (libc::major(dev), libc::minor(dev));
    let stat = PathBuf::from(format!("/sys/dev/block/{maj}:{min}/stat"));
    if !stat.exists() {
        return Err(sys(
            path,
            "find block device",
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("device {maj}:{min} has no {}", stat.display()),
            ),
        ));
    }
    Ok(stat)
}

/// Bytes read so far by the block device holding `path` (sectors read x 512), device-wide.
pub fn block_device_read_bytes(path: &Path) -> Result<u64, IoError> {
    let stat = block_device_stat_path(path)?;
    let text = std::fs::read_to_string(&stat).map_err(|e| sys(&stat, "read", e))?;
    text.split_whitespace()
        .nth(2)
        .and_then(|v| v.parse::<u64>().ok())
        .map(|sectors| sectors * 512)
        .ok_or_else(|| {
            sys(
                &stat,
                "parse",
                std::io::Error::new(std::io::ErrorKind::InvalidData, "no sectors-read field"),
            )
        })
}
