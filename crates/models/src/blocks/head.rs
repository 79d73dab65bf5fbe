//! The ends of the network: token embedding rows in, logits out.

use sluice_kernels::dequantize_row;

use super::{check_finite, Batch, Env, Stage};
use crate::weights::Mat;
use crate::ModelError;

/// Embedding rows of the batch's tokens (`[T, n_embd]`), each multiplied by `scale`
/// (Gemma scales by sqrt(n_embd); 1.0 = none).
pub fn embed(
    env: &Env<'_>,
    table: &Mat,
    batch: &Batch<'_>,
    scale: f32,
) -> Result<Vec<f32>, ModelError> {
    let e = table.cols;
    let bytes = table.bytes(env.map);
    let row_bytes = table.ty.row_bytes(e as u64).unwrap_or(0) as usize;
    let mut x = vec![0.0f32; batch.len() * e];
    for (row, &tok) in x.chunks_mut(e).zip(batch.tokens) {
        let start = tok as usize * row_bytes;
        dequantize_row(table.ty, &bytes[start..start + row_bytes], row)?;
        if scale != 1.0 {
            row.iter_mut().for_each(|v| *v *= scale);
        }
    }
    Ok(x)
}

/// Final RMS norm of the selected rows of `x` (`[T, E]`) and the output projection.
pub fn logits(
    env: &Env<'_>,
    x: &[f32],
    rows: &[usize],
    norm: &[f32],
    eps: f32,
    output: &Mat,
) -> Result<Vec<f32>, ModelError> {
    let e = norm.len();
    let mut h = Vec::with_capacity(rows.len() * e);
    for &r in rows {
        let mut row = x[r * e..(r + 1) * e].to_vec();
        crate::ops::rms_norm_inplace(&mut row, norm, eps);
        h.extend_from_slice(&row);
    }
    env.linear(output, &h, rows.len())
}

/// Fails if the logits of `rows` (`[rows.len(), n_vocab]`) hold NaN or Inf, naming the
/// first such row's position.
pub fn check_logits(logits: &[f32], rows: &[usize], batch: &Batch<'_>) -> Result<(), ModelError> {
    let positions: Vec<usize> = rows.iter().map(|&r| batch.positions[r]).collect();
    let width = logits.len() / rows.len().max(1);
    check_finite(logits, width, &positions, Stage::Logits)
}
