//! Page-cache tools on a real temp file: DONTNEED empties the cache for the range, reading
//! fills it, cachestat and mincore agree, and storage counters grow by at least the bytes
//! read from a dropped file. Also: WILLNEED hints from the engine fill the cache.

mod common;

use common::{cfg, TempFile};
use sluice_io::pagecache::{block_device_stat_path, residency_cachestat, residency_mincore};
use sluice_io::{
    block_device_read_bytes, drop_page_cache, open_engine, proc_self_io_read_bytes, residency,
    Backend,
};
use std::io::Read;
use std::time::{Duration, Instant};

const LEN: usize = (8 << 20) + 100;

fn pages(len: usize) -> u64 {
    len.div_ceil(4096) as u64
}

fn read_all(path: &std::path::Path) -> Vec<u8> {
    let mut v = Vec::new();
    std::fs::File::open(path)
        .unwrap()
        .read_to_end(&mut v)
        .unwrap();
    v
}

#[test]
fn drop_then_read_changes_residency() {
    let f = TempFile::new("pc", LEN, 1);
    let whole = 0..LEN as u64;
    drop_page_cache(&f.path, whole.clone()).expect("fadvise");
    let (res, total) = residency(&f.path, whole.clone()).unwrap();
    assert_eq!(total, pages(LEN));
    assert!(res <= 2, "after DONTNEED {res}/{total} pages resident");
    assert_eq!(read_all(&f.path), f.bytes);
    let (res, total) = residency(&f.path, whole.clone()).unwrap();
    assert_eq!(res, total, "after reading the whole file");
    // Half the file dropped: about half resident.
    drop_page_cache(&f.path, 0..(LEN / 2) as u64).unwrap();
    let (res, _) = residency(&f.path, whole).unwrap();
    let half = pages(LEN) / 2;
    assert!(res >= half - 2 && res <= half + 2, "{res} vs ~{half}");
}

#[test]
fn cachestat_and_mincore_agree() {
    let f = TempFile::new("agree", LEN, 2);
    let whole = 0..LEN as u64;
    drop_page_cache(&f.path, whole.clone()).unwrap();
    // Read a middle window only.
    let mut file = std::fs::File::open(&f.path).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    use std::io::{Seek, SeekFrom};
    file.seek(SeekFrom::Start(3 << 20)).unwrap();
    file.read_exact(&mut buf).unwrap();
    let m = residency_mincore(&f.path, whole.clone()).unwrap();
    match residency_cachestat(&f.path, whole.clone()) {
        Ok(c) => assert_eq!(c, m, "cachestat vs mincore"),
        Err(e) => eprintln!("note: cachestat unavailable ({e}); mincore only"),
    }
    assert!(m.0 >= 256, "the 1 MiB read window must be resident: {m:?}");
    // Readahead never goes backwards: the range before the window stays empty.
    let before = 0..(3 << 20) as u64;
    assert!(residency_mincore(&f.path, before).unwrap().0 <= 1);
}

#[test]
fn storage_counters_grow_by_bytes_read() {
    let f = TempFile::new("ctr", LEN, 3);
    drop_page_cache(&f.path, 0..LEN as u64).unwrap();
    let io0 = proc_self_io_read_bytes().expect("/proc/self/io");
    let dev0 = match block_device_stat_path(&f.path) {
        Ok(_) => Some(block_device_read_bytes(&f.path).unwrap()),
        Err(e) => {
            eprintln!("note: no block device for the temp dir ({e}); device counter skipped");
            None
        }
    };
    assert_eq!(read_all(&f.path), f.bytes);
    let io1 = proc_self_io_read_bytes().unwrap();
    assert!(io1 - io0 >= (LEN as u64) / 4096 * 4096, "{io0} -> {io1}");
    if let Some(d0) = dev0 {
        let d1 = block_device_read_bytes(&f.path).unwrap();
        assert!(d1 - d0 >= (LEN as u64) / 4096 * 4096, "{d0} -> {d1}");
    }
}

fn wait_until(mut cond: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(20) {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

#[test]
fn willneed_hint_fills_cache_off_thread() {
    let f = TempFile::new("hint", LEN, 4);
    let e = open_engine(&f.path, &cfg(Backend::Pread, false)).unwrap();
    drop_page_cache(&f.path, 0..LEN as u64).unwrap();
    e.set_hints(false);
    e.hint_willneed(0..LEN as u64);
    assert_eq!(e.stats().hints, 0, "switched off: no hint issued");
    e.set_hints(true);
    e.hint_willneed(0..(1 << 20));
    assert!(wait_until(|| e.stats().hints == 1), "hint never issued");
    assert!(
        wait_until(|| residency(&f.path, 0..(1 << 20)).unwrap().0 > 0),
        "WILLNEED did not bring any page in"
    );
}
