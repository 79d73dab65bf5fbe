//! The hashed n-gram PLE layer on the GPU (the CPU's `sluice_models::blocks::ple`).
//!
//! Owns: [`DPle`] (its device weights), its per-sequence convolution ring ([`PleState`];
//! the hash context it continues is the sequence's, `forward::GpuKv`) and its launches ([`GpuDecoder::ple_layer`]: key / value products of
//! the rows hashed and gathered on the host, `rms_groups`, `ple_gate`, `conv_ring` and the
//! ring store).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use sluice_models::blocks::ple::PleWeights;
use sluice_models::plan::DecoderPlan;
use sluice_models::ModelError;

use crate::forward::bufs::Io;
use crate::forward::scratch::NextBufs;
use crate::forward::state::{dup, ptr, zeros};
use crate::forward::{i32_of, DMat, GpuDecoder, Uploader};
use crate::kernels;

/// The PLE layer in VRAM (`ple::PleWeights`).
pub(crate) struct DPle {
    pub(crate) key: DMat,
    pub(crate) value: DMat,
    pub(crate) norm_key: u64,
    pub(crate) norm_query: u64,
    pub(crate) norm_conv: u64,
    pub(crate) conv: u64,
    pub(crate) kernel: usize,
    pub(crate) dilation: usize,
}

/// The PLE layer's state for a sequence: its convolution ring, the last `(kernel - 1) *
/// dilation` normed gated values of every stream (not read by a batch starting at 0).
pub(crate) struct PleState {
    pub(crate) ring: CudaSlice<f32>,
}

impl PleState {
    /// Zeros for streams `width` values wide.
    pub(crate) fn new(
        stream: &Arc<CudaStream>,
        w: &DPle,
        width: usize,
    ) -> Result<PleState, ModelError> {
        Ok(PleState {
            ring: zeros(stream, (w.kernel - 1) * w.dilation * width, "PLE state")?,
        })
    }

    /// A copy on the device (a snapshot); None if a copy failed.
    pub(crate) fn copy(&self, stream: &Arc<CudaStream>) -> Option<PleState> {
        Some(PleState {
            ring: dup(stream, &self.ring)?,
        })
    }

    /// The ring's device address.
    pub(crate) fn ptr(&self, stream: &Arc<CudaStream>) -> u64 {
        ptr(stream, &self.ring)
    }
}

impl Uploader<'_> {
    pub(crate) fn ple(&mut self, w: &PleWeights) -> Result<DPle, String> {
        Ok(DPle {
            key: self.mat(&w.key)?,
            value: self.mat(&w.value)?,
            norm_key: self.norm(&w.norm_key)?,
            norm_query: self.norm(&w.norm_query)?,
            norm_conv: self.norm(&w.norm_conv)?,
            conv: self.norm(&w.conv)?,
            kernel: w.kernel,
            dilation: w.dilation,
        })
    }
}

impl GpuDecoder {
    /// The PLE layer `w` on the streams `x` (`[n][s][e]`) from the gathered rows in `b.pe`:
    /// `x += G + silu(conv(norm(G)))`, the convolution reading the ring `hist` for
    /// positions before the batch; the ring gets the batch's last values after.
    pub(crate) fn ple_layer(
        &self,
        w: &DPle,
        (s, x): (usize, u64),
        hist: u64,
        io: &Io,
        b: &NextBufs,
    ) -> Result<(), ModelError> {
        let Io {
            n, pos, rows, eps, ..
        } = *io;
        let e = self.plan.n_embd;
        let ei = i32_of(e, "n_embd")?;
        let width = s * e;
        let norm = |src: u64, wt: u64, dst: u64| {
            kernels::RmsGroups {
                x: src,
                w: wt,
                out: dst,
                e: ei,
                eps,
            }
            .launch(self, (n as u32, s as u32, 1))
        };
        self.mv_rows(&[(&w.key, b.pk), (&w.value, b.pv)], rows, b.pe)?;
        norm(b.pk, w.norm_key, b.pkn)?;
        norm(x, w.norm_query, b.pq)?;
        kernels::PleGate {
            k: b.pkn,
            q: b.pq,
            v: b.pv,
            gv: b.gv,
            e: ei,
        }
        .launch(self, (n as u32, s as u32, 1))?;
        norm(b.gv, w.norm_conv, b.pn)?;
        let taps = (w.conv, w.kernel, w.dilation);
        self.conv(b.pn, hist, taps, b.gv, x, pos, width, n)
    }
}

/// What the PLE kernels refuse of layer `il`'s PLE layer `w`: no hash in the plan, shapes
/// unlike the streams'. The reason when not.
pub(crate) fn check_layer(plan: &DecoderPlan, il: usize, w: &PleWeights) -> Result<(), String> {
    let e = plan.n_embd;
    let d = plan.lowrank.as_ref().map_or(1, |lr| lr.n_stream) * e;
    let Some(pp) = &plan.ple else {
        return Err(format!("layer {il}: a PLE layer without the plan's hash"));
    };
    let heads = pp.hash.n_heads();
    let width = heads * (e / heads.max(1));
    let ok = heads > 0
        && w.kernel > 0
        && w.dilation > 0
        && (w.key.rows, w.key.cols, w.value.rows, w.value.cols) == (d, width, e, width)
        && w.norm_key.len() == d
        && w.norm_query.len() == d
        && w.norm_conv.len() == d
        && w.conv.len() == d * w.kernel;
    if !ok {
        return Err(format!(
            "layer {il}: PLE layer shapes do not match the streams"
        ));
    }
    Ok(())
}
