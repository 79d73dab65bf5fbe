//! matvec throughput in weight bytes per CPU-second of this process (1 rayon thread), for a
//! machine shared with other jobs, where criterion's wall-clock numbers mostly measure the
//! other jobs. CPU time comes from `/proc/self/task/*/schedstat` (ns, Linux only); each
//! figure is the best of 7 runs of 20 matvecs. Also a 256 MiB read loop for reference.
//!
//! Run: `cargo run -p sluice-kernels --release --example matvec_cpu_time [FORMAT_FILTER]`
//! (`-- --matmul [FILTER]`: matmul of 32 tokens at 4096x2048 on each tier instead;
//! `-- --stream [FILTER]`: single-token matvecs over 256 MiB of expert-shaped 768x2048
//! matrices, one after another, so the weights come from DRAM as in a MoE decode, on each
//! tier; then the same with 8 tokens per matrix, as a prefill's experts see them).

use sluice_kernels::{matmul_with, matvec_with, GgmlType, Isa};
use std::hint::black_box;

/// CPU time of every thread of this process so far, in ns.
fn cpu_ns() -> u64 {
    let mut t = 0;
    for e in std::fs::read_dir("/proc/self/task").expect("Linux /proc") {
        let p = e.expect("task entry").path().join("schedstat");
        if let Ok(s) = std::fs::read_to_string(p) {
            t += s
                .split_whitespace()
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    t
}

/// Offsets of the f16 block scales of `ty` (all set to 0.01; MXFP4's E8M0 byte to 2^-8).
fn scale_offsets(ty: GgmlType) -> &'static [usize] {
    use GgmlType::*;
    match ty {
        Q8_0 | Q5_0 | Q4_0 | IQ4_NL | IQ4_XS => &[0],
        Q4_1 | Q5_1 | Q4_K | Q5_K => &[0, 2],
        Q2_K => &[80, 82],
        Q3_K => &[108],
        Q6_K => &[208],
        TQ1_0 => &[52],
        TQ2_0 => &[64],
        _ => &[],
    }
}

fn weights(ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let rb = ty.row_bytes(cols as u64).unwrap() as usize;
    let mut s = 0x1234_5678_9abc_def0u64;
    let mut w: Vec<u8> = (0..rows * rb)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s as u8
        })
        .collect();
    let h = half::f16::from_f32(0.01).to_bits().to_le_bytes();
    for b in w.chunks_exact_mut(ty.type_size() as usize) {
        if ty == GgmlType::MXFP4 {
            b[0] = 120;
        }
        for &o in scale_offsets(ty) {
            b[o..o + 2].copy_from_slice(&h);
        }
    }
    w
}

/// Best CPU time (ns) of one call of `f`, over 7 runs of `iters` calls on `pool`'s thread.
fn best_ns(pool: &rayon::ThreadPool, iters: usize, mut f: impl FnMut() + Send) -> f64 {
    let mut best = f64::MAX;
    for rep in 0..8 {
        let c0 = cpu_ns();
        // The whole loop on the pool's one thread: no hand-offs between calls.
        pool.install(|| {
            for _ in 0..iters {
                f();
            }
        });
        let dt = (cpu_ns() - c0) as f64 / iters as f64;
        if rep > 0 {
            best = best.min(dt);
        }
    }
    best
}

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let matmul = args.first().map(String::as_str) == Some("--matmul");
    if matmul {
        args.remove(0);
    }
    let stream = args.first().map(String::as_str) == Some("--stream");
    if stream {
        args.remove(0);
    }
    let filter = args.first().cloned().unwrap_or_default();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    use GgmlType::*;
    let types = [
        Q4_K, Q6_K, Q8_0, Q5_0, Q4_0, Q4_1, Q5_1, IQ4_NL, MXFP4, Q2_K, Q3_K, Q5_K, IQ4_XS, TQ1_0,
        TQ2_0,
    ];
    if stream {
        let (rows, cols) = (768usize, 2048usize);
        println!(
            "matvec {rows}x{cols} over 256 MiB of matrices, 1 thread: GB of weights per CPU-second"
        );
        for ty in types
            .into_iter()
            .filter(|t| t.to_string().contains(&filter))
        {
            let one = weights(ty, rows, cols);
            let count = (256usize << 20) / one.len();
            // Distinct copies (not one buffer read again), so every pass streams from DRAM.
            let ws: Vec<Vec<u8>> = (0..count).map(|_| one.clone()).collect();
            let x: Vec<f32> = (0..cols)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
                .collect();
            let mut y = vec![0.0f32; rows];
            let mut line = format!("{ty:7}");
            for isa in Isa::available().into_iter().skip(1) {
                let ns = best_ns(&pool, 1, || {
                    for w in &ws {
                        matvec_with(isa, ty, black_box(w), rows, cols, black_box(&x), &mut y)
                            .unwrap();
                    }
                });
                line += &format!("  {}: {:6.2}", isa.name(), (count * one.len()) as f64 / ns);
            }
            // An expert's share of a prefill: 8 tokens per matrix.
            let n = 8;
            let xs: Vec<f32> = (0..n * cols)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
                .collect();
            let mut ys = vec![0.0f32; n * rows];
            for isa in Isa::available().into_iter().skip(1) {
                let ns = best_ns(&pool, 1, || {
                    for w in &ws {
                        matmul_with(
                            isa,
                            ty,
                            black_box(w),
                            rows,
                            cols,
                            black_box(&xs),
                            n,
                            &mut ys,
                        )
                        .unwrap();
                    }
                });
                line += &format!(
                    "  {} x8: {:6.2}",
                    isa.name(),
                    (count * one.len()) as f64 / ns
                );
            }
            println!("{line}");
        }
        return;
    }
    if matmul {
        let (rows, cols, n) = (4096usize, 2048usize, 32usize);
        println!("matmul {rows}x{cols}, {n} tokens, 1 thread: GB of weights per CPU-second");
        for ty in types
            .into_iter()
            .filter(|t| t.to_string().contains(&filter))
        {
            let w = weights(ty, rows, cols);
            let x: Vec<f32> = (0..n * cols)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
                .collect();
            let mut y = vec![0.0f32; n * rows];
            let mut line = format!("{ty:7}");
            for isa in Isa::available().into_iter().skip(1) {
                let ns = best_ns(&pool, 2, || {
                    matmul_with(isa, ty, black_box(&w), rows, cols, black_box(&x), n, &mut y)
                        .unwrap()
                });
                line += &format!("  {}: {:6.2}", isa.name(), (n * w.len()) as f64 / ns);
            }
            println!("{line}");
        }
        return;
    }
    let buf: Vec<u64> = (0..(256usize << 20) / 8).map(|i| i as u64).collect();
    let mut best = f64::MAX;
    for _ in 0..5 {
        let c0 = cpu_ns();
        black_box(buf.iter().fold(0u64, |a, &v| a.wrapping_add(v)));
        best = best.min((cpu_ns() - c0) as f64);
    }
    println!(
        "memory_read 256MiB: {:.2} GB per CPU-s",
        (buf.len() * 8) as f64 / best
    );
    drop(buf);
    println!("GB of weights per CPU-second, 1 thread:");
    for ty in types {
        if !ty.to_string().contains(&filter) {
            continue;
        }
        let mut line = format!("{ty:7}");
        for (rows, cols) in [(4096usize, 2048usize), (2048, 768)] {
            let w = weights(ty, rows, cols);
            let x: Vec<f32> = (0..cols)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
                .collect();
            let mut y = vec![0.0f32; rows];
            for isa in Isa::available() {
                if rows == 2048 && isa != Isa::best() {
                    continue;
                }
                let best = best_ns(&pool, 20, || {
                    matvec_with(isa, ty, black_box(&w), rows, cols, black_box(&x), &mut y).unwrap()
                });
                line += &format!(
                    "  {rows}x{cols}/{}: {:6.2}",
                    isa.name(),
                    w.len() as f64 / best
                );
            }
        }
        println!("{line}");
    }
}
