//! The one interface through which blocks reach the kernels.
//!
//! Owns: [`Compute`], the operations the shared blocks need from a backend (today the
//! weight-times-activations product), and [`Cpu`], its implementation over
//! `sluice-kernels` (scalar / AVX2 / AVX-512 picked at run time). A GPU backend is one more
//! implementation of this trait, not a fork of every architecture.

use sluice_kernels::{matmul, matvec, GgmlType, KernelError};

/// What blocks ask of a backend.
pub trait Compute: Send + Sync {
    /// `y[n, rows] = x[n, cols] W^T` for a `[rows, cols]` weight matrix of type `ty`
    /// stored in `w`. Must give the same bits for n = 1 and n > 1 (chunking never changes
    /// logits).
    #[allow(clippy::too_many_arguments)]
    fn linear(
        &self,
        ty: GgmlType,
        w: &[u8],
        rows: usize,
        cols: usize,
        x: &[f32],
        n: usize,
        y: &mut [f32],
    ) -> Result<(), KernelError>;

    /// Short name for start-up lines and statistics.
    fn name(&self) -> &'static str;
}

/// The CPU backend (the current rayon pool does the work).
#[derive(Debug, Default, Clone, Copy)]
pub struct Cpu;

impl Compute for Cpu {
    fn linear(
        &self,
        ty: GgmlType,
        w: &[u8],
        rows: usize,
        cols: usize,
        x: &[f32],
        n: usize,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        if n == 1 {
            matvec(ty, w, rows, cols, x, y)
        } else {
            matmul(ty, w, rows, cols, x, n, y)
        }
    }

    fn name(&self) -> &'static str {
        "cpu"
    }
}
