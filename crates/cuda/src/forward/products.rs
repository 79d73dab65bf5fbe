//! The weight products of the GPU decoder: [`GpuDecoder::mv`] (over the chunk table a
//! [`Rows`] names) picks, for up to three matrices of one format and shape, the tensor-core kernel (`mvt_*`, or `mvt1_*` for chunks
//! of at most 8 rows with [`Mvt1Staging`]'s staging) or the f32 one (`mvg_*`), and launches
//! it over a chunk table.

use sluice_kernels::GgmlType;
use sluice_models::ModelError;

use crate::forward::scratch::Rows;
use crate::forward::{i32_of, DMat, GpuDecoder, MVG_N};
use crate::{kernels, Mma};

/// Whether the tensor-core products (`mvt_*`, f16 operands) take weights of `ty`: every
/// format whose values f16 holds, i.e. all but F32 and BF16 (their range and precision
/// stay on the f32 kernels).
pub(crate) fn takes_f16(ty: GgmlType) -> bool {
    !matches!(ty, GgmlType::F32 | GgmlType::BF16)
}

/// Whether the int8 tensor-core products (`mvi_*`, forward.cu's `I8_FORMAT`) take weights
/// of `ty`: Q8_0 and Q4_K.
pub(crate) fn takes_i8(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q8_0 | GgmlType::Q4_K)
}

/// Bytes of one 32-column block of `quant_x8`'s output (`QX_BYTES`: 32 quants, f32
/// scale, f32 sum, 8 bytes unused), and of the quantized input of a product over `chunks` chunks of a
/// `cols`-column input (a row per chunk row, MVG_N a chunk).
pub(crate) const QX_BYTES: usize = 48;

/// Weight rows and threads of a block of the dp4a decode kernel `mvq_*` (`MVQ_ROWS`).
pub(crate) const MVQ_ROWS: usize = 8;

pub(crate) const MVQ_THREADS: u32 = 4 * 32;

/// Threads of a `quant_x8` block (four a 32-column block).
pub(crate) const QX_THREADS: u32 = 256;

pub(crate) fn xq_bytes(chunks: usize, cols: usize) -> usize {
    chunks * crate::forward::MVG_N * cols.div_ceil(32) * QX_BYTES
}

/// Weight rows and threads of one block of `mvt_*` (`MVT_ROWS`, `MVT_WARPS` of
/// `forward.cu`) and of `mvg_*` (a warp per row, `MVG_WARPS`).
pub(crate) const MVT_ROWS: usize = 16;

pub(crate) const MVT_THREADS: u32 = 16 * 32;

/// Threads of one block of the decode kernel `mvd_*` (`MVD_WARPS` of `forward.cu`).
pub(crate) const MVD_THREADS: u32 = 4 * 32;

/// `mvd_*`'s default staging: up to four 512-column steps in flight.
pub(crate) const MVD_STAGES: usize = 4;

/// The fewest blocks a decode product takes `mvd_*` with (about 4 an SM of the H200). On
/// the 30B-A3B Q4_K cut (ncu, per launch, mvt1 -> mvd): routed gate + up (768 blocks)
/// 33.6 -> 26.9 us, down (1024) 23.1 -> 16.7; q + k + v (320) 18.6 -> 19.6, o (128) 16.6
/// -> 34.8, the head (19) 9.5 -> 17.4: fewer blocks than SMs' worth leave `mvd_*` slower.
pub(crate) const MVD_MIN_BLOCKS: usize = 512;

pub(crate) const MVG_ROWS: usize = 4;

pub(crate) const MVG_THREADS: u32 = MVG_ROWS as u32 * 32;

/// Columns of one step of `mvt_*` (MVT_WARPS * 32) and the bytes of `mvt1_*`'s partial
/// sums (`MVT_PART(1)`), the least dynamic shared memory it takes.
pub(crate) const MVT_STEP: usize = 512;

pub(crate) const MVT1_PART: usize = 16 * 4 * 32 * 4;

pub(crate) const MVT1_MAX_STAGES: usize = 8;

/// The decode kernel's default staging: three steps of 1536 columns in flight. On the H200
/// (tg64, `SLUICE_CUDA_MVT1_STAGES` / `SLUICE_CUDA_MVT1_STEP` swept in one call): 30B-A3B
/// Q4_K 158.1 t/s vs 130.1 with 512-column steps (145.2 for the static 3 x 16 KB buffers
/// before), GLM-5.2 4-layer cut (Q8_0, IQ2_XXS) 307.9 vs 212.0, Gemma 3 cut 4293 vs 3807;
/// 2048-column and wider steps were slower on the 30B and the GLM cut (115.6, 200.7) and
/// about even on the Gemma cut (4321-4340); more stages gained nothing.
pub(crate) const MVT1_STAGES: usize = 3;

pub(crate) const MVT1_STEP: usize = 1536;

/// How the decode kernel `mvt1_*` stages a matrix's bytes: `stages` steps at once of
/// `step` columns (a multiple of MVT_STEP; fewer when the matrix has fewer or their bytes
/// pass `stage_bytes`, 0: no byte limit), in at most `smem_max` bytes of shared memory.
/// Never changes a bit (forward.cu: a warp takes the same column groups in the same order
/// whatever the step).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mvt1Staging {
    pub(crate) stages: usize,
    pub(crate) step: usize,
    pub(crate) stage_bytes: usize,
    pub(crate) smem_max: usize,
    /// No more stages than the matrix has steps (`mvd_*`: less shared memory a block, more
    /// blocks an SM).
    pub(crate) fit_steps: bool,
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(default)
}

/// The fewest blocks a decode product takes `mvd_*` with ([`MVD_MIN_BLOCKS`], or
/// `SLUICE_CUDA_MVD_MIN_BLOCKS`; `SLUICE_CUDA_DECODE=mvt1`: never).
pub(crate) fn mvd_min_blocks() -> usize {
    if std::env::var("SLUICE_CUDA_DECODE").is_ok_and(|v| v == "mvt1") {
        usize::MAX
    } else {
        env_usize("SLUICE_CUDA_MVD_MIN_BLOCKS", MVD_MIN_BLOCKS)
    }
}

impl Mvt1Staging {
    /// `mvt1_*`'s staging: [`MVT1_STAGES`] steps of [`MVT1_STEP`] columns (or
    /// `SLUICE_CUDA_MVT1_STAGES` / `_STEP` / `_STAGE_KB`) within `smem_max` bytes.
    pub(crate) fn mvt1(smem_max: usize) -> Mvt1Staging {
        Mvt1Staging {
            stages: env_usize("SLUICE_CUDA_MVT1_STAGES", MVT1_STAGES).clamp(1, MVT1_MAX_STAGES),
            step: env_usize("SLUICE_CUDA_MVT1_STEP", MVT1_STEP),
            stage_bytes: env_usize("SLUICE_CUDA_MVT1_STAGE_KB", 0) * 1024,
            smem_max,
            fit_steps: false,
        }
    }

    /// `mvd_*`'s: small stages (512 columns), up to [`MVD_STAGES`] of them within
    /// SLUICE_CUDA_MVD_SMEM_KB (32) of shared memory, so that many 4-warp blocks fit an SM
    /// (`SLUICE_CUDA_MVD_STAGES` / `_STEP` for A/B).
    pub(crate) fn mvd(smem_max: usize) -> Mvt1Staging {
        Mvt1Staging {
            stages: env_usize("SLUICE_CUDA_MVD_STAGES", MVD_STAGES).clamp(1, MVT1_MAX_STAGES),
            step: env_usize("SLUICE_CUDA_MVD_STEP", MVT_STEP),
            stage_bytes: 0,
            smem_max: (env_usize("SLUICE_CUDA_MVD_SMEM_KB", 32) * 1024).clamp(MVT1_PART, smem_max),
            fit_steps: true,
        }
    }

    /// (stages, step columns, stage buffer bytes, dynamic shared memory) for a matrix of
    /// `cols` columns and `row_bytes` a row.
    pub(crate) fn layout(&self, cols: usize, row_bytes: usize) -> (usize, usize, usize, usize) {
        let per_step = MVT_ROWS * MVT_STEP * row_bytes / cols;
        let fit = |bytes: usize| (bytes / per_step.max(1)).max(1);
        let mut mult = (self.step / MVT_STEP).max(1);
        if self.stage_bytes > 0 {
            mult = mult.min(fit(self.stage_bytes));
        }
        mult = mult.min(cols.div_ceil(MVT_STEP)).min(fit(self.smem_max));
        let step = MVT_STEP * mult;
        let stage = (per_step * mult).next_multiple_of(16);
        let mut stages = self.stages.clamp(1, (self.smem_max / stage).max(1));
        if self.fit_steps {
            stages = stages.min(cols.div_ceil(step)).max(1);
        }
        (stages, step, stage, (stages * stage).max(MVT1_PART))
    }
}

impl GpuDecoder {
    /// `y[rows_of_chunks] = W x` for every `(W, y)` of `parts`, through the chunk table
    /// `rows` names (its chunks in grid y); `x_div` chunk rows per row of `x` (the routed
    /// experts' (token, slot) rows read their token's input). Consecutive matrices of the
    /// same format and shape (q, k and v; gate and up) share a launch, up to three.
    pub(crate) fn mv(
        &self,
        parts: &[(&DMat, u64)],
        rows: Rows,
        x: u64,
        x_div: usize,
    ) -> Result<(), ModelError> {
        let Rows {
            table: chunks,
            count: nchunks,
            chunks: grid_y,
            small,
            xq,
            xq_bytes: xq_cap,
            rows_max,
        } = rows;
        if grid_y == 0 {
            return Ok(());
        }
        let gy = u32::try_from(grid_y)
            .ok()
            .filter(|&g| g <= 65_535)
            .ok_or_else(|| ModelError::Compute(format!("cuda: {grid_y} chunks in one launch")))?;
        let mut rest = parts;
        while let Some((&(m, _), _)) = rest.split_first() {
            let same = |(o, _): &&(&DMat, u64)| {
                o.fi == m.fi && o.cols == m.cols && o.row_bytes == m.row_bytes
            };
            let n = rest.iter().take(3).take_while(same).count();
            let (group, tail) = rest.split_at(n);
            rest = tail;
            let mvt = match &self.f.mvt[m.fi] {
                Some(_) if small && self.d.mma == Mma::Prefill => None,
                k => k.as_ref(),
            };
            // The int8 form where the format has one (prefill and decode alike: a row's
            // bits must not depend on its chunk), over the input quantized once here.
            let int8 = match &self.f.mvi[m.fi] {
                Some(k) if self.int8 && mvt.is_some() => Some(k),
                _ => None,
            };
            // The dp4a decode product quantizes its chunk's rows itself (into shared
            // memory: `rows_max` rows of the input's blocks, where they fit; `mvi1_*` /
            // `mvid_*` otherwise, the same bits), the others read `quant_x8`'s.
            let mvq_smem = rows_max.min(MVG_N) * m.cols.div_ceil(32) * QX_BYTES;
            let mvq = match &self.f.mvq[m.fi] {
                Some([k16, k8])
                    if int8.is_some() && small && self.dp4a && mvq_smem <= self.mvt1.smem_max =>
                {
                    // 8 lanes a row where 16 would leave lanes idle: 24 blocks (the routed
                    // down product's 768 columns) are 2 blocks for 8 lanes, 1 for the rest.
                    let uneven = (1..=8).contains(&(m.cols.div_ceil(32) % 16));
                    match self.mvq_q {
                        2 => Some((k8, 2 * MVQ_ROWS)),
                        1 if uneven => Some((k8, 2 * MVQ_ROWS)),
                        _ => Some((k16, MVQ_ROWS)),
                    }
                }
                _ => None,
            };
            let mut x_in = x;
            if int8.is_some() && mvq.is_none() {
                if xq_bytes(grid_y, m.cols) > xq_cap {
                    return Err(ModelError::Compute(format!(
                        "cuda: {grid_y} chunks of {} columns pass the call's quantized input",
                        m.cols
                    )));
                }
                let blocks = (MVG_N * m.cols.div_ceil(32) * 4).div_ceil(QX_THREADS as usize);
                kernels::QuantX8 {
                    chunks,
                    n_chunks: nchunks,
                    x,
                    x_div: x_div as i32,
                    xq,
                    cols: i32_of(m.cols, "columns")?,
                }
                .launch(self, (blocks as u32, gy, 1))?;
                x_in = xq;
            }
            let mvt = int8.or(mvt);
            let decode = mvt.is_some() && small && mvq.is_none();
            // `mvd_*` where the launch has blocks enough to fill the SMs with its small
            // blocks (routed experts); `mvt1_*`'s 16-warp blocks otherwise (fewer, wider
            // matrices: o, the head), whose column steps its warps share. The same bits.
            let tiles: usize = group.iter().map(|(d, _)| d.rows.div_ceil(MVT_ROWS)).sum();
            let use_mvd = decode && tiles * grid_y >= self.mvd_min_blocks;
            let (k, rows_per_block, threads) = match mvt {
                _ if mvq.is_some() => {
                    let (k, rows) = mvq.expect("some");
                    (k, rows, MVQ_THREADS)
                }
                Some([_, _, d]) if use_mvd => (d, MVT_ROWS, MVD_THREADS),
                Some([one, four, _]) => (if small { one } else { four }, MVT_ROWS, MVT_THREADS),
                None => (&self.f.mvg[m.fi], MVG_ROWS, MVG_THREADS),
            };
            // Unused slots: no rows (no blocks), their table and output never read.
            let part = |i: usize| group.get(i).map_or((m, 0, 0u64), |&(d, y)| (d, d.rows, y));
            let (p0, p1, p2) = (part(0), part(1), part(2));
            let blocks: usize = [p0.1, p1.1, p2.1]
                .iter()
                .map(|r| r.div_ceil(rows_per_block))
                .sum();
            let mut smem = 0;
            if mvq.is_some() {
                smem = mvq_smem;
            }
            let mut staging = None;
            if decode {
                let st = if use_mvd { &self.mvd } else { &self.mvt1 };
                let (stages, step, stage, bytes) = st.layout(m.cols, m.row_bytes as usize);
                staging = Some([stages as i32, step as i32, stage as i32]);
                smem = bytes;
            }
            kernels::Mv {
                w0: self.ptrs_base + 8 * p0.0.tab as u64,
                w1: self.ptrs_base + 8 * p1.0.tab as u64,
                w2: self.ptrs_base + 8 * p2.0.tab as u64,
                chunks,
                n_chunks: nchunks,
                x: x_in,
                x_div: x_div as i32,
                y0: p0.2,
                y1: p1.2,
                y2: p2.2,
                rows0: i32_of(p0.1, "rows")?,
                rows1: i32_of(p1.1, "rows")?,
                rows2: i32_of(p2.1, "rows")?,
                cols: i32_of(m.cols, "columns")?,
                row_bytes: m.row_bytes,
                staging,
            }
            .launch(self, k, (blocks as u32, gy, 1), threads, smem)?;
        }
        Ok(())
    }

    /// `y = W x` for every `(W, y)` of `parts` over the rows `rows` names ([`Self::mv`] with
    /// one row of X per output row).
    pub(crate) fn mv_rows(
        &self,
        parts: &[(&DMat, u64)],
        rows: Rows,
        x: u64,
    ) -> Result<(), ModelError> {
        self.mv(parts, rows, x, 1)
    }
}
