//! Contract tests for every IO backend x O_DIRECT on/off: random segments land at the
//! placed offsets with exactly the file's bytes, completions in any order, reads at the file
//! end, errors naming file/offset/length, buffers always returned, stats reconcile.

mod common;

use common::{cfg, is_tmpfs, Rng, TempFile};
use sluice_io::{
    open_engine, required_capacity, AlignedBuf, Backend, IoEngine, IoError, ReadDone, ReadReq,
    Segment,
};
use std::collections::HashMap;

const FILE_LEN: usize = (24 << 20) + 1237; // unaligned end
const MAX_SEG: usize = 3 << 20;

fn random_segment(r: &mut Rng, file_len: usize) -> Segment {
    let len = match r.below(4) {
        0 => 1 + r.below(64) as usize,
        1 => 1 + r.below(8192) as usize,
        _ => 1 + r.below(MAX_SEG as u64) as usize,
    };
    let offset = r.below((file_len - len + 1) as u64);
    Segment { offset, len }
}

/// One request's segments: 1 to 3 random ones within the test file.
fn random_segments(r: &mut Rng) -> Vec<Segment> {
    let n = 1 + r.below(3) as usize;
    (0..n).map(|_| random_segment(r, FILE_LEN)).collect()
}

fn req(tag: u64, segments: Vec<Segment>) -> ReadReq {
    let buf = AlignedBuf::new(required_capacity(&segments));
    ReadReq { tag, segments, buf }
}

fn check_done(done: &ReadDone, segs: &[Segment], bytes: &[u8]) {
    if let Err(e) = &done.result {
        panic!("request {} failed: {e}", done.tag);
    }
    assert_eq!(done.placed.len(), segs.len());
    for (i, s) in segs.iter().enumerate() {
        let p = done.placed[i];
        let got = &done.buf.as_slice()[p..p + s.len];
        let want = &bytes[s.offset as usize..s.offset as usize + s.len];
        assert!(
            got == want,
            "tag {} segment {i} ({s:?}) placed at {p}: wrong bytes",
            done.tag
        );
    }
}

fn expect_direct(e: &dyn IoEngine, backend: Backend, direct: bool, dir_is_tmpfs: bool) {
    let st = e.stats();
    let asked = direct && backend != Backend::Mmap;
    if asked && dir_is_tmpfs {
        assert!(
            st.direct_refused && !st.direct,
            "tmpfs must refuse O_DIRECT: {st:?}"
        );
    } else {
        assert!(!st.direct_refused, "{st:?}");
        assert_eq!(st.direct, asked, "{st:?}");
    }
}

/// Many requests in flight (a sliding window), completions consumed in whatever order they
/// come, via both wait_one and try_complete.
fn random_reads(backend: Backend, direct: bool) {
    let f = TempFile::new("rand", FILE_LEN, 0x5eed ^ direct as u64);
    let tmpfs = is_tmpfs(&std::env::temp_dir());
    let e = open_engine(&f.path, &cfg(backend, direct)).expect("open engine");
    expect_direct(e.as_ref(), backend, direct, tmpfs);
    assert!(e.wait_one().is_none() && e.try_complete().is_none());
    let mut r = Rng(42);
    let mut outstanding: HashMap<u64, Vec<Segment>> = HashMap::new();
    let (mut want_bytes, mut want_tasks, mut n_req) = (0u64, 0u64, 0u64);
    let mut completed = 0;
    let total = 120u64;
    for tag in 0..total {
        let segs = random_segments(&mut r);
        want_bytes += segs.iter().map(|s| s.len as u64).sum::<u64>();
        want_tasks += segs.len() as u64;
        n_req += 1;
        outstanding.insert(tag, segs.clone());
        e.submit(req(tag, segs)).expect("submit");
        while let Some(d) = e.try_complete() {
            check_done(
                &d,
                &outstanding.remove(&d.tag).expect("known tag"),
                &f.bytes,
            );
            completed += 1;
        }
        if outstanding.len() >= 24 {
            let d = e.wait_one().expect("in flight");
            check_done(
                &d,
                &outstanding.remove(&d.tag).expect("known tag"),
                &f.bytes,
            );
            completed += 1;
        }
    }
    while let Some(d) = e.wait_one() {
        check_done(
            &d,
            &outstanding.remove(&d.tag).expect("known tag"),
            &f.bytes,
        );
        completed += 1;
    }
    assert!(outstanding.is_empty());
    assert_eq!(completed, total);
    let st = e.stats();
    assert_eq!(st.dispatches, n_req);
    assert_eq!(st.tasks, want_tasks);
    assert_eq!(st.bytes_requested, want_bytes);
    assert!(st.bytes_read >= want_bytes, "{st:?}");
    assert_eq!(st.errors, 0);
    assert!(st.busy_ns > 0 && st.busy_ns <= st.wall_ns, "{st:?}");
    assert!(st.sum_task_ns >= st.busy_ns, "{st:?}");
}

/// Segments touching the unaligned end of the file, and one request spanning everything.
fn file_end(backend: Backend, direct: bool) {
    let f = TempFile::new("end", FILE_LEN, 7 + direct as u64);
    let e = open_engine(&f.path, &cfg(backend, direct)).expect("open engine");
    let n = FILE_LEN as u64;
    let cases: Vec<Vec<Segment>> = vec![
        vec![Segment {
            offset: n - 1,
            len: 1,
        }],
        vec![Segment {
            offset: n - 5000,
            len: 5000,
        }],
        vec![
            Segment {
                offset: n - 1237,
                len: 1237,
            },
            Segment { offset: 0, len: 1 },
            Segment {
                offset: n - 4097,
                len: 4097,
            },
        ],
        vec![Segment {
            offset: 0,
            len: FILE_LEN,
        }],
        vec![],
        vec![Segment { offset: 77, len: 0 }],
    ];
    for (tag, segs) in cases.iter().enumerate() {
        e.submit(req(tag as u64, segs.clone())).expect("submit");
    }
    let mut seen = 0;
    while let Some(d) = e.wait_one() {
        check_done(&d, &cases[d.tag as usize], &f.bytes);
        seen += 1;
    }
    assert_eq!(seen, cases.len());
}

fn assert_names(err: &IoError, path: &std::path::Path, offset: u64, len: usize) {
    let msg = err.to_string();
    assert!(msg.contains(&path.display().to_string()), "{msg}");
    assert!(msg.contains(&offset.to_string()), "{msg}");
    assert!(msg.contains(&len.to_string()), "{msg}");
}

/// Errors: beyond EOF (straddling and fully past), buffer too small. The buffer always
/// comes back, and a good segment in the same batch still reads correctly.
fn errors(backend: Backend, direct: bool) {
    let f = TempFile::new("err", 100_000, 11 + direct as u64);
    let e = open_engine(&f.path, &cfg(backend, direct)).expect("open engine");
    let straddle = Segment {
        offset: 99_990,
        len: 20,
    };
    let past = Segment {
        offset: 200_000,
        len: 4096,
    };
    e.submit(req(1, vec![straddle])).unwrap();
    e.submit(req(
        2,
        vec![
            Segment {
                offset: 10,
                len: 10,
            },
            past,
        ],
    ))
    .unwrap();
    let small = ReadReq {
        tag: 3,
        segments: vec![Segment {
            offset: 4000,
            len: 200,
        }],
        buf: AlignedBuf::new(4096),
    };
    e.submit(small).unwrap();
    e.submit(req(
        4,
        vec![Segment {
            offset: 12_345,
            len: 50_000,
        }],
    ))
    .unwrap();
    let mut seen = 0;
    while let Some(d) = e.wait_one() {
        seen += 1;
        match d.tag {
            1 => {
                let err = d.result.as_ref().expect_err("straddles EOF");
                assert!(matches!(err, IoError::UnexpectedEof { .. }), "{err}");
                assert_names(err, &f.path, straddle.offset, straddle.len);
                assert_eq!(d.buf.capacity(), 4096);
            }
            2 => {
                let err = d.result.as_ref().expect_err("past EOF");
                assert!(matches!(err, IoError::UnexpectedEof { .. }), "{err}");
                assert_names(err, &f.path, past.offset, past.len);
            }
            3 => {
                let err = d.result.as_ref().expect_err("buffer too small");
                assert!(
                    matches!(
                        err,
                        IoError::BufferTooSmall {
                            needed: 8192,
                            capacity: 4096,
                            ..
                        }
                    ),
                    "{err}"
                );
                assert_eq!(d.buf.capacity(), 4096);
            }
            4 => check_done(
                &d,
                &[Segment {
                    offset: 12_345,
                    len: 50_000,
                }],
                &f.bytes,
            ),
            t => panic!("unknown tag {t}"),
        }
    }
    assert_eq!(seen, 4);
    let st = e.stats();
    assert_eq!(st.errors, 3);
    assert_eq!(st.dispatches, 4);
}

/// Dropping the engine with reads in flight neither hangs nor touches freed buffers.
fn drop_in_flight(backend: Backend, direct: bool) {
    let f = TempFile::new("drop", 8 << 20, 99);
    let e = open_engine(&f.path, &cfg(backend, direct)).expect("open engine");
    for tag in 0..40 {
        e.submit(req(
            tag,
            vec![Segment {
                offset: tag * 100_000,
                len: 1 << 20,
            }],
        ))
        .unwrap();
    }
    let d = e.wait_one().expect("one completes");
    assert!(d.result.is_ok());
    drop(e);
}

/// tmpfs: before Linux 6.6 it refused O_DIRECT (fallback, reported), since then it accepts
/// it. Either way the flags must say which happened and the bytes must be right.
fn tmpfs_reads(backend: Backend) {
    let shm = std::path::Path::new("/dev/shm");
    if !shm.is_dir() || !is_tmpfs(shm) {
        eprintln!("note: /dev/shm is not tmpfs here; tmpfs test skipped");
        return;
    }
    let f = TempFile::new_in(shm, "tmpfs", 300_000, 5);
    let e = open_engine(&f.path, &cfg(backend, true)).expect("open engine");
    let st = e.stats();
    if backend == Backend::Mmap {
        assert!(!st.direct && !st.direct_refused);
    } else {
        assert!(st.direct != st.direct_refused, "{st:?}");
    }
    let segs = vec![Segment {
        offset: 1234,
        len: 250_000,
    }];
    e.submit(req(0, segs.clone())).unwrap();
    check_done(&e.wait_one().unwrap(), &segs, &f.bytes);
}

/// A file whose file system refuses O_DIRECT at open (procfs): the engine must fall back to
/// buffered reads, set `direct_refused`, and still read the right bytes (oracle: std::fs).
fn direct_refused(backend: Backend) {
    let p = std::path::Path::new("/proc/version");
    let want = std::fs::read(p).expect("read /proc/version");
    let e = open_engine(p, &cfg(backend, true)).expect("open engine");
    let st = e.stats();
    assert!(st.direct_refused && !st.direct, "{st:?}");
    let segs = vec![Segment {
        offset: 0,
        len: want.len().min(16),
    }];
    e.submit(req(0, segs.clone())).unwrap();
    check_done(&e.wait_one().unwrap(), &segs, &want);
}

macro_rules! contract {
    ($($name:ident: $backend:expr, $direct:expr;)*) => {$(
        mod $name {
            use super::*;
            #[test] fn random_reads() { super::random_reads($backend, $direct) }
            #[test] fn file_end() { super::file_end($backend, $direct) }
            #[test] fn errors() { super::errors($backend, $direct) }
            #[test] fn drop_in_flight() { super::drop_in_flight($backend, $direct) }
        }
    )*};
}

contract! {
    uring_direct: Backend::Uring, true;
    uring_buffered: Backend::Uring, false;
    pread_direct: Backend::Pread, true;
    pread_buffered: Backend::Pread, false;
    mmap_direct_flag: Backend::Mmap, true;
    mmap_buffered: Backend::Mmap, false;
}

/// `inflight_bytes` caps the bytes io_uring has in the kernel at once: with a 1-byte cap,
/// one read at a time (segments far larger than the cap still go, alone), so the reads never
/// overlap (their summed durations equal the busy time exactly) and every byte still lands.
/// With a 256 KiB cap, reads of any size mixed: the bytes are right.
#[test]
fn uring_inflight_cap() {
    for direct in [true, false] {
        let f = TempFile::new("cap", FILE_LEN, 0xcafe ^ direct as u64);
        for cap in [1usize, 256 << 10] {
            let mut c = cfg(Backend::Uring, direct);
            c.inflight_bytes = cap;
            let e = open_engine(&f.path, &c).expect("open engine");
            let mut r = Rng(7 + cap as u64);
            let mut outstanding: HashMap<u64, Vec<Segment>> = HashMap::new();
            for tag in 0..40 {
                let segs = random_segments(&mut r);
                outstanding.insert(tag, segs.clone());
                e.submit(req(tag, segs)).expect("submit");
            }
            while let Some(d) = e.wait_one() {
                check_done(
                    &d,
                    &outstanding.remove(&d.tag).expect("known tag"),
                    &f.bytes,
                );
            }
            assert!(outstanding.is_empty());
            let st = e.stats();
            assert_eq!(st.errors, 0);
            if cap == 1 {
                assert_eq!(
                    st.sum_task_ns, st.busy_ns,
                    "direct={direct}: reads overlapped under a 1-byte cap: {st:?}"
                );
            }
        }
    }
}

#[test]
fn tmpfs_uring() {
    tmpfs_reads(Backend::Uring)
}
#[test]
fn tmpfs_pread() {
    tmpfs_reads(Backend::Pread)
}
#[test]
fn tmpfs_mmap() {
    tmpfs_reads(Backend::Mmap)
}
#[test]
fn direct_refused_uring() {
    direct_refused(Backend::Uring)
}
#[test]
fn direct_refused_pread() {
    direct_refused(Backend::Pread)
}

#[test]
fn uring_is_really_uring_here() {
    // If the kernel allows io_uring the engine must not silently fall back.
    let f = TempFile::new("name", 8192, 3);
    let e = open_engine(&f.path, &cfg(Backend::Uring, true)).unwrap();
    let st = e.stats();
    assert_eq!(e.name() == "pread", st.uring_fallback);
    if st.uring_fallback {
        eprintln!("note: io_uring refused on this kernel; pread fallback was used");
    }
}

#[test]
fn bad_config_and_missing_file() {
    let mut c = cfg(Backend::Pread, true);
    c.threads = 0;
    assert!(matches!(
        open_engine(std::path::Path::new("/nonexistent"), &c),
        Err(IoError::Config(_))
    ));
    let c = cfg(Backend::Uring, true);
    let p = std::path::Path::new("/nonexistent/sluice-io-no-such-file");
    match open_engine(p, &c) {
        Err(e @ IoError::Open { .. }) => assert!(e.to_string().contains(&p.display().to_string())),
        Err(e) => panic!("wrong error {e}"),
        Ok(_) => panic!("opened a missing file"),
    }
}
