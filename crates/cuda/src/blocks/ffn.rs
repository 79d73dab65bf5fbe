//! The dense GLU feed-forward on the GPU (the CPU's `sluice_models::blocks::ffn`).
//!
//! Owns: [`DenseFfn`] (gate, up, down and the activation) and its launches
//! ([`GpuDecoder::dense_ffn`]): the gate / up products in one launch, `glu_act`, down.

use sluice_models::blocks::ffn::Activation;
use sluice_models::ModelError;

use crate::forward::bufs::{FfnBufs, Io};
use crate::forward::{DMat, GpuDecoder};
use crate::kernels;

/// A dense feed-forward in VRAM.
pub(crate) struct DenseFfn {
    pub(crate) gate: DMat,
    pub(crate) up: DMat,
    pub(crate) down: DMat,
    pub(crate) act: Act,
}

/// `glu_act`'s activation id and its clamp limit ([`act_id`]).
pub(crate) type Act = (i32, f32);

/// `glu_act`'s sigmoid (`g = sigmoid(g) * u`: QSA's output gate).
pub(crate) const ACT_SIGMOID: Act = (3, 0.0);

impl GpuDecoder {
    /// A dense GLU feed-forward (the CPU's `blocks::ffn`) of the normed input into `o`.
    pub(crate) fn dense_ffn(&self, w: &DenseFfn, io: &Io, f: &FfnBufs) -> Result<(), ModelError> {
        let DenseFfn {
            gate,
            up,
            down,
            act,
        } = w;
        let Io { n, rows, h, o, .. } = *io;
        let FfnBufs { g, u, .. } = *f;
        self.mv_rows(&[(gate, g), (up, u)], rows, h)?;
        let len = n * gate.rows;
        self.glu(g, u, len, *act)?;
        self.mv_rows(&[(down, o)], rows, g)?;
        Ok(())
    }
}

/// `glu_act`'s activation id and clamp limit.
pub(crate) fn act_id(a: Activation) -> Act {
    match a {
        Activation::Silu => (0, 0.0),
        Activation::GeluTanh => (1, 0.0),
        Activation::SiluClamped { limit } => (2, limit),
    }
}

impl GpuDecoder {
    /// `g = act(g) * u` over `len` values.
    pub(crate) fn glu(&self, g: u64, u: u64, len: usize, act: Act) -> Result<(), ModelError> {
        kernels::GluAct {
            g,
            u,
            n: len as i64,
            act: act.0,
            limit: act.1,
        }
        .launch(self, (len.div_ceil(256) as u32, 1, 1))
    }
}
