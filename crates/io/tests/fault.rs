//! Fault injection: the file is truncated after the engine opened it. Reads past the new
//! end must fail with an error naming file/offset/length, never return stale or zero bytes;
//! reads before it still succeed.

mod common;

use common::{cfg, TempFile};
use sluice_io::{open_engine, required_capacity, AlignedBuf, Backend, IoError, ReadReq, Segment};

fn truncated_after_open(backend: Backend, direct: bool) {
    let f = TempFile::new("trunc", 1 << 20, 77 + direct as u64);
    let e = open_engine(&f.path, &cfg(backend, direct)).expect("open engine");
    // Warm the engine once so the truncation really happens after reads started.
    let ok = Segment {
        offset: 1000,
        len: 5000,
    };
    let mk = |tag, segs: Vec<Segment>| ReadReq {
        tag,
        buf: AlignedBuf::new(required_capacity(&segs)),
        segments: segs,
    };
    e.submit(mk(0, vec![ok])).unwrap();
    assert!(e.wait_one().unwrap().result.is_ok());

    let new_len = 256 << 10;
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f.path)
        .unwrap()
        .set_len(new_len)
        .unwrap();

    let past = Segment {
        offset: 512 << 10,
        len: 4096,
    };
    let straddle = Segment {
        offset: new_len - 100,
        len: 200,
    };
    e.submit(mk(1, vec![past])).unwrap();
    e.submit(mk(2, vec![ok, straddle])).unwrap();
    e.submit(mk(3, vec![ok])).unwrap();
    let mut seen = 0;
    while let Some(d) = e.wait_one() {
        seen += 1;
        match d.tag {
            1 | 2 => {
                let s = if d.tag == 1 { past } else { straddle };
                let err = d.result.expect_err("read past the truncated end must fail");
                assert!(matches!(err, IoError::UnexpectedEof { .. }), "{err}");
                let msg = err.to_string();
                assert!(msg.contains(&f.path.display().to_string()), "{msg}");
                assert!(msg.contains(&s.offset.to_string()), "{msg}");
                assert!(msg.contains(&s.len.to_string()), "{msg}");
            }
            3 => {
                assert!(d.result.is_ok());
                let p = d.placed[0];
                assert_eq!(
                    &d.buf.as_slice()[p..p + ok.len],
                    &f.bytes[ok.offset as usize..ok.offset as usize + ok.len]
                );
            }
            t => panic!("unknown tag {t}"),
        }
    }
    assert_eq!(seen, 3);
    assert_eq!(e.stats().errors, 2);
}

#[test]
fn truncated_uring_direct() {
    truncated_after_open(Backend::Uring, true)
}
#[test]
fn truncated_uring_buffered() {
    truncated_after_open(Backend::Uring, false)
}
#[test]
fn truncated_pread_direct() {
    truncated_after_open(Backend::Pread, true)
}
#[test]
fn truncated_pread_buffered() {
    truncated_after_open(Backend::Pread, false)
}
#[test]
fn truncated_mmap() {
    truncated_after_open(Backend::Mmap, false)
}
