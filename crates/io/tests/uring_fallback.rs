//! io_uring refused (simulated with SLUICE_IO_DISABLE_URING, which takes the same path as an
//! ENOSYS/EPERM from io_uring_setup): the engine falls back to the pread pool, says so in
//! its name and stats, and still reads correctly. Own binary: it sets a process env var.

mod common;

use common::{cfg, TempFile};
use sluice_io::{open_engine, required_capacity, AlignedBuf, Backend, ReadReq, Segment};

#[test]
fn uring_refused_falls_back_to_pread() {
    std::env::set_var("SLUICE_IO_DISABLE_URING", "1");
    let f = TempFile::new("fallback", 50_000, 9);
    let e = open_engine(&f.path, &cfg(Backend::Uring, true)).expect("falls back, not fails");
    assert_eq!(e.name(), "pread");
    assert!(e.stats().uring_fallback);
    let segs = vec![Segment {
        offset: 333,
        len: 40_000,
    }];
    e.submit(ReadReq {
        tag: 1,
        buf: AlignedBuf::new(required_capacity(&segs)),
        segments: segs,
    })
    .unwrap();
    let d = e.wait_one().unwrap();
    assert!(d.result.is_ok());
    assert_eq!(
        &d.buf.as_slice()[d.placed[0]..d.placed[0] + 40_000],
        &f.bytes[333..40_333]
    );
}
