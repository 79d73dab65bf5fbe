//! The one interface through which blocks reach the kernels.
//!
//! Owns: [`Compute`], the operations the shared blocks need from a backend (today the
//! weight-times-activations product), and [`Cpu`], its implementation over
//! `sluice-kernels` (scalar / AVX2 / AVX-512 picked at run time). A GPU backend is one more
//! implementation of this trait, not a fork of every architecture.

use rayon::prelude::*;
use sluice_kernels::{
    matmul, matvec, matvec_rows, BatchScratch, GgmlType, KernelError, PreparedBatch, QuantizedActs,
};

/// Which routed-expert matrix a job's weights are: a backend may cache experts by this
/// identity (the bytes themselves may sit in a RAM cache slot reused for other experts).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct UnitKey {
    pub layer: u32,
    pub unit: u32,
    /// The matrix within the unit (0 gate, 1 up, 2 down for GLU experts).
    pub part: u8,
}

/// One product of a [`Compute::linear_group`]: `y[n, rows] = x[n, cols] W^T`.
pub struct LinearJob<'a> {
    pub ty: GgmlType,
    pub w: &'a [u8],
    pub rows: usize,
    pub cols: usize,
    pub x: &'a [f32],
    pub n: usize,
    pub y: &'a mut [f32],
    /// The routed expert these weights belong to (None for every other matrix).
    pub unit: Option<UnitKey>,
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

    /// All jobs run as one parallel pass over (job, row block) tasks, each input prepared
    /// once per weight type: single-token jobs with `matvec_rows`, several-token jobs
    /// with the register-blocked kernels of a `PreparedBatch`.
    fn linear_group(&self, jobs: &mut [LinearJob<'_>]) -> Result<(), KernelError> {
        let well_formed_n = |j: &LinearJob<'_>| {
            j.rows > 0
                && j.n > 0
                && j.y.len() == j.rows * j.n
                && j.x.len() == j.cols * j.n
                && j.w.len().is_multiple_of(j.rows)
        };
        // A single job, or a shape the kernels must report: one at a time.
        if jobs.len() == 1 || jobs.iter().any(|j| !well_formed_n(j)) {
            for j in jobs.iter_mut() {
                self.linear(j.ty, j.w, j.rows, j.cols, j.x, j.n, j.y)?;
            }
            return Ok(());
        }
        if jobs.iter().any(|j| j.n != 1) {
            return grouped_matmul(jobs);
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

/// Several-token jobs in one parallel pass: each input prepared once per weight type
/// ([`PreparedBatch`]), tasks over (job, row block) write disjoint rows of per-job
/// `[rows, n]` buffers, transposed into `y` afterwards. Same bits as `matmul` per job.
fn grouped_matmul(jobs: &mut [LinearJob<'_>]) -> Result<(), KernelError> {
    // Distinct (input, weight type) pairs, each prepared once, in parallel.
    let mut keys: Vec<(usize, usize, GgmlType)> = Vec::new();
    let mut meta = Vec::with_capacity(jobs.len());
    for j in jobs.iter() {
        let key = (j.x.as_ptr() as usize, j.x.len(), j.ty);
        let idx = keys.iter().position(|k| *k == key).unwrap_or_else(|| {
            keys.push(key);
            keys.len() - 1
        });
        // (weights, row bytes, tokens, batch index)
        meta.push((j.w, j.w.len() / j.rows, j.n, idx));
    }
    let first_job: Vec<usize> = (0..keys.len())
        .map(|bi| {
            meta.iter()
                .position(|m| m.3 == bi)
                .expect("every key has a job")
        })
        .collect();
    let batches: Vec<((), PreparedBatch)> = first_job
        .par_iter()
        .map(|&ji| {
            let j = &jobs[ji];
            PreparedBatch::new(j.ty, j.x, j.n, j.cols).map(|b| ((), b))
        })
        .collect::<Result<_, _>>()?;
    let total: usize = jobs.iter().map(|j| j.rows * j.n).sum();
    let threads = rayon::current_num_threads().max(1);
    let mut yts: Vec<Vec<f32>> = jobs.iter().map(|j| vec![0.0f32; j.rows * j.n]).collect();
    let mut tasks: Vec<(usize, usize, &mut [f32])> = Vec::new();
    for (ji, yt) in yts.iter_mut().enumerate() {
        let (_, _, n, bi) = meta[ji];
        // About 8 tasks per thread over all jobs (in row-token products), whole row groups.
        let group = batches[bi].1.row_group();
        let rows_per = (total.div_ceil(threads * 8) / n)
            .max(8)
            .next_multiple_of(group);
        for (c, ys) in yt.chunks_mut(rows_per * n).enumerate() {
            tasks.push((ji, c * rows_per, ys));
        }
    }
    let (meta_r, batches_r) = (&meta, &batches);
    tasks.into_par_iter().try_for_each_init(
        || -> Vec<Option<BatchScratch>> { (0..batches_r.len()).map(|_| None).collect() },
        |scratch, (ji, r0, ys)| {
            let (w, rb, n, bi) = meta_r[ji];
            let nr = ys.len() / n;
            let b = &batches_r[bi].1;
            let s = scratch[bi].get_or_insert_with(|| b.scratch());
            b.rows_t_with(s, &w[r0 * rb..(r0 + nr) * rb], ys)
        },
    )?;
    jobs.par_iter_mut().zip(&yts).for_each(|(j, yt)| {
        let (rows, n) = (j.rows, j.n);
        for (r, yrow) in yt.chunks(n).enumerate() {
            for (t, &v) in yrow.iter().enumerate() {
                j.y[t * rows + r] = v;
            }
        }
    });
    Ok(())
}
