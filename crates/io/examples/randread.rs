//! Random-read throughput of one IO backend on a big file (compare with fio).
//!
//! cargo run --release -p sluice-io --example randread -- FILE [--backend uring|pread|mmap]
//!   [--size 4M] [--depth 16] [--threads 8] [--segments 1] [--buffered] [--unaligned]
//!   [--total 2G] [--no-drop] [--seed N]
//!
//! Keeps `depth` requests in flight; each request reads `segments` pieces of `size`/segments
//! bytes at random offsets (4 KiB aligned unless --unaligned). Drops the file's pages from
//! the page cache first (posix_fadvise DONTNEED) and reports residency, /proc/self/io and
//! block-device reads so page-cache hits cannot pass for SSD bandwidth.

use sluice_io::pagecache::block_device_read_bytes;
use sluice_io::{
    drop_page_cache, open_engine, proc_self_io_read_bytes, required_capacity, residency,
    AlignedBuf, Backend, IoConfig, ReadReq, Segment,
};
use std::path::PathBuf;
use std::time::Instant;

fn parse_size(s: &str) -> usize {
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1usize << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>()
        .expect("size: a number with optional K/M/G")
        * mul
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mut file: Option<PathBuf> = None;
    let mut cfg = IoConfig::default();
    let (mut size, mut depth, mut segments) = (4usize << 20, 16usize, 1usize);
    let (mut total, mut unaligned, mut drop, mut seed) = (2usize << 30, false, true, 1u64);
    while let Some(a) = args.next() {
        let mut val = || args.next().expect("missing value");
        match a.as_str() {
            "--backend" => cfg.backend = val().parse::<Backend>().expect("backend"),
            "--size" => size = parse_size(&val()),
            "--depth" => depth = val().parse().expect("depth"),
            "--threads" => cfg.threads = val().parse().expect("threads"),
            "--segments" => segments = val().parse().expect("segments"),
            "--total" => total = parse_size(&val()),
            "--buffered" => cfg.direct = false,
            "--unaligned" => unaligned = true,
            "--no-drop" => drop = false,
            "--low-priority" => cfg.high_priority = false,
            "--seed" => seed = val().parse().expect("seed"),
            f if !f.starts_with("--") => file = Some(PathBuf::from(f)),
            other => panic!("unknown argument {other}"),
        }
    }
    cfg.depth = depth;
    let path = file.expect("usage: randread FILE [options]");
    let file_len = std::fs::metadata(&path).expect("stat FILE").len();
    let seg_len = size / segments;
    assert!(seg_len > 0 && (seg_len as u64) < file_len, "size vs file");

    if drop {
        let t = drop_page_cache(&path, 0..file_len).expect("drop page cache");
        println!("dropped page cache in {:.1} ms", t.as_secs_f64() * 1e3);
    }
    let (r0, pages) = residency(&path, 0..file_len).expect("residency");
    let io0 = proc_self_io_read_bytes().unwrap_or(0);
    let dev0 = block_device_read_bytes(&path).ok();

    let engine = open_engine(&path, &cfg).expect("open engine");
    let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut make_segments = || -> Vec<Segment> {
        (0..segments)
            .map(|_| {
                let span = file_len - seg_len as u64;
                let mut off = next() % span;
                if !unaligned {
                    off &= !4095;
                }
                Segment {
                    offset: off,
                    len: seg_len,
                }
            })
            .collect()
    };
    let n_req = total.div_ceil(size);
    let t = Instant::now();
    let (mut submitted, mut done) = (0usize, 0usize);
    for tag in 0..depth.min(n_req) {
        let segs = make_segments();
        let buf = AlignedBuf::new(required_capacity(&segs) + 4096 * segments);
        engine
            .submit(ReadReq {
                tag: tag as u64,
                segments: segs,
                buf,
            })
            .expect("submit");
        submitted += 1;
    }
    while let Some(d) = engine.wait_one() {
        if let Err(e) = &d.result {
            panic!("read failed: {e}");
        }
        done += 1;
        if submitted < n_req {
            engine
                .submit(ReadReq {
                    tag: submitted as u64,
                    segments: make_segments(),
                    buf: d.buf,
                })
                .expect("submit");
            submitted += 1;
        }
    }
    let wall = t.elapsed().as_secs_f64();
    let st = engine.stats();
    let (r1, _) = residency(&path, 0..file_len).expect("residency");
    let io1 = proc_self_io_read_bytes().unwrap_or(0);
    println!(
        "backend {} (asked {}) size {} x{} segs depth {} threads {} direct {} -> {} requests",
        engine.name(),
        cfg.backend,
        size,
        segments,
        depth,
        cfg.threads,
        st.direct,
        done
    );
    println!(
        "wall {:.2} s  requested {:.2} GB/s  (bytes_read/wall {:.2} GB/s)",
        wall,
        st.bytes_requested as f64 / wall / 1e9,
        st.bytes_read as f64 / wall / 1e9
    );
    println!("stats: {st}");
    println!(
        "page cache: resident {r0}/{pages} pages before, {r1}/{pages} after; \
         /proc/self/io read_bytes +{:.2} GB",
        (io1 - io0) as f64 / 1e9
    );
    if let (Some(d0), Ok(d1)) = (dev0, block_device_read_bytes(&path)) {
        println!(
            "block device read +{:.2} GB (device-wide)",
            (d1 - d0) as f64 / 1e9
        );
    }
    if drop {
        drop_page_cache(&path, 0..file_len).ok();
    }
}
