//! Routing replay: the experts each token uses taken from a recorded routing trace instead
//! of the model's router (`sluice bench --replay-routing TRACE`), so a synthetic file of the
//! same routing geometry is read with a real model's access pattern.
//!
//! Owns: the geometry check between a trace and a model (layers, which of them have routed
//! experts, experts per layer, top-k; expert *bytes* may differ: a trace of a small-hidden
//! model replays on a large synth of its routing geometry), and the cursor handing every
//! batch of the engine the next tokens of the trace (wrapping to its start at the end).
//!
//! Does not own: the override itself (the MoE block asks [`RoutingReplay::ids`] in place of
//! its router's choice) nor the trace format ([`crate::trace`]). A replayed run is an IO
//! benchmark only: its logits are not the model's and are never claimed.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::trace::{RoutingTrace, TraceError};

/// The routing geometry a trace must share with the model it replays on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Geometry {
    pub n_layer: u32,
    pub n_expert: u32,
    pub top_k: u32,
    /// Layers with routed experts, in order.
    pub moe_layers: Vec<u32>,
}

impl std::fmt::Display for Geometry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} layers ({} with routed experts), {} experts, top-{}",
            self.n_layer,
            self.moe_layers.len(),
            self.n_expert,
            self.top_k
        )
    }
}

/// A trace being replayed: shared by every sequence of the engine (one cursor).
#[derive(Debug)]
pub struct RoutingReplay {
    trace: RoutingTrace,
    path: PathBuf,
    /// Per model layer: its index among the trace's MoE layers (`None`: no routed experts).
    slot: Vec<Option<usize>>,
    k: usize,
    /// Trace tokens handed out so far (the next batch starts at this one, modulo the
    /// trace's length).
    next: AtomicU64,
}

/// The trace tokens of one engine batch: token `t` of the batch replays trace token
/// `(start + t) % n_tokens`.
#[derive(Debug, Clone, Copy)]
pub struct ReplayBatch<'a> {
    pub replay: &'a RoutingReplay,
    pub start: u64,
}

impl ReplayBatch<'_> {
    /// The `top_k` experts token `t` of the batch uses in layer `layer`, in router order.
    pub fn ids(&self, t: usize, layer: usize) -> Option<&[u16]> {
        self.replay.ids(self.start + t as u64, layer)
    }
}

impl RoutingReplay {
    /// A replay of `trace` (read from `path`) on a model of geometry `model`; a trace of
    /// another geometry is refused, naming both.
    pub fn new(
        trace: RoutingTrace,
        path: &Path,
        model: &Geometry,
    ) -> Result<RoutingReplay, TraceError> {
        let h = &trace.header;
        let found = Geometry {
            n_layer: h.n_layer,
            n_expert: h.n_expert,
            top_k: h.top_k,
            moe_layers: h.moe_layers(),
        };
        if &found != model {
            let mut what = format!("the trace has {found}, the model {model}");
            if found.moe_layers != model.moe_layers && found.n_layer == model.n_layer {
                what.push_str(&format!(
                    " (routed-expert layers {:?} vs {:?})",
                    found.moe_layers, model.moe_layers
                ));
            }
            return Err(TraceError::Geometry {
                path: path.to_path_buf(),
                what,
            });
        }
        if trace.n_tokens() == 0 {
            return Err(TraceError::Header {
                path: path.to_path_buf(),
                what: "no tokens to replay".into(),
            });
        }
        let mut slot = vec![None; model.n_layer as usize];
        for (i, &l) in model.moe_layers.iter().enumerate() {
            slot[l as usize] = Some(i);
        }
        Ok(RoutingReplay {
            k: h.top_k as usize,
            trace,
            path: path.to_path_buf(),
            slot,
            next: AtomicU64::new(0),
        })
    }

    /// Hands out the next `n` tokens of the trace for one engine batch.
    pub fn begin_batch(&self, n: usize) -> ReplayBatch<'_> {
        ReplayBatch {
            replay: self,
            start: self.next.fetch_add(n as u64, Ordering::Relaxed),
        }
    }

    /// The experts trace token `token` (modulo the trace's length) uses in `layer`.
    pub fn ids(&self, token: u64, layer: usize) -> Option<&[u16]> {
        let li = (*self.slot.get(layer)?)?;
        let t = (token % self.trace.n_tokens() as u64) as usize;
        Some(&self.trace.token(t)[li * self.k..(li + 1) * self.k])
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn trace(&self) -> &RoutingTrace {
        &self.trace
    }

    /// Trace tokens handed out so far (more than the trace's length once it wrapped).
    pub fn tokens_replayed(&self) -> u64 {
        self.next.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::TraceHeader;

    fn header(n_layer: u32, moe: &[u32]) -> TraceHeader {
        TraceHeader {
            model: "t".into(),
            n_layer,
            n_expert: 4,
            top_k: 2,
            expert_bytes: (0..n_layer)
                .map(|l| if moe.contains(&l) { 100 } else { 0 })
                .collect(),
        }
    }

    fn geometry(n_layer: u32, moe: &[u32]) -> Geometry {
        Geometry {
            n_layer,
            n_expert: 4,
            top_k: 2,
            moe_layers: moe.to_vec(),
        }
    }

    #[test]
    fn hands_out_trace_tokens_in_order_and_wraps() {
        // Layers 0 and 2 routed; token t uses {t%4, (t+1)%4} in layer 0, reversed in 2.
        let toks: Vec<Vec<u16>> = (0..3u16)
            .map(|t| vec![t % 4, (t + 1) % 4, (t + 1) % 4, t % 4])
            .collect();
        let trace = RoutingTrace::from_tokens(header(3, &[0, 2]), &toks).unwrap();
        let r = RoutingReplay::new(trace, Path::new("x"), &geometry(3, &[0, 2])).unwrap();
        let b = r.begin_batch(2);
        assert_eq!(b.ids(0, 0), Some(&[0, 1][..]));
        assert_eq!(b.ids(1, 2), Some(&[2, 1][..]));
        assert_eq!(b.ids(0, 1), None, "layer 1 has no routed experts");
        let b = r.begin_batch(2); // trace tokens 2 and 3 = 0 (wrapped)
        assert_eq!(b.ids(0, 0), Some(&[2, 3][..]));
        assert_eq!(b.ids(1, 0), Some(&[0, 1][..]));
        assert_eq!(r.tokens_replayed(), 4);
    }

    #[test]
    fn refuses_another_geometry() {
        let toks = vec![vec![0u16, 1, 2, 3]];
        let trace = RoutingTrace::from_tokens(header(3, &[0, 2]), &toks).unwrap();
        let err = RoutingReplay::new(trace.clone(), Path::new("x.slrt"), &geometry(3, &[0, 1]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("x.slrt") && err.contains("[0, 2]"), "{err}");
        let mut g = geometry(3, &[0, 2]);
        g.top_k = 4;
        let err = RoutingReplay::new(trace, Path::new("x.slrt"), &g)
            .unwrap_err()
            .to_string();
        assert!(err.contains("top-2") && err.contains("top-4"), "{err}");
    }
}
