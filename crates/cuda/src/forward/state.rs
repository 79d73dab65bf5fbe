//! A sequence's state on the GPU: [`GpuKv`] (in `SeqState::device`: the KV cache in VRAM,
//! f16 or f32 as the host cache says, and each layer's own state: DeepSeek V4's rings and
//! compressor rows, the recurrent states, indexer keys, the PLE ring and hash context),
//! made on a sequence's first call (`GpuDecoder::kv`, [`layer_state`]) and copied whole
//! for a snapshot.

use std::any::Any;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use sluice_models::state::{ExtraState, SeqState};
use sluice_models::ModelError;

use crate::blocks::dsv4_attention::{CompKv, DComp, Dsv4Kv};
use crate::blocks::kda::kda_state;
use crate::blocks::mla::DSelect;
use crate::blocks::mla_pooled::pool_state;
use crate::blocks::ple::ple_state;
use crate::forward::{err, DAttn, GpuDecoder};

/// One sequence's KV cache in VRAM: per layer `[n_ctx][n_head_kv * head_dim]` keys and
/// values, f16 (llama.cpp's default cache; the CPU path rounds to f16 the same way) or f32
/// as the sequence's host cache says (`--kv-f32`); DeepSeek V4 layers keep `Dsv4Kv`
/// instead.
pub struct GpuKv {
    pub(crate) k: Vec<CudaSlice<u8>>,
    pub(crate) v: Vec<CudaSlice<u8>>,
    /// Per layer: DeepSeek V4 attention's state (None for other layers).
    pub(crate) dsv4: Vec<Option<Dsv4Kv>>,
    /// Per layer: the attention's own state ([`layer_state`]; empty for most).
    pub(crate) rec: Vec<Vec<CudaSlice<f32>>>,
    /// Per layer: the PLE layer's convolution ring (None without one).
    pub(crate) ple: Vec<Option<CudaSlice<f32>>>,
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

impl ExtraState for GpuKv {
    fn clone_box(&self) -> Box<dyn ExtraState> {
        let copy = |src: &[CudaSlice<u8>]| -> Option<Vec<CudaSlice<u8>>> {
            src.iter().map(|s| self.stream.clone_dtod(s).ok()).collect()
        };
        let (k, v) = (copy(&self.k), copy(&self.v));
        let dsv4: Option<Vec<Option<Dsv4Kv>>> = self
            .dsv4
            .iter()
            .map(|d| match d {
                None => Some(None),
                Some(d) => d.copy(&self.stream).map(Some),
            })
            .collect();
        let opt = |src: &[Option<CudaSlice<f32>>]| -> Option<Vec<Option<CudaSlice<f32>>>> {
            src.iter()
                .map(|d| match d {
                    None => Some(None),
                    Some(d) => self.stream.clone_dtod(d).ok().map(Some),
                })
                .collect()
        };
        let ple = opt(&self.ple);
        let rec: Option<Vec<Vec<CudaSlice<f32>>>> = self
            .rec
            .iter()
            .map(|l| l.iter().map(|b| self.stream.clone_dtod(b).ok()).collect())
            .collect();
        let synced = self.stream.synchronize().is_ok();
        let ok = self.ok
            && synced
            && k.is_some()
            && v.is_some()
            && dsv4.is_some()
            && rec.is_some()
            && ple.is_some();
        Box::new(GpuKv {
            k: k.unwrap_or_default(),
            v: v.unwrap_or_default(),
            dsv4: dsv4.unwrap_or_default(),
            rec: rec.unwrap_or_default(),
            ple: ple.unwrap_or_default(),
            ple_ctx: self.ple_ctx.clone(),
            next: self.next,
            n_ctx: self.n_ctx,
            f32: self.f32,
            stream: self.stream.clone(),
            ok,
        })
    }

    fn clear(&mut self) {
        // Rows are indexed by position and written before they are read.
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// One layer's own attention state for a sequence of `n_ctx` positions, zeros: GLM's DSA
/// indexer keys (every position's, f32); DeltaNet's convolution ring of the last `kernel -
/// 1` inputs and recurrent matrices; KDA's ([`kda_state`]); QSA's raw keys of
/// every position and pooled keys of every complete block (with an indexer); a k-pool
/// indexer's ([`pool_state`]); none for the others (DeepSeek V4's is
/// [`Dsv4Kv`]).
pub(crate) fn layer_state(
    stream: &Arc<CudaStream>,
    attn: &DAttn,
    n_ctx: usize,
) -> Result<Vec<CudaSlice<f32>>, ModelError> {
    let zeros = |len: usize| {
        stream
            .alloc_zeros::<f32>(len.max(1))
            .map_err(|e| err("attention state", e))
    };
    match attn {
        DAttn::Mla(m) => match &m.select {
            DSelect::Indexer(ix) => Ok(vec![zeros(n_ctx * ix.head_dim)?]),
            DSelect::Pooled(ix) => pool_state(stream, ix, n_ctx),
            DSelect::All | DSelect::Previous => Ok(Vec::new()),
        },
        DAttn::Delta(w) => {
            let s = &w.shape;
            Ok(vec![
                zeros((s.conv_kernel - 1) * s.conv_dim())?,
                zeros(s.n_v_heads * s.d_k * s.d_v)?,
            ])
        }
        DAttn::Kda(w) => kda_state(stream, &w.shape),
        DAttn::Qsa(w) if w.shape.ratio > 0 => {
            let s = &w.shape;
            Ok(vec![
                zeros(n_ctx * s.idx_dim)?,
                zeros((n_ctx / s.ratio + 1) * s.idx_dim)?,
            ])
        }
        _ => Ok(Vec::new()),
    }
}

impl GpuDecoder {
    /// The sequence's KV cache in VRAM, made on its first call.
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
            let sh = &self.plan.shape;
            // A length-limited plan never writes past its `max_positions` (`check_length`).
            let n_ctx = state
                .n_ctx()
                .min(self.plan.max_positions.unwrap_or(usize::MAX));
            let stream = &self.stream;
            let esize = if want_f32 { 4 } else { 2 };
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
            let zeros = |len: usize| -> Result<CudaSlice<f32>, ModelError> {
                stream
                    .alloc_zeros::<f32>(len.max(1))
                    .map_err(|e| err("DeepSeek V4 state", e))
            };
            let comp = |c: &DComp| -> Result<CompKv, ModelError> {
                let carry = c.coff * c.ratio * c.coff * c.head_dim;
                Ok(CompKv {
                    rc: zeros(carry)?,
                    rz: zeros(carry)?,
                    rows: zeros(n_ctx / c.ratio * c.head_dim)?,
                })
            };
            let mut dsv4 = Vec::with_capacity(self.layers.len());
            for l in &self.layers {
                dsv4.push(match (&l.attn, &self.dsv4) {
                    (DAttn::Dsv4(a), Some(s)) => Some(Dsv4Kv {
                        ring: zeros(s.window * s.head_dim)?,
                        comp: a.comp.as_ref().map(comp).transpose()?,
                        index: a.indexer.as_ref().map(|ix| comp(&ix.comp)).transpose()?,
                    }),
                    _ => None,
                });
            }
            let rec = self
                .layers
                .iter()
                .map(|l| layer_state(stream, &l.attn, n_ctx))
                .collect::<Result<Vec<_>, _>>()?;
            let width = self.next_dims.streams * self.plan.n_embd;
            let ple = self
                .layers
                .iter()
                .map(|l| {
                    l.ple
                        .as_ref()
                        .map(|w| ple_state(stream, w, width))
                        .transpose()
                })
                .collect::<Result<Vec<_>, _>>()?;
            let ple_ctx = self.plan.ple.as_ref().map_or(Vec::new(), |pp| {
                vec![pp.hash.eos; pp.hash.ngram.saturating_sub(1)]
            });
            state.device = Some(Box::new(GpuKv {
                k,
                v,
                dsv4,
                rec,
                ple,
                ple_ctx,
                next: 0,
                n_ctx,
                f32: want_f32,
                stream: stream.clone(),
                ok: true,
            }));
        }
        Ok(state
            .device
            .as_mut()
            .and_then(|x| x.as_any_mut().downcast_mut::<GpuKv>())
            .expect("made above"))
    }
}
