//! Activation preparation for [`PreparedBatch`]: which form each input takes and the
//! per-token work, spread over a caller-chosen parallel runner.
//!
//! Owns: the choice of form (packed Q8_0 for the AVX-512 register-blocked Q8 kernels,
//! packed Q8_K for the AVX2 / AVX-512 K-quant kernels, [`QuantizedActs`] otherwise), the
//! grouping of inputs that quantize the same `x` the same way (one quantization per token
//! serves the whole group: a packed Q8_0 token for Q5_0 and for Q8_0 weights differs only
//! in its offset corrections), and the (group, token run) work items. Each token's values
//! depend only on that token's row of `x`, so neither the grouping nor the split changes a
//! bit.

use std::sync::Mutex;

use crate::{
    check_supported, shape, Backend, BatchActs, BatchInput, GgmlType, KernelError, PreparedBatch,
    QuantizedActs,
};

/// Tokens per work item.
const TOKENS_PER_ITEM: usize = 4;

/// The form an input is prepared in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Form {
    /// Packed Q8_0 blocks (AVX-512: the 32-element block formats with Q8_0 activations;
    /// AVX2: Q5_0 and Q4_0).
    PackedQ8,
    /// Packed Q8_K blocks (AVX2 / AVX-512, Q4_K and Q6_K).
    PackedQ8K,
    /// [`QuantizedActs`] per token.
    Generic,
}

fn form(be: Backend, ty: GgmlType, n: usize, cols: usize) -> Form {
    #[cfg(target_arch = "x86_64")]
    {
        use GgmlType::*;
        if n >= 2 && cols > 0 {
            if let (Backend::Avx512(_), Q5_0 | Q8_0 | Q4_0 | IQ4_NL | MXFP4) = (be, ty) {
                return Form::PackedQ8;
            }
            // AVX2: only the formats whose unsigned quants keep `maddubs` exact (no i16
            // saturation): Q5_0 (0..=31) and Q4_0 (0..=15).
            if let (Backend::Avx2(_), Q5_0 | Q4_0) = (be, ty) {
                return Form::PackedQ8;
            }
            if let (Backend::Avx2(_) | Backend::Avx512(_), Q2_K | Q3_K | Q4_K | Q5_K | Q6_K) =
                (be, ty)
            {
                return Form::PackedQ8K;
            }
        }
    }
    let _ = (be, ty, n, cols);
    Form::Generic
}

/// One token's prepared activations for one input.
enum TokenActs {
    #[cfg(target_arch = "x86_64")]
    Q8(crate::x86::PackedQ8),
    #[cfg(target_arch = "x86_64")]
    Q8K(crate::x86::PackedQ8K),
    Generic(QuantizedActs),
}

/// Inputs prepared together: the same `x`, token count, columns and (packed) form.
struct Group {
    members: Vec<usize>,
    form: Form,
    /// The address of `x` (identity only).
    x: usize,
    len: usize,
    n: usize,
    cols: usize,
}

/// `x` of token `t` of input `inp`.
fn row<'a>(inp: &BatchInput<'a>, t: usize) -> &'a [f32] {
    &inp.x[t * inp.cols..(t + 1) * inp.cols]
}

/// Tokens `t0..t1` of `g`: `[member][token]` values.
fn prepare_tokens(
    be: Backend,
    g: &Group,
    inputs: &[BatchInput<'_>],
    t0: usize,
    t1: usize,
) -> Result<Vec<Vec<TokenActs>>, KernelError> {
    let mut out: Vec<Vec<TokenActs>> = g
        .members
        .iter()
        .map(|_| Vec::with_capacity(t1 - t0))
        .collect();
    let lead = &inputs[g.members[0]];
    for t in t0..t1 {
        let xt = row(lead, t);
        match g.form {
            #[cfg(target_arch = "x86_64")]
            Form::PackedQ8 => {
                let blocks = tiers::q8_0(be, xt);
                for (o, &m) in out.iter_mut().zip(&g.members) {
                    o.push(TokenActs::Q8(crate::x86::PackedQ8::new(
                        inputs[m].ty,
                        &blocks,
                    )));
                }
            }
            #[cfg(target_arch = "x86_64")]
            Form::PackedQ8K => {
                let packed = crate::x86::PackedQ8K::new(&tiers::q8_k(be, xt));
                for o in out.iter_mut() {
                    o.push(TokenActs::Q8K(packed.clone()));
                }
            }
            _ => {
                for (o, &m) in out.iter_mut().zip(&g.members) {
                    o.push(TokenActs::Generic(QuantizedActs::new(inputs[m].ty, xt)?));
                }
            }
        }
    }
    Ok(out)
}

/// Prepare every input on `be`; `run(items, f)` must call `f(i)` once for every
/// `i < items` (in any order, on any threads) and return when all are done.
pub(crate) fn prepare(
    be: Backend,
    inputs: &[BatchInput<'_>],
    run: impl Fn(usize, &(dyn Fn(usize) + Sync)),
) -> Vec<Result<PreparedBatch, KernelError>> {
    let mut results: Vec<Option<Result<PreparedBatch, KernelError>>> =
        inputs.iter().map(|_| None).collect();
    let mut groups: Vec<Group> = Vec::new();
    for (i, inp) in inputs.iter().enumerate() {
        let checked = check_supported(inp.ty).and_then(|()| {
            shape(
                "matmul",
                inp.ty,
                "x length (n * cols)",
                inp.n.saturating_mul(inp.cols),
                inp.x.len(),
            )
        });
        if let Err(e) = checked {
            results[i] = Some(Err(e));
            continue;
        }
        let f = form(be, inp.ty, inp.n, inp.cols);
        let same = |g: &Group| {
            f != Form::Generic
                && g.form == f
                && g.x == inp.x.as_ptr() as usize
                && g.len == inp.x.len()
                && g.n == inp.n
                && g.cols == inp.cols
        };
        match groups.iter_mut().find(|g| same(g)) {
            Some(g) => g.members.push(i),
            None => groups.push(Group {
                members: vec![i],
                form: f,
                x: inp.x.as_ptr() as usize,
                len: inp.x.len(),
                n: inp.n,
                cols: inp.cols,
            }),
        }
    }
    // (group, first token, end token)
    let items: Vec<(usize, usize, usize)> = groups
        .iter()
        .enumerate()
        .flat_map(|(gi, g)| {
            (0..g.n)
                .step_by(TOKENS_PER_ITEM)
                .map(move |t0| (gi, t0, (t0 + TOKENS_PER_ITEM).min(g.n)))
        })
        .collect();
    type Slot = Mutex<Option<Result<Vec<Vec<TokenActs>>, KernelError>>>;
    let slots: Vec<Slot> = items.iter().map(|_| Mutex::new(None)).collect();
    {
        let (groups, items, slots) = (&groups, &items, &slots);
        run(items.len(), &|i| {
            let (gi, t0, t1) = items[i];
            let r = prepare_tokens(be, &groups[gi], inputs, t0, t1);
            *slots[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
        });
    }
    // Collect each member's tokens in order (items are ordered by group, then token).
    let mut per_input: Vec<Result<Vec<TokenActs>, KernelError>> =
        inputs.iter().map(|_| Ok(Vec::new())).collect();
    for ((gi, _, _), slot) in items.iter().zip(slots) {
        let r = slot
            .into_inner()
            .unwrap_or_else(|p| p.into_inner())
            .expect("every item prepared");
        let members = &groups[*gi].members;
        match r {
            Ok(by_member) => {
                for (&m, toks) in members.iter().zip(by_member) {
                    if let Ok(v) = &mut per_input[m] {
                        v.extend(toks);
                    }
                }
            }
            Err(e) => {
                for &m in members {
                    if per_input[m].is_ok() {
                        per_input[m] = Err(e.clone());
                    }
                }
            }
        }
    }
    for g in &groups {
        for &m in &g.members {
            let inp = &inputs[m];
            let toks = std::mem::replace(&mut per_input[m], Ok(Vec::new()));
            results[m] = Some(toks.map(|toks| PreparedBatch {
                be,
                ty: inp.ty,
                cols: inp.cols,
                n: inp.n,
                acts: batch_acts(be, g.form, toks),
            }));
        }
    }
    results
        .into_iter()
        .map(|r| r.expect("every input checked or grouped"))
        .collect()
}

/// The tokens of one input as the form its kernels take.
fn batch_acts(be: Backend, form: Form, toks: Vec<TokenActs>) -> BatchActs {
    let _ = (be, form);
    #[cfg(target_arch = "x86_64")]
    match (form, be) {
        (Form::PackedQ8, _) => {
            return BatchActs::PackedQ8(
                toks.into_iter()
                    .map(|t| match t {
                        TokenActs::Q8(p) => p,
                        _ => unreachable!("a packed Q8 group prepares packed Q8 tokens"),
                    })
                    .collect(),
            );
        }
        (Form::PackedQ8K, _) => {
            return BatchActs::PackedQ8K(
                toks.into_iter()
                    .map(|t| match t {
                        TokenActs::Q8K(p) => p,
                        _ => unreachable!("a packed Q8_K group prepares packed Q8_K tokens"),
                    })
                    .collect(),
            );
        }
        _ => {}
    }
    BatchActs::Generic(
        toks.into_iter()
            .map(|t| match t {
                TokenActs::Generic(a) => a,
                #[allow(unreachable_patterns)]
                _ => unreachable!("a generic group prepares QuantizedActs"),
            })
            .collect(),
    )
}

/// The activation quantizers compiled for the CPU's vector tier (the same loops as
/// `formats::quantize_row_q8_0` / `quantize_row_q8_k`: same bits).
#[cfg(target_arch = "x86_64")]
mod tiers {
    use crate::formats::{self, BlockQ8K, BlockQ8_0};
    use crate::Backend;

    #[target_feature(enable = "avx2,f16c")]
    fn q8_0_avx2(x: &[f32]) -> Vec<BlockQ8_0> {
        formats::quantize_row_q8_0_inline(x)
    }

    #[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl")]
    fn q8_0_avx512(x: &[f32]) -> Vec<BlockQ8_0> {
        formats::quantize_row_q8_0_inline(x)
    }

    #[target_feature(enable = "avx2,f16c")]
    fn q8_k_avx2(x: &[f32]) -> Vec<BlockQ8K> {
        formats::quantize_row_q8_k_inline(x)
    }

    #[target_feature(enable = "avx2,f16c,avx512f,avx512bw,avx512vl")]
    fn q8_k_avx512(x: &[f32]) -> Vec<BlockQ8K> {
        formats::quantize_row_q8_k_inline(x)
    }

    /// `quantize_row_q8_0(x)` on `be`'s tier.
    pub(super) fn q8_0(be: Backend, x: &[f32]) -> Vec<BlockQ8_0> {
        match be {
            // SAFETY: the token proves the CPU has the AVX2 tier (F16C included).
            Backend::Avx2(_) => unsafe { q8_0_avx2(x) },
            // SAFETY: the token proves the CPU has the AVX2 tier and AVX-512 F/BW/VL.
            Backend::Avx512(_) => unsafe { q8_0_avx512(x) },
            Backend::Scalar => formats::quantize_row_q8_0(x),
        }
    }

    /// `quantize_row_q8_k(x)` on `be`'s tier.
    pub(super) fn q8_k(be: Backend, x: &[f32]) -> Vec<BlockQ8K> {
        match be {
            // SAFETY: the token proves the CPU has the AVX2 tier (F16C included).
            Backend::Avx2(_) => unsafe { q8_k_avx2(x) },
            // SAFETY: the token proves the CPU has the AVX2 tier and AVX-512 F/BW/VL.
            Backend::Avx512(_) => unsafe { q8_k_avx512(x) },
            Backend::Scalar => formats::quantize_row_q8_k(x),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::{quantize_row_q8_0, quantize_row_q8_k};
    use crate::Isa;

    /// Each tier's quantizers give the scalar ones' bits: random rows of mixed scales,
    /// zero blocks, ties, huge values, infinities and NaN.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn tier_quantizers_equal_the_scalar_ones() {
        let mut s = 0x2545_f491_4f6c_dd1du64;
        let mut x: Vec<f32> = (0..256 * 24)
            .map(|i| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let unit = (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                unit * 2f32.powi((i / 256) * 3 - 30)
            })
            .collect();
        x[256..512].fill(0.0);
        for (i, v) in x[512..768].iter_mut().enumerate() {
            *v = (i % 7) as f32 * 0.5 - 1.5; // halves: rounding ties
        }
        x[800] = f32::MAX;
        x[1100] = f32::INFINITY;
        x[1400] = f32::NEG_INFINITY;
        x[1700] = f32::NAN;
        x[2000] = -3.0e38;
        let want0 = quantize_row_q8_0(&x);
        let wantk = quantize_row_q8_k(&x);
        for isa in Isa::available() {
            let be = Backend::new(isa).unwrap();
            let got0 = tiers::q8_0(be, &x);
            assert_eq!(got0.len(), want0.len());
            for (a, b) in got0.iter().zip(&want0) {
                assert_eq!((a.d, a.qs), (b.d, b.qs), "{isa:?} q8_0");
            }
            let gotk = tiers::q8_k(be, &x);
            for (a, b) in gotk.iter().zip(&wantk) {
                assert_eq!(a.d.to_bits(), b.d.to_bits(), "{isa:?} q8_k d");
                assert_eq!((a.qs, a.bsums), (b.qs, b.bsums), "{isa:?} q8_k");
            }
        }
    }
}
