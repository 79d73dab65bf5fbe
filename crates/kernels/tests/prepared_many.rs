//! `PreparedBatch::new_many` (several inputs prepared in one pool pass, inputs over the same
//! `x` sharing one quantization per token) gives, for every input, the products of
//! `matvec` on each token bit for bit, at several thread counts, with inputs shared by
//! several weight types (Q5_0 + Q8_0 + Q4_0, Q4_K + Q6_K, dense), distinct inputs, and a
//! bad input reported without spoiling the others; `rows_t` and the token-major
//! `rows_tokens_with` write the same values (and nothing outside their pieces).

mod common;

use common::*;
use sluice_kernels::{matvec, BatchInput, GgmlType, PreparedBatch};

fn pool(n: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build()
        .unwrap()
}

#[test]
fn new_many_equals_matvec_per_token() {
    let cols = 512;
    let rows = 9;
    // (type, which input: 0 = xa, 1 = xb)
    let jobs = [
        (GgmlType::Q5_0, 0usize),
        (GgmlType::Q8_0, 0),
        (GgmlType::Q4_K, 0),
        (GgmlType::Q6_K, 0),
        (GgmlType::Q4_0, 0),
        (GgmlType::Q6_K, 1),
        (GgmlType::Q4_K, 1),
        (GgmlType::F32, 1),
        (GgmlType::Q5_0, 1),
        (GgmlType::Q4_1, 0),
    ];
    for n in [2usize, 5, 13] {
        let mut rng = SplitMix(n as u64 * 7919);
        let xs: Vec<Vec<f32>> = (0..2)
            .map(|_| {
                (0..n)
                    .flat_map(|_| random_x(GgmlType::Q4_K, cols, &mut rng, false))
                    .collect()
            })
            .collect();
        let ws: Vec<Vec<u8>> = jobs
            .iter()
            .map(|&(ty, _)| {
                (0..rows)
                    .flat_map(|_| random_row(ty, cols, &mut rng, false))
                    .collect()
            })
            .collect();
        let want: Vec<Vec<f32>> = pool(1).install(|| {
            jobs.iter()
                .zip(&ws)
                .map(|(&(ty, xi), w)| {
                    // [rows, n] like rows_t
                    let mut yt = vec![0.0f32; rows * n];
                    for t in 0..n {
                        let mut y = vec![0.0f32; rows];
                        matvec(ty, w, rows, cols, &xs[xi][t * cols..(t + 1) * cols], &mut y)
                            .unwrap();
                        for r in 0..rows {
                            yt[r * n + t] = y[r];
                        }
                    }
                    yt
                })
                .collect()
        });
        for threads in [1, 2, 3] {
            let mut inputs: Vec<BatchInput<'_>> = jobs
                .iter()
                .map(|&(ty, xi)| BatchInput {
                    ty,
                    x: &xs[xi],
                    n,
                    cols,
                })
                .collect();
            // A bad input (x one token short) in the middle.
            inputs.insert(
                3,
                BatchInput {
                    ty: GgmlType::Q8_0,
                    x: &xs[0][..(n - 1) * cols],
                    n,
                    cols,
                },
            );
            let got = pool(threads).install(|| PreparedBatch::new_many(&inputs));
            assert_eq!(got.len(), inputs.len());
            assert!(got[3].is_err(), "short x reported");
            let got: Vec<_> = got
                .into_iter()
                .enumerate()
                .filter(|(i, _)| *i != 3)
                .map(|(_, b)| b.unwrap())
                .collect();
            for (ji, (b, w)) in got.iter().zip(&ws).enumerate() {
                let mut yt = vec![f32::NAN; rows * n];
                b.rows_t(w, &mut yt).unwrap();
                let same = yt
                    .iter()
                    .zip(&want[ji])
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "job {ji} ({:?}) n={n} threads={threads}", jobs[ji].0);
                // Token-major output pieces (rows 2.. of a wider `[n, rows + 3]` output).
                let mut y = vec![f32::NAN; n * (rows + 3)];
                let mut pieces: Vec<&mut [f32]> = y
                    .chunks_mut(rows + 3)
                    .map(|r| &mut r[2..2 + rows])
                    .collect();
                let mut s = b.scratch();
                b.rows_tokens_with(&mut s, w, &mut pieces).unwrap();
                for t in 0..n {
                    for r in 0..rows {
                        let v = y[t * (rows + 3) + 2 + r];
                        assert_eq!(v.to_bits(), want[ji][r * n + t].to_bits(), "job {ji} t={t}");
                    }
                    assert!(y[t * (rows + 3)].is_nan() && y[t * (rows + 3) + rows + 2].is_nan());
                }
            }
        }
    }
}
