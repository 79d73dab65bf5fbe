//! SSD streaming of routed experts: the [`ExpertSource`] backed by the expert cache and
//! the IO engine.
//!
//! Owns: mapping (layer, expert) to the file segments of its gate/up/down slices, the
//! hits-first / misses-in-flight schedule of one layer's experts, resident (pinned)
//! layers, and the compute thread's IO-wait counters. Budget enforcement and eviction
//! are the cache's (`expert_tier`); reading is the IO engine's (`sluice-io`).

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use sluice_io::{
    open_engine, required_capacity, AlignedBuf, IoConfig, IoEngine, IoStats, ReadDone, ReadReq,
    Segment,
};

use crate::expert::{ExpertSource, ExpertView};
use crate::expert_tier::{
    CacheConfig, CacheError, CacheStats, ExpertCache, ExpertKey, Lookup, Pinned, PolicyKind,
    SlotBuf, Ticket,
};
use crate::model::weights::{Ffn, Weights};
use crate::EngineError;

impl SlotBuf for AlignedBuf {
    fn alloc(bytes: usize) -> Self {
        AlignedBuf::new(bytes)
    }
    fn as_slice(&self) -> &[u8] {
        AlignedBuf::as_slice(self)
    }
    fn size(&self) -> usize {
        self.capacity()
    }
}

/// How the streaming tier is set up.
#[derive(Debug, Clone)]
pub struct StreamConfig {
    /// Bytes the cache may hold (cached + in flight).
    pub budget: u64,
    pub policy: PolicyKind,
    /// The first N MoE layers' experts are read once at start and never evicted.
    pub resident_layers: usize,
    pub io: IoConfig,
}

/// File layout of one MoE layer's experts.
struct LayerLayout {
    /// gate, up, down stacked tensors: (start offset, bytes per expert).
    parts: [(u64, usize); 3],
    n_expert: usize,
    /// Slot bytes one expert needs (aligned spans of its three segments; the largest over
    /// the layer, since alignment padding depends on the offset).
    capacity: usize,
    /// Cache size class.
    class: usize,
}

impl LayerLayout {
    fn segments(&self, e: usize) -> Vec<Segment> {
        self.parts
            .iter()
            .map(|&(start, n)| Segment {
                offset: start + (e * n) as u64,
                len: n,
            })
            .collect()
    }
}

/// Counters of the compute side of streaming.
#[derive(Debug, Default, Clone)]
pub struct StreamStats {
    /// Time the compute thread spent waiting for expert reads.
    pub io_wait_ns: u64,
    /// Experts computed while other reads of the same layer were still in flight.
    pub overlapped: u64,
    /// Layer visits that had to be split because the batch's experts exceed the budget.
    pub budget_rounds: u64,
}

/// Routed experts streamed from the model file through a byte-budgeted cache.
pub struct StreamingExperts {
    cache: ExpertCache<AlignedBuf>,
    io: Box<dyn IoEngine>,
    layers: Vec<Option<LayerLayout>>,
    /// Pins of resident layers' experts, held for the model's lifetime.
    resident: Vec<Pinned<AlignedBuf>>,
    /// Expert bytes (without alignment) read at start for resident layers.
    resident_read: u64,
    io_wait_ns: AtomicU64,
    overlapped: AtomicU64,
    budget_rounds: AtomicU64,
}

impl StreamingExperts {
    /// The smallest budget that can run the model: one layer's top-k experts at once.
    pub fn min_budget(weights: &Weights, top_k: usize) -> u64 {
        let largest = layouts(weights)
            .iter()
            .flatten()
            .map(|l| l.capacity)
            .max()
            .unwrap_or(0);
        crate::expert_tier::min_budget(top_k, largest as u64)
    }

    /// Total bytes of all routed experts in the file.
    pub fn total_expert_bytes(weights: &Weights) -> u64 {
        layouts(weights)
            .iter()
            .flatten()
            .map(|l| l.parts.iter().map(|p| p.1 as u64).sum::<u64>() * l.n_expert as u64)
            .sum()
    }

    /// Bytes of one routed expert (gate + up + down) for each layer; 0 for dense layers.
    pub fn expert_bytes_per_layer(weights: &Weights) -> Vec<u64> {
        layouts(weights)
            .iter()
            .map(|l| {
                l.as_ref()
                    .map_or(0, |l| l.parts.iter().map(|p| p.1 as u64).sum())
            })
            .collect()
    }

    /// Open the IO engine on `path` and build the cache. Fails before any read when the
    /// budget cannot hold one layer's top-k experts.
    pub fn open(
        path: &Path,
        weights: &Weights,
        top_k: usize,
        cfg: &StreamConfig,
    ) -> Result<Self, EngineError> {
        let mut layers = layouts(weights);
        // One size class per distinct (gate, up, down) byte size, with the capacity of the
        // worst alignment among all its experts, so a slot can hold any expert of any
        // layer of that class (mixed-quant files get one pool per class).
        let mut classes: Vec<([usize; 3], usize)> = Vec::new();
        for l in layers.iter().flatten() {
            let sizes = l.parts.map(|p| p.1);
            match classes.iter_mut().find(|c| c.0 == sizes) {
                Some(c) => c.1 = c.1.max(l.capacity),
                None => classes.push((sizes, l.capacity)),
            }
        }
        for l in layers.iter_mut().flatten() {
            let sizes = l.parts.map(|p| p.1);
            l.class = classes
                .iter()
                .position(|c| c.0 == sizes)
                .expect("class recorded above");
            l.capacity = classes[l.class].1;
        }
        let classes: Vec<usize> = classes.iter().map(|c| c.1).collect();
        let cache = ExpertCache::new(
            CacheConfig {
                budget: cfg.budget,
                slot_sizes: classes,
                top_k,
                n_layer: layers.len() as u32,
            },
            cfg.policy.build(),
        )
        .map_err(|e| EngineError::Stream(format!("{}: {e}", path.display())))?;
        let io = open_engine(path, &cfg.io).map_err(|e| EngineError::Stream(e.to_string()))?;
        let mut s = StreamingExperts {
            cache,
            io,
            layers,
            resident: Vec::new(),
            resident_read: 0,
            io_wait_ns: AtomicU64::new(0),
            overlapped: AtomicU64::new(0),
            budget_rounds: AtomicU64::new(0),
        };
        s.load_resident(cfg.resident_layers)?;
        Ok(s)
    }

    /// Read every expert of the first `n` MoE layers into resident (never evicted) slots.
    fn load_resident(&mut self, n: usize) -> Result<(), EngineError> {
        let moe: Vec<usize> = (0..self.layers.len())
            .filter(|&l| self.layers[l].is_some())
            .take(n)
            .collect();
        for l in moe {
            let layout = self.layers[l].take().expect("moe layer");
            let n_expert = layout.n_expert;
            let mut tickets: HashMap<u64, (usize, Ticket)> = HashMap::new();
            for e in 0..n_expert {
                let key = ExpertKey::new(l as u32, e as u32);
                let r = self
                    .cache
                    .reserve_resident(key, layout.class)
                    .map_err(cache_err)?;
                tickets.insert(e as u64, (e, r.ticket));
                self.io
                    .submit(ReadReq {
                        tag: e as u64,
                        segments: layout.segments(e),
                        buf: r.buf,
                    })
                    .map_err(|e| EngineError::Stream(e.to_string()))?;
            }
            while !tickets.is_empty() {
                let done = self.next_completion()?;
                let (_, pinned) = self.land(done, &mut tickets)?;
                self.resident_read += layout.parts.iter().map(|p| p.1 as u64).sum::<u64>();
                self.resident.push(pinned);
            }
            self.layers[l] = Some(layout);
        }
        Ok(())
    }

    /// Expert bytes read at start for `--resident-layers`.
    pub fn resident_read_bytes(&self) -> u64 {
        self.resident_read
    }

    pub fn cache_stats(&self) -> CacheStats {
        self.cache.stats()
    }

    /// The IO backend actually in use (after any fallback).
    pub fn io_stats_name(&self) -> &'static str {
        self.io.name()
    }

    pub fn io_stats(&self) -> IoStats {
        self.io.stats()
    }

    pub fn stream_stats(&self) -> StreamStats {
        StreamStats {
            io_wait_ns: self.io_wait_ns.load(Ordering::Relaxed),
            overlapped: self.overlapped.load(Ordering::Relaxed),
            budget_rounds: self.budget_rounds.load(Ordering::Relaxed),
        }
    }

    /// Wait for one read, fill its slot and return (index in the layer's list, pinned slot).
    fn complete_one(
        &self,
        in_flight: &mut HashMap<u64, (usize, Ticket)>,
    ) -> Result<(usize, Pinned<AlignedBuf>), EngineError> {
        let t0 = Instant::now();
        let done = self.next_completion()?;
        self.io_wait_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.land(done, in_flight)
    }

    /// The next finished read (blocking); an error if the engine has none in flight.
    fn next_completion(&self) -> Result<ReadDone, EngineError> {
        self.io
            .wait_one()
            .ok_or_else(|| EngineError::Stream("IO engine lost a read".into()))
    }

    /// Give a finished read's buffer to its reserved slot (or release the slot if the read
    /// failed, returning the error naming file, offset and length).
    fn land(
        &self,
        done: ReadDone,
        in_flight: &mut HashMap<u64, (usize, Ticket)>,
    ) -> Result<(usize, Pinned<AlignedBuf>), EngineError> {
        let (i, ticket) = in_flight
            .remove(&done.tag)
            .expect("completion for a read we issued");
        if let Err(e) = done.result {
            self.cache.release_failed(ticket, Some(done.buf));
            return Err(EngineError::Stream(e.to_string()));
        }
        let pinned = self
            .cache
            .fill(ticket, done.buf, &done.placed)
            .map_err(cache_err)?;
        Ok((i, pinned))
    }
}

fn cache_err(e: CacheError) -> EngineError {
    EngineError::Stream(e.to_string())
}

/// Per layer: where its experts' gate/up/down slices are and the slot bytes one needs.
fn layouts(weights: &Weights) -> Vec<Option<LayerLayout>> {
    weights
        .layers
        .iter()
        .map(|l| match &l.ffn {
            Ffn::Moe { experts, .. } => {
                let parts = [&experts.gate, &experts.up, &experts.down]
                    .map(|s| (s.range.start as u64, s.expert_bytes()));
                let mut layout = LayerLayout {
                    parts,
                    n_expert: experts.gate.n_expert,
                    capacity: 0,
                    class: 0,
                };
                layout.capacity = (0..layout.n_expert)
                    .map(|e| required_capacity(&layout.segments(e)))
                    .max()
                    .unwrap_or(0);
                Some(layout)
            }
            Ffn::Dense { .. } => None,
        })
        .collect()
}

impl ExpertSource for StreamingExperts {
    /// Hits are computed at once while the misses' reads are in flight; each miss is
    /// computed as it lands. When the batch needs more experts than the budget holds at
    /// once (prefill), the list is worked through in rounds: what fits is read, computed
    /// and unpinned, then the rest.
    fn for_each_expert(
        &self,
        _weights: &Weights,
        layer: usize,
        experts: &[usize],
        f: &mut dyn FnMut(usize, ExpertView<'_>) -> Result<(), EngineError>,
    ) -> Result<(), EngineError> {
        let Some(layout) = self.layers[layer].as_ref() else {
            return Ok(());
        };
        let mut in_flight: HashMap<u64, (usize, Ticket)> = HashMap::new();
        let result = self.run_layer(layout, layer, experts, f, &mut in_flight);
        if result.is_err() {
            // Never leave reads behind: a stale completion would reach the next layer.
            self.drain(&mut in_flight);
        }
        result
    }

    fn end_tokens(&self, n: usize) {
        for _ in 0..n {
            self.cache.end_token();
        }
    }
}

impl StreamingExperts {
    /// Wait for every read still in flight after an error; landed ones stay cached, failed
    /// ones give their slot back.
    fn drain(&self, in_flight: &mut HashMap<u64, (usize, Ticket)>) {
        while !in_flight.is_empty() {
            let Some(done) = self.io.wait_one() else {
                break;
            };
            // Landed reads stay cached; failed ones give their slot back.
            let _ = self.land(done, in_flight);
        }
    }

    /// One layer's experts: hits computed at once, misses as they land, in budget rounds.
    fn run_layer(
        &self,
        layout: &LayerLayout,
        layer: usize,
        experts: &[usize],
        f: &mut dyn FnMut(usize, ExpertView<'_>) -> Result<(), EngineError>,
        in_flight: &mut HashMap<u64, (usize, Ticket)>,
    ) -> Result<(), EngineError> {
        // Round 1 looks every expert up (this is what the hit/miss statistics count);
        // later rounds only retry the misses that did not fit.
        let mut misses: Vec<usize> = Vec::new();
        let mut hits: Vec<(usize, Pinned<AlignedBuf>)> = Vec::new();
        for (i, &e) in experts.iter().enumerate() {
            match self.cache.lookup(ExpertKey::new(layer as u32, e as u32)) {
                Lookup::Hit(p) => hits.push((i, p)),
                Lookup::Pending | Lookup::Miss => misses.push(i),
            }
        }
        let mut first = true;
        while !misses.is_empty() || !hits.is_empty() || !in_flight.is_empty() {
            let mut deferred = Vec::new();
            for &i in &misses {
                let key = ExpertKey::new(layer as u32, experts[i] as u32);
                match self.cache.reserve(key, layout.class) {
                    Ok(r) => {
                        let tag = i as u64;
                        in_flight.insert(tag, (i, r.ticket));
                        if let Err(e) = self.io.submit(ReadReq {
                            tag,
                            segments: layout.segments(experts[i]),
                            buf: r.buf,
                        }) {
                            let (_, t) = in_flight.remove(&tag).expect("just inserted");
                            self.cache.release_failed(t, None);
                            return Err(EngineError::Stream(e.to_string()));
                        }
                    }
                    Err(CacheError::BudgetTooSmall { .. })
                        if !in_flight.is_empty() || !hits.is_empty() =>
                    {
                        deferred.push(i)
                    }
                    Err(e) => return Err(cache_err(e)),
                }
            }
            if !first || !deferred.is_empty() {
                self.budget_rounds
                    .fetch_add(u64::from(!deferred.is_empty()), Ordering::Relaxed);
            }
            first = false;
            // Hits first, while the misses load.
            for (i, p) in hits.drain(..) {
                if !in_flight.is_empty() {
                    self.overlapped.fetch_add(1, Ordering::Relaxed);
                }
                f(i, expert_view(&p, layout))?;
            }
            while !in_flight.is_empty() {
                let (i, p) = self.complete_one(in_flight)?;
                if !in_flight.is_empty() {
                    self.overlapped.fetch_add(1, Ordering::Relaxed);
                }
                f(i, expert_view(&p, layout))?;
            }
            misses = deferred;
        }
        Ok(())
    }
}

/// The three matrices of a cached expert.
fn expert_view<'a>(p: &'a Pinned<AlignedBuf>, layout: &LayerLayout) -> ExpertView<'a> {
    let b = p.bytes();
    let at = |i: usize| &b[p.placed()[i]..p.placed()[i] + layout.parts[i].1];
    ExpertView {
        gate: at(0),
        up: at(1),
        down: at(2),
    }
}
