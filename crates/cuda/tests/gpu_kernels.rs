//! GPU products against the scalar reference (needs a CUDA device; ignored otherwise:
//! `cargo test --release -p sluice-cuda --test gpu_kernels -- --ignored`).
//!
//! Weights are random blocks with valid scales; the oracle is `sluice_kernels`'
//! `dequantize_row` (the format spec) and an f64 dot product. The GPU keeps activations in
//! f32, so the bound is f32 rounding: |gpu - ref| <= 1e-4 * sum |w_i x_i| + 1e-6.

use sluice_cuda::Cuda;
use sluice_kernels::{dequantize_row, GgmlType};
use sluice_models::compute::{Compute, Cpu, LinearJob};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

fn f16_bits(v: f32) -> [u8; 2] {
    half::f16::from_f32(v).to_bits().to_le_bytes()
}

/// `rows` random rows of `ty` with `cols` columns (valid, finite scales).
fn random_weights(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let rb = ty.row_bytes(cols as u64).unwrap() as usize;
    let mut w = vec![0u8; rb * rows];
    match ty {
        GgmlType::F32 => {
            for c in w.chunks_exact_mut(4) {
                c.copy_from_slice(&rng.unit().to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for c in w.chunks_exact_mut(2) {
                c.copy_from_slice(&f16_bits(rng.unit()));
            }
        }
        GgmlType::BF16 => {
            for c in w.chunks_exact_mut(2) {
                c.copy_from_slice(&half::bf16::from_f32(rng.unit()).to_bits().to_le_bytes());
            }
        }
        _ => {
            for b in w.iter_mut() {
                *b = rng.next() as u8;
            }
            let (bs, scales): (usize, &[usize]) = match ty {
                GgmlType::Q8_0 => (34, &[0]),
                GgmlType::Q5_0 => (22, &[0]),
                GgmlType::Q4_K => (144, &[0, 2]),
                GgmlType::Q6_K => (210, &[208]),
                GgmlType::Q4_0 | GgmlType::IQ4_NL => (18, &[0]),
                GgmlType::Q4_1 => (20, &[0, 2]),
                GgmlType::Q5_1 => (24, &[0, 2]),
                GgmlType::MXFP4 => (17, &[]),
                GgmlType::Q2_K => (84, &[80, 82]),
                GgmlType::Q3_K => (110, &[108]),
                GgmlType::Q5_K => (176, &[0, 2]),
                GgmlType::IQ4_XS => (136, &[0]),
                GgmlType::IQ2_XXS => (66, &[0]),
                GgmlType::IQ2_XS => (74, &[0]),
                GgmlType::IQ3_XXS => (98, &[0]),
                GgmlType::TQ2_0 => (66, &[64]),
                _ => panic!("no generator for {ty:?}"),
            };
            for blk in w.chunks_exact_mut(bs) {
                for &o in scales {
                    let d = 0.001 + 0.02 * rng.unit().abs();
                    blk[o..o + 2].copy_from_slice(&f16_bits(d));
                }
                if ty == GgmlType::MXFP4 {
                    // E8M0 scale 2^(e - 127): keep it near the others' (2^-9 .. 2^-2).
                    blk[0] = 118 + (rng.next() % 8) as u8;
                }
            }
        }
    }
    w
}

/// Reference y[t, r] and the bound sum |w x| for it.
fn reference(
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
) -> (Vec<f64>, Vec<f64>) {
    let rb = w.len() / rows;
    let mut deq = vec![0.0f32; cols];
    let mut y = vec![0.0f64; n * rows];
    let mut mag = vec![0.0f64; n * rows];
    for r in 0..rows {
        dequantize_row(ty, &w[r * rb..(r + 1) * rb], &mut deq).unwrap();
        for t in 0..n {
            let xs = &x[t * cols..(t + 1) * cols];
            let (mut s, mut m) = (0.0f64, 0.0f64);
            for (a, b) in deq.iter().zip(xs) {
                s += *a as f64 * *b as f64;
                m += (*a as f64 * *b as f64).abs();
            }
            y[t * rows + r] = s;
            mag[t * rows + r] = m;
        }
    }
    (y, mag)
}

fn cuda(stable: &[u8]) -> Cuda {
    Cuda::new(stable).unwrap_or_else(|e| panic!("this test needs a CUDA device: {e}"))
}

#[test]
#[ignore = "needs a CUDA device"]
fn every_format_matches_the_reference() {
    let mut rng = Rng(0x9e3779b97f4a7c15);
    for (ty, _) in sluice_cuda::FORMATS {
        for (rows, cols) in [(1, 256), (37, 512), (300, 2816), (5, 4096)] {
            let w = random_weights(ty, rows, cols, &mut rng);
            // Resident (weights inside the stable range) and copied per use.
            for resident in [true, false] {
                let g = if resident { cuda(&w) } else { cuda(&[]) };
                for n in [1, 3, 8, 9, 20, 70] {
                    let x: Vec<f32> = (0..n * cols).map(|_| rng.unit()).collect();
                    let mut y = vec![f32::NAN; n * rows];
                    g.linear(ty, &w, rows, cols, &x, n, &mut y).unwrap();
                    let (want, mag) = reference(ty, &w, rows, cols, &x, n);
                    for (i, ((&got, &want), &m)) in y.iter().zip(&want).zip(&mag).enumerate() {
                        let tol = 1e-4 * m + 1e-6;
                        assert!(
                            (got as f64 - want).abs() <= tol,
                            "{ty:?} rows {rows} cols {cols} n {n} resident {resident}: y[{i}] = {got}, reference {want} (tolerance {tol})"
                        );
                    }
                    let s = g.stats();
                    if resident {
                        assert_eq!(
                            s.transient_bytes, 0,
                            "{ty:?}: resident weights were copied per use"
                        );
                    } else {
                        assert_eq!(
                            s.resident_bytes, 0,
                            "{ty:?}: weights outside the map became resident"
                        );
                    }
                }
            }
        }
    }
}

/// A token's result has the same bits whatever batch it comes in (prompt chunking never
/// changes logits), and resident or copied weights give the same bits.
#[test]
#[ignore = "needs a CUDA device"]
fn bits_do_not_depend_on_batch_or_residency() {
    let mut rng = Rng(42);
    for (ty, _) in sluice_cuda::FORMATS {
        let (rows, cols, n) = (96, 1024, 21);
        let w = random_weights(ty, rows, cols, &mut rng);
        let x: Vec<f32> = (0..n * cols).map(|_| rng.unit()).collect();
        let (res, copy) = (cuda(&w), cuda(&[]));
        let mut all = vec![0.0f32; n * rows];
        res.linear(ty, &w, rows, cols, &x, n, &mut all).unwrap();
        let mut all2 = vec![0.0f32; n * rows];
        copy.linear(ty, &w, rows, cols, &x, n, &mut all2).unwrap();
        assert!(
            all.iter()
                .zip(&all2)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{ty:?}: resident != copied"
        );
        for t in 0..n {
            let mut one = vec![0.0f32; rows];
            res.linear(
                ty,
                &w,
                rows,
                cols,
                &x[t * cols..(t + 1) * cols],
                1,
                &mut one,
            )
            .unwrap();
            let row = &all[t * rows..(t + 1) * rows];
            assert!(
                one.iter().zip(row).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{ty:?}: token {t} alone differs from token {t} in a batch of {n}"
            );
        }
    }
}

/// A group (shared input, several weights, one unsupported type) equals the jobs one by
/// one; the unsupported type runs on the CPU with the CPU's exact bits.
#[test]
#[ignore = "needs a CUDA device"]
fn group_equals_single_jobs_and_falls_back_to_the_cpu() {
    let mut rng = Rng(7);
    let cols = 512;
    let n = 2;
    let x: Vec<f32> = (0..n * cols).map(|_| rng.unit()).collect();
    let specs = [
        (GgmlType::Q4_K, 64),
        (GgmlType::Q8_0, 48),
        (GgmlType::TQ2_0, 32),
        (GgmlType::Q6_K, 16),
    ];
    let ws: Vec<Vec<u8>> = specs
        .iter()
        .map(|&(ty, rows)| random_weights(ty, rows, cols, &mut rng))
        .collect();
    let g = cuda(&[]);
    let mut ys: Vec<Vec<f32>> = specs
        .iter()
        .map(|&(_, rows)| vec![0.0f32; n * rows])
        .collect();
    {
        let mut jobs: Vec<LinearJob<'_>> = specs
            .iter()
            .zip(&ws)
            .zip(ys.iter_mut())
            .map(|((&(ty, rows), w), y)| LinearJob {
                ty,
                w,
                rows,
                cols,
                x: &x,
                n,
                y,
                unit: None,
            })
            .collect();
        g.linear_group(&mut jobs).unwrap();
    }
    for (((ty, rows), w), y) in specs.iter().zip(&ws).zip(&ys) {
        let mut one = vec![0.0f32; n * rows];
        if *ty == GgmlType::TQ2_0 {
            Cpu.linear(*ty, w, *rows, cols, &x, n, &mut one).unwrap();
        } else {
            g.linear(*ty, w, *rows, cols, &x, n, &mut one).unwrap();
        }
        assert!(
            one.iter().zip(y).all(|(a, b)| a.to_bits() == b.to_bits()),
            "{ty:?}: group != single"
        );
    }
    let s = g.stats();
    assert_eq!(s.cpu_jobs, 1, "TQ2_0 runs on the CPU (the group's one job)");
    assert_eq!(
        s.gpu_jobs,
        3 + 3,
        "three GPU jobs in the group, three alone"
    );
}

/// Experts through the VRAM expert cache, uploaded on the copy stream from page-locked host
/// memory (`pin_host`, as the RAM tier's slots are) and from pageable memory, in groups that
/// mix hits and misses (the hits are launched before the misses' uploads are waited for):
/// every result has the bits of the same job without a cache, and the pinned bytes are
/// counted as uploaded from page-locked memory.
#[test]
#[ignore = "needs a CUDA device"]
fn expert_cache_uploads_from_pinned_memory_keep_bits() {
    use sluice_models::compute::UnitKey;
    let mut rng = Rng(99);
    let (rows, cols, n) = (256, 2048, 3);
    let ty = GgmlType::Q4_K;
    let rb = ty.row_bytes(cols as u64).unwrap() as usize;
    let experts = 12;
    // One page-aligned arena holding every expert, like the tier's slots (whole pages).
    let total = experts * rows * rb;
    assert_eq!(total % 4096, 0);
    let mut buf = vec![0u8; total + 4096];
    let off = buf.as_ptr().align_offset(4096);
    let arena = &mut buf[off..off + total];
    for (e, chunk) in arena.chunks_exact_mut(rows * rb).enumerate() {
        assert!(e < experts);
        chunk.copy_from_slice(&random_weights(ty, rows, cols, &mut rng));
    }
    let arena = &*arena;
    let w = |e: usize| &arena[e * rows * rb..(e + 1) * rows * rb];
    let x: Vec<f32> = (0..n * cols).map(|_| rng.unit()).collect();
    let plain = cuda(&[]);
    let want: Vec<Vec<f32>> = (0..experts)
        .map(|e| {
            let mut y = vec![0.0f32; n * rows];
            plain.linear(ty, w(e), rows, cols, &x, n, &mut y).unwrap();
            y
        })
        .collect();
    for pinned in [true, false] {
        let g = cuda(&[]);
        // Room for 5 experts: groups of 4 over a sliding window hit and miss.
        g.set_expert_cache(5 * (rows * rb) as u64).unwrap();
        if pinned {
            g.pin_host(arena).unwrap();
        }
        for step in 0..20usize {
            let ids: Vec<usize> = (0..4).map(|k| (step + 2 * k) % experts).collect();
            let mut ys: Vec<Vec<f32>> = ids.iter().map(|_| vec![f32::NAN; n * rows]).collect();
            {
                let mut jobs: Vec<LinearJob<'_>> = ids
                    .iter()
                    .zip(ys.iter_mut())
                    .map(|(&e, y)| LinearJob {
                        ty,
                        w: w(e),
                        rows,
                        cols,
                        x: &x,
                        n,
                        y,
                        unit: Some(UnitKey {
                            layer: 0,
                            unit: e as u32,
                            part: 0,
                        }),
                    })
                    .collect();
                g.linear_group(&mut jobs).unwrap();
            }
            for (&e, y) in ids.iter().zip(&ys) {
                assert!(
                    y.iter()
                        .zip(&want[e])
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "pinned {pinned}, step {step}: expert {e} differs from no cache"
                );
            }
        }
        let s = g.stats();
        eprintln!("pinned {pinned}: {s:?}");
        assert!(s.expert_hits > 0 && s.expert_misses > 0 && s.expert_evictions > 0);
        assert_eq!(s.upload_bytes, s.expert_upload_bytes);
        assert!(s.upload_ns > 0);
        if pinned {
            assert_eq!(s.pinned_bytes, arena.len() as u64);
            assert_eq!(s.upload_pinned_bytes, s.upload_bytes);
            g.unpin_host(arena);
            assert_eq!(g.stats().pinned_bytes, 0);
        } else {
            assert_eq!(s.upload_pinned_bytes, 0);
        }
    }
}
