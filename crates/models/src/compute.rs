//! The one interface through which blocks reach the kernels.
//!
//! Owns: [`Compute`], the operations the shared blocks need from a backend (today the
//! weight-times-activations product), and [`Cpu`], its implementation over
//! `sluice-kernels` (scalar / AVX2 / AVX-512 picked at run time). A GPU backend is one more
//! implementation of this trait, not a fork of every architecture.

use std::sync::Mutex;

use sluice_kernels::{
    matmul, matvec, matvec_rows, pool, BatchInput, BatchScratch, GgmlType, KernelError,
    PreparedBatch, QuantizedActs,
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
    /// logits), and must write every element of `y` (callers may pass buffers holding
    /// stale values, see `blocks::take_buf`).
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

/// A backend shared through an `Arc` (e.g. one a caller also inspects after the run) is a
/// backend: every call goes to the shared one.
impl<C: Compute + ?Sized> Compute for std::sync::Arc<C> {
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
        (**self).linear(ty, w, rows, cols, x, n, y)
    }

    fn linear_group(&self, jobs: &mut [LinearJob<'_>]) -> Result<(), KernelError> {
        (**self).linear_group(jobs)
    }

    fn name(&self) -> &'static str {
        (**self).name()
    }
}

/// The CPU backend: every product runs on the persistent compute pool
/// ([`sluice_kernels::pool`], as many threads as the current rayon pool has).
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
        let mut jobs = [LinearJob {
            ty,
            w,
            rows,
            cols,
            x,
            n,
            y,
            unit: None,
        }];
        self.linear_group(&mut jobs)
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
        // A shape the kernels must report (or an empty product): the plain drivers.
        if jobs.iter().any(|j| !well_formed_n(j)) {
            for j in jobs.iter_mut() {
                if j.n == 1 {
                    matvec(j.ty, j.w, j.rows, j.cols, j.x, j.y)?;
                } else {
                    matmul(j.ty, j.w, j.rows, j.cols, j.x, j.n, j.y)?;
                }
            }
            return Ok(());
        }
        if jobs.iter().any(|j| j.n != 1) {
            return grouped_matmul(jobs);
        }
        grouped_matvec(jobs)
    }

    fn name(&self) -> &'static str {
        "cpu"
    }
}

/// Weight bytes one task should at least cover (below this, handing a task out costs
/// more than it saves).
const MIN_TASK_BYTES: usize = 16 * 1024;
/// Tasks per thread a pass aims at (the atomic hand-out balances them).
const TASKS_PER_THREAD: usize = 8;
/// Tasks per thread of a single-token pass (decode): fewer, longer contiguous row ranges,
/// each walked as one stream (the AMD row walks). 12-layer 30B-shape Q4_K, AVX2 tier,
/// `sluice bench -t 2 -p 0 -n 32 -r 2`, AMD EPYC Zen 4, 7 alternated rounds, medians: 8
/// tasks 64.0 tok/s, 4 tasks 69.0 (32: 42-63, 2: 61.5-75.0); the 30B-shape Q8_0 and
/// Gemma 3 270M unchanged within noise (3 rounds: 37.1 / 37.7, 80.6 / 83.4).
const MATVEC_TASKS_PER_THREAD: usize = 4;

/// The first error any task reported.
struct FirstError(Mutex<Option<KernelError>>);

impl FirstError {
    fn new() -> Self {
        FirstError(Mutex::new(None))
    }
    fn set(&self, r: Result<(), KernelError>) {
        if let Err(e) = r {
            lock(&self.0).get_or_insert(e);
        }
    }
    fn result(self) -> Result<(), KernelError> {
        match self.0.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Distinct (input, weight type) keys of `jobs` and each job's key index.
fn input_keys(jobs: &[LinearJob<'_>]) -> (Vec<usize>, Vec<usize>) {
    let mut keys: Vec<(usize, usize, GgmlType)> = Vec::new();
    let mut first = Vec::new();
    let idx = jobs
        .iter()
        .enumerate()
        .map(|(ji, j)| {
            let key = (j.x.as_ptr() as usize, j.x.len(), j.ty);
            keys.iter().position(|k| *k == key).unwrap_or_else(|| {
                keys.push(key);
                first.push(ji);
                keys.len() - 1
            })
        })
        .collect();
    (first, idx)
}

/// Rows per task for a matrix of `rb`-byte rows in a pass over `total_bytes` of weights,
/// `per_thread` tasks per thread.
fn rows_per_task(rb: usize, total_bytes: usize, threads: usize, per_thread: usize) -> usize {
    let bytes = total_bytes
        .div_ceil(threads * per_thread)
        .max(MIN_TASK_BYTES);
    (bytes / rb.max(1)).max(1)
}

/// Single-token jobs in one pass: activations quantized once per distinct input, then
/// (job, row block) tasks with `matvec_rows` (same bits as `matvec`).
fn grouped_matvec(jobs: &mut [LinearJob<'_>]) -> Result<(), KernelError> {
    let (first, idx) = input_keys(jobs);
    let acts: Vec<QuantizedActs> = if first.len() == 1 {
        vec![QuantizedActs::new(jobs[first[0]].ty, jobs[first[0]].x)?]
    } else {
        let slots: Vec<Mutex<Option<Result<QuantizedActs, KernelError>>>> =
            first.iter().map(|_| Mutex::new(None)).collect();
        let jr = &*jobs;
        pool::run(first.len(), &|_, i| {
            let j = &jr[first[i]];
            *lock(&slots[i]) = Some(QuantizedActs::new(j.ty, j.x));
        });
        slots
            .into_iter()
            .map(|s| {
                s.into_inner()
                    .unwrap_or_else(|p| p.into_inner())
                    .expect("every input prepared")
            })
            .collect::<Result<_, _>>()?
    };
    let threads = pool::threads();
    let total: usize = jobs.iter().map(|j| j.w.len()).sum();
    // (type, weights, columns, row bytes, activation index)
    let meta: Vec<_> = jobs
        .iter()
        .zip(&idx)
        .map(|(j, &ai)| (j.ty, j.w, j.cols, j.w.len() / j.rows, ai))
        .collect();
    let mut tasks: Vec<Mutex<(usize, usize, &mut [f32])>> = Vec::new();
    for (ji, j) in jobs.iter_mut().enumerate() {
        let per = rows_per_task(meta[ji].3, total, threads, MATVEC_TASKS_PER_THREAD);
        for (c, ys) in j.y.chunks_mut(per).enumerate() {
            tasks.push(Mutex::new((ji, c * per, ys)));
        }
    }
    let err = FirstError::new();
    pool::run(tasks.len(), &|_, i| {
        let mut t = lock(&tasks[i]);
        let (ji, r0, ref mut ys) = *t;
        let (ty, w, cols, rb, ai) = meta[ji];
        let w = &w[r0 * rb..(r0 + ys.len()) * rb];
        err.set(matvec_rows(ty, w, cols, &acts[ai], ys));
    });
    err.result()
}

/// Several-token jobs in one parallel pass: each input prepared once per weight type
/// ([`PreparedBatch`]), tasks over (job, row block) write their rows of every token's
/// output row in place. Same bits as `matmul` per job.
fn grouped_matmul(jobs: &mut [LinearJob<'_>]) -> Result<(), KernelError> {
    let (first, idx) = input_keys(jobs);
    // One pool pass over the tokens of every distinct input (an input shared by several
    // weight types of one activation format is quantized once per token).
    let inputs: Vec<BatchInput<'_>> = first
        .iter()
        .map(|&ji| {
            let j = &jobs[ji];
            BatchInput {
                ty: j.ty,
                x: j.x,
                n: j.n,
                cols: j.cols,
            }
        })
        .collect();
    let batches: Vec<PreparedBatch> = PreparedBatch::new_many(&inputs)
        .into_iter()
        .collect::<Result<_, _>>()?;
    let threads = pool::threads();
    // Weight bytes times tokens: the work of a job.
    let total: usize = jobs.iter().map(|j| j.w.len() * j.n).sum();
    // (weights, row bytes, tokens, batch index)
    let meta: Vec<_> = jobs
        .iter()
        .zip(&idx)
        .map(|(j, &bi)| (j.w, j.w.len() / j.rows, j.n, bi))
        .collect();
    // Tasks over (job, row block); each gets token t's piece `y[t][r0..r0 + nr]` of every
    // token row, so the kernels write the `[n, rows]` output directly (no transposition).
    // (job, first row, rows, one slice per token)
    type Task<'y> = (usize, usize, usize, Vec<&'y mut [f32]>);
    let mut tasks: Vec<Task<'_>> = Vec::new();
    for (ji, j) in jobs.iter_mut().enumerate() {
        let (_, rb, n, bi) = meta[ji];
        // Whole row groups of the register-blocked kernels.
        let group = batches[bi].row_group();
        let per = rows_per_task(rb * n, total, threads, TASKS_PER_THREAD).next_multiple_of(group);
        let first = tasks.len();
        for r0 in (0..j.rows).step_by(per) {
            let nr = per.min(j.rows - r0);
            tasks.push((ji, r0, nr, Vec::with_capacity(n)));
        }
        for yrow in j.y.chunks_mut(j.rows) {
            let mut rest = yrow;
            for t in &mut tasks[first..] {
                let (piece, tail) = std::mem::take(&mut rest).split_at_mut(t.2);
                t.3.push(piece);
                rest = tail;
            }
        }
    }
    // Largest tasks first (experts get different token counts), so the last tasks
    // handed out are small and threads finish together.
    // (cost: weight bytes times tokens = output values times row bytes)
    tasks.sort_by_key(|(ji, _, nr, _)| std::cmp::Reverse(nr * meta[*ji].2 * meta[*ji].1));
    let tasks: Vec<Mutex<Task<'_>>> = tasks.into_iter().map(Mutex::new).collect();
    // Per-thread scratch, one per prepared input.
    let scratch: Vec<Mutex<Vec<Option<BatchScratch>>>> = (0..threads)
        .map(|_| Mutex::new((0..batches.len()).map(|_| None).collect()))
        .collect();
    let err = FirstError::new();
    pool::run(tasks.len(), &|worker, i| {
        let mut t = lock(&tasks[i]);
        let (ji, r0, nr, ref mut out) = *t;
        let (w, rb, _, bi) = meta[ji];
        let b = &batches[bi];
        let mut sc = lock(&scratch[worker]);
        let s = sc[bi].get_or_insert_with(|| b.scratch());
        err.set(b.rows_tokens_with(s, &w[r0 * rb..(r0 + nr) * rb], out));
    });
    drop(tasks);
    err.result()
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_kernels::formats::quantize_row_q8_0;

    fn data(len: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        (0..len)
            .map(|_| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (s >> 8) as f32 / (1u32 << 24) as f32 - 0.5
            })
            .collect()
    }

    fn q8_matrix(rows: usize, cols: usize, seed: u32) -> Vec<u8> {
        let w = data(rows * cols, seed);
        let mut out = Vec::new();
        for r in w.chunks(cols) {
            for b in quantize_row_q8_0(r) {
                out.extend_from_slice(&b.d.to_le_bytes());
                out.extend(b.qs.iter().map(|&q| q as u8));
            }
        }
        out
    }

    /// The grouped pool passes give the plain drivers' bits (`matvec` / `matmul` per
    /// job) at every thread count, with shared and distinct inputs and mixed types.
    #[test]
    fn grouped_products_match_the_plain_drivers_at_every_thread_count() {
        let cols = 256;
        let shapes = [
            (200usize, GgmlType::Q8_0),
            (64, GgmlType::Q8_0),
            (37, GgmlType::F32),
            (129, GgmlType::Q8_0),
        ];
        let ws: Vec<Vec<u8>> = shapes
            .iter()
            .enumerate()
            .map(|(i, &(rows, ty))| match ty {
                GgmlType::F32 => data(rows * cols, 50 + i as u32)
                    .iter()
                    .flat_map(|v| v.to_le_bytes())
                    .collect(),
                _ => q8_matrix(rows, cols, 10 + i as u32),
            })
            .collect();
        for n in [1usize, 3, 9] {
            let xa = data(n * cols, 1);
            let xb = data(n * cols, 2);
            // jobs 0, 1 share xa; 2, 3 share xb
            let xs = [&xa, &xa, &xb, &xb];
            let single = rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .build()
                .unwrap();
            let want: Vec<Vec<f32>> = single.install(|| {
                shapes
                    .iter()
                    .enumerate()
                    .map(|(i, &(rows, ty))| {
                        let mut y = vec![0.0f32; n * rows];
                        if n == 1 {
                            matvec(ty, &ws[i], rows, cols, xs[i], &mut y).unwrap();
                        } else {
                            matmul(ty, &ws[i], rows, cols, xs[i], n, &mut y).unwrap();
                        }
                        y
                    })
                    .collect()
            });
            for threads in [1, 2, 3, 4, 8] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let mut ys: Vec<Vec<f32>> = shapes
                    .iter()
                    .map(|&(rows, _)| vec![f32::NAN; n * rows])
                    .collect();
                pool.install(|| {
                    let mut jobs: Vec<LinearJob<'_>> = shapes
                        .iter()
                        .zip(ys.iter_mut())
                        .enumerate()
                        .map(|(i, (&(rows, ty), y))| LinearJob {
                            ty,
                            w: &ws[i],
                            rows,
                            cols,
                            x: xs[i],
                            n,
                            y,
                            unit: None,
                        })
                        .collect();
                    Cpu.linear_group(&mut jobs).unwrap();
                });
                for (i, (got, want)) in ys.iter().zip(&want).enumerate() {
                    let same = got
                        .iter()
                        .zip(want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "job {i} differs: n={n} threads={threads}");
                }
                // One product alone takes the same path.
                let mut y = vec![f32::NAN; n * shapes[0].0];
                pool.install(|| Cpu.linear(GgmlType::Q8_0, &ws[0], 200, cols, &xa, n, &mut y))
                    .unwrap();
                assert!(y
                    .iter()
                    .zip(&want[0])
                    .all(|(a, b)| a.to_bits() == b.to_bits()));
            }
        }
    }

    /// A malformed job is reported, not run.
    #[test]
    fn bad_shapes_are_errors() {
        let w = vec![0u8; 34 * 8 - 1];
        let x = vec![0.0f32; 256];
        let mut y = vec![0.0f32; 1];
        assert!(Cpu
            .linear(GgmlType::Q8_0, &w, 1, 256, &x, 1, &mut y)
            .is_err());
    }
}
