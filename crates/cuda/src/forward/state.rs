//! A sequence's state on the GPU: [`GpuKv`] (in `SeqState::device`), made on a sequence's
//! first call (`GpuDecoder::kv`) and copied whole for a snapshot.
//!
//! Owns what the blocks share: the KV rows in VRAM (f16 or f32 as the host cache says),
//! the position the sequential state continues at, the PLE hash context, the per-layer
//! [`LayerState`] (each variant a block's own state type, defined with its allocation,
//! copy and addresses in its block file: `DsaState`, `PoolState`, `DeltaState`,
//! `KdaState`, `QsaState`, `Dsv4Kv`; the PLE ring `PleState`) and the addresses one call's
//! launches read ([`LayerPtrs`]). Clearing a sequence needs no device work: every block's
//! state is either indexed by position (written before it is read) or not read at all by a
//! batch starting at position 0, so clearing only forgets the position held.

use std::any::Any;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use sluice_models::state::{ExtraState, SeqState};
use sluice_models::ModelError;

use crate::blocks::deltanet::{DeltaPtrs, DeltaState};
use crate::blocks::dsa_indexer::{DsaPtrs, DsaState};
use crate::blocks::dsv4_attention::{Dsv4Kv, Dsv4Ptrs};
use crate::blocks::kda::{KdaPtrs, KdaState};
use crate::blocks::mla::DSelect;
use crate::blocks::mla_pooled::{PoolPtrs, PoolState};
use crate::blocks::ple::PleState;
use crate::blocks::qsa::{QsaPtrs, QsaState};
use crate::forward::{err, DAttn, GpuDecoder};

/// `len` zeros on the device (at least one value), for a block's state (`what` names it in
/// an error).
pub(crate) fn zeros(
    stream: &Arc<CudaStream>,
    len: usize,
    what: &str,
) -> Result<CudaSlice<f32>, ModelError> {
    stream
        .alloc_zeros::<f32>(len.max(1))
        .map_err(|e| err(what, e))
}

/// A device copy of `s` (a snapshot's), None if it failed.
pub(crate) fn dup(stream: &Arc<CudaStream>, s: &CudaSlice<f32>) -> Option<CudaSlice<f32>> {
    stream.clone_dtod(s).ok()
}

/// The device address of `s`.
pub(crate) fn ptr(stream: &Arc<CudaStream>, s: &CudaSlice<f32>) -> u64 {
    s.device_ptr(stream).0
}

/// One layer's own state beside its KV rows: its block's state type, or none (GQA, MLA
/// over every position or the previous indexer's pick, QSA without an indexer).
pub(crate) enum LayerState {
    None,
    /// GLM's DSA indexer (MLA selecting by its own indexer).
    Dsa(DsaState),
    /// A full pooled layer's k-pool indexer.
    Pool(PoolState),
    Delta(DeltaState),
    Kda(KdaState),
    Qsa(QsaState),
    Dsv4(Dsv4Kv),
}

/// [`LayerState`]'s device addresses for one call.
#[derive(Clone, Copy, Default)]
pub(crate) enum OwnPtrs {
    #[default]
    None,
    Dsa(DsaPtrs),
    Pool(PoolPtrs),
    Delta(DeltaPtrs),
    Kda(KdaPtrs),
    Qsa(QsaPtrs),
    Dsv4(Dsv4Ptrs),
}

/// What one layer's launches read of the sequence for one call: its KV rows (keys,
/// values), its own state's addresses and its PLE ring (0: none).
#[derive(Clone, Copy, Default)]
pub(crate) struct LayerPtrs {
    pub(crate) kv: (u64, u64),
    pub(crate) own: OwnPtrs,
    pub(crate) ple: u64,
}

impl LayerState {
    /// Zeros for layer `attn` over a sequence of `n_ctx` positions (`dsv4`: the decoder's
    /// DeepSeek V4 shape).
    fn new(
        stream: &Arc<CudaStream>,
        attn: &DAttn,
        dsv4: Option<&sluice_models::blocks::dsv4_attention::Dsv4Shape>,
        n_ctx: usize,
    ) -> Result<LayerState, ModelError> {
        Ok(match attn {
            DAttn::Mla(m) => match &m.select {
                DSelect::Indexer(ix) => LayerState::Dsa(DsaState::new(stream, ix, n_ctx)?),
                DSelect::Pooled(ix) => LayerState::Pool(PoolState::new(stream, ix, n_ctx)?),
                DSelect::All | DSelect::Previous => LayerState::None,
            },
            DAttn::Delta(w) => LayerState::Delta(DeltaState::new(stream, &w.shape)?),
            DAttn::Kda(w) => LayerState::Kda(KdaState::new(stream, &w.shape)?),
            DAttn::Qsa(w) => match QsaState::new(stream, &w.shape, n_ctx)? {
                Some(s) => LayerState::Qsa(s),
                None => LayerState::None,
            },
            DAttn::Dsv4(a) => match dsv4 {
                Some(s) => LayerState::Dsv4(Dsv4Kv::new(stream, a, s, n_ctx)?),
                None => LayerState::None,
            },
            DAttn::Gqa(_) => LayerState::None,
        })
    }

    /// A copy on the device (a snapshot); None if a copy failed.
    fn copy(&self, stream: &Arc<CudaStream>) -> Option<LayerState> {
        Some(match self {
            LayerState::None => LayerState::None,
            LayerState::Dsa(s) => LayerState::Dsa(s.copy(stream)?),
            LayerState::Pool(s) => LayerState::Pool(s.copy(stream)?),
            LayerState::Delta(s) => LayerState::Delta(s.copy(stream)?),
            LayerState::Kda(s) => LayerState::Kda(s.copy(stream)?),
            LayerState::Qsa(s) => LayerState::Qsa(s.copy(stream)?),
            LayerState::Dsv4(s) => LayerState::Dsv4(s.copy(stream)?),
        })
    }

    fn ptrs(&self, stream: &Arc<CudaStream>) -> OwnPtrs {
        match self {
            LayerState::None => OwnPtrs::None,
            LayerState::Dsa(s) => OwnPtrs::Dsa(s.ptrs(stream)),
            LayerState::Pool(s) => OwnPtrs::Pool(s.ptrs(stream)),
            LayerState::Delta(s) => OwnPtrs::Delta(s.ptrs(stream)),
            LayerState::Kda(s) => OwnPtrs::Kda(s.ptrs(stream)),
            LayerState::Qsa(s) => OwnPtrs::Qsa(s.ptrs(stream)),
            LayerState::Dsv4(s) => OwnPtrs::Dsv4(s.ptrs(stream)),
        }
    }
}

impl LayerPtrs {
    /// Every address (a captured graph's key).
    pub(crate) fn key(&self, out: &mut Vec<u64>) {
        out.extend([self.kv.0, self.kv.1, self.ple]);
        match self.own {
            OwnPtrs::None => {}
            OwnPtrs::Dsa(p) => out.push(p.keys),
            OwnPtrs::Pool(p) => out.extend([p.keys, p.gates, p.pooled]),
            OwnPtrs::Delta(p) => out.extend([p.ring, p.state]),
            OwnPtrs::Kda(p) => out.extend(p.rings.into_iter().chain([p.state])),
            OwnPtrs::Qsa(p) => out.extend([p.keys, p.pooled]),
            OwnPtrs::Dsv4(p) => out.extend([p.ring].into_iter().chain(p.comp).chain(p.index)),
        }
    }
}

/// The error of a layer whose state is not its block's kind (never, for a state made by
/// the same decoder).
pub(crate) fn state_mismatch(il: usize) -> ModelError {
    ModelError::Compute(format!(
        "cuda: layer {il}: the sequence's GPU state is not this layer's kind"
    ))
}

/// One sequence's state in VRAM (see the module header): per layer `[n_ctx][n_head_kv *
/// head_dim]` keys and values, f16 (llama.cpp's default cache; the CPU path rounds to f16
/// the same way) or f32 as the sequence's host cache says (`--kv-f32`; DeepSeek V4,
/// DeltaNet and KDA layers keep none), each layer's [`LayerState`] and PLE ring.
pub struct GpuKv {
    pub(crate) k: Vec<CudaSlice<u8>>,
    pub(crate) v: Vec<CudaSlice<u8>>,
    /// Per layer: the attention's own state.
    pub(crate) layers: Vec<LayerState>,
    /// Per layer: the PLE layer's convolution ring (None without one).
    pub(crate) ple: Vec<Option<PleState>>,
    /// The PLE hash's context: the last `ngram - 1` token ids (EOS at a start).
    pub(crate) ple_ctx: Vec<u32>,
    /// The position the sequential state (DeepSeek V4's windows and compressor carry,
    /// recurrent states, the PLE ring and context) continues at (usize::MAX while a call
    /// runs, or after one failed).
    pub(crate) next: usize,
    pub(crate) n_ctx: usize,
    pub(crate) f32: bool,
    pub(crate) stream: Arc<CudaStream>,
    /// False when a copy failed (the next forward call reports it).
    pub(crate) ok: bool,
}

impl GpuKv {
    /// Every layer's addresses for one call.
    pub(crate) fn ptrs(&self) -> Vec<LayerPtrs> {
        let s = &self.stream;
        (0..self.layers.len())
            .map(|il| LayerPtrs {
                kv: (self.k[il].device_ptr(s).0, self.v[il].device_ptr(s).0),
                own: self.layers[il].ptrs(s),
                ple: self.ple[il].as_ref().map_or(0, |p| p.ptr(s)),
            })
            .collect()
    }
}

impl ExtraState for GpuKv {
    fn clone_box(&self) -> Box<dyn ExtraState> {
        let s = &self.stream;
        let copy = |src: &[CudaSlice<u8>]| -> Option<Vec<CudaSlice<u8>>> {
            src.iter().map(|b| s.clone_dtod(b).ok()).collect()
        };
        let (k, v) = (copy(&self.k), copy(&self.v));
        let layers: Option<Vec<LayerState>> = self.layers.iter().map(|l| l.copy(s)).collect();
        let ple: Option<Vec<Option<PleState>>> = self
            .ple
            .iter()
            .map(|p| match p {
                None => Some(None),
                Some(p) => p.copy(s).map(Some),
            })
            .collect();
        let synced = s.synchronize().is_ok();
        let ok =
            self.ok && synced && k.is_some() && v.is_some() && layers.is_some() && ple.is_some();
        Box::new(GpuKv {
            k: k.unwrap_or_default(),
            v: v.unwrap_or_default(),
            layers: layers.unwrap_or_default(),
            ple: ple.unwrap_or_default(),
            ple_ctx: self.ple_ctx.clone(),
            next: self.next,
            n_ctx: self.n_ctx,
            f32: self.f32,
            stream: s.clone(),
            ok,
        })
    }

    fn clear(&mut self) {
        // Nothing on the device (see the module header): the next call starts at 0 and
        // resets the PLE context.
        self.next = 0;
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl GpuDecoder {
    /// The sequence's state in VRAM, made on its first call.
    pub(crate) fn kv<'s>(
        &self,
        state: &'s mut SeqState,
        pos0: usize,
    ) -> Result<&'s mut GpuKv, ModelError> {
        let want_f32 = !state.kv.f16();
        let usable = state
            .device
            .as_mut()
            .and_then(|x| x.as_any_mut().downcast_mut::<GpuKv>())
            .is_some_and(|kv| kv.ok && kv.k.len() == self.layers.len() && kv.f32 == want_f32);
        if !usable {
            if pos0 > 0 {
                return Err(ModelError::Compute(
                    "cuda: this sequence has no KV cache on the GPU (it was started or restored without it)".into(),
                ));
            }
            // A length-limited plan never writes past its `max_positions` (`check_length`).
            let n_ctx = state
                .n_ctx()
                .min(self.plan.max_positions.unwrap_or(usize::MAX));
            state.device = Some(Box::new(self.new_kv(n_ctx, want_f32)?));
        }
        Ok(state
            .device
            .as_mut()
            .and_then(|x| x.as_any_mut().downcast_mut::<GpuKv>())
            .expect("made above"))
    }

    /// A new sequence's state for `n_ctx` positions (`f32`: an f32 KV cache).
    fn new_kv(&self, n_ctx: usize, f32: bool) -> Result<GpuKv, ModelError> {
        let sh = &self.plan.shape;
        let stream = &self.stream;
        let esize = if f32 { 4 } else { 2 };
        let alloc = |dim: usize| -> Result<Vec<CudaSlice<u8>>, ModelError> {
            self.layers
                .iter()
                .map(|l| {
                    // DeltaNet and KDA layers keep no KV cache.
                    let dim = if matches!(l.attn, DAttn::Delta(_) | DAttn::Kda(_)) {
                        0
                    } else {
                        dim
                    };
                    // SAFETY: attention reads only rows 0..=pos, each written by
                    // kv_store earlier in the same stream.
                    unsafe { stream.alloc::<u8>((n_ctx * dim * esize).max(1)) }
                        .map_err(|e| err("KV cache", e))
                })
                .collect()
        };
        // DeepSeek V4 layers keep their own state instead (Dsv4Kv).
        let (kd, vd) = if self.dsv4.is_some() {
            (0, 0)
        } else {
            (sh.n_head_kv * sh.head_dim, sh.n_head_kv * sh.head_dim_v)
        };
        let k = alloc(kd)?;
        let v = alloc(vd)?;
        let layers = self
            .layers
            .iter()
            .map(|l| LayerState::new(stream, &l.attn, self.dsv4.as_ref(), n_ctx))
            .collect::<Result<Vec<_>, _>>()?;
        let width = self.next_dims.streams * self.plan.n_embd;
        let ple = self
            .layers
            .iter()
            .map(|l| {
                l.ple
                    .as_ref()
                    .map(|w| PleState::new(stream, w, width))
                    .transpose()
            })
            .collect::<Result<Vec<_>, _>>()?;
        let ple_ctx = self.plan.ple.as_ref().map_or(Vec::new(), |pp| {
            vec![pp.hash.eos; pp.hash.ngram.saturating_sub(1)]
        });
        Ok(GpuKv {
            k,
            v,
            layers,
            ple,
            ple_ctx,
            next: 0,
            n_ctx,
            f32,
            stream: stream.clone(),
            ok: true,
        })
    }
}
