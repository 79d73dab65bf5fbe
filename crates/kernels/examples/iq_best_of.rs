//! Best-of-400 matvec throughput of the IQ grid formats (1 thread, 4096x2048), per SIMD tier:
//! a noise-robust companion to the criterion `iq/` group on a shared machine (the fastest of
//! many runs is the one least disturbed by other processes).
//!
//! Run: `cargo run --release -p sluice-kernels --example iq_best_of [-- IQ2_XXS ...]`.

use sluice_kernels::iq::IQ_TYPES;
use sluice_kernels::{matvec_with, GgmlType, Isa};
use std::time::Instant;

/// Deterministic random blocks with the f16 block scale 0.01 (as `benches/matvec.rs`).
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
    w
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (rows, cols) = (4096usize, 2048usize);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    let x: Vec<f32> = (0..cols)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
        .collect();
    let mut y = vec![0.0f32; rows];
    for ty in IQ_TYPES
        .into_iter()
        .filter(|t| args.is_empty() || args.iter().any(|a| a == t.name()))
    {
        let w = weights(ty, rows, cols);
        for isa in Isa::available() {
            let mut best = f64::MAX;
            for _ in 0..400 {
                let t = Instant::now();
                pool.install(|| matvec_with(isa, ty, &w, rows, cols, &x, &mut y))
                    .unwrap();
                best = best.min(t.elapsed().as_secs_f64());
            }
            println!(
                "{ty} {} {rows}x{cols} 1t: {:.2} GB/s",
                isa.name(),
                w.len() as f64 / best / 1e9
            );
        }
    }
}
