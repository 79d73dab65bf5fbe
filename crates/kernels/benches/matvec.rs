//! matvec throughput per weight format, in weight bytes per second, next to this machine's
//! memory read bandwidth (a plain read loop over 256 MiB).
//!
//! Run: `cargo bench -p sluice-kernels --bench matvec` (a few minutes). Filter with e.g.
//! `-- Q4_K`. `SLUICE_ISA` does not matter here except for the `auto/` group: the `isa/`
//! group runs each available tier explicitly; the `kq/` group (the quants-k formats, 1
//! thread, 4096x2048 and 2048x768) runs every tier at 4096x2048; `iq/` does the same for
//! the IQ grid formats (1 thread, 4096x2048 and 2048x768; filter with `-- iq/`); `matmul/`:
//! prefill-shaped matmul (128 tokens, Gemma 3 270M's 640x2048 FFN down projection, 1
//! thread) on the AVX2 and AVX-512 tiers, in weight bytes x tokens per second; `out/`: the
//! tied Gemma 3 output matrix (262144x640 Q8_0) matvec, 1 and 2 threads, next to
//! `memory_read`; `expert/`: every weight format at the DeepSeek V4 expert shape (4096x2048)
//! and the Qwen3 one (2048x768), 1 and 2 threads, on the tier `isa()` picks (filter with
//! `-- 'expert/|memory_read'`; `tools/bench-table.py` turns the output into a table).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use sluice_kernels::{matmul_with, matvec_with, GgmlType, Isa};
use std::hint::black_box;
use std::time::Duration;

const TYPES: [GgmlType; 7] = [
    GgmlType::Q4_K,
    GgmlType::Q6_K,
    GgmlType::Q8_0,
    GgmlType::Q5_0,
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
];

/// (rows, cols): square, expert up/gate, expert down.
const SHAPES: [(usize, usize); 3] = [(4096, 4096), (768, 2048), (2048, 768)];

/// Deterministic pseudo-random bytes with sane f16 scales, so no NaN/Inf slow paths.
fn weights(ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let rb = ty.row_bytes(cols as u64).unwrap() as usize;
    let mut s = 0x1234_5678_9abc_def0u64;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let mut w: Vec<u8> = (0..rows * rb).map(|_| next() as u8).collect();
    let half = |v: f32| half::f16::from_f32(v).to_bits().to_le_bytes();
    let bsz = ty.type_size() as usize;
    match ty {
        GgmlType::F32 => {
            for c in w.chunks_exact_mut(4) {
                c.copy_from_slice(&((next() % 2000) as f32 / 1000.0 - 1.0).to_le_bytes());
            }
        }
        GgmlType::F16 | GgmlType::BF16 => {
            for c in w.chunks_exact_mut(2) {
                let v = (next() % 2000) as f32 / 1000.0 - 1.0;
                let b = if ty == GgmlType::F16 {
                    half(v)
                } else {
                    ((v.to_bits() >> 16) as u16).to_le_bytes()
                };
                c.copy_from_slice(&b);
            }
        }
        GgmlType::Q8_0 | GgmlType::Q5_0 => w
            .chunks_exact_mut(bsz)
            .for_each(|b| b[..2].copy_from_slice(&half(0.01))),
        GgmlType::Q4_K => w.chunks_exact_mut(bsz).for_each(|b| {
            b[..2].copy_from_slice(&half(0.01));
            b[2..4].copy_from_slice(&half(0.001));
        }),
        GgmlType::Q6_K => w
            .chunks_exact_mut(bsz)
            .for_each(|b| b[208..].copy_from_slice(&half(0.01))),
        _ if sluice_kernels::iq::is_iq(ty) => iq_scales(ty, &mut w),
        _ => kq_scales(ty, &mut w),
    }
    w
}

/// The quants-k formats (their own group, 1 thread, two shapes).
const KQ_TYPES: [GgmlType; 11] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_1,
    GgmlType::IQ4_NL,
    GgmlType::MXFP4,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q5_K,
    GgmlType::IQ4_XS,
    GgmlType::TQ1_0,
    GgmlType::TQ2_0,
];

/// Sane scales for the quants-k formats (offsets of their f16 scales / E8M0 byte).
fn kq_scales(ty: GgmlType, w: &mut [u8]) {
    let half = |v: f32| half::f16::from_f32(v).to_bits().to_le_bytes();
    let bsz = ty.type_size() as usize;
    let offs: &[usize] = match ty {
        GgmlType::Q4_0 | GgmlType::IQ4_NL | GgmlType::IQ4_XS => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::TQ1_0 => &[52],
        GgmlType::TQ2_0 => &[64],
        GgmlType::MXFP4 => {
            w.chunks_exact_mut(bsz).for_each(|b| b[0] = 120);
            return;
        }
        _ => unreachable!(),
    };
    for b in w.chunks_exact_mut(bsz) {
        for &o in offs {
            b[o..o + 2].copy_from_slice(&half(0.01));
        }
    }
}

/// quants-k formats: 1 thread, 4096x2048 and 2048x768, on the tier `isa()` picks and on
/// every available tier for 4096x2048.
fn bench_kquants(c: &mut Criterion) {
    let p = pool(1);
    for ty in KQ_TYPES {
        let mut g = c.benchmark_group(format!("kq/{ty}"));
        g.sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_millis(1200));
        for (rows, cols) in [(4096usize, 2048usize), (2048, 768)] {
            let w = weights(ty, rows, cols);
            let x: Vec<f32> = (0..cols)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
                .collect();
            let mut y = vec![0.0f32; rows];
            g.throughput(Throughput::Bytes(w.len() as u64));
            let tiers = if rows == 4096 {
                Isa::available()
            } else {
                vec![sluice_kernels::isa()]
            };
            for isa in tiers {
                g.bench_function(
                    BenchmarkId::new(format!("{rows}x{cols}"), format!("1t-{}", isa.name())),
                    |b| {
                        b.iter(|| {
                            p.install(|| {
                                matvec_with(
                                    isa,
                                    ty,
                                    black_box(&w),
                                    rows,
                                    cols,
                                    black_box(&x),
                                    &mut y,
                                )
                            })
                            .unwrap()
                        })
                    },
                );
            }
        }
        g.finish();
    }
}

fn pool(n: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build()
        .unwrap()
}

fn bench_matvec(c: &mut Criterion) {
    matvec_threads_groups(c, "matvec", TYPES, &SHAPES);
}

/// One group `PREFIX/<TYPE>` per format: matvec at each shape on 1 and 2 threads, on the
/// tier `isa()` picks, in weight bytes per second.
fn matvec_threads_groups(
    c: &mut Criterion,
    prefix: &str,
    types: impl IntoIterator<Item = GgmlType>,
    shapes: &[(usize, usize)],
) {
    let pools = [(1usize, pool(1)), (2usize, pool(2))];
    let isa = sluice_kernels::isa();
    for ty in types {
        let mut g = c.benchmark_group(format!("{prefix}/{ty}"));
        g.sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_millis(1200));
        for &(rows, cols) in shapes {
            let w = weights(ty, rows, cols);
            let x: Vec<f32> = (0..cols)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
                .collect();
            let mut y = vec![0.0f32; rows];
            g.throughput(Throughput::Bytes(w.len() as u64));
            for (nt, p) in &pools {
                g.bench_function(
                    BenchmarkId::new(format!("{rows}x{cols}"), format!("{nt}t")),
                    |b| {
                        b.iter(|| {
                            p.install(|| {
                                matvec_with(
                                    isa,
                                    ty,
                                    black_box(&w),
                                    rows,
                                    cols,
                                    black_box(&x),
                                    &mut y,
                                )
                            })
                            .unwrap();
                        })
                    },
                );
            }
        }
        g.finish();
    }
}

/// Every weight format at the expert shapes, 1 and 2 threads, on the chosen tier.
fn bench_experts(c: &mut Criterion) {
    let all = TYPES
        .into_iter()
        .chain(KQ_TYPES)
        .chain(sluice_kernels::iq::IQ_TYPES);
    matvec_threads_groups(c, "expert", all, &IQ_SHAPES);
}

/// Every available tier, 1 thread, 4096x4096: how much each tier buys.
fn bench_tiers(c: &mut Criterion) {
    let p = pool(1);
    let (rows, cols) = (4096, 4096);
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::Q8_0,
        GgmlType::Q5_0,
    ] {
        let mut g = c.benchmark_group(format!("isa/{ty}"));
        g.sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_millis(1200));
        let w = weights(ty, rows, cols);
        let x: Vec<f32> = (0..cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
            .collect();
        let mut y = vec![0.0f32; rows];
        g.throughput(Throughput::Bytes(w.len() as u64));
        for isa in Isa::available() {
            g.bench_function(isa.name(), |b| {
                b.iter(|| {
                    p.install(|| {
                        matvec_with(isa, ty, black_box(&w), rows, cols, black_box(&x), &mut y)
                    })
                    .unwrap()
                })
            });
        }
        g.finish();
    }
}

/// Memory read bandwidth: sum 256 MiB of u64 (vectorized read loop), 1 and 2 threads.
fn bench_memory(c: &mut Criterion) {
    let buf: Vec<u64> = (0..(256usize << 20) / 8).map(|i| i as u64).collect();
    let mut g = c.benchmark_group("memory_read");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_millis(2000));
    g.throughput(Throughput::Bytes((buf.len() * 8) as u64));
    for nt in [1usize, 2] {
        let p = pool(nt);
        g.bench_function(BenchmarkId::new("256MiB", format!("{nt}t")), |b| {
            b.iter(|| {
                p.install(|| {
                    use rayon::prelude::*;
                    let per = buf.len().div_ceil(nt);
                    buf.par_chunks(per)
                        .map(|c| c.iter().fold(0u64, |a, &v| a.wrapping_add(v)))
                        .reduce(|| 0, u64::wrapping_add)
                })
            })
        });
    }
    g.finish();
}

// ---- IQ grid formats ---------------------------------------------------------------------

/// (rows, cols) for the IQ formats: an attention-size matrix and an expert down projection.
const IQ_SHAPES: [(usize, usize); 2] = [(4096, 2048), (2048, 768)];

/// Sane f16 block scales (0.01) in random IQ blocks (IQ1_M: in its scale words' top nibbles).
fn iq_scales(ty: GgmlType, w: &mut [u8]) {
    let d = half::f16::from_f32(0.01).to_bits();
    for b in w.chunks_exact_mut(ty.type_size() as usize) {
        if ty == GgmlType::IQ1_M {
            for k in 0..4 {
                let p = 48 + 2 * k;
                let v = u16::from_le_bytes([b[p], b[p + 1]]);
                let v = (v & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12);
                b[p..p + 2].copy_from_slice(&v.to_le_bytes());
            }
        } else {
            b[..2].copy_from_slice(&d.to_le_bytes());
        }
    }
}

/// IQ formats, 1 thread, every available tier: `iq/<TYPE>/<rows>x<cols>/<tier>`.
fn bench_iq(c: &mut Criterion) {
    let p = pool(1);
    for ty in sluice_kernels::iq::IQ_TYPES {
        let mut g = c.benchmark_group(format!("iq/{ty}"));
        g.sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_millis(1200));
        for (rows, cols) in IQ_SHAPES {
            let w = weights(ty, rows, cols);
            let x: Vec<f32> = (0..cols)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
                .collect();
            let mut y = vec![0.0f32; rows];
            g.throughput(Throughput::Bytes(w.len() as u64));
            for isa in Isa::available() {
                g.bench_function(
                    BenchmarkId::new(format!("{rows}x{cols}"), isa.name()),
                    |b| {
                        b.iter(|| {
                            p.install(|| {
                                matvec_with(
                                    isa,
                                    ty,
                                    black_box(&w),
                                    rows,
                                    cols,
                                    black_box(&x),
                                    &mut y,
                                )
                            })
                            .unwrap()
                        })
                    },
                );
            }
        }
        g.finish();
    }
}

/// Prefill-shaped matmuls, 1 thread, each x86 tier: 128 tokens through a 640x2048 matrix (a
/// dense layer), and 8 tokens through a 768x2048 one (a 30B-A3B expert in a 128-token
/// prefill: 128 x 8 / 128 tokens per expert on average).
fn bench_matmul(c: &mut Criterion) {
    for (rows, cols, n) in [(640usize, 2048usize, 128usize), (768, 2048, 8)] {
        bench_matmul_shape(c, rows, cols, n);
    }
}

fn bench_matmul_shape(c: &mut Criterion, rows: usize, cols: usize, n: usize) {
    let p = pool(1);
    for ty in [
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::Q5_0,
        GgmlType::Q8_0,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q5_K,
        GgmlType::IQ2_XXS,
        GgmlType::IQ4_XS,
    ] {
        let mut g = c.benchmark_group(format!("matmul/{ty}"));
        g.sample_size(10)
            .warm_up_time(Duration::from_millis(300))
            .measurement_time(Duration::from_millis(1500));
        let w = weights(ty, rows, cols);
        let x: Vec<f32> = (0..n * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
            .collect();
        let mut y = vec![0.0f32; rows * n];
        g.throughput(Throughput::Bytes((w.len() * n) as u64));
        for isa in Isa::available().into_iter().filter(|&i| i != Isa::Scalar) {
            g.bench_function(
                BenchmarkId::new(format!("{rows}x{cols}x{n}"), isa.name()),
                |b| {
                    b.iter(|| {
                        p.install(|| {
                            matmul_with(
                                isa,
                                ty,
                                black_box(&w),
                                rows,
                                cols,
                                black_box(&x),
                                n,
                                &mut y,
                            )
                        })
                        .unwrap()
                    })
                },
            );
        }
        g.finish();
    }
}

/// The tied Gemma 3 output matrix (262144x640 Q8_0, 178 MB): one decode step's matvec.
fn bench_output(c: &mut Criterion) {
    let (rows, cols, ty) = (262_144usize, 640usize, GgmlType::Q8_0);
    let w = weights(ty, rows, cols);
    let x: Vec<f32> = (0..cols)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
        .collect();
    let mut y = vec![0.0f32; rows];
    let mut g = c.benchmark_group("out/Q8_0");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_millis(2000));
    g.throughput(Throughput::Bytes(w.len() as u64));
    for nt in [1usize, 2] {
        let p = pool(nt);
        g.bench_function(
            BenchmarkId::new(format!("{rows}x{cols}"), format!("{nt}t")),
            |b| {
                b.iter(|| {
                    p.install(|| {
                        matvec_with(
                            sluice_kernels::isa(),
                            ty,
                            black_box(&w),
                            rows,
                            cols,
                            black_box(&x),
                            &mut y,
                        )
                    })
                    .unwrap()
                })
            },
        );
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default();
    targets = bench_memory, bench_experts, bench_matvec, bench_tiers, bench_kquants, bench_iq, bench_matmul, bench_output
}
criterion_main!(benches);
