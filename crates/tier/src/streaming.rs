//! SSD streaming of routed experts: the [`ExpertSource`] backed by the expert cache and
//! the IO engine.
//!
//! Owns: mapping (layer, unit) to the file segments of its matrices (from the
//! [`UnitGroup`] the loader describes), the hits-first / misses-in-flight schedule of one
//! layer's units, reading from a packed sidecar when one is given (one read per unit),
//! slot memory made ready on a background thread at load, warming from a profile,
//! resident (pinned) layers, the routing of completions to the sequence
//! that issued them (several sequences may forward through one source at once), reads
//! ahead of demand (certain prefetch of units known ahead, speculative router lookahead
//! gated by how many demand reads are in flight), and the compute side's IO-wait counters. Budget enforcement and eviction are the cache's;
//! reading is the IO engine's (`sluice-io`).

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use sluice_io::{
    open_engine, required_capacity, AlignedBuf, IoConfig, IoEngine, IoStats, ReadDone, ReadReq,
    Segment,
};

use crate::groups::{UnitGroup, UnitLayer};
use crate::pack::{PackError, PackFile, PackLayer};
use crate::profile::Profile;
use crate::source::{BatchFn, ExpertSource, ExpertView, Stop, StreamError};
use crate::{
    CacheConfig, CacheError, CacheStats, ExpertCache, ExpertKey, Lookup, Pinned, PolicyKind,
    SlotBuf, Ticket,
};

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

/// File layout of one layer's units.
struct LayerLayout {
    unit: UnitLayer,
    /// Where the units are in a packed sidecar (one read per unit), when one is used.
    packed: Option<PackLayer>,
    /// Slot bytes one unit needs (aligned spans of its segments; the largest over the
    /// layer, since alignment padding depends on the offset).
    capacity: usize,
    /// Cache size class.
    class: usize,
}

impl LayerLayout {
    fn segments(&self, e: usize) -> Vec<Segment> {
        if let Some(p) = &self.packed {
            return vec![Segment {
                offset: p.offset(e),
                len: p.unit_bytes() as usize,
            }];
        }
        (0..self.unit.parts.len())
            .map(|i| {
                let r = self.unit.part_range(i, e);
                Segment {
                    offset: r.start,
                    len: (r.end - r.start) as usize,
                }
            })
            .collect()
    }

    fn sizes(&self) -> Vec<u64> {
        self.unit.parts.iter().map(|p| p.bytes_per_unit).collect()
    }
}

/// Counters of the compute side of streaming.
#[derive(Debug, Default, Clone)]
pub struct StreamStats {
    /// Time the compute thread spent waiting for expert reads (its own, and reads of units
    /// it needs that a prefetch or another sequence issued).
    pub io_wait_ns: u64,
    /// Experts computed while other reads of the same layer were still in flight.
    pub overlapped: u64,
    /// Layer visits that had to be split because the batch's experts exceed the budget.
    pub budget_rounds: u64,
    /// Certain prefetches ([`ExpertSource::prefetch`]): reads issued, their expert bytes,
    /// units already cached or in flight (no read), and units left out because the budget
    /// beyond one layer's top-k was used up.
    pub prefetch_issued: u64,
    pub prefetch_bytes: u64,
    pub prefetch_present: u64,
    pub prefetch_skipped: u64,
    /// Prefetched units found cached or still in flight when the layer asked for them
    /// (the rest of `prefetch_issued` were evicted before use, or are not asked yet).
    pub prefetch_hit: u64,
    /// Units another read (a prefetch, another sequence) had in flight when the layer
    /// looked them up, evicted after landing and before the layer pinned them, so read
    /// again (`--stats` reconciles bytes with them).
    pub reread: u64,
    pub reread_bytes: u64,
    /// Router lookahead ([`ExpertSource::lookahead`]): units predicted, how many of them the
    /// layer's real routing chose (`la_correct` of `la_actual` units the layers asked for
    /// after a prediction: the accuracy), reads issued and their bytes, predicted units
    /// already cached or in flight, left out (budget), dropped because demand reads kept
    /// the disk busy until the layer ran, read and used by the layer visit they were read
    /// for (`la_hit`), read and not used by it (`la_wasted`, bytes `la_wasted_bytes`).
    pub la_predicted: u64,
    pub la_correct: u64,
    pub la_actual: u64,
    pub la_issued: u64,
    pub la_bytes: u64,
    pub la_present: u64,
    pub la_skipped: u64,
    pub la_dropped: u64,
    pub la_hit: u64,
    pub la_wasted: u64,
    pub la_wasted_bytes: u64,
}

/// Why a unit was read ahead of its layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ahead {
    /// Certain: the unit follows from the token ids (hash-routed layers).
    Certain,
    /// Speculative: predicted by router lookahead.
    Lookahead,
}

/// Lookahead counters (see the `la_*` fields of [`StreamStats`]).
#[derive(Default)]
struct LaCounters {
    predicted: AtomicU64,
    correct: AtomicU64,
    actual: AtomicU64,
    issued: AtomicU64,
    bytes: AtomicU64,
    present: AtomicU64,
    skipped: AtomicU64,
    dropped: AtomicU64,
    hit: AtomicU64,
    wasted: AtomicU64,
    wasted_bytes: AtomicU64,
}

/// Predicted units waiting for the disk to have room (issued by [`StreamingExperts::pump`]).
#[derive(Default)]
struct Pending {
    layer: usize,
    units: std::collections::VecDeque<usize>,
}

/// Routed experts streamed from the model file through a byte-budgeted cache.
///
/// Safe to share between sequences forwarding at the same time: every read gets a unique
/// tag, one caller at a time polls the IO engine and hands other callers' completions over
/// through a mailbox, and a unit another sequence is already reading is waited for rather
/// than read twice.
pub struct StreamingExperts {
    cache: Arc<ExpertCache<AlignedBuf>>,
    /// The background thread that makes slot memory ready at load, and its stop flag.
    slot_filler: Mutex<Option<std::thread::JoinHandle<()>>>,
    stop_filler: Arc<AtomicBool>,
    io: Box<dyn IoEngine>,
    layers: Vec<Option<LayerLayout>>,
    /// The sidecar units are read from (a unit's first good read is checked against its
    /// unit hash), and per layer, the units whose read from it passed the check.
    pack: Option<PackFile>,
    verified: Vec<Vec<AtomicBool>>,
    /// Pins of resident layers' experts, held for the model's lifetime.
    resident: Vec<Pinned<AlignedBuf>>,
    /// Expert bytes (without alignment) read at start for resident layers.
    resident_read: u64,
    next_tag: AtomicU64,
    mailbox: Mutex<Mailbox>,
    landed: Condvar,
    io_wait_ns: AtomicU64,
    overlapped: AtomicU64,
    budget_rounds: AtomicU64,
    /// Prefetch reads in flight (issued by no caller): tag -> reservation. Whoever polls
    /// the IO engine lands them.
    prefetching: Mutex<HashMap<u64, Ticket>>,
    top_k: usize,
    prefetch_issued: AtomicU64,
    prefetch_bytes: AtomicU64,
    prefetch_present: AtomicU64,
    prefetch_skipped: AtomicU64,
    prefetch_hit: AtomicU64,
    reread: AtomicU64,
    reread_bytes: AtomicU64,
    /// Units read by a prefetch and not asked for yet (for `prefetch_hit` / `la_hit`).
    prefetched: Mutex<HashMap<ExpertKey, Ahead>>,
    /// Certain prefetches on (`--no-hash-prefetch` turns them off, for A/B).
    certain_prefetch: AtomicBool,
    /// Router lookahead on (`--lookahead` / `--no-lookahead`).
    lookahead: AtomicBool,
    /// Speculative reads are issued only while at most this many demand reads are in flight.
    la_max_demand: AtomicUsize,
    /// Reads the IO engine keeps in flight (`IoConfig::depth`): speculative reads never
    /// take the total past it.
    depth: usize,
    /// Demand reads in flight of the layer being computed (last set by a walk).
    demand: AtomicUsize,
    /// Predicted units not issued yet, and the last prediction per layer (for accuracy).
    pending: Mutex<Pending>,
    predicted: Mutex<HashMap<usize, Vec<usize>>>,
    la: LaCounters,
}

impl Drop for StreamingExperts {
    fn drop(&mut self) {
        self.stop_filler.store(true, Ordering::Relaxed);
        self.wait_slots_ready();
    }
}

/// Completions that arrived for a caller other than the one polling.
#[derive(Default)]
struct Mailbox {
    done: HashMap<u64, ReadDone>,
    /// A caller is blocked in `IoEngine::wait_one`.
    polling: bool,
}

/// Reads one caller has in flight: tag -> (index in its unit list, reservation).
type InFlight = HashMap<u64, (usize, Ticket)>;

impl StreamingExperts {
    /// The smallest budget that can run the model: one layer's top-k units at once.
    pub fn min_budget(group: &UnitGroup, top_k: usize) -> u64 {
        let largest = layouts(group, None)
            .iter()
            .flatten()
            .map(|l| l.capacity)
            .max()
            .unwrap_or(0);
        crate::min_budget(top_k, largest as u64)
    }

    /// Open the IO engine on `path` and build the cache. Fails before any read when the
    /// budget cannot hold one layer's top-k units.
    pub fn open(
        path: &Path,
        group: &UnitGroup,
        top_k: usize,
        cfg: &StreamConfig,
    ) -> Result<Self, StreamError> {
        Self::open_packed(path, group, top_k, cfg, None)
    }

    /// Like [`Self::open`]; with `pack` (a sidecar validated against this model), every
    /// unit is read from the sidecar in one aligned read instead of one read per matrix.
    pub fn open_packed(
        path: &Path,
        group: &UnitGroup,
        top_k: usize,
        cfg: &StreamConfig,
        pack: Option<&PackFile>,
    ) -> Result<Self, StreamError> {
        let mut layers = layouts(group, pack);
        // One size class per distinct list of matrix sizes, with the capacity of the worst
        // alignment among all its units, so a slot can hold any unit of any layer of that
        // class (mixed-quant files get one pool per class).
        let mut classes: Vec<(Vec<u64>, usize)> = Vec::new();
        for l in layers.iter().flatten() {
            let sizes = l.sizes();
            match classes.iter_mut().find(|c| c.0 == sizes) {
                Some(c) => c.1 = c.1.max(l.capacity),
                None => classes.push((sizes, l.capacity)),
            }
        }
        for l in layers.iter_mut().flatten() {
            let sizes = l.sizes();
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
        )?;
        let io = open_engine(pack.map_or(path, |p| p.path.as_path()), &cfg.io)?;
        let mut s = StreamingExperts {
            cache: Arc::new(cache),
            slot_filler: Mutex::new(None),
            stop_filler: Arc::new(AtomicBool::new(false)),
            io,
            layers,
            pack: pack.cloned(),
            verified: pack.map_or_else(Vec::new, |p| {
                p.unit_hashes
                    .iter()
                    .map(|h| h.iter().map(|_| AtomicBool::new(false)).collect())
                    .collect()
            }),
            resident: Vec::new(),
            resident_read: 0,
            next_tag: AtomicU64::new(0),
            mailbox: Mutex::new(Mailbox::default()),
            landed: Condvar::new(),
            io_wait_ns: AtomicU64::new(0),
            overlapped: AtomicU64::new(0),
            budget_rounds: AtomicU64::new(0),
            prefetching: Mutex::new(HashMap::new()),
            top_k,
            prefetch_issued: AtomicU64::new(0),
            prefetch_bytes: AtomicU64::new(0),
            prefetch_present: AtomicU64::new(0),
            prefetch_skipped: AtomicU64::new(0),
            prefetch_hit: AtomicU64::new(0),
            reread: AtomicU64::new(0),
            reread_bytes: AtomicU64::new(0),
            prefetched: Mutex::new(HashMap::new()),
            certain_prefetch: AtomicBool::new(true),
            lookahead: AtomicBool::new(false),
            la_max_demand: AtomicUsize::new(0),
            depth: cfg.io.depth.max(1),
            demand: AtomicUsize::new(0),
            pending: Mutex::new(Pending::default()),
            predicted: Mutex::new(HashMap::new()),
            la: LaCounters::default(),
        };
        s.load_resident(cfg.resident_layers)?;
        s.start_slot_filler();
        Ok(s)
    }

    /// Allocate and fault in the budget's slot memory on a background thread, so the first
    /// tokens' reads do not wait for page faults on the compute thread. Slots go to the size
    /// classes in proportion to their layers; the thread stops when the budget is full or
    /// the source is dropped. Never changes what is computed.
    fn start_slot_filler(&self) {
        let order: Vec<usize> = self.layers.iter().flatten().map(|l| l.class).collect();
        if order.is_empty() {
            return;
        }
        let cache = self.cache.clone();
        let stop = self.stop_filler.clone();
        let h = std::thread::Builder::new()
            .name("sluice-slots".into())
            .spawn(move || {
                let mut refused = 0;
                for &class in order.iter().cycle() {
                    if stop.load(Ordering::Relaxed) || refused >= order.len() {
                        break;
                    }
                    let Some(bytes) = cache.class_bytes(class) else {
                        break;
                    };
                    let s = cache.stats();
                    if s.bytes_allocated + bytes as u64 > s.budget {
                        refused += 1;
                        continue;
                    }
                    let mut buf = AlignedBuf::new(bytes);
                    for b in buf.as_mut_slice().iter_mut().step_by(4096) {
                        *b = 0;
                    }
                    match cache.add_free_slot(class, buf) {
                        Ok(()) => refused = 0,
                        Err(_) => refused += 1,
                    }
                }
            });
        if let Ok(h) = h {
            *self
                .slot_filler
                .lock()
                .unwrap_or_else(PoisonError::into_inner) = Some(h);
        }
    }

    /// Wait until the background slot filler is done (for tests and measurements).
    pub fn wait_slots_ready(&self) {
        let h = self
            .slot_filler
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(h) = h {
            let _ = h.join();
        }
    }

    /// Read every unit of the first `n` layers that have units into resident (never
    /// evicted) slots.
    fn load_resident(&mut self, n: usize) -> Result<(), StreamError> {
        let moe: Vec<usize> = (0..self.layers.len())
            .filter(|&l| self.layers[l].is_some())
            .take(n)
            .collect();
        for l in moe {
            let layout = self.layers[l].take().expect("moe layer");
            let n_units = layout.unit.n_units;
            let mut tickets = InFlight::new();
            for e in 0..n_units {
                let key = ExpertKey::new(l as u32, e as u32);
                let r = self.cache.reserve_resident(key, layout.class)?;
                let tag = self.tag();
                tickets.insert(tag, (e, r.ticket));
                self.io.submit(ReadReq {
                    tag,
                    segments: layout.segments(e),
                    buf: r.buf,
                })?;
            }
            while !tickets.is_empty() {
                let (_, pinned) = self.complete_one(&mut tickets)?;
                self.resident_read += layout.unit.unit_bytes();
                self.resident.push(pinned);
            }
            self.layers[l] = Some(layout);
        }
        Ok(())
    }

    /// Warm the cache from a popularity profile: seed the policy's statistics and read the
    /// most popular experts while they fit in the budget without evicting. Blocks until
    /// they have landed. Returns (experts read, expert bytes read).
    pub fn preload(&self, profile: &Profile) -> Result<(u64, u64), StreamError> {
        let mut in_flight = InFlight::new();
        let mut n = 0u64;
        let mut bytes = 0u64;
        let depth = 64;
        let wait0 = self.io_wait_ns.load(Ordering::Relaxed);
        let res = crate::sim::preload(
            &self.cache,
            profile,
            |l| {
                let layout = self.layers.get(l as usize)?.as_ref()?;
                Some((layout.class, layout.capacity))
            },
            |k, r| {
                let Some(layout) = self.layers.get(k.layer as usize).and_then(Option::as_ref)
                else {
                    self.cache.release_failed(r.ticket, Some(r.buf));
                    return Ok(());
                };
                if k.expert as usize >= layout.unit.n_units {
                    self.cache.release_failed(r.ticket, Some(r.buf));
                    return Ok(());
                }
                let tag = self.tag();
                in_flight.insert(tag, (0, r.ticket));
                if self
                    .io
                    .submit(ReadReq {
                        tag,
                        segments: layout.segments(k.expert as usize),
                        buf: r.buf,
                    })
                    .is_err()
                {
                    if let Some((_, t)) = in_flight.remove(&tag) {
                        self.cache.release_failed(t, None);
                    }
                    return Ok(());
                }
                n += 1;
                bytes += layout.unit.unit_bytes();
                while in_flight.len() >= depth {
                    if self.complete_one(&mut in_flight).is_err() {
                        break;
                    }
                }
                Ok(())
            },
        );
        let mut first_err = res.err().map(StreamError::from);
        while !in_flight.is_empty() {
            if let Err(e) = self.complete_one(&mut in_flight) {
                first_err.get_or_insert(e);
            }
        }
        // Preload reads are not demand reads: the cache's miss counters and the compute
        // side's IO wait stay untouched.
        self.io_wait_ns.store(wait0, Ordering::Relaxed);
        match first_err {
            Some(e) => Err(e),
            None => Ok((n, bytes)),
        }
    }

    fn tag(&self) -> u64 {
        self.next_tag.fetch_add(1, Ordering::Relaxed)
    }

    /// Expert bytes read at start for `--resident-layers`.
    pub fn resident_read_bytes(&self) -> u64 {
        self.resident_read
    }

    pub fn cache_stats(&self) -> CacheStats {
        self.cache.stats()
    }

    /// Tell `hook` where the cache's slot memory is (see [`crate::SlotMemory`]): e.g. a GPU
    /// backend page-locks it so copies of streamed experts to VRAM run at pinned speed.
    pub fn set_slot_memory(&self, hook: Arc<dyn crate::SlotMemory>) {
        self.cache.set_slot_memory(hook);
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
            prefetch_issued: self.prefetch_issued.load(Ordering::Relaxed),
            prefetch_bytes: self.prefetch_bytes.load(Ordering::Relaxed),
            prefetch_present: self.prefetch_present.load(Ordering::Relaxed),
            prefetch_skipped: self.prefetch_skipped.load(Ordering::Relaxed),
            prefetch_hit: self.prefetch_hit.load(Ordering::Relaxed),
            reread: self.reread.load(Ordering::Relaxed),
            reread_bytes: self.reread_bytes.load(Ordering::Relaxed),
            la_predicted: self.la.predicted.load(Ordering::Relaxed),
            la_correct: self.la.correct.load(Ordering::Relaxed),
            la_actual: self.la.actual.load(Ordering::Relaxed),
            la_issued: self.la.issued.load(Ordering::Relaxed),
            la_bytes: self.la.bytes.load(Ordering::Relaxed),
            la_present: self.la.present.load(Ordering::Relaxed),
            la_skipped: self.la.skipped.load(Ordering::Relaxed),
            la_dropped: self.la.dropped.load(Ordering::Relaxed),
            la_hit: self.la.hit.load(Ordering::Relaxed),
            la_wasted: self.la.wasted.load(Ordering::Relaxed),
            la_wasted_bytes: self.la.wasted_bytes.load(Ordering::Relaxed),
        }
    }

    /// Turn router lookahead ([`ExpertSource::lookahead`]) on or off (off by default).
    /// What is computed is the same either way; only which reads are issued when changes.
    pub fn set_lookahead(&self, on: bool) {
        self.lookahead.store(on, Ordering::Relaxed);
    }

    /// Speculative reads wait until at most `n` demand reads of the layer being computed
    /// are in flight (0: only once the disk has no demand read left; `usize::MAX`: at once,
    /// queued behind the demand reads already submitted). The IO depth caps them either way.
    pub fn set_lookahead_max_demand(&self, n: usize) {
        self.la_max_demand.store(n, Ordering::Relaxed);
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn predicted(&self) -> std::sync::MutexGuard<'_, HashMap<usize, Vec<usize>>> {
        self.predicted
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Issue pending speculative reads while the disk has room: at most `la_max_demand`
    /// demand reads in flight, and all reads in flight below the IO depth.
    fn pump(&self) {
        let max_demand = self.la_max_demand.load(Ordering::Relaxed);
        let mut p = self.pending();
        while !p.units.is_empty() {
            let demand = self.demand.load(Ordering::Relaxed);
            if demand > max_demand || demand + self.prefetching().len() >= self.depth {
                return;
            }
            let e = p.units.pop_front().expect("checked non-empty");
            let layer = p.layer;
            self.issue(layer, &[e], Ahead::Lookahead);
        }
    }

    /// At the start of `layer`'s walk: score the last prediction for it, drop its predicted
    /// units not issued yet, and count lookahead units read for it that it did not use.
    fn settle_lookahead(&self, layer: usize, units: &[usize]) {
        if let Some(pred) = self.predicted().remove(&layer) {
            let correct = pred.iter().filter(|e| units.contains(e)).count();
            self.la.correct.fetch_add(correct as u64, Ordering::Relaxed);
            self.la
                .actual
                .fetch_add(units.len() as u64, Ordering::Relaxed);
        }
        {
            let mut p = self.pending();
            if p.layer == layer && !p.units.is_empty() {
                self.la
                    .dropped
                    .fetch_add(p.units.len() as u64, Ordering::Relaxed);
                p.units.clear();
            }
        }
        let Some(layout) = self.layers.get(layer).and_then(Option::as_ref) else {
            return;
        };
        let unit_bytes = layout.unit.unit_bytes();
        let mut wasted = 0u64;
        // Locks are taken one at a time here (`pump` holds `pending` while it issues).
        self.prefetched().retain(|k, a| {
            let stale = *a == Ahead::Lookahead && k.layer as usize == layer;
            wasted += u64::from(stale);
            !stale
        });
        self.la.wasted.fetch_add(wasted, Ordering::Relaxed);
        self.la
            .wasted_bytes
            .fetch_add(wasted * unit_bytes, Ordering::Relaxed);
    }

    /// Turn certain prefetches ([`ExpertSource::prefetch`]) on or off (on by default).
    /// Off, `prefetch` reads nothing; what is computed is the same either way.
    pub fn set_certain_prefetch(&self, on: bool) {
        self.certain_prefetch.store(on, Ordering::Relaxed);
    }

    fn prefetched(&self) -> std::sync::MutexGuard<'_, HashMap<ExpertKey, Ahead>> {
        self.prefetched
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn prefetching(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Ticket>> {
        self.prefetching
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// A completion of a prefetch read: fill its slot (unpinned at once: cached for the
    /// caller that needs it) or give the slot back if the read failed. Returns whether
    /// `done` was a prefetch read.
    fn land_prefetch(&self, done: &mut Option<ReadDone>) -> bool {
        let Some(d) = done.as_ref() else {
            return false;
        };
        let Some(ticket) = self.prefetching().remove(&d.tag) else {
            return false;
        };
        let d = done.take().expect("checked above");
        match d.result {
            // A unit that fails its check is dropped here; the demand read of it fails.
            Ok(()) if self.check_packed(ticket.key(), &d).is_ok() => {
                let _ = self.cache.fill(ticket, d.buf, &d.placed);
            }
            _ => self.cache.release_failed(ticket, Some(d.buf)),
        }
        self.landed.notify_all();
        true
    }

    fn mailbox(&self) -> std::sync::MutexGuard<'_, Mailbox> {
        self.mailbox.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Wait for one of the caller's reads (`in_flight`), fill its slot and return
    /// (index in the caller's list, pinned slot). Counts the wait as IO wait.
    fn complete_one(
        &self,
        in_flight: &mut InFlight,
    ) -> Result<(usize, Pinned<AlignedBuf>), StreamError> {
        let t0 = Instant::now();
        let done = self.next_own_completion(in_flight)?;
        self.io_wait_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        self.land(done, in_flight)
    }

    /// The next finished read among `in_flight` (blocking). One caller at a time blocks
    /// in the IO engine; a completion for another caller goes to the mailbox and wakes it.
    fn next_own_completion(&self, in_flight: &InFlight) -> Result<ReadDone, StreamError> {
        let mut mb = self.mailbox();
        loop {
            if let Some(tag) = in_flight.keys().find(|t| mb.done.contains_key(t)).copied() {
                return Ok(mb.done.remove(&tag).expect("present"));
            }
            if mb.polling {
                mb = self.landed.wait(mb).unwrap_or_else(PoisonError::into_inner);
                continue;
            }
            mb.polling = true;
            drop(mb);
            let done = self.io.wait_one();
            mb = self.mailbox();
            mb.polling = false;
            self.landed.notify_all();
            let mut done = done;
            if self.land_prefetch(&mut done) {
                continue;
            }
            match done {
                Some(d) if in_flight.contains_key(&d.tag) => return Ok(d),
                Some(d) => {
                    mb.done.insert(d.tag, d);
                }
                None => return Err(StreamError::LostRead),
            }
        }
    }

    /// Block briefly until another sequence lands or releases something (used when a unit
    /// is being read by another sequence, or the budget is held by others' pins).
    fn wait_for_others(&self) {
        let mut mb = self.mailbox();
        if !mb.polling && !self.prefetching().is_empty() {
            // A unit we need may be a prefetch read nobody else polls for: poll once.
            mb.polling = true;
            drop(mb);
            let mut done = self.io.wait_one();
            mb = self.mailbox();
            mb.polling = false;
            if !self.land_prefetch(&mut done) {
                if let Some(d) = done {
                    mb.done.insert(d.tag, d);
                }
            }
            self.landed.notify_all();
            return;
        }
        let _ = self
            .landed
            .wait_timeout(mb, Duration::from_micros(200))
            .unwrap_or_else(PoisonError::into_inner);
    }

    /// With a sidecar: the bytes the first read of unit `key` got must hash as the model's
    /// bytes of that unit did at pack time (a damaged sidecar never reaches the compute);
    /// later reads of a unit that passed read the same bytes of the same open file and are
    /// not hashed again (about 0.3 ms per 2.6 MB unit saved on every re-read).
    fn check_packed(&self, key: ExpertKey, done: &ReadDone) -> Result<(), PackError> {
        let Some(pack) = &self.pack else {
            return Ok(());
        };
        let seen = self
            .verified
            .get(key.layer as usize)
            .and_then(|l| l.get(key.expert as usize));
        if seen.is_some_and(|v| v.load(Ordering::Relaxed)) {
            return Ok(());
        }
        let Some(layer) = pack.layers.get(key.layer as usize).and_then(Option::as_ref) else {
            return Ok(());
        };
        let at = done.placed.first().copied().unwrap_or(0);
        let bytes = done
            .buf
            .as_slice()
            .get(at..at + layer.unit_bytes() as usize)
            .unwrap_or(&[]);
        pack.check_unit(key.layer, key.expert, bytes)?;
        if let Some(v) = seen {
            v.store(true, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Give a finished read's buffer to its reserved slot (or release the slot if the read
    /// failed, returning the error naming file, offset and length).
    fn land(
        &self,
        done: ReadDone,
        in_flight: &mut InFlight,
    ) -> Result<(usize, Pinned<AlignedBuf>), StreamError> {
        let (i, ticket) = in_flight
            .remove(&done.tag)
            .expect("completion for a read we issued");
        if let Err(e) = done.result {
            self.cache.release_failed(ticket, Some(done.buf));
            self.landed.notify_all();
            return Err(e.into());
        }
        if let Err(e) = self.check_packed(ticket.key(), &done) {
            self.cache.release_failed(ticket, Some(done.buf));
            self.landed.notify_all();
            return Err(e.into());
        }
        let pinned = self.cache.fill(ticket, done.buf, &done.placed);
        self.landed.notify_all();
        Ok((i, pinned?))
    }
}

/// Per layer: where its units' matrices are and the slot bytes one needs.
fn layouts(group: &UnitGroup, pack: Option<&PackFile>) -> Vec<Option<LayerLayout>> {
    group
        .layers
        .iter()
        .enumerate()
        .map(|(l, layer)| {
            layer.as_ref().map(|unit| {
                let mut layout = LayerLayout {
                    unit: unit.clone(),
                    packed: pack.and_then(|p| p.layers.get(l).cloned().flatten()),
                    capacity: 0,
                    class: 0,
                };
                layout.capacity = (0..unit.n_units)
                    .map(|e| required_capacity(&layout.segments(e)))
                    .max()
                    .unwrap_or(0);
                layout
            })
        })
        .collect()
}

impl ExpertSource for StreamingExperts {
    /// Hits are computed at once while the misses' reads are in flight; each miss is
    /// computed as it lands. When the batch needs more units than the budget holds at
    /// once (prefill), the list is worked through in rounds: what fits is read, computed
    /// and unpinned, then the rest.
    fn for_each_expert(
        &self,
        mapped: &[u8],
        layer: usize,
        units: &[usize],
        f: &mut dyn FnMut(usize, ExpertView<'_>) -> Result<(), Stop>,
    ) -> Result<(), StreamError> {
        self.for_each_batch(mapped, layer, units, &mut |batch| {
            batch.iter().try_for_each(|&(i, v)| f(i, v))
        })
    }

    /// The hits of each round come as one batch; each miss as it lands.
    fn for_each_batch(
        &self,
        _mapped: &[u8],
        layer: usize,
        units: &[usize],
        f: &mut BatchFn<'_>,
    ) -> Result<(), StreamError> {
        let Some(layout) = self.layers.get(layer).and_then(Option::as_ref) else {
            return Ok(());
        };
        let mut in_flight = InFlight::new();
        let result = self.run_layer(layout, layer, units, f, &mut in_flight);
        if !in_flight.is_empty() {
            // Never leave reads behind (after an error or a stop): a stale completion would
            // reach the next layer.
            self.drain(&mut in_flight);
        }
        // The layer's demand reads are done: predicted units still waiting may go now.
        self.demand.store(0, Ordering::Relaxed);
        self.pump();
        match result {
            Err(Halt::Stream(e)) => Err(e),
            Err(Halt::Stopped) => Err(StreamError::Stopped),
            Ok(()) => Ok(()),
        }
    }

    fn end_tokens(&self, n: usize) {
        for _ in 0..n {
            self.cache.end_token();
        }
    }

    /// Start reading the units of `layer` that are neither cached nor in flight, without
    /// waiting. Prefetches never take the last `top_k` largest slots' worth of budget (what
    /// one layer needs to run), so they cannot starve the layer being computed nor evict
    /// each other before use; pinned units are never evicted (the cache's rule).
    fn prefetch(&self, layer: usize, units: &[usize]) {
        if !self.certain_prefetch.load(Ordering::Relaxed) {
            return;
        }
        self.issue(layer, units, Ahead::Certain);
    }

    fn lookahead_enabled(&self) -> bool {
        self.lookahead.load(Ordering::Relaxed)
    }

    /// Remember the prediction (for the accuracy counters) and queue reads for the
    /// predicted units that are neither cached nor in flight; they are issued as the disk
    /// has room (see [`StreamingExperts::set_lookahead_max_demand`]), by the same path and
    /// budget rule as certain prefetches, and dropped when `layer` starts its walk.
    fn lookahead(&self, layer: usize, units: &[usize]) {
        if !self.lookahead_enabled() || self.layers.get(layer).and_then(Option::as_ref).is_none() {
            return;
        }
        self.la
            .predicted
            .fetch_add(units.len() as u64, Ordering::Relaxed);
        self.predicted().insert(layer, units.to_vec());
        let mut todo = std::collections::VecDeque::with_capacity(units.len());
        for &e in units {
            if self.cache.contains(ExpertKey::new(layer as u32, e as u32)) {
                self.la.present.fetch_add(1, Ordering::Relaxed);
            } else {
                todo.push_back(e);
            }
        }
        {
            let mut p = self.pending();
            if !p.units.is_empty() {
                self.la
                    .dropped
                    .fetch_add(p.units.len() as u64, Ordering::Relaxed);
            }
            *p = Pending { layer, units: todo };
        }
        self.pump();
    }
}

impl StreamingExperts {
    /// Read `units` of `layer` ahead of their layer (certain or speculative). Never takes
    /// the last `top_k` largest slots' worth of budget; evicts only unpinned entries, by
    /// the policy.
    fn issue(&self, layer: usize, units: &[usize], why: Ahead) {
        let Some(layout) = self.layers.get(layer).and_then(Option::as_ref) else {
            return;
        };
        let largest = self
            .layers
            .iter()
            .flatten()
            .map(|l| l.capacity as u64)
            .max()
            .unwrap_or(0);
        let reserve = crate::min_budget(self.top_k, largest);
        let in_flight: u64 = self.prefetching().len() as u64 * largest;
        let mut room = self
            .cache
            .budget()
            .saturating_sub(reserve)
            .saturating_sub(in_flight);
        let (present, skipped, issued, bytes_ctr) = match why {
            Ahead::Certain => (
                &self.prefetch_present,
                &self.prefetch_skipped,
                &self.prefetch_issued,
                &self.prefetch_bytes,
            ),
            Ahead::Lookahead => (
                &self.la.present,
                &self.la.skipped,
                &self.la.issued,
                &self.la.bytes,
            ),
        };
        for &e in units {
            let key = ExpertKey::new(layer as u32, e as u32);
            if self.cache.contains(key) {
                present.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            if (layout.capacity as u64) > room {
                skipped.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let Ok(r) = self.cache.reserve(key, layout.class) else {
                skipped.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            room -= layout.capacity as u64;
            let tag = self.tag();
            self.prefetching().insert(tag, r.ticket);
            let segments = layout.segments(e);
            let bytes: u64 = segments.iter().map(|s| s.len as u64).sum();
            if self
                .io
                .submit(ReadReq {
                    tag,
                    segments,
                    buf: r.buf,
                })
                .is_err()
            {
                if let Some(t) = self.prefetching().remove(&tag) {
                    self.cache.release_failed(t, None);
                }
                continue;
            }
            issued.fetch_add(1, Ordering::Relaxed);
            bytes_ctr.fetch_add(bytes, Ordering::Relaxed);
            self.prefetched().entry(key).or_insert(why);
        }
    }
}

/// Why a layer's walk ended early.
enum Halt {
    Stream(StreamError),
    Stopped,
}

impl<E: Into<StreamError>> From<E> for Halt {
    fn from(e: E) -> Halt {
        Halt::Stream(e.into())
    }
}

impl StreamingExperts {
    /// Wait for every read still in flight after an error; landed ones stay cached, failed
    /// ones give their slot back.
    fn drain(&self, in_flight: &mut InFlight) {
        while !in_flight.is_empty() {
            let Ok(done) = self.next_own_completion(in_flight) else {
                break;
            };
            let _ = self.land(done, in_flight);
        }
    }

    /// One layer's units: hits computed at once, misses as they land, in budget rounds.
    fn run_layer(
        &self,
        layout: &LayerLayout,
        layer: usize,
        units: &[usize],
        f: &mut BatchFn<'_>,
        in_flight: &mut InFlight,
    ) -> Result<(), Halt> {
        let call =
            |f: &mut BatchFn<'_>, ready: &[(usize, Pinned<AlignedBuf>)]| -> Result<(), Halt> {
                let views: Vec<(usize, ExpertView<'_>)> = ready
                    .iter()
                    .map(|(i, p)| (*i, expert_view(p, layout)))
                    .collect();
                f(&views).map_err(|Stop| Halt::Stopped)
            };
        // Round 1 looks every unit up (this is what the hit/miss statistics count);
        // later rounds only retry the misses that did not fit.
        let mut misses: Vec<usize> = Vec::new();
        let mut hits: Vec<(usize, Pinned<AlignedBuf>)> = Vec::new();
        let mut prefetched = self.prefetched();
        let (mut used, mut la_used) = (0, 0);
        // Units another read had in flight at lookup (counted pending, not missed): if that
        // copy is evicted before we pin it, our read of it is counted as a re-read.
        let mut was_pending = vec![false; units.len()];
        for (i, &e) in units.iter().enumerate() {
            let key = ExpertKey::new(layer as u32, e as u32);
            let ours = if prefetched.is_empty() {
                None
            } else {
                prefetched.remove(&key)
            };
            let found = match self.cache.lookup(key) {
                Lookup::Hit(p) => {
                    hits.push((i, p));
                    true
                }
                Lookup::Pending => {
                    was_pending[i] = true;
                    misses.push(i);
                    true
                }
                Lookup::Miss => {
                    misses.push(i);
                    false
                }
            };
            match ours {
                Some(Ahead::Certain) if found => used += 1,
                Some(Ahead::Lookahead) if found => la_used += 1,
                _ => {}
            }
        }
        drop(prefetched);
        self.settle_lookahead(layer, units);
        self.prefetch_hit.fetch_add(used, Ordering::Relaxed);
        self.la.hit.fetch_add(la_used, Ordering::Relaxed);
        let mut first = true;
        while !misses.is_empty() || !hits.is_empty() || !in_flight.is_empty() {
            let mut deferred = Vec::new();
            // Units others are reading: looked at first next round (pinned before this
            // layer's other reservations could evict them once landed).
            let mut waiting = Vec::new();
            let mut blocked_by_others = false;
            for &i in &misses {
                let key = ExpertKey::new(layer as u32, units[i] as u32);
                match self.cache.reserve(key, layout.class) {
                    Ok(r) => {
                        if std::mem::take(&mut was_pending[i]) {
                            self.reread.fetch_add(1, Ordering::Relaxed);
                            self.reread_bytes
                                .fetch_add(layout.unit.unit_bytes(), Ordering::Relaxed);
                        }
                        let tag = self.tag();
                        in_flight.insert(tag, (i, r.ticket));
                        if let Err(e) = self.io.submit(ReadReq {
                            tag,
                            segments: layout.segments(units[i]),
                            buf: r.buf,
                        }) {
                            let (_, t) = in_flight.remove(&tag).expect("just inserted");
                            self.cache.release_failed(t, None);
                            return Err(e.into());
                        }
                    }
                    // Another sequence cached or is reading it since we looked: take the
                    // cached copy, or wait for that read.
                    Err(CacheError::AlreadyPresent { .. }) => match self.cache.peek(key) {
                        Some(p) => hits.push((i, p)),
                        None => {
                            blocked_by_others = true;
                            waiting.push(i)
                        }
                    },
                    Err(CacheError::BudgetTooSmall { .. })
                        if !in_flight.is_empty() || !hits.is_empty() =>
                    {
                        deferred.push(i)
                    }
                    // Nothing of ours is pinned or in flight: the budget is held by other
                    // sequences' pins, which they release as they compute.
                    Err(CacheError::BudgetTooSmall {
                        pinned, in_flight, ..
                    }) if pinned + in_flight > 0 => {
                        blocked_by_others = true;
                        deferred.push(i)
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            if !first || !deferred.is_empty() {
                self.budget_rounds
                    .fetch_add(u64::from(!deferred.is_empty()), Ordering::Relaxed);
            }
            waiting.append(&mut deferred);
            let deferred = waiting;
            first = false;
            // Hits first (one batch), while the misses load.
            self.demand.store(in_flight.len(), Ordering::Relaxed);
            if !hits.is_empty() {
                if !in_flight.is_empty() {
                    self.overlapped
                        .fetch_add(hits.len() as u64, Ordering::Relaxed);
                }
                call(f, &hits)?;
                hits.clear();
            }
            while !in_flight.is_empty() {
                let landed = self.complete_one(in_flight)?;
                self.demand.store(in_flight.len(), Ordering::Relaxed);
                if !blocked_by_others {
                    // (Not while a unit of ours is landing unpinned from another read.)
                    self.pump();
                }
                if !in_flight.is_empty() {
                    self.overlapped.fetch_add(1, Ordering::Relaxed);
                }
                call(f, std::slice::from_ref(&landed))?;
            }
            if blocked_by_others {
                // Waiting for a read issued elsewhere (a prefetch, another sequence) is
                // waiting for IO too.
                let t0 = Instant::now();
                self.wait_for_others();
                self.io_wait_ns
                    .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
            }
            misses = deferred;
        }
        Ok(())
    }
}

/// The matrices of a cached unit.
fn expert_view<'a>(p: &'a Pinned<AlignedBuf>, layout: &LayerLayout) -> ExpertView<'a> {
    let b = p.bytes();
    let mut parts: [&[u8]; crate::MAX_PARTS] = [&[]; crate::MAX_PARTS];
    let n = layout.unit.parts.len();
    let mut packed_at = p.placed()[0];
    for (i, part) in layout.unit.parts.iter().enumerate() {
        let len = part.bytes_per_unit as usize;
        let at = if layout.packed.is_some() {
            // One segment: the parts follow each other.
            packed_at += len;
            packed_at - len
        } else {
            p.placed()[i]
        };
        parts[i] = &b[at..at + len];
    }
    ExpertView::new(&parts[..n])
}
