//! Gated DeltaNet on the GPU (the CPU's `sluice_models::blocks::deltanet`).
//!
//! Owns: [`DDelta`] (its device weights), what `delta_rule` takes ([`DV_MAX`], its shared
//! memory [`gdn_smem`]), and the launches: the q|k|v products, `conv_ring` (the causal
//! convolution over the batch and the ring of earlier inputs, [`GpuDecoder::conv`]), the
//! gates, [`GpuDecoder::delta_rule`] (a block per value head walking the batch's tokens
//! with the head's state in shared memory; KDA runs it too, with per-channel decay). Its
//! per-sequence state: [`DeltaState`] (the ring and the recurrent matrices; [`DeltaPtrs`]
//! for a call), which continues or restarts at 0.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use sluice_models::blocks::deltanet::{DeltaShape, DeltaWeights};
use sluice_models::plan::DecoderPlan;
use sluice_models::ModelError;

use crate::blocks::hyper_lowrank::DFew;
use crate::forward::bufs::Io;
use crate::forward::scratch::NextBufs;
use crate::forward::state::{dup, ptr, zeros};
use crate::forward::{i32_of, DMat, GpuDecoder, Uploader};
use crate::kernels;

/// Threads of `delta_rule` and the value columns each owns at most (`GDN_THREADS`,
/// `GDN_COLS` of qwen4exp.cu): the widest value head it takes.
pub(crate) const GDN_THREADS: u32 = 128;

pub(crate) const GDN_COLS: usize = 4;

pub(crate) const DV_MAX: usize = GDN_THREADS as usize * GDN_COLS;

/// A Gated DeltaNet layer in VRAM (`deltanet::DeltaWeights`).
pub(crate) struct DDelta {
    pub(crate) qkv: DMat,
    pub(crate) gate: DMat,
    pub(crate) beta: DFew,
    pub(crate) alpha: DFew,
    pub(crate) out: DMat,
    pub(crate) conv: u64,
    pub(crate) dt_bias: u64,
    pub(crate) a: u64,
    pub(crate) norm: u64,
    pub(crate) shape: DeltaShape,
}

/// A Gated DeltaNet layer's state for a sequence: the convolution ring of the last
/// `kernel - 1` q|k|v inputs and the recurrent matrices (`[hv][dk][dv]`). The kernels read
/// neither in a batch starting at position 0 (a fresh sequence).
pub(crate) struct DeltaState {
    pub(crate) ring: CudaSlice<f32>,
    pub(crate) state: CudaSlice<f32>,
}

/// [`DeltaState`]'s device addresses for one call.
#[derive(Clone, Copy, Default)]
pub(crate) struct DeltaPtrs {
    pub(crate) ring: u64,
    pub(crate) state: u64,
}

impl DeltaState {
    /// Zeros for a layer of shape `s`.
    pub(crate) fn new(stream: &Arc<CudaStream>, s: &DeltaShape) -> Result<DeltaState, ModelError> {
        Ok(DeltaState {
            ring: zeros(stream, (s.conv_kernel - 1) * s.conv_dim(), "DeltaNet state")?,
            state: zeros(stream, s.n_v_heads * s.d_k * s.d_v, "DeltaNet state")?,
        })
    }

    /// A copy on the device (a snapshot); None if a copy failed.
    pub(crate) fn copy(&self, stream: &Arc<CudaStream>) -> Option<DeltaState> {
        Some(DeltaState {
            ring: dup(stream, &self.ring)?,
            state: dup(stream, &self.state)?,
        })
    }

    pub(crate) fn ptrs(&self, stream: &Arc<CudaStream>) -> DeltaPtrs {
        DeltaPtrs {
            ring: ptr(stream, &self.ring),
            state: ptr(stream, &self.state),
        }
    }
}

/// Shared memory `delta_rule` declares statically (`block_sum`'s partial sums), with room
/// to spare: the dynamic part may have the opt-in limit less this.
pub(crate) const GDN_STATIC_SMEM: usize = 1024;

/// Dynamic shared memory of `delta_rule` for a head of `dk x dv` (the state, q, k and the
/// rows' decay).
pub(crate) fn gdn_smem(sh: &DeltaShape) -> usize {
    4 * (sh.d_k * sh.d_v + 3 * sh.d_k)
}

impl Uploader<'_> {
    pub(crate) fn delta(&mut self, w: &DeltaWeights, shape: &DeltaShape) -> Result<DDelta, String> {
        Ok(DDelta {
            qkv: self.mat(&w.qkv)?,
            gate: self.mat(&w.gate)?,
            beta: self.few(&w.beta)?,
            alpha: self.few(&w.alpha)?,
            out: self.mat(&w.out)?,
            conv: self.norm(&w.conv)?,
            dt_bias: self.norm(&w.dt_bias)?,
            a: self.norm(&w.a)?,
            norm: self.norm(&w.norm)?,
            shape: *shape,
        })
    }
}

impl GpuDecoder {
    /// The causal depthwise convolution of `n` tokens' rows `input` (`width` channels; taps
    /// `(weights, kernel, dilation)`) over the batch and the per-sequence `ring` of earlier
    /// positions, into `out` (`gv` null: SiLU of it; else `out += gv + SiLU`), then the
    /// batch's last inputs into the ring: every read of the ring comes first.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn conv(
        &self,
        input: u64,
        ring: u64,
        taps: (u64, usize, usize),
        gv: u64,
        out: u64,
        pos: u64,
        width: usize,
        n: usize,
    ) -> Result<(), ModelError> {
        let (w, kernel, dil) = taps;
        kernels::ConvRing {
            input,
            ring,
            w,
            gv,
            out,
            pos,
            width: i32_of(width, "convolution channels")?,
            kernel: kernel as i32,
            dil: dil as i32,
        }
        .launch(self, (n as u32, width.div_ceil(256) as u32, 1))?;
        let slots = (kernel - 1) * dil;
        if slots > 0 {
            self.ring_store(input, 0, ring, 0, pos, width, slots, n)?;
        }
        Ok(())
    }

    /// Gated DeltaNet `w` of the block input `io.h` into `b.dout` (`[n][hv * dv]`, before
    /// the output product); `st`: the layer's convolution ring and recurrent matrices.
    pub(crate) fn delta(
        &self,
        w: &DDelta,
        st: DeltaPtrs,
        io: &Io,
        b: &NextBufs,
    ) -> Result<(), ModelError> {
        let Io {
            n, pos, rows, h, ..
        } = *io;
        let s = &w.shape;
        let cd = s.conv_dim();
        self.few(&w.beta, h, b.beta, rows, n)?;
        self.few(&w.alpha, h, b.alpha, rows, n)?;
        let parts = [(&w.qkv, b.cqkv), (&w.gate, b.z)];
        self.mv_rows(&parts, rows, h)?;
        let taps = (w.conv, s.conv_kernel, 1);
        self.conv(b.cqkv, st.ring, taps, 0, b.cconv, pos, cd, n)?;
        let (hk, dk) = (s.n_k_heads as u64, s.d_k as u64);
        let q = b.cconv;
        let (k, v) = (q + 4 * hk * dk, q + 8 * hk * dk);
        let gates = (b.beta, b.alpha, b.z);
        let st = (st.state, b.dout);
        self.delta_rule(
            s,
            (q, k, v, cd),
            gates,
            (w.a, w.dt_bias),
            w.norm,
            st,
            pos,
            n,
            false,
        )
    }

    /// The delta rule (`delta_rule`) of `n` tokens for every value head of `sh`: q, k, v
    /// rows at `qkv` (token stride `qkv.3` values), `gates`: beta, the decay inputs
    /// (alpha, or the per-channel log-decay when `per_channel`) and the output gate; `ab`:
    /// the per-head rate and dt bias (DeltaNet); `st`: the state and the output.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn delta_rule(
        &self,
        sh: &DeltaShape,
        qkv: (u64, u64, u64, usize),
        gates: (u64, u64, u64),
        ab: (u64, u64),
        norm: u64,
        st: (u64, u64),
        pos: u64,
        n: usize,
        per_channel: bool,
    ) -> Result<(), ModelError> {
        kernels::DeltaRule {
            q: qkv.0,
            k: qkv.1,
            v: qkv.2,
            beta: gates.0,
            g: gates.1,
            z: gates.2,
            a: ab.0,
            dt_bias: ab.1,
            norm,
            state: st.0,
            out: st.1,
            pos,
            ts: i32_of(qkv.3, "row stride")?,
            n: n as i32,
            hk: sh.n_k_heads as i32,
            dk: sh.d_k as i32,
            dv: sh.d_v as i32,
            gate_sigmoid: i32::from(sh.gate_sigmoid),
            per_channel: i32::from(per_channel),
            eps: sh.rms_eps,
        }
        .launch_smem(self, (sh.n_v_heads as u32, 1, 1), gdn_smem(sh))
    }
}

/// What `conv_ring` and `delta_rule` refuse of layer `il`'s Gated DeltaNet: heads wider than
/// [`DV_MAX`] values, a state past `smem` bytes of shared memory, weights unlike its
/// shape. The reason when not.
pub(crate) fn check_layer(
    plan: &DecoderPlan,
    il: usize,
    w: &DeltaWeights,
    sh: &DeltaShape,
    smem: usize,
) -> Result<(), String> {
    let e = plan.n_embd;
    let (hv, dk, dv) = (sh.n_v_heads, sh.d_k, sh.d_v);
    let cd = sh.conv_dim();
    let ok = sh.n_k_heads > 0
        && hv > 0
        && dk > 0
        && dv > 0
        && dv <= DV_MAX
        && gdn_smem(sh) <= smem
        && sh.conv_kernel > 0
        && (w.qkv.rows, w.gate.rows, w.beta.rows, w.alpha.rows) == (cd, hv * dv, hv, hv)
        && (w.out.rows, w.out.cols) == (e, hv * dv)
        && w.conv.len() == cd * sh.conv_kernel
        && (w.dt_bias.len(), w.a.len(), w.norm.len()) == (hv, hv, dv);
    if !ok {
        return Err(format!(
            "layer {il}: a Gated DeltaNet of {} key / {hv} value heads of {dk} x {dv} the kernels do not take (values up to {}, the state within {smem} bytes of shared memory)",
            sh.n_k_heads,
            DV_MAX
        ));
    }
    Ok(())
}
