//! The inner loops of softmax attention over an f32 KV cache.
//!
//! Owns: [`dot`] (the fixed-order f32 dot product every attention block uses), [`scores`]
//! (one query group against a run of keys) and [`weighted_sum`] (probabilities times a run
//! of values), each with a scalar form (the spec) and AVX2 / AVX-512 forms picked at run
//! time. The fast forms only run several independent sums side by side (several heads,
//! several keys, several output lanes); every single sum performs exactly the scalar
//! form's operations in the scalar form's order (each product rounded, then added; no
//! fused multiply-add), so every tier gives the same bits.

use crate::{isa, Backend, Isa, KernelError};

/// Plain f32 dot product in a fixed order: eight lane sums (lane `l` adds `a[i] * b[i]`
/// for `i = l mod 8`, in order, each product rounded before it is added), combined as
/// `(((s0 + s4) + (s1 + s5)) + (s2 + s6)) + (s3 + s7)`, then the `len % 8` tail products
/// added in order. Over the shorter of the two lengths.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ar, br) = (ac.remainder(), bc.remainder());
    for (ca, cb) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] += ca[l] * cb[l];
        }
    }
    let mut s = (acc[0] + acc[4]) + (acc[1] + acc[5]) + (acc[2] + acc[6]) + (acc[3] + acc[7]);
    for (x, y) in ar.iter().zip(br) {
        s += x * y;
    }
    s
}

/// The shape of a [`scores`] / [`weighted_sum`] call: `heads` query rows of `dim` values
/// (contiguous), `n` cache rows of which the `j`-th starts at `j * stride` (keys: `dim`
/// values; values: `dim_v` values).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// Query heads that share these keys / values (a GQA group).
    pub heads: usize,
    /// Cache rows (positions).
    pub n: usize,
    /// Distance in f32s between consecutive cache rows.
    pub stride: usize,
}

fn check(what: &'static str, expected: usize, found: usize) -> Result<(), KernelError> {
    // The `Shape` error names a weight type; attention has none, F32 is its data type.
    crate::shape("attention", crate::GgmlType::F32, what, expected, found)
}

fn check_rows(sp: Span, width: usize, rows: &[f32]) -> Result<(), KernelError> {
    if sp.n > 0 {
        let need = (sp.n - 1) * sp.stride + width;
        if rows.len() < need {
            return check("cache rows length (at least)", need, rows.len());
        }
    }
    Ok(())
}

/// `out[h * n + j] = dot(q[h], key j) * scale` for the `sp.heads` query rows of `q`
/// (`heads * dim` values) and the `sp.n` keys of `keys` (key j = `keys[j * stride..][..dim]`),
/// on the tier [`isa()`] chose. Same bits as [`dot`] times `scale` on every tier.
pub fn scores(
    q: &[f32],
    keys: &[f32],
    sp: Span,
    scale: f32,
    out: &mut [f32],
) -> Result<(), KernelError> {
    scores_with(isa(), q, keys, sp, scale, out)
}

/// [`scores`] on an explicit tier (tests, benches).
pub fn scores_with(
    isa: Isa,
    q: &[f32],
    keys: &[f32],
    sp: Span,
    scale: f32,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let be = Backend::new(isa)?;
    if sp.heads == 0 {
        return check("out length", 0, out.len());
    }
    let dim = q.len() / sp.heads;
    check("query length (heads * dim)", sp.heads * dim, q.len())?;
    check("out length (heads * n)", sp.heads * sp.n, out.len())?;
    check_rows(sp, dim, keys)?;
    if dim == 0 || sp.n == 0 {
        out.fill(dot(&[], &[]) * scale);
        return Ok(());
    }
    match be {
        #[cfg(target_arch = "x86_64")]
        Backend::Avx2(t) => t.attn_scores(q, dim, keys, sp, scale, out),
        #[cfg(target_arch = "x86_64")]
        Backend::Avx512(t) => t.attn_scores(q, dim, keys, sp, scale, out),
        _ => scores_ref(q, dim, keys, sp, scale, out),
    }
    Ok(())
}

/// The scalar form of [`scores`] (shapes already checked).
fn scores_ref(q: &[f32], dim: usize, keys: &[f32], sp: Span, scale: f32, out: &mut [f32]) {
    for (qh, oh) in q.chunks_exact(dim).zip(out.chunks_exact_mut(sp.n)) {
        for (j, o) in oh.iter_mut().enumerate() {
            *o = dot(qh, &keys[j * sp.stride..j * sp.stride + dim]) * scale;
        }
    }
}

/// `out[h] += p[h * n + j] * value j` for j = 0, 1, .. in order (each product rounded,
/// then added) for the `sp.heads` rows of `out` (`heads * dim_v` values, value j =
/// `values[j * stride..][..dim_v]`), on the tier [`isa()`] chose. Same bits on every tier.
pub fn weighted_sum(
    p: &[f32],
    values: &[f32],
    sp: Span,
    out: &mut [f32],
) -> Result<(), KernelError> {
    weighted_sum_with(isa(), p, values, sp, out)
}

/// [`weighted_sum`] on an explicit tier (tests, benches).
pub fn weighted_sum_with(
    isa: Isa,
    p: &[f32],
    values: &[f32],
    sp: Span,
    out: &mut [f32],
) -> Result<(), KernelError> {
    let be = Backend::new(isa)?;
    if sp.heads == 0 {
        return check("out length", 0, out.len());
    }
    let dim_v = out.len() / sp.heads;
    check("out length (heads * dim_v)", sp.heads * dim_v, out.len())?;
    check("probabilities length (heads * n)", sp.heads * sp.n, p.len())?;
    check_rows(sp, dim_v, values)?;
    if dim_v == 0 || sp.n == 0 {
        return Ok(());
    }
    match be {
        #[cfg(target_arch = "x86_64")]
        Backend::Avx2(t) => t.attn_weighted_sum(p, values, sp, dim_v, out),
        #[cfg(target_arch = "x86_64")]
        Backend::Avx512(t) => t.attn_weighted_sum(p, values, sp, dim_v, out),
        _ => weighted_sum_ref(p, values, sp, dim_v, out),
    }
    Ok(())
}

/// The scalar form of [`weighted_sum`] (shapes already checked).
fn weighted_sum_ref(p: &[f32], values: &[f32], sp: Span, dim_v: usize, out: &mut [f32]) {
    for (ph, oh) in p.chunks_exact(sp.n).zip(out.chunks_exact_mut(dim_v)) {
        for (j, &pj) in ph.iter().enumerate() {
            let v = &values[j * sp.stride..j * sp.stride + dim_v];
            for (a, &b) in oh.iter_mut().zip(v) {
                *a += pj * b;
            }
        }
    }
}
