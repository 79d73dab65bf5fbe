//! The dense GLU feed-forward on the GPU (the CPU's `sluice_models::blocks::ffn`).
//!
//! Owns: [`DenseFfn`] (gate, up, down and the activation) and its launches
//! ([`GpuDecoder::dense_ffn`]): the gate / up products in one launch, `glu_act`, down.

use sluice_models::ModelError;

use crate::forward::{Act, Call, DMat, GpuDecoder};

/// A dense feed-forward in VRAM.
pub(crate) struct DenseFfn {
    pub(crate) gate: DMat,
    pub(crate) up: DMat,
    pub(crate) down: DMat,
    pub(crate) act: Act,
}

impl GpuDecoder {
    /// A dense GLU feed-forward (the CPU's `blocks::ffn`) of the normed input into `o`.
    pub(crate) fn dense_ffn(&self, w: &DenseFfn, c: &Call<'_>) -> Result<(), ModelError> {
        let DenseFfn {
            gate,
            up,
            down,
            act,
        } = w;
        let Call {
            n,
            small,
            dense,
            n_dense,
            nd,
            h,
            o,
            g,
            u,
            ..
        } = *c;

        self.mv(&[(gate, g), (up, u)], dense, n_dense, nd, h, 1, small)?;
        let len = n * gate.rows;
        self.glu(g, u, len, *act)?;
        self.mv(&[(down, o)], dense, n_dense, nd, g, 1, small)?;
        Ok(())
    }
}
