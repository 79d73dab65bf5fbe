//! `act::geglu` gives the scalar loop's bits on every ISA tier (a dense sweep of gate values
//! over the whole range incl. the clamp edges, specials and subnormals; lengths that are not
//! whole vectors), and a length mismatch is an error.

use sluice_kernels::act::{geglu_with, gelu_tanh};
use sluice_kernels::Isa;

#[test]
fn every_tier_gives_the_scalar_bits() {
    let mut g: Vec<f32> = Vec::new();
    let mut x = -120.0f32;
    while x <= 120.0 {
        g.push(x);
        x += 0.000_93 * (1.0 + x.abs());
    }
    g.extend([
        0.0,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MIN_POSITIVE / 4.0,
        -f32::MIN_POSITIVE / 3.0,
        f32::MAX,
        f32::MIN,
        43.5,
        -43.5,
        -44.0,
        1e-20,
    ]);
    let u: Vec<f32> = (0..g.len())
        .map(|i| ((i % 97) as f32 - 48.0) * 0.173)
        .collect();
    let want: Vec<f32> = g.iter().zip(&u).map(|(&a, &b)| gelu_tanh(a) * b).collect();
    for isa in Isa::available() {
        for len in [g.len(), g.len() - 1, 17, 5, 0] {
            let mut got = g[..len].to_vec();
            geglu_with(isa, &mut got, &u[..len]).unwrap();
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!(
                    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                    "{isa:?} g={} u={}: {a} vs {b}",
                    g[i],
                    u[i]
                );
            }
        }
        let mut nan = vec![f32::NAN; 3];
        geglu_with(isa, &mut nan, &[1.0; 3]).unwrap();
        assert!(nan.iter().all(|v| v.is_nan()));
        assert!(geglu_with(isa, &mut [0.0; 4], &[0.0; 3]).is_err());
    }
}
