//! Kimi delta attention on the GPU (the CPU's `sluice_models::blocks::kda`).
//!
//! Owns: [`DKda`] (its device weights), its per-sequence state ([`KdaState`]: the three
//! convolution rings and the recurrent matrices; [`KdaPtrs`] for a call), its view as a
//! delta rule
//! ([`delta_shape`]) and its launches ([`GpuDecoder::kda`]: the products, the three
//! convolutions, `kda_gate`, `delta_rule` with per-channel decay).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use sluice_models::blocks::deltanet::DeltaShape;
use sluice_models::blocks::kda::{KdaShape, KdaWeights};
use sluice_models::plan::DecoderPlan;
use sluice_models::ModelError;

use crate::blocks::deltanet::{gdn_smem, DV_MAX};
use crate::blocks::hyper_lowrank::DFew;
use crate::forward::bufs::Io;
use crate::forward::scratch::NextBufs;
use crate::forward::state::{dup, ptr, zeros};
use crate::forward::{i32_of, DMat, GpuDecoder, Uploader};
use crate::kernels;

/// Kimi delta attention of one layer in VRAM (`kda::KdaWeights`).
pub(crate) struct DKda {
    pub(crate) q: DMat,
    pub(crate) k: DMat,
    pub(crate) v: DMat,
    /// The q, k and v convolutions' taps.
    pub(crate) conv: [u64; 3],
    pub(crate) f_a: DMat,
    pub(crate) f_b: DMat,
    pub(crate) g_a: DMat,
    pub(crate) g_b: DMat,
    pub(crate) beta: DFew,
    pub(crate) dt_bias: u64,
    pub(crate) a: u64,
    pub(crate) norm: u64,
    pub(crate) out: DMat,
    pub(crate) shape: KdaShape,
}

/// A KDA layer as the delta-rule kernel sees it: a DeltaNet of as many key as value heads,
/// square, with the sigmoid-gated output norm.
pub(crate) fn delta_shape(s: &KdaShape) -> DeltaShape {
    DeltaShape {
        n_k_heads: s.n_head,
        n_v_heads: s.n_head,
        d_k: s.head_dim,
        d_v: s.head_dim,
        conv_kernel: s.conv_kernel,
        rms_eps: s.rms_eps,
        gate_sigmoid: true,
    }
}

/// One KDA layer's state for a sequence: the q, k and v convolution rings (the last
/// `kernel - 1` inputs each) and the recurrent matrices; like DeltaNet's, not read by a
/// batch starting at position 0.
pub(crate) struct KdaState {
    pub(crate) rings: [CudaSlice<f32>; 3],
    pub(crate) state: CudaSlice<f32>,
}

/// [`KdaState`]'s device addresses for one call.
#[derive(Clone, Copy, Default)]
pub(crate) struct KdaPtrs {
    pub(crate) rings: [u64; 3],
    pub(crate) state: u64,
}

impl KdaState {
    /// Zeros for a layer of shape `s`.
    pub(crate) fn new(stream: &Arc<CudaStream>, s: &KdaShape) -> Result<KdaState, ModelError> {
        let ring = (s.conv_kernel - 1) * s.inner();
        Ok(KdaState {
            rings: [
                zeros(stream, ring, "KDA state")?,
                zeros(stream, ring, "KDA state")?,
                zeros(stream, ring, "KDA state")?,
            ],
            state: zeros(stream, s.n_head * s.head_dim * s.head_dim, "KDA state")?,
        })
    }

    /// A copy on the device (a snapshot); None if a copy failed.
    pub(crate) fn copy(&self, stream: &Arc<CudaStream>) -> Option<KdaState> {
        let [q, k, v] = &self.rings;
        Some(KdaState {
            rings: [dup(stream, q)?, dup(stream, k)?, dup(stream, v)?],
            state: dup(stream, &self.state)?,
        })
    }

    pub(crate) fn ptrs(&self, stream: &Arc<CudaStream>) -> KdaPtrs {
        KdaPtrs {
            rings: self.rings.each_ref().map(|r| ptr(stream, r)),
            state: ptr(stream, &self.state),
        }
    }
}

impl Uploader<'_> {
    pub(crate) fn kda(&mut self, w: &KdaWeights, shape: &KdaShape) -> Result<DKda, String> {
        Ok(DKda {
            q: self.mat(&w.q)?,
            k: self.mat(&w.k)?,
            v: self.mat(&w.v)?,
            conv: [
                self.norm(&w.conv_q)?,
                self.norm(&w.conv_k)?,
                self.norm(&w.conv_v)?,
            ],
            f_a: self.mat(&w.f_a)?,
            f_b: self.mat(&w.f_b)?,
            g_a: self.mat(&w.g_a)?,
            g_b: self.mat(&w.g_b)?,
            beta: self.few(&w.beta)?,
            dt_bias: self.norm(&w.dt_bias)?,
            a: self.norm(&w.a)?,
            norm: self.norm(&w.norm)?,
            out: self.mat(&w.out)?,
            shape: *shape,
        })
    }
}

impl GpuDecoder {
    /// Kimi delta attention `w` of the block input `io.h` into `b.dout` (`[n][inner]`,
    /// before the output product); `st`: the q, k, v convolution rings and the recurrent
    /// matrices.
    pub(crate) fn kda(
        &self,
        w: &DKda,
        st: KdaPtrs,
        io: &Io,
        b: &NextBufs,
    ) -> Result<(), ModelError> {
        let Io {
            n, pos, rows, h, ..
        } = *io;
        let s = &w.shape;
        let inner = s.inner();
        // q, k, v side by side in the DeltaNet buffers: [3][n][inner] before and after the
        // convolutions.
        let part = |base: u64, i: usize| base + 4 * (i * n * inner) as u64;
        let raw = [part(b.cqkv, 0), part(b.cqkv, 1), part(b.cqkv, 2)];
        let conv = [part(b.cconv, 0), part(b.cconv, 1), part(b.cconv, 2)];
        let qkv = [(&w.q, raw[0]), (&w.k, raw[1]), (&w.v, raw[2])];
        self.mv_rows(&qkv, rows, h)?;
        self.mv_rows(&[(&w.f_a, b.fl), (&w.g_a, b.gl)], rows, h)?;
        self.few(&w.beta, h, b.beta, rows, n)?;
        self.mv_rows(&[(&w.f_b, b.alpha)], rows, b.fl)?;
        self.mv_rows(&[(&w.g_b, b.z)], rows, b.gl)?;
        let ii = i32_of(inner, "KDA width")?;
        kernels::KdaGate {
            f: b.alpha,
            dt_bias: w.dt_bias,
            a: w.a,
            inner: ii,
            d: s.head_dim as i32,
            lb: s.lower_bound.unwrap_or(0.0),
            has_lb: i32::from(s.lower_bound.is_some()),
        }
        .launch(self, (n as u32, inner.div_ceil(256) as u32, 1))?;
        for i in 0..3 {
            let taps = (w.conv[i], s.conv_kernel, 1);
            self.conv(raw[i], st.rings[i], taps, 0, conv[i], pos, inner, n)?;
        }
        let delta = delta_shape(s);
        let (q, k, v) = (conv[0], conv[1], conv[2]);
        let (ab, st3) = ((w.a, 0), (st.state, b.dout));
        let gates = (b.beta, b.alpha, b.z);
        self.delta_rule(
            &delta,
            (q, k, v, inner),
            gates,
            ab,
            w.norm,
            st3,
            pos,
            n,
            true,
        )
    }
}

/// What the KDA kernels refuse of layer `il`: heads wider than [`DV_MAX`], a state past
/// `smem` bytes of shared memory, weights unlike its shape. The reason when not.
pub(crate) fn check_layer(
    plan: &DecoderPlan,
    il: usize,
    w: &KdaWeights,
    s: &KdaShape,
    smem: usize,
) -> Result<(), String> {
    let e = plan.n_embd;
    let (h, d) = (s.n_head, s.head_dim);
    let inner = s.inner();
    let delta = delta_shape(s);
    let ok = h > 0
        && d > 0
        && d <= DV_MAX
        && gdn_smem(&delta) <= smem
        && s.conv_kernel > 0
        && (w.q.rows, w.k.rows, w.v.rows) == (inner, inner, inner)
        && (w.f_a.rows, w.g_a.rows) == (d, d)
        && (w.f_b.rows, w.f_b.cols, w.g_b.rows, w.g_b.cols) == (inner, d, inner, d)
        && w.beta.rows == h
        && (w.out.rows, w.out.cols) == (e, inner)
        && [&w.conv_q, &w.conv_k, &w.conv_v]
            .iter()
            .all(|c| c.len() == inner * s.conv_kernel)
        && (w.dt_bias.len(), w.a.len(), w.norm.len()) == (inner, h, d);
    if !ok {
        return Err(format!(
            "layer {il}: a Kimi delta attention of {h} heads of {d} the kernels do not take (heads up to {}, the state within {smem} bytes of shared memory)",
            DV_MAX
        ));
    }
    Ok(())
}
