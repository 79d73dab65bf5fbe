//! Where routed experts' bytes come from, as the MoE block sees it.
//!
//! Owns: the [`ExpertSource`] trait ("make units e1..en of layer l available and hand me
//! each one's matrices"), the [`ExpertView`] of one unit, and [`StreamError`], the typed
//! error of a streaming source. The resident source (slices of the memory map) lives with
//! the models; the SSD-streaming one is [`crate::streaming::StreamingExperts`].

use crate::{CacheError, TraceError};

/// The most matrices one unit may have.
pub const MAX_PARTS: usize = 4;

/// The matrices of one routed unit, borrowed from wherever they live, in the order of the
/// layer's [`crate::UnitLayer::parts`].
#[derive(Clone, Copy)]
pub struct ExpertView<'a> {
    parts: [&'a [u8]; MAX_PARTS],
    n: usize,
}

impl<'a> ExpertView<'a> {
    /// A view over `parts` (at most [`MAX_PARTS`]).
    pub fn new(parts: &[&'a [u8]]) -> ExpertView<'a> {
        assert!(
            parts.len() <= MAX_PARTS,
            "a unit has at most {MAX_PARTS} matrices"
        );
        let mut a: [&'a [u8]; MAX_PARTS] = [&[]; MAX_PARTS];
        a[..parts.len()].copy_from_slice(parts);
        ExpertView {
            parts: a,
            n: parts.len(),
        }
    }

    /// Matrix `i` of the unit.
    pub fn part(&self, i: usize) -> &'a [u8] {
        assert!(i < self.n, "unit has {} matrices, asked for {i}", self.n);
        self.parts[i]
    }

    pub fn len(&self) -> usize {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }
}

/// Returned by a per-unit callback to stop the walk (the caller keeps its own error).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stop;

/// Why a streaming source could not deliver.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error("expert streaming: {0}")]
    Io(#[from] sluice_io::IoError),
    #[error("expert streaming: {0}")]
    Cache(#[from] CacheError),
    #[error("routing trace: {0}")]
    Trace(#[from] TraceError),
    #[error("expert streaming: {0}")]
    Pack(#[from] crate::pack::PackError),
    #[error("expert streaming: the IO engine lost a read (no completion for a read in flight)")]
    LostRead,
    #[error("expert streaming: {0}")]
    Config(String),
    /// The per-unit callback returned [`Stop`]; the caller holds the reason.
    #[error("the expert walk was stopped by its caller")]
    Stopped,
}

/// Gives the MoE block access to routed units' matrices.
pub trait ExpertSource: Send + Sync {
    /// Make each unit in `units` (ids within `layer`) available and call
    /// `f(index_in_units, view)` for it. Calls may come in any order (a cache serves hits
    /// first while misses load); callers must make their result independent of the order.
    /// `mapped` is the whole model file as mapped (what a resident source slices).
    /// If `f` returns [`Stop`], the walk ends early (no reads left in flight) and returns
    /// [`StreamError::Stopped`]: the caller knows why it stopped.
    fn for_each_expert(
        &self,
        mapped: &[u8],
        layer: usize,
        units: &[usize],
        f: &mut dyn FnMut(usize, ExpertView<'_>) -> Result<(), Stop>,
    ) -> Result<(), StreamError>;

    /// Like [`ExpertSource::for_each_expert`], but units that are ready together (all of
    /// them for a resident source; the cache hits of a streaming one) come as one batch,
    /// so the caller can compute them in one parallel pass. Every unit comes exactly once.
    fn for_each_batch(
        &self,
        mapped: &[u8],
        layer: usize,
        units: &[usize],
        f: &mut BatchFn<'_>,
    ) -> Result<(), StreamError> {
        self.for_each_expert(mapped, layer, units, &mut |i, v| f(&[(i, v)]))
    }

    /// `n` more tokens were evaluated (the clock of decaying eviction policies).
    fn end_tokens(&self, _n: usize) {}

    /// Units of `layer` that are certain to be needed soon (e.g. hash-routed layers, whose
    /// experts follow from the token ids): a streaming source may start reading them now,
    /// without waiting. Never changes what [`ExpertSource::for_each_expert`] computes.
    fn prefetch(&self, _layer: usize, _units: &[usize]) {}

    /// Whether [`ExpertSource::lookahead`] does anything (callers skip predicting if not).
    fn lookahead_enabled(&self) -> bool {
        false
    }

    /// Units of `layer` *predicted* to be needed next (router lookahead: the next layer's
    /// router applied to an earlier hidden state). A streaming source may read them when
    /// the disk has room; speculative, so never at the expense of demand reads or pinned
    /// units. Never changes what [`ExpertSource::for_each_expert`] computes.
    fn lookahead(&self, _layer: usize, _units: &[usize]) {}
}

/// A callback over a batch of ready units: (index in the unit list, view).
pub type BatchFn<'a> = dyn FnMut(&[(usize, ExpertView<'_>)]) -> Result<(), Stop> + 'a;

/// A shared source (lets the caller keep a handle for statistics).
impl<T: ExpertSource> ExpertSource for std::sync::Arc<T> {
    fn for_each_expert(
        &self,
        mapped: &[u8],
        layer: usize,
        units: &[usize],
        f: &mut dyn FnMut(usize, ExpertView<'_>) -> Result<(), Stop>,
    ) -> Result<(), StreamError> {
        (**self).for_each_expert(mapped, layer, units, f)
    }

    fn for_each_batch(
        &self,
        mapped: &[u8],
        layer: usize,
        units: &[usize],
        f: &mut BatchFn<'_>,
    ) -> Result<(), StreamError> {
        (**self).for_each_batch(mapped, layer, units, f)
    }

    fn end_tokens(&self, n: usize) {
        (**self).end_tokens(n)
    }

    fn prefetch(&self, layer: usize, units: &[usize]) {
        (**self).prefetch(layer, units)
    }

    fn lookahead_enabled(&self) -> bool {
        (**self).lookahead_enabled()
    }

    fn lookahead(&self, layer: usize, units: &[usize]) {
        (**self).lookahead(layer, units)
    }
}
