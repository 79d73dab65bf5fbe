//! Quantized block formats and the CPU kernels over them.
//!
//! Owns: block layouts ([`formats`]), a scalar reference for every op ([`reference`], the
//! spec), AVX2 / AVX-512 fast paths ([`x86`]) chosen once at run time
//! (`SLUICE_ISA=scalar|avx2|avx512` forces a lower tier), and the row-parallel
//! `matvec` / `matmul` drivers on the current rayon pool, and [`pool`]: a persistent pool
//! with cheap dispatch for callers that schedule their own row blocks, and [`attn`]: the
//! f32 loops of softmax attention (scores, weighted value sums) and [`act`]: element-wise
//! activations, on the same tiers.
//!
//! Weight formats: F32, F16, BF16, Q8_0, Q5_0, Q4_K, Q6_K, and Q4_0, Q4_1, Q5_1, IQ4_NL,
//! MXFP4, Q2_K, Q3_K, Q5_K, IQ4_XS, TQ1_0, TQ2_0. Activations are prepared once per weight
//! format ([`QuantizedActs`]), the format ggml pairs with it: Q8_0 blocks for the 32-element
//! block formats (Q8_0, Q5_0, Q4_0, IQ4_NL, MXFP4), Q8_1 (Q8_0 plus the block sum) for
//! Q4_1 and Q5_1, Q8_K blocks for the 256-element ones (the K-quants,
//! IQ4_XS, TQ1_0, TQ2_0), plain f32 for the dense formats.
//!
//! IQ grid formats ([`iq`]): IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M, with
//! Q8_K activations (scalar reference + AVX2 kernels, recompiled with AVX-512 enabled for
//! that tier).
//!
//! Linear attention ([`delta_rule`]): the delta-rule state step shared by Gated DeltaNet
//! and Kimi Delta Attention.

pub mod act;
pub mod attn;
pub mod delta_rule;
pub mod formats;
pub mod iq;
mod isa;
pub mod pool;
mod prepare;
pub mod reference;
pub mod x86;

use formats::{BlockQ8K, BlockQ8_0, BlockQ8_1};
use rayon::prelude::*;

pub use isa::{isa, Isa};
pub use sluice_gguf::GgmlType;

/// Errors of the kernel entry points.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum KernelError {
    /// The weight type has no kernels here.
    #[error("kernels: weight type {ty} is not supported (supported: F32, F16, BF16, Q8_0, Q5_0, Q4_K, Q6_K, Q4_0, Q4_1, Q5_1, IQ4_NL, MXFP4, Q2_K, Q3_K, Q5_K, IQ4_XS, TQ1_0, TQ2_0, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M)")]
    Unsupported {
        /// The type asked for.
        ty: GgmlType,
    },
    /// A buffer length or dimension does not fit the op.
    #[error("kernels: {op} on {ty}: {what}: expected {expected}, found {found}")]
    Shape {
        /// Operation name (`matvec`, `dequantize_row`, ...).
        op: &'static str,
        /// Weight type.
        ty: GgmlType,
        /// Which quantity is wrong.
        what: &'static str,
        /// Expected value.
        expected: usize,
        /// Value found.
        found: usize,
    },
    /// An ISA tier was requested explicitly that this CPU does not have.
    #[error("kernels: ISA tier {0:?} is not available on this CPU")]
    IsaUnavailable(Isa),
    /// An accelerator backend failed (driver call, launch, copy).
    #[error("kernels: device: {0}")]
    Device(String),
}

/// Whether `ty` has kernels here.
pub fn is_supported(ty: GgmlType) -> bool {
    use GgmlType::*;
    matches!(ty, F32 | F16 | BF16 | Q8_0 | Q5_0 | Q4_K | Q6_K)
        || matches!(ty, Q4_0 | Q4_1 | Q5_1 | IQ4_NL | MXFP4) // quants-k, Q8_0 activations
        || matches!(ty, Q2_K | Q3_K | Q5_K | IQ4_XS | TQ1_0 | TQ2_0) // quants-k, Q8_K activations
        || iq::is_iq(ty)
}

fn check_supported(ty: GgmlType) -> Result<(), KernelError> {
    if is_supported(ty) {
        Ok(())
    } else {
        Err(KernelError::Unsupported { ty })
    }
}

fn shape(
    op: &'static str,
    ty: GgmlType,
    what: &'static str,
    expected: usize,
    found: usize,
) -> Result<(), KernelError> {
    if expected == found {
        Ok(())
    } else {
        Err(KernelError::Shape {
            op,
            ty,
            what,
            expected,
            found,
        })
    }
}

/// Bytes of a row of `cols` elements of `ty`; errors when `cols` is not whole blocks.
pub fn row_bytes(op: &'static str, ty: GgmlType, cols: usize) -> Result<usize, KernelError> {
    check_supported(ty)?;
    let bs = ty.block_size() as usize;
    if !cols.is_multiple_of(bs) {
        return Err(KernelError::Shape {
            op,
            ty,
            what: "columns (rounded down to whole blocks)",
            expected: cols / bs * bs,
            found: cols,
        });
    }
    Ok(cols / bs * ty.type_size() as usize)
}

/// Dequantize one row (`dst.len()` elements) of `ty` from `src` (exactly its row bytes).
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), KernelError> {
    let rb = row_bytes("dequantize_row", ty, dst.len())?;
    shape("dequantize_row", ty, "source bytes", rb, src.len())?;
    use GgmlType::*;
    match ty {
        F32 => reference::dequantize_f32(src, dst),
        F16 => reference::dequantize_f16(src, dst),
        BF16 => reference::dequantize_bf16(src, dst),
        Q8_0 => reference::dequantize_q8_0(src, dst),
        Q5_0 => reference::dequantize_q5_0(src, dst),
        Q4_K => reference::dequantize_q4_k(src, dst),
        Q6_K => reference::dequantize_q6_k(src, dst),
        Q4_0 => reference::dequantize_q4_0(src, dst),
        Q4_1 => reference::dequantize_q4_1(src, dst),
        Q5_1 => reference::dequantize_q5_1(src, dst),
        IQ4_NL => reference::dequantize_iq4_nl(src, dst),
        MXFP4 => reference::dequantize_mxfp4(src, dst),
        Q2_K => reference::dequantize_q2_k(src, dst),
        Q3_K => reference::dequantize_q3_k(src, dst),
        Q5_K => reference::dequantize_q5_k(src, dst),
        IQ4_XS => reference::dequantize_iq4_xs(src, dst),
        TQ1_0 => reference::dequantize_tq1_0(src, dst),
        TQ2_0 => reference::dequantize_tq2_0(src, dst),
        _ if iq::is_iq(ty) => iq::reference::dequantize(ty, src, dst),
        _ => unreachable!("checked by row_bytes"),
    }
    Ok(())
}

/// Activation storage for one weight format.
#[derive(Clone, Debug)]
pub(crate) enum ActData {
    F32(Vec<f32>),
    Q8_0(Vec<BlockQ8_0>),
    Q8_1(Vec<BlockQ8_1>),
    Q8K(Vec<BlockQ8K>),
}

/// An activation row `x` prepared once for dotting with rows of one weight format.
#[derive(Clone, Debug)]
pub struct QuantizedActs {
    weight_ty: GgmlType,
    cols: usize,
    data: ActData,
}

impl QuantizedActs {
    /// Prepare `x` for weights of type `weight_ty`: quantize to Q8_0 (32-element block
    /// formats; Q8_1 for Q4_1 / Q5_1), to Q8_K (256-element ones), or keep f32 (F32/F16/BF16). `x.len()` must be
    /// whole blocks.
    pub fn new(weight_ty: GgmlType, x: &[f32]) -> Result<Self, KernelError> {
        row_bytes("QuantizedActs::new", weight_ty, x.len())?;
        use GgmlType::*;
        let data = match weight_ty {
            F32 | F16 | BF16 => ActData::F32(x.to_vec()),
            Q8_0 | Q5_0 => ActData::Q8_0(formats::quantize_row_q8_0(x)),
            Q4_K | Q6_K => ActData::Q8K(formats::quantize_row_q8_k(x)),
            Q4_0 | IQ4_NL | MXFP4 => ActData::Q8_0(formats::quantize_row_q8_0(x)),
            Q4_1 | Q5_1 => ActData::Q8_1(formats::quantize_row_q8_1(x)),
            Q2_K | Q3_K | Q5_K | IQ4_XS | TQ1_0 | TQ2_0 => {
                ActData::Q8K(formats::quantize_row_q8_k(x))
            }
            _ if iq::is_iq(weight_ty) => ActData::Q8K(formats::quantize_row_q8_k(x)),
            _ => unreachable!("checked by row_bytes"),
        };
        Ok(QuantizedActs {
            weight_ty,
            cols: x.len(),
            data,
        })
    }

    /// The weight type these activations were prepared for.
    pub fn weight_ty(&self) -> GgmlType {
        self.weight_ty
    }

    /// Number of activation elements.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The Q8_0 blocks, when prepared for a 32-element block format.
    pub fn q8_0_blocks(&self) -> Option<&[BlockQ8_0]> {
        match &self.data {
            ActData::Q8_0(v) => Some(v),
            _ => None,
        }
    }

    /// The Q8_1 blocks, when prepared for Q4_1 / Q5_1.
    pub fn q8_1_blocks(&self) -> Option<&[BlockQ8_1]> {
        match &self.data {
            ActData::Q8_1(v) => Some(v),
            _ => None,
        }
    }

    /// The Q8_K blocks, when prepared for a 256-element block format (K-quants, IQ).
    pub fn q8_k_blocks(&self) -> Option<&[BlockQ8K]> {
        match &self.data {
            ActData::Q8K(v) => Some(v),
            _ => None,
        }
    }

    /// The f32 activations, when prepared for F32/F16/BF16 weights.
    pub fn f32_values(&self) -> Option<&[f32]> {
        match &self.data {
            ActData::F32(v) => Some(v),
            _ => None,
        }
    }
}

/// A CPU tier proven available (holds the token that proves it).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Backend {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2(x86::Avx2),
    #[cfg(target_arch = "x86_64")]
    Avx512(x86::Avx512),
}

impl Backend {
    fn new(isa: Isa) -> Result<Backend, KernelError> {
        match isa {
            Isa::Scalar => Ok(Backend::Scalar),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => x86::Avx2::new()
                .map(Backend::Avx2)
                .ok_or(KernelError::IsaUnavailable(isa)),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => x86::Avx512::new()
                .map(Backend::Avx512)
                .ok_or(KernelError::IsaUnavailable(isa)),
            #[cfg(not(target_arch = "x86_64"))]
            _ => Err(KernelError::IsaUnavailable(isa)),
        }
    }

    /// `out[r] = row r of w . acts` for `out.len()` consecutive `rb`-byte rows; the same
    /// bits as [`Backend::dot_tile`] on each row alone (single-token row kernels).
    #[inline]
    fn rows(self, ty: GgmlType, w: &[u8], rb: usize, acts: &QuantizedActs, out: &mut [f32]) {
        match self {
            #[cfg(target_arch = "x86_64")]
            Backend::Avx2(t) => t.rows(ty, w, rb, acts, out),
            #[cfg(target_arch = "x86_64")]
            Backend::Avx512(t) => t.rows(ty, w, rb, acts, out),
            _ => {
                for (i, o) in out.iter_mut().enumerate() {
                    let row = &w[i * rb..(i + 1) * rb];
                    self.dot_tile(ty, row, &[acts], std::slice::from_mut(o));
                }
            }
        }
    }

    /// `out[t] = row . acts[t]` for every t; `acts.len() == out.len() <= TILE`.
    /// Each `out[t]` depends only on `row` and `acts[t]` (not on the tile), which is what
    /// makes matmul bit-identical to matvec.
    #[inline]
    fn dot_tile(self, ty: GgmlType, row: &[u8], acts: &[&QuantizedActs], out: &mut [f32]) {
        match self {
            Backend::Scalar => {
                for (o, a) in out.iter_mut().zip(acts) {
                    *o = ref_dot(ty, row, a);
                }
            }
            #[cfg(target_arch = "x86_64")]
            Backend::Avx2(t) => t.dot_tile(ty, row, acts, out),
            #[cfg(target_arch = "x86_64")]
            Backend::Avx512(t) => t.dot_tile(ty, row, acts, out),
        }
    }
}

/// Scalar reference dot of one row with prepared activations (types already checked).
pub(crate) fn ref_dot(ty: GgmlType, row: &[u8], a: &QuantizedActs) -> f32 {
    use GgmlType::*;
    match (ty, &a.data) {
        (F32, ActData::F32(x)) => reference::dot_f32(row, x),
        (F16, ActData::F32(x)) => reference::dot_f16(row, x),
        (BF16, ActData::F32(x)) => reference::dot_bf16(row, x),
        (Q8_0, ActData::Q8_0(y)) => reference::dot_q8_0(row, y),
        (Q5_0, ActData::Q8_0(y)) => reference::dot_q5_0(row, y),
        (Q4_K, ActData::Q8K(y)) => reference::dot_q4_k(row, y),
        (Q6_K, ActData::Q8K(y)) => reference::dot_q6_k(row, y),
        (Q4_0, ActData::Q8_0(y)) => reference::dot_q4_0(row, y),
        (Q4_1, ActData::Q8_1(y)) => reference::dot_q4_1(row, y),
        (Q5_1, ActData::Q8_1(y)) => reference::dot_q5_1(row, y),
        (IQ4_NL, ActData::Q8_0(y)) => reference::dot_iq4_nl(row, y),
        (MXFP4, ActData::Q8_0(y)) => reference::dot_mxfp4(row, y),
        (Q2_K, ActData::Q8K(y)) => reference::dot_q2_k(row, y),
        (Q3_K, ActData::Q8K(y)) => reference::dot_q3_k(row, y),
        (Q5_K, ActData::Q8K(y)) => reference::dot_q5_k(row, y),
        (IQ4_XS, ActData::Q8K(y)) => reference::dot_iq4_xs(row, y),
        (TQ1_0, ActData::Q8K(y)) => reference::dot_tq1_0(row, y),
        (TQ2_0, ActData::Q8K(y)) => reference::dot_tq2_0(row, y),
        (t, ActData::Q8K(y)) if iq::is_iq(t) => iq::reference::dot(t, row, y),
        _ => unreachable!("activation format checked by the caller"),
    }
}

/// Tokens per matmul tile: each weight row is decoded once per tile.
pub const TILE: usize = 8;

fn check_acts(
    op: &'static str,
    ty: GgmlType,
    row_len: usize,
    a: &QuantizedActs,
) -> Result<(), KernelError> {
    let rb = row_bytes(op, ty, a.cols)?;
    shape(op, ty, "row bytes", rb, row_len)?;
    let compatible = matches!(
        (ty, &a.data),
        (
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16,
            ActData::F32(_)
        ) | (GgmlType::Q8_0 | GgmlType::Q5_0, ActData::Q8_0(_))
            | (GgmlType::Q4_K | GgmlType::Q6_K, ActData::Q8K(_))
    ) || matches!(
        // quants-k
        (ty, &a.data),
        (
            GgmlType::Q4_0 | GgmlType::IQ4_NL | GgmlType::MXFP4,
            ActData::Q8_0(_)
        ) | (GgmlType::Q4_1 | GgmlType::Q5_1, ActData::Q8_1(_))
            | (
                GgmlType::Q2_K
                    | GgmlType::Q3_K
                    | GgmlType::Q5_K
                    | GgmlType::IQ4_XS
                    | GgmlType::TQ1_0
                    | GgmlType::TQ2_0,
                ActData::Q8K(_)
            )
    ) || (iq::is_iq(ty) && matches!(a.data, ActData::Q8K(_)));
    if !compatible {
        return Err(KernelError::Shape {
            op,
            ty,
            what: "activations prepared for another weight type (type id)",
            expected: ty.id() as usize,
            found: a.weight_ty.id() as usize,
        });
    }
    Ok(())
}

/// Dot of one weight row (`row`, exactly the row bytes for `acts.cols()` elements) with
/// prepared activations, on the tier [`isa()`] chose.
///
/// # Panics
/// When `row` or `acts` do not fit `ty` (use [`try_vec_dot`] for a typed error).
pub fn vec_dot(ty: GgmlType, row: &[u8], acts: &QuantizedActs) -> f32 {
    match try_vec_dot(ty, row, acts) {
        Ok(v) => v,
        Err(e) => panic!("{e}"),
    }
}

/// `y[i] = row(i) . acts` for consecutive rows `w_rows` (`y.len()` rows of `cols`
/// columns), on the calling thread with the best ISA tier. Gives the same bits as
/// [`matvec`] for those rows; callers that schedule their own parallel work (several
/// matrices in one pass) use it with activations prepared once.
pub fn matvec_rows(
    ty: GgmlType,
    w_rows: &[u8],
    cols: usize,
    acts: &QuantizedActs,
    y: &mut [f32],
) -> Result<(), KernelError> {
    let be = Backend::new(isa())?;
    let rb = check_matrix("matvec_rows", ty, w_rows, y.len(), cols)?;
    shape("matvec_rows", ty, "activation columns", cols, acts.cols())?;
    check_acts("matvec_rows", ty, rb, acts)?;
    be.rows(ty, w_rows, rb, acts, y);
    Ok(())
}

/// [`vec_dot`] returning a typed error instead of panicking.
pub fn try_vec_dot(ty: GgmlType, row: &[u8], acts: &QuantizedActs) -> Result<f32, KernelError> {
    vec_dot_with(isa(), ty, row, acts)
}

/// [`vec_dot`] on an explicit tier (tests, benches).
pub fn vec_dot_with(
    isa: Isa,
    ty: GgmlType,
    row: &[u8],
    acts: &QuantizedActs,
) -> Result<f32, KernelError> {
    let be = Backend::new(isa)?;
    check_acts("vec_dot", ty, row.len(), acts)?;
    let mut out = [0.0f32];
    be.dot_tile(ty, row, &[acts], &mut out);
    Ok(out[0])
}

/// y[r] = W[r,:] . x for r in 0..rows; W is rows x cols in format ty, row-major, each row
/// `ty.row_bytes(cols)` bytes. Parallel over rows on the CURRENT rayon pool (callers wrap
/// in `pool.install`). Each y[r] is computed by exactly one thread in a fixed order, so the
/// result is bit-identical for any thread count.
pub fn matvec(
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    y: &mut [f32],
) -> Result<(), KernelError> {
    matvec_with(isa(), ty, w, rows, cols, x, y)
}

/// Y[t, r] = W[r,:] . X[t,:] for t in 0..n; X is n x cols row-major, Y is n x rows
/// row-major. Bit-identical to [`matvec`] for each t, while each weight row is decoded
/// once per tile of [`TILE`] tokens.
pub fn matmul(
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    y: &mut [f32],
) -> Result<(), KernelError> {
    matmul_with(isa(), ty, w, rows, cols, x, n, y)
}

/// Rows per rayon task: enough work per task to hide scheduling, enough tasks to balance.
fn rows_per_task(rows: usize, row_bytes: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    let by_balance = rows.div_ceil(threads * 8);
    // At least ~32 KiB of weights per task.
    let by_size = (32 * 1024usize).div_ceil(row_bytes.max(1));
    by_balance.max(by_size).max(1)
}

fn check_matrix(
    op: &'static str,
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
) -> Result<usize, KernelError> {
    let rb = row_bytes(op, ty, cols)?;
    let total = rb.checked_mul(rows).ok_or(KernelError::Shape {
        op,
        ty,
        what: "rows * row bytes (overflows)",
        expected: usize::MAX,
        found: rows,
    })?;
    shape(op, ty, "weight bytes", total, w.len())?;
    Ok(rb)
}

/// [`matvec`] on an explicit tier (tests, benches).
#[allow(clippy::too_many_arguments)]
pub fn matvec_with(
    isa: Isa,
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    y: &mut [f32],
) -> Result<(), KernelError> {
    let be = Backend::new(isa)?;
    let rb = check_matrix("matvec", ty, w, rows, cols)?;
    shape("matvec", ty, "x length", cols, x.len())?;
    shape("matvec", ty, "y length", rows, y.len())?;
    if rows == 0 {
        return Ok(());
    }
    let acts = QuantizedActs::new(ty, x)?;
    let chunk = rows_per_task(rows, rb);
    y.par_chunks_mut(chunk).enumerate().for_each(|(c, ys)| {
        let r0 = c * chunk;
        be.rows(ty, &w[r0 * rb..(r0 + ys.len()) * rb], rb, &acts, ys);
    });
    Ok(())
}

/// [`matmul`] on an explicit tier (tests, benches).
#[allow(clippy::too_many_arguments)]
pub fn matmul_with(
    isa: Isa,
    ty: GgmlType,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    y: &mut [f32],
) -> Result<(), KernelError> {
    let be = Backend::new(isa)?;
    let rb = check_matrix("matmul", ty, w, rows, cols)?;
    shape(
        "matmul",
        ty,
        "x length (n * cols)",
        n.saturating_mul(cols),
        x.len(),
    )?;
    shape(
        "matmul",
        ty,
        "y length (n * rows)",
        n.saturating_mul(rows),
        y.len(),
    )?;
    if rows == 0 || n == 0 {
        return Ok(());
    }
    let batch = PreparedBatch::with_backend(be, ty, x, n, cols)?;
    // yt is rows x n (row-major): each task owns whole rows of it.
    let mut yt = vec![0.0f32; rows * n];
    let chunk = rows_per_task(rows, rb).next_multiple_of(batch.row_group());
    yt.par_chunks_mut(chunk * n).enumerate().try_for_each_init(
        || batch.scratch(),
        |scratch, (c, ys)| {
            let r0 = c * chunk;
            let nr = ys.len() / n;
            batch.rows_t_with(scratch, &w[r0 * rb..(r0 + nr) * rb], ys)
        },
    )?;
    // [rows, n] -> [n, rows], one token per task (pure copies).
    y.par_chunks_mut(rows).enumerate().for_each(|(t, yt_row)| {
        for (r, v) in yt_row.iter_mut().enumerate() {
            *v = yt[r * n + t];
        }
    });
    Ok(())
}

/// Activations of `n` tokens prepared once for one weight type, in the form the fastest
/// available kernel wants (the AVX-512 register-blocked Q8 kernels take packed Q8_0
/// blocks, the AVX2 / AVX-512 register-blocked Q2_K-Q6_K kernels packed Q8_K blocks;
/// every other path takes [`QuantizedActs`]). Lets a caller schedule row blocks of
/// several matrices in one parallel pass ([`PreparedBatch::rows_t`]); every path gives
/// the same bits as [`matvec`] on each token.
pub struct PreparedBatch {
    be: Backend,
    ty: GgmlType,
    cols: usize,
    n: usize,
    acts: BatchActs,
}

enum BatchActs {
    Generic(Vec<QuantizedActs>),
    /// Q5_0 / Q4_0 on the AVX2 tier, the 32-element block formats on the AVX-512 tier (the
    /// backend holds the token).
    #[cfg(target_arch = "x86_64")]
    PackedQ8(Vec<x86::PackedQ8>),
    /// Q2_K-Q6_K on the AVX2 or AVX-512 tier (the backend holds the token).
    #[cfg(target_arch = "x86_64")]
    PackedQ8K(Vec<x86::PackedQ8K>),
}

/// One input of [`PreparedBatch::new_many`]: `x` (`[n, cols]`) for weights of type `ty`.
#[derive(Clone, Copy, Debug)]
pub struct BatchInput<'a> {
    pub ty: GgmlType,
    pub x: &'a [f32],
    pub n: usize,
    pub cols: usize,
}

/// Per-task scratch space of [`PreparedBatch::rows_t_with`].
pub struct BatchScratch(Option<BatchScratchInner>);

#[cfg(target_arch = "x86_64")]
enum BatchScratchInner {
    Q8(x86::DecodedRows),
    K(x86::DecodedK),
}
#[cfg(not(target_arch = "x86_64"))]
type BatchScratchInner = ();

impl PreparedBatch {
    /// Prepare `x` (`[n, cols]`) for weights of type `ty` on the best ISA tier.
    pub fn new(ty: GgmlType, x: &[f32], n: usize, cols: usize) -> Result<Self, KernelError> {
        Self::with_backend(Backend::new(isa())?, ty, x, n, cols)
    }

    fn with_backend(
        be: Backend,
        ty: GgmlType,
        x: &[f32],
        n: usize,
        cols: usize,
    ) -> Result<Self, KernelError> {
        let input = [BatchInput { ty, x, n, cols }];
        let run = |items: usize, f: &(dyn Fn(usize) + Sync)| {
            (0..items).into_par_iter().for_each(f);
        };
        prepare::prepare(be, &input, run)
            .pop()
            .expect("one result per input")
    }

    /// Prepare several inputs in one pass on the compute [`pool`] (tokens of every input
    /// spread over its threads). Inputs over the same `x` that quantize it the same way
    /// (e.g. q/k in Q5_0 and v in Q8_0, or gate and up) quantize each token once. One
    /// result per input, in order; the same values as [`PreparedBatch::new`] on each.
    pub fn new_many(inputs: &[BatchInput<'_>]) -> Vec<Result<Self, KernelError>> {
        match Backend::new(isa()) {
            Ok(be) => prepare::prepare(be, inputs, |items, f| pool::run(items, &|_, i| f(i))),
            Err(e) => inputs.iter().map(|_| Err(e.clone())).collect(),
        }
    }

    /// Tokens in the batch.
    pub fn n(&self) -> usize {
        self.n
    }

    /// Row blocks given to [`PreparedBatch::rows_t`] should be multiples of this (except
    /// the last block of a matrix).
    pub fn row_group(&self) -> usize {
        match &self.acts {
            BatchActs::Generic(_) => 1,
            #[cfg(target_arch = "x86_64")]
            BatchActs::PackedQ8(..) => x86::TR,
            #[cfg(target_arch = "x86_64")]
            BatchActs::PackedQ8K(..) => x86::KTR,
        }
    }

    /// Scratch space for one task (reuse it across calls on one thread).
    pub fn scratch(&self) -> BatchScratch {
        match &self.acts {
            BatchActs::Generic(_) => BatchScratch(None),
            #[cfg(target_arch = "x86_64")]
            BatchActs::PackedQ8(..) => BatchScratch(Some(BatchScratchInner::Q8(
                x86::DecodedRows::new(self.cols / formats::QK8_0, x86::TR),
            ))),
            #[cfg(target_arch = "x86_64")]
            BatchActs::PackedQ8K(..) => BatchScratch(Some(BatchScratchInner::K(
                x86::DecodedK::new(self.cols / formats::QK_K, x86::KTR),
            ))),
        }
    }

    /// `yt[r, t] = row(r) . x[t]` for the consecutive weight rows `w_rows` (`yt` is
    /// `[rows, n]` row-major), on the calling thread.
    pub fn rows_t(&self, w_rows: &[u8], yt: &mut [f32]) -> Result<(), KernelError> {
        let mut s = self.scratch();
        self.rows_t_with(&mut s, w_rows, yt)
    }

    /// [`PreparedBatch::rows_t`] with caller-kept scratch space.
    pub fn rows_t_with(
        &self,
        scratch: &mut BatchScratch,
        w_rows: &[u8],
        yt: &mut [f32],
    ) -> Result<(), KernelError> {
        let n = self.n;
        if n == 0 {
            return Ok(());
        }
        let nr = yt.len() / n;
        shape(
            "matmul",
            self.ty,
            "output length (rows * n)",
            nr * n,
            yt.len(),
        )?;
        self.rows_into(scratch, w_rows, &mut RowMajor { yt, n })
    }

    /// `out[t][r] = row(r) . x[t]` for the consecutive weight rows `w_rows`: `out` holds
    /// one slice per token, each as long as the block has rows (e.g. token t's piece of a
    /// `[n, rows]` output, so no transposition is needed). Same values as
    /// [`PreparedBatch::rows_t_with`].
    pub fn rows_tokens_with(
        &self,
        scratch: &mut BatchScratch,
        w_rows: &[u8],
        out: &mut [&mut [f32]],
    ) -> Result<(), KernelError> {
        shape("matmul", self.ty, "output token slices", self.n, out.len())?;
        let Some(nr) = out.first().map(|o| o.len()) else {
            return Ok(());
        };
        for o in out.iter() {
            shape("matmul", self.ty, "output slice length (rows)", nr, o.len())?;
        }
        self.rows_into(scratch, w_rows, &mut TokenRows { out, rows: nr })
    }

    fn rows_into(
        &self,
        scratch: &mut BatchScratch,
        w_rows: &[u8],
        out: &mut impl RowsOut,
    ) -> Result<(), KernelError> {
        let (ty, n) = (self.ty, self.n);
        let nr = out.rows();
        let rb = check_matrix("matmul", ty, w_rows, nr, self.cols)?;
        if n == 0 || nr == 0 {
            return Ok(());
        }
        // One token: the single-token row kernels (two rows interleaved, weights
        // prefetched; the same bits as the one-row dot below).
        if let (BatchActs::Generic(acts), 1) = (&self.acts, n) {
            if let Some(y) = out.single_token() {
                self.be.rows(ty, w_rows, rb, &acts[0], y);
                return Ok(());
            }
        }
        match &self.acts {
            BatchActs::Generic(acts) => {
                let acts: Vec<&QuantizedActs> = acts.iter().collect();
                let mut o = [0.0f32; TILE];
                for i in 0..nr {
                    let row = &w_rows[i * rb..(i + 1) * rb];
                    for (c, a) in acts.chunks(TILE).enumerate() {
                        let o = &mut o[..a.len()];
                        self.be.dot_tile(ty, row, a, o);
                        out.put(i, c * TILE, o);
                    }
                }
            }
            #[cfg(target_arch = "x86_64")]
            BatchActs::PackedQ8(acts) => {
                if !matches!(scratch.0, Some(BatchScratchInner::Q8(_))) {
                    *scratch = self.scratch();
                }
                let Some(BatchScratchInner::Q8(s)) = &mut scratch.0 else {
                    unreachable!("scratch made for this batch")
                };
                match self.be {
                    Backend::Avx512(tok) => tok.matmul_q8_rows(ty, w_rows, rb, acts, s, out),
                    Backend::Avx2(tok) => tok.matmul_q8_rows(ty, w_rows, rb, acts, s, out),
                    Backend::Scalar => unreachable!("packed only on the x86 tiers"),
                }
            }
            #[cfg(target_arch = "x86_64")]
            BatchActs::PackedQ8K(acts) => {
                let nb = self.cols / formats::QK_K;
                if !matches!(&scratch.0, Some(BatchScratchInner::K(s)) if s.nb() == nb) {
                    *scratch = self.scratch();
                }
                let Some(BatchScratchInner::K(s)) = &mut scratch.0 else {
                    unreachable!("scratch made for this batch")
                };
                match self.be {
                    Backend::Avx512(tok) => tok.matmul_k_rows(ty, w_rows, rb, acts, s, out),
                    Backend::Avx2(tok) => tok.matmul_k_rows(ty, w_rows, rb, acts, s, out),
                    Backend::Scalar => unreachable!("packed only on the x86 tiers"),
                }
            }
        }
        Ok(())
    }
}

/// Where the matmul kernels put `value(row r, token t)` of a block of rows.
pub(crate) trait RowsOut {
    /// Rows in the block.
    fn rows(&self) -> usize;
    /// `value(r, t0 + i) = vals[i]` for every i.
    fn put(&mut self, r: usize, t0: usize, vals: &[f32]);
    /// With one token: its output over the block's rows, contiguous.
    fn single_token(&mut self) -> Option<&mut [f32]>;
}

/// `[rows, n]` row-major.
struct RowMajor<'a> {
    yt: &'a mut [f32],
    n: usize,
}

impl RowsOut for RowMajor<'_> {
    fn rows(&self) -> usize {
        self.yt.len() / self.n
    }
    #[inline]
    fn put(&mut self, r: usize, t0: usize, vals: &[f32]) {
        let at = r * self.n + t0;
        self.yt[at..at + vals.len()].copy_from_slice(vals);
    }
    fn single_token(&mut self) -> Option<&mut [f32]> {
        (self.n == 1).then_some(&mut *self.yt)
    }
}

/// One slice per token (`out[t][r]`).
struct TokenRows<'a, 'b> {
    out: &'a mut [&'b mut [f32]],
    rows: usize,
}

impl RowsOut for TokenRows<'_, '_> {
    fn rows(&self) -> usize {
        self.rows
    }
    #[inline]
    fn put(&mut self, r: usize, t0: usize, vals: &[f32]) {
        for (o, &v) in self.out[t0..t0 + vals.len()].iter_mut().zip(vals) {
            o[r] = v;
        }
    }
    fn single_token(&mut self) -> Option<&mut [f32]> {
        match &mut *self.out {
            [only] => Some(&mut **only),
            _ => None,
        }
    }
}
