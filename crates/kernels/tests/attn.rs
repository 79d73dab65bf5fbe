//! Attention loops (`sluice_kernels::attn`): every ISA tier gives the scalar form's bits
//! for scores and weighted value sums (any head count, key count, dimension and stride,
//! including tails that are not whole 8-float pieces); the scalar form is the documented
//! order (checked against an independent transcription here); bad shapes are errors.

use proptest::prelude::*;
use sluice_kernels::attn::{dot, scores_with, weighted_sum_with, Span};
use sluice_kernels::Isa;

/// Values with mixed magnitudes (so a changed summation order or a fused multiply-add
/// changes low bits).
fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let unit = (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            let exp = ((s >> 8) % 17) as i32 - 8;
            unit * 2f32.powi(exp)
        })
        .collect()
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn every_tier_gives_the_scalar_bits(
        heads in 1usize..10,
        n in 0usize..41,
        dim in prop::sample::select(vec![1usize, 3, 7, 8, 9, 15, 16, 17, 24, 40, 64, 100, 128, 256, 257]),
        pad in 0usize..20,
        scale in prop::sample::select(vec![1.0f32, 0.0625, 0.3, 1.7]),
        seed in any::<u64>(),
    ) {
        let stride = dim + pad;
        let q = values(heads * dim, seed);
        let keys = values(n * stride + 5, seed ^ 1);
        let vals = values(n * stride + 3, seed ^ 2);
        let sp = Span { heads, n, stride };
        let mut want_s = vec![f32::NAN; heads * n];
        scores_with(Isa::Scalar, &q, &keys, sp, scale, &mut want_s).unwrap();
        // Probabilities as the caller has them (any values will do for the sum).
        let p = values(heads * n, seed ^ 3);
        let start = values(heads * dim, seed ^ 4);
        let mut want_o = start.clone();
        weighted_sum_with(Isa::Scalar, &p, &vals, sp, &mut want_o).unwrap();
        for isa in Isa::available() {
            let mut got = vec![f32::NAN; heads * n];
            scores_with(isa, &q, &keys, sp, scale, &mut got).unwrap();
            prop_assert!(same_bits(&got, &want_s), "{:?} scores heads={} n={} dim={}", isa, heads, n, dim);
            let mut o = start.clone();
            weighted_sum_with(isa, &p, &vals, sp, &mut o).unwrap();
            prop_assert!(same_bits(&o, &want_o), "{:?} weighted sum heads={} n={} dim={}", isa, heads, n, dim);
        }
    }
}

/// The scalar forms are the documented order, transcribed independently: eight lane sums
/// combined pairwise then in order, the tail added last; value sums row by row.
#[test]
fn scalar_forms_follow_the_documented_order() {
    for dim in [5usize, 8, 13, 64, 256, 259] {
        let (heads, n, stride) = (3usize, 11usize, dim + 2);
        let q = values(heads * dim, dim as u64);
        let keys = values(n * stride, 7 + dim as u64);
        let sp = Span { heads, n, stride };
        let mut got = vec![0.0f32; heads * n];
        scores_with(Isa::Scalar, &q, &keys, sp, 0.5, &mut got).unwrap();
        for h in 0..heads {
            for j in 0..n {
                let (a, b) = (&q[h * dim..][..dim], &keys[j * stride..][..dim]);
                let mut lane = [0.0f32; 8];
                let whole = dim / 8 * 8;
                for i in 0..whole {
                    lane[i % 8] += a[i] * b[i];
                }
                let mut s = (lane[0] + lane[4]) + (lane[1] + lane[5]);
                s += lane[2] + lane[6];
                s += lane[3] + lane[7];
                for i in whole..dim {
                    s += a[i] * b[i];
                }
                assert_eq!(got[h * n + j].to_bits(), (s * 0.5).to_bits(), "dim {dim}");
                assert_eq!(dot(a, b).to_bits(), s.to_bits());
            }
        }
        let p = values(heads * n, 99);
        let mut o = vec![0.0f32; heads * dim];
        weighted_sum_with(Isa::Scalar, &p, &keys, sp, &mut o).unwrap();
        for h in 0..heads {
            for e in 0..dim {
                let mut s = 0.0f32;
                for j in 0..n {
                    s += p[h * n + j] * keys[j * stride + e];
                }
                assert_eq!(o[h * dim + e].to_bits(), s.to_bits());
            }
        }
    }
    // The order matters on these values: a plain left-to-right sum differs somewhere
    // (so the comparisons above can fail).
    let (a, b) = (values(256, 5), values(256, 6));
    let plain = (0..20).any(|k| {
        let (a, b) = (&a[k..k + 200], &b[k..k + 200]);
        let seq = a.iter().zip(b).fold(0.0f32, |s, (x, y)| s + x * y);
        seq.to_bits() != dot(a, b).to_bits()
    });
    assert!(plain);
}

#[test]
fn bad_shapes_are_errors() {
    let sp = Span {
        heads: 2,
        n: 3,
        stride: 8,
    };
    let q = vec![0.0f32; 16];
    let mut out = vec![0.0f32; 6];
    // keys one short of the last row
    assert!(scores_with(Isa::Scalar, &q, &[0.0; 23], sp, 1.0, &mut out).is_err());
    assert!(scores_with(Isa::Scalar, &q, &[0.0; 24], sp, 1.0, &mut out).is_ok());
    // out of the wrong length
    assert!(scores_with(Isa::Scalar, &q, &[0.0; 24], sp, 1.0, &mut out[..5]).is_err());
    // query not whole heads
    assert!(scores_with(Isa::Scalar, &q[..15], &[0.0; 24], sp, 1.0, &mut out).is_err());
    let mut o = vec![0.0f32; 16];
    assert!(weighted_sum_with(Isa::Scalar, &[0.0; 5], &[0.0; 24], sp, &mut o).is_err());
    assert!(weighted_sum_with(Isa::Scalar, &[0.0; 6], &[0.0; 23], sp, &mut o).is_err());
    assert!(weighted_sum_with(Isa::Scalar, &[0.0; 6], &[0.0; 24], sp, &mut o).is_ok());
}
