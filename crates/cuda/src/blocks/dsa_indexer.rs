//! GLM's DSA lightning indexer on the GPU (the CPU's `sluice_models::blocks::dsa_indexer`),
//! and the indexer scoring every indexed attention shares.
//!
//! Owns: [`DDsa`] (its device weights: query / key products, the keys' LayerNorm, the head
//! weights) and [`GpuDecoder::index_select`]: an indexer's scores of the rows each token
//! sees (`dsv4_index_scores`) and their top-k (`dsv4_topk`), in tiles of tokens within
//! [`SCORES_MAX`] floats ([`IndexSelect`] names the rows; DeepSeek V4's indexer, QSA's and
//! the k-pool indexer call it too). Its per-sequence state: [`DsaState`] (every position's
//! keys; [`DsaPtrs`] for a call). Its launches before the scoring are in `blocks::mla`.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use sluice_models::ModelError;

use crate::forward::bufs::IndexBufs;
use crate::forward::state::{dup, ptr, zeros};
use crate::forward::{i32_of, DMat, GpuDecoder};
use crate::kernels;

/// Blocks per token of the lightning indexer's scores (rows strided over them; a fixed
/// count, so a captured decode step replays at any position).
pub(crate) const INDEX_BLOCKS: u32 = 64;

/// Most indexer scores held at once (floats; 256 MiB): longer prompts at longer contexts
/// are scored in tiles of tokens.
pub(crate) const SCORES_MAX: usize = 1 << 26;

/// One layer's lightning indexer as `GpuDecoder::index_select` runs it: queries `iq`
/// (`[n][n_head * head_dim]`, roped), head weights `wh` (`[n][n_head]`), the rows it scores
/// (`[..][head_dim]`; token t sees `(pos + 1) / ratio` of them) and its top-k.
pub(crate) struct IndexSelect {
    pub(crate) iq: u64,
    pub(crate) wh: u64,
    pub(crate) n_head: usize,
    pub(crate) head_dim: usize,
    pub(crate) rows: u64,
    pub(crate) ratio: usize,
    pub(crate) top_k: usize,
}

/// GLM's DSA lightning indexer of one MLA layer.
pub(crate) struct DDsa {
    pub(crate) n_head: usize,
    pub(crate) head_dim: usize,
    pub(crate) top_k: usize,
    pub(crate) q_b: DMat,
    pub(crate) k: DMat,
    pub(crate) k_norm: u64,
    pub(crate) k_norm_bias: u64,
    pub(crate) k_norm_eps: f32,
    pub(crate) proj: DMat,
}

pub(crate) const IDX_MAX_Q: usize = 8192;

/// A DSA indexer's state for a sequence: every position's key (f32, LayerNorm'd, roped on
/// its first dims), written by `dsa_key_prep` before any read of its row.
pub(crate) struct DsaState {
    pub(crate) keys: CudaSlice<f32>,
}

/// [`DsaState`]'s device addresses for one call.
#[derive(Clone, Copy, Default)]
pub(crate) struct DsaPtrs {
    pub(crate) keys: u64,
}

impl DsaState {
    /// Zeros for a sequence of `n_ctx` positions.
    pub(crate) fn new(
        stream: &Arc<CudaStream>,
        ix: &DDsa,
        n_ctx: usize,
    ) -> Result<DsaState, ModelError> {
        Ok(DsaState {
            keys: zeros(stream, n_ctx * ix.head_dim, "DSA indexer state")?,
        })
    }

    /// A copy on the device (a snapshot); None if a copy failed.
    pub(crate) fn copy(&self, stream: &Arc<CudaStream>) -> Option<DsaState> {
        Some(DsaState {
            keys: dup(stream, &self.keys)?,
        })
    }

    pub(crate) fn ptrs(&self, stream: &Arc<CudaStream>) -> DsaPtrs {
        DsaPtrs {
            keys: ptr(stream, &self.keys),
        }
    }
}

impl GpuDecoder {
    /// An indexer's choice for each of `n` tokens (positions at `pos`): the scores of the
    /// rows each sees into `b.scores` (row stride `b.stride`), then the top-k into `b.sel`
    /// (`[n][top_k]`) and the counts into `b.nsel`, in tiles of `b.tile` tokens (the scores
    /// buffer holds one tile). A token's scores and choice do not depend on its tile.
    pub(crate) fn index_select(
        &self,
        ix: &IndexSelect,
        pos: u64,
        b: &IndexBufs,
        n: usize,
    ) -> Result<(), ModelError> {
        let IndexBufs {
            scores,
            stride,
            tile,
            sel,
            nsel,
            ..
        } = *b;
        let stride_i = i32_of(stride, "indexer rows")?;
        let qn = (ix.n_head * ix.head_dim) as u64;
        let mut t0 = 0;
        while t0 < n {
            let m = tile.min(n - t0);
            let t = t0 as u64;
            kernels::Dsv4IndexScores {
                iq: ix.iq + 4 * t * qn,
                // (QSA's indexer has no head weights: a null pointer.)
                wh: if ix.wh == 0 {
                    0
                } else {
                    ix.wh + 4 * t * ix.n_head as u64
                },
                rows: ix.rows,
                pos: pos + 4 * t,
                scores,
                n_head: ix.n_head as i32,
                ihd: ix.head_dim as i32,
                ratio: ix.ratio as i32,
                stride: stride_i,
            }
            .launch(self, (m as u32, INDEX_BLOCKS, 1))?;
            kernels::Dsv4Topk {
                scores,
                pos: pos + 4 * t,
                sel: sel + 4 * t * ix.top_k as u64,
                nsel: nsel + 4 * t,
                ratio: ix.ratio as i32,
                stride: stride_i,
                k: i32_of(ix.top_k, "top-k")?,
            }
            .launch(self, (m as u32, 1, 1))?;
            t0 += m;
        }
        Ok(())
    }
}
