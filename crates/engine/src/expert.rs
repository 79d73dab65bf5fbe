//! Where routed experts' bytes come from.
//!
//! Owns: the [`ExpertSource`] trait the MoE layer asks for "the bytes of expert e of layer
//! l", and [`ResidentExperts`], the source that serves them straight from the mapped file.
//! The SSD-streaming cache implements the same trait; the forward pass never knows which
//! one it talks to.

use crate::model::weights::Weights;
use crate::EngineError;

/// The three matrices of one routed expert, borrowed from wherever they live.
#[derive(Clone, Copy)]
pub struct ExpertView<'a> {
    /// `[n_ff_exp, n_embd]`
    pub gate: &'a [u8],
    /// `[n_ff_exp, n_embd]`
    pub up: &'a [u8],
    /// `[n_embd, n_ff_exp]`
    pub down: &'a [u8],
}

/// Gives the MoE layer access to expert weights.
pub trait ExpertSource: Send + Sync {
    /// Make each expert in `experts` (ids within `layer`) available and call
    /// `f(index_in_experts, view)` for it. Calls may come in any order (a cache serves hits
    /// first while misses load); callers must make their result independent of the order.
    fn for_each_expert(
        &self,
        weights: &Weights,
        layer: usize,
        experts: &[usize],
        f: &mut dyn FnMut(usize, ExpertView<'_>) -> Result<(), EngineError>,
    ) -> Result<(), EngineError>;

    /// `n` more tokens were evaluated (the clock of decaying eviction policies).
    fn end_tokens(&self, _n: usize) {}
}

/// A shared source (lets the caller keep a handle for statistics).
impl<T: ExpertSource> ExpertSource for std::sync::Arc<T> {
    fn for_each_expert(
        &self,
        weights: &Weights,
        layer: usize,
        experts: &[usize],
        f: &mut dyn FnMut(usize, ExpertView<'_>) -> Result<(), EngineError>,
    ) -> Result<(), EngineError> {
        (**self).for_each_expert(weights, layer, experts, f)
    }

    fn end_tokens(&self, n: usize) {
        (**self).end_tokens(n)
    }
}

/// Serves experts from the memory-mapped model file (everything resident or paged by the OS).
#[derive(Debug, Default)]
pub struct ResidentExperts;

impl ExpertSource for ResidentExperts {
    fn for_each_expert(
        &self,
        weights: &Weights,
        layer: usize,
        experts: &[usize],
        f: &mut dyn FnMut(usize, ExpertView<'_>) -> Result<(), EngineError>,
    ) -> Result<(), EngineError> {
        let crate::model::weights::Ffn::Moe { experts: t, .. } = &weights.layers[layer].ffn else {
            return Ok(());
        };
        let bytes = weights.map.bytes();
        for (i, &e) in experts.iter().enumerate() {
            f(
                i,
                ExpertView {
                    gate: &bytes[t.gate.expert_range(e)],
                    up: &bytes[t.up.expert_range(e)],
                    down: &bytes[t.down.expert_range(e)],
                },
            )?;
        }
        Ok(())
    }
}
