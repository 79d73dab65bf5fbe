//! Moving part of a file map into anonymous memory: the syscalls behind
//! [`crate::MappedFile::copy_into_ram`].
//!
//! Why: a decode reads every resident weight once per token, and through a file map those
//! reads walk 4 KiB page-cache pages (this kernel has no read-only THP for file systems),
//! so each row kernel crosses a page boundary every few rows and the TLB holds a fraction
//! of a layer. The same bytes in anonymous memory advised `MADV_HUGEPAGE` sit in 2 MiB
//! pages: 12-layer 30B-shape synth, `sluice bench -t 2 -p 0 -n 32` on an AMD EPYC (Zen 3),
//! alternated rounds, tg32 medians 42.5 -> 53.4 (Q4_K) and 20.2 -> 24.1 (Q8_0); Gemma 3
//! 270M Q4_K_M tg64 55.3 -> 61.0.
//!
//! How, without ever exposing a half-copied range: the bytes are read into a fresh
//! anonymous mapping first (placed at the same offset modulo 2 MiB as the target, so its
//! huge pages survive the move), made read-only, then `mremap(MREMAP_FIXED)` moves it over
//! the file-backed pages in one call. Any failure before the move leaves the file map as it
//! was.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

/// The huge-page size the placement keeps alignment for (x86-64 and aarch64 with 4 KiB
/// base pages).
const HUGE: usize = 2 << 20;

/// Replace `len` bytes of the mapping at `addr` (page-aligned, inside a live private
/// mapping of `file` whose byte `offset` is at `addr`) with anonymous read-only memory
/// holding the same bytes, advised for transparent huge pages.
///
/// # Safety
/// `addr..addr + len` must lie inside a mapping owned by the caller, and no reference to
/// those bytes may be live across the call (the pages are swapped underneath). The bytes
/// read afterwards are the file's, as before, unless the file changed since it was mapped.
pub(crate) unsafe fn replace_with_anonymous_copy(
    file: &File,
    addr: usize,
    len: usize,
    offset: u64,
) -> io::Result<()> {
    // A staging mapping with room to place the copy at `addr`'s offset within a huge page.
    let staging_len = len + HUGE;
    // SAFETY: a new anonymous private mapping at an address the kernel picks; nothing
    // existing is touched. Checked for failure below.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            staging_len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    let base = raw as usize;
    let shift = (addr % HUGE + HUGE - base % HUGE) % HUGE;
    let copy = base + shift;
    let result = (|| {
        // SAFETY: `copy..copy + len` lies inside the staging mapping made above.
        // MADV_HUGEPAGE only asks for huge pages; a kernel without THP refuses it
        // (EINVAL), which costs speed, not correctness, so that error is ignored.
        unsafe { libc::madvise(copy as *mut libc::c_void, len, libc::MADV_HUGEPAGE) };
        // SAFETY: the staging mapping is writable, private to this function and `len`
        // bytes long from `copy`; no other reference to it exists.
        let dst = unsafe { std::slice::from_raw_parts_mut(copy as *mut u8, len) };
        file.read_exact_at(dst, offset)?;
        // SAFETY: same range as above, inside the staging mapping.
        if unsafe { libc::mprotect(copy as *mut libc::c_void, len, libc::PROT_READ) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: moves the staging pages onto `addr..addr + len`, which the caller
        // guarantees is its own mapping with no live references; MREMAP_FIXED replaces
        // whatever is mapped there in the same call.
        let moved = unsafe {
            libc::mremap(
                copy as *mut libc::c_void,
                len,
                len,
                libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                addr as *mut libc::c_void,
            )
        };
        if moved == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    })();
    // The staging slack before and after the moved range (all of it on failure).
    let unmap = |start: usize, end: usize| {
        if end > start {
            // SAFETY: `start..end` lies inside the staging mapping and holds no moved pages
            // (after a successful move that range is already unmapped, which munmap
            // accepts).
            unsafe { libc::munmap(start as *mut libc::c_void, end - start) };
        }
    };
    match result {
        Ok(()) => {
            unmap(base, copy);
            unmap(copy + len, base + staging_len);
        }
        Err(_) => unmap(base, base + staging_len),
    }
    result
}
