//! The delta-rule state update of linear-attention layers (Gated DeltaNet, Kimi Delta
//! Attention): one token's step over one head's `[d_k, d_v]` f32 state.
//!
//! Owns: [`delta_rule_step`] and its per-tier copies. The step is
//! `S = diag(decay) S; kv = S^T k; delta = beta (v - kv); S += k delta^T; o = S^T q`,
//! done in two passes over the state (decay fused with `S^T k`, the update fused with
//! `S^T q`) instead of four.
//!
//! Bits: every tier runs the same Rust body. Lanes only ever span the `d_v` dimension and
//! the sums over `d_k` keep their order, and Rust never fuses a multiply and an add, so the
//! AVX2 and AVX-512 copies (the body compiled with those features enabled, for wider
//! vectors) give the scalar copy's bits, which are the four-pass form's bits.

use crate::isa::{isa, Isa};

/// One token's delta-rule step on one head: `s` is the `[k.len(), dv]` state, row-major
/// (row i = key channel i); `row_decay[i]` multiplies row i first (a scalar decay is the
/// same value in every row). Writes `out` (`o = S^T q` with the updated state); `kv` is
/// scratch of `dv` values.
///
/// # Panics
/// If the slice lengths disagree with `k.len()` and `dv`.
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_step(
    s: &mut [f32],
    dv: usize,
    k: &[f32],
    q: &[f32],
    v: &[f32],
    row_decay: &[f32],
    beta: f32,
    kv: &mut [f32],
    out: &mut [f32],
) {
    delta_rule_step_with(isa(), s, dv, k, q, v, row_decay, beta, kv, out)
}

/// [`delta_rule_step`] on a chosen tier (tests; a tier this CPU lacks runs the best one
/// below it).
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_step_with(
    tier: Isa,
    s: &mut [f32],
    dv: usize,
    k: &[f32],
    q: &[f32],
    v: &[f32],
    row_decay: &[f32],
    beta: f32,
    kv: &mut [f32],
    out: &mut [f32],
) {
    let dk = k.len();
    assert!(
        s.len() == dk * dv
            && q.len() == dk
            && row_decay.len() == dk
            && v.len() == dv
            && kv.len() == dv
            && out.len() == dv,
        "delta_rule_step: state {} for d_k {dk} x d_v {dv}, q {}, decay {}, v {}, kv {}, out {}",
        s.len(),
        q.len(),
        row_decay.len(),
        v.len(),
        kv.len(),
        out.len()
    );
    #[cfg(target_arch = "x86_64")]
    {
        if tier >= Isa::Avx512 && Isa::Avx512.is_available() {
            // SAFETY: the CPU supports AVX-512F (checked just above); the body is safe Rust.
            unsafe { step_avx512(s, dv, k, q, v, row_decay, beta, kv, out) };
            return;
        }
        if tier >= Isa::Avx2 && Isa::Avx2.is_available() {
            // SAFETY: the CPU supports AVX2 (checked just above); the body is safe Rust.
            unsafe { step_avx2(s, dv, k, q, v, row_decay, beta, kv, out) };
            return;
        }
    }
    let _ = tier;
    step_body(s, dv, k, q, v, row_decay, beta, kv, out)
}

/// The body compiled with a tier's features (wider vectors, the same operations).
macro_rules! tier_copy {
    ($name:ident, $features:literal) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn $name(
            s: &mut [f32],
            dv: usize,
            k: &[f32],
            q: &[f32],
            v: &[f32],
            row_decay: &[f32],
            beta: f32,
            kv: &mut [f32],
            out: &mut [f32],
        ) {
            step_body(s, dv, k, q, v, row_decay, beta, kv, out)
        }
    };
}
tier_copy!(step_avx512, "avx512f");
tier_copy!(step_avx2, "avx2");

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn step_body(
    s: &mut [f32],
    dv: usize,
    k: &[f32],
    q: &[f32],
    v: &[f32],
    row_decay: &[f32],
    beta: f32,
    kv: &mut [f32],
    out: &mut [f32],
) {
    // Pass 1: decay each row, then kv += k_i * row (sums over i in order).
    kv.fill(0.0);
    for ((row, &ki), &di) in s.chunks_exact_mut(dv).zip(k).zip(row_decay) {
        for (a, sv) in kv.iter_mut().zip(row.iter_mut()) {
            *sv *= di;
            *a += ki * *sv;
        }
    }
    for (a, &vv) in kv.iter_mut().zip(v) {
        *a = beta * (vv - *a);
    }
    // Pass 2: row += k_i * delta, then out += q_i * row (the updated row).
    out.fill(0.0);
    for ((row, &ki), &qi) in s.chunks_exact_mut(dv).zip(k).zip(q) {
        for ((sv, &dl), o) in row.iter_mut().zip(kv.iter()).zip(out.iter_mut()) {
            *sv += ki * dl;
            *o += qi * *sv;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The four-pass definition, written out plainly (the spec of the fused step).
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
    fn four_pass(
        s: &mut [f32],
        dv: usize,
        k: &[f32],
        q: &[f32],
        v: &[f32],
        row_decay: &[f32],
        beta: f32,
        out: &mut [f32],
    ) {
        let dk = k.len();
        for i in 0..dk {
            for a in 0..dv {
                s[i * dv + a] *= row_decay[i];
            }
        }
        let mut kv = vec![0.0f32; dv];
        for i in 0..dk {
            for a in 0..dv {
                kv[a] += k[i] * s[i * dv + a];
            }
        }
        for a in 0..dv {
            kv[a] = beta * (v[a] - kv[a]);
        }
        for i in 0..dk {
            for a in 0..dv {
                s[i * dv + a] += k[i] * kv[a];
            }
        }
        out.fill(0.0);
        for i in 0..dk {
            for a in 0..dv {
                out[a] += q[i] * s[i * dv + a];
            }
        }
    }

    fn rand_vec(seed: &mut u64, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn every_tier_gives_the_four_pass_bits() {
        let mut seed = 7u64;
        // Shapes: the real heads (128 x 128), odd sizes that leave vector tails.
        for &(dk, dv) in &[(128usize, 128usize), (16, 16), (7, 37), (64, 19)] {
            for per_row in [false, true] {
                let s0 = rand_vec(&mut seed, dk * dv);
                let k = rand_vec(&mut seed, dk);
                let q = rand_vec(&mut seed, dk);
                let v = rand_vec(&mut seed, dv);
                let decay: Vec<f32> = if per_row {
                    rand_vec(&mut seed, dk)
                        .iter()
                        .map(|x| 0.5 + 0.5 * x.abs())
                        .collect()
                } else {
                    vec![0.93; dk]
                };
                let mut s_ref = s0.clone();
                let mut o_ref = vec![0.0f32; dv];
                // Three tokens in a row, so state carried between steps is compared too.
                for _ in 0..3 {
                    four_pass(&mut s_ref, dv, &k, &q, &v, &decay, 0.6, &mut o_ref);
                }
                for tier in Isa::available() {
                    let mut s = s0.clone();
                    let mut o = vec![0.0f32; dv];
                    let mut kv = vec![0.0f32; dv];
                    for _ in 0..3 {
                        delta_rule_step_with(
                            tier, &mut s, dv, &k, &q, &v, &decay, 0.6, &mut kv, &mut o,
                        );
                    }
                    let same = |a: &[f32], b: &[f32]| {
                        a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
                    };
                    assert!(same(&s, &s_ref), "{tier:?} state differs ({dk}x{dv})");
                    assert!(same(&o, &o_ref), "{tier:?} output differs ({dk}x{dv})");
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "delta_rule_step")]
    fn mismatched_lengths_are_refused() {
        let mut s = vec![0.0f32; 12];
        let (mut kv, mut o) = (vec![0.0; 4], vec![0.0; 4]);
        delta_rule_step(
            &mut s, 4, &[1.0; 3], &[1.0; 2], &[1.0; 4], &[1.0; 3], 1.0, &mut kv, &mut o,
        );
    }
}
