//! The one interface through which blocks reach the kernels.
//!
//! Owns: [`Compute`], the operations the shared blocks need from a backend (today the
//! weight-times-activations product), and [`Cpu`], its implementation over
//! `sluice-kernels` (scalar / AVX2 / AVX-512 picked at run time). A GPU backend is one more
//! implementation of this trait, not a fork of every architecture.

use rayon::prelude::*;
use sluice_kernels::{matmul, matvec, matvec_rows, GgmlType, KernelError, QuantizedActs};

/// One product of a [`Compute::linear_group`]: `y[n, rows] = x[n, cols] W^T`.
pub struct LinearJob<'a> {
    pub ty: GgmlType,
    pub w: &'a [u8],
    pub rows: usize,
    pub cols: usize,
    pub x: &'a [f32],
    pub n: usize,
    pub y: &'a mut [f32],
}

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

    /// Several independent products at once (e.g. the gate and up matrices of every
    /// expert a token uses). Same bits as calling [`Compute::linear`] on each; a backend
    /// may schedule them together (one pass, one barrier).
    fn linear_group(&self, jobs: &mut [LinearJob<'_>]) -> Result<(), KernelError> {
        for j in jobs.iter_mut() {
            self.linear(j.ty, j.w, j.rows, j.cols, j.x, j.n, j.y)?;
        }
        Ok(())
    }

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

    /// Single-token jobs run as one parallel pass over (job, row block) tasks, each
    /// activation prepared once per (input, weight type); jobs with several tokens use
    /// the register-blocked matmul one after another.
    fn linear_group(&self, jobs: &mut [LinearJob<'_>]) -> Result<(), KernelError> {
        let well_formed = |j: &LinearJob<'_>| {
            j.rows > 0
                && j.y.len() == j.rows
                && j.x.len() == j.cols
                && j.w.len().is_multiple_of(j.rows)
        };
        // Several tokens, a single job, or a shape the kernels must report: one at a time.
        if jobs.len() == 1 || jobs.iter().any(|j| j.n != 1 || !well_formed(j)) {
            for j in jobs.iter_mut() {
                self.linear(j.ty, j.w, j.rows, j.cols, j.x, j.n, j.y)?;
            }
            return Ok(());
        }
        // Activations: one per distinct (input slice, weight type).
        let mut acts: Vec<((usize, usize, GgmlType), QuantizedActs)> = Vec::new();
        let mut meta = Vec::with_capacity(jobs.len());
        for j in jobs.iter() {
            let key = (j.x.as_ptr() as usize, j.x.len(), j.ty);
            let idx = match acts.iter().position(|a| a.0 == key) {
                Some(i) => i,
                None => {
                    acts.push((key, QuantizedActs::new(j.ty, j.x)?));
                    acts.len() - 1
                }
            };
            // (type, weights, columns, row bytes, activation index)
            meta.push((j.ty, j.w, j.cols, j.w.len() / j.rows.max(1), idx));
        }
        let total_rows: usize = jobs.iter().map(|j| j.rows).sum();
        let threads = rayon::current_num_threads().max(1);
        // About 8 tasks per thread over all jobs, at least 16 rows each.
        let per_task = total_rows.div_ceil(threads * 8).max(16);
        let mut tasks: Vec<(usize, usize, &mut [f32])> = Vec::new();
        for (ji, j) in jobs.iter_mut().enumerate() {
            let rows = j.rows;
            for (c, ys) in j.y[..rows].chunks_mut(per_task).enumerate() {
                tasks.push((ji, c * per_task, ys));
            }
        }
        let (meta, acts) = (&meta, &acts);
        tasks.into_par_iter().try_for_each(|(ji, r0, ys)| {
            let (ty, w, cols, rb, ai) = meta[ji];
            let w = &w[r0 * rb..(r0 + ys.len()) * rb];
            matvec_rows(ty, w, cols, &acts[ai].1, ys)
        })
    }

    fn name(&self) -> &'static str {
        "cpu"
    }
}
