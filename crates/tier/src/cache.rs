//! The expert cache: (layer, expert) -> a slot holding that expert's bytes, under a hard
//! byte budget.
//!
//! Owns: slot pools (one per size class; a mixed-quant file has several expert sizes),
//! the budget invariant, pinning, resident entries and hit/miss statistics. Eviction
//! order is delegated to a [`Policy`]; reading bytes is the caller's job (a
//! [`Reservation`] hands its slot buffer out for the read and [`ExpertCache::fill`] takes
//! it back).
//!
//! **Budget.** Every slot counted against the budget is in one of three states: free
//! (allocated, kept for reuse), reserved (a read in flight) or cached. The invariant,
//! checked after every change in debug builds and by the property tests, is
//! `free + in flight + cached == allocated <= budget`; so RSS for slots never passes the
//! budget, whatever the routing does. Slots are allocated once and reused; a free slot of
//! another size class is released only when the budget has no room for the class needed.
//!
//! **Pinning.** A [`Pinned`] handle (returned by a hit or by `fill`) pins its slot: the
//! slot cannot be evicted while any handle (or clone) is alive; dropping it unpins. This
//! is the `pin`/`unpin` pair, made impossible to unbalance. The cache holds one reference
//! to each slot's data and hands out the others only under its lock, so "no handle alive"
//! is exactly `Arc::strong_count == 1`.
//!
//! **Resident entries** (`--resident-layers`) are filled through
//! [`ExpertCache::reserve_resident`]: never evicted, and counted separately as resident
//! weights (`CacheStats::resident_bytes`), not in the cache budget.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use thiserror::Error;

pub use super::key::ExpertKey;
use super::policy::Policy;
use super::slot::{SlotBuf, SlotMemory};

/// Index of a slot in the cache (stable while the slot exists).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlotId(pub u32);

/// The smallest usable budget: one layer's selected experts at once, `top_k` x the
/// largest slot.
pub fn min_budget(top_k: usize, largest_slot: u64) -> u64 {
    (top_k as u64).saturating_mul(largest_slot)
}

#[derive(Debug, Error, PartialEq)]
pub enum CacheError {
    #[error(
        "expert cache budget {budget} bytes is below the minimum {min} bytes \
         (one layer's top-{top_k} experts of up to {slot_bytes} bytes each must fit at once); \
         raise the budget to at least {min}"
    )]
    BudgetBelowMinimum {
        budget: u64,
        min: u64,
        top_k: usize,
        slot_bytes: u64,
    },
    #[error(
        "expert cache budget {budget} bytes too small for {key}: a {need}-byte slot does not fit \
         beside {pinned} bytes pinned and {in_flight} bytes in flight, and nothing is evictable"
    )]
    BudgetTooSmall {
        key: ExpertKey,
        need: u64,
        budget: u64,
        pinned: u64,
        in_flight: u64,
    },
    #[error("{key} is already cached or being read; look it up instead of reserving it")]
    AlreadyPresent { key: ExpertKey },
    #[error("slot size class {class} does not exist (the cache has {n_classes})")]
    UnknownClass { class: usize, n_classes: usize },
    #[error("invalid expert cache configuration: {0}")]
    Config(&'static str),
    #[error("buffer returned for {key} is {found} bytes, its slot is {expected} bytes")]
    WrongBuffer {
        key: ExpertKey,
        expected: usize,
        found: usize,
    },
}

/// What a cache constructor needs.
#[derive(Debug, Clone)]
pub struct CacheConfig {
    /// Bytes for cached + in-flight slots (resident entries not included).
    pub budget: u64,
    /// Bytes of each size class (index = class id); rounded up by `SlotBuf::slot_size`.
    pub slot_sizes: Vec<usize>,
    /// Experts selected per token per layer.
    pub top_k: usize,
    /// Layers tracked in per-layer statistics.
    pub n_layer: u32,
}

/// Per-layer counters.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LayerStats {
    pub hits: u64,
    pub misses: u64,
    /// Requests that found the read already in flight (e.g. prefetched).
    pub pending: u64,
    pub evictions: u64,
}

impl LayerStats {
    pub fn requests(&self) -> u64 {
        self.hits + self.misses + self.pending
    }
    /// hits / requests (0 when there were none).
    pub fn hit_rate(&self) -> f64 {
        ratio(self.hits, self.requests())
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// A snapshot of the cache's counters since construction.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CacheStats {
    pub policy: &'static str,
    pub budget: u64,
    /// Totals over all layers.
    pub total: LayerStats,
    pub per_layer: Vec<LayerStats>,
    pub tokens: u64,
    /// Slot buffers ever allocated (reuse does not count) and released.
    pub slot_allocations: u64,
    pub slot_frees: u64,
    /// Bytes of slots holding cached data now (resident excluded).
    pub bytes_cached: u64,
    pub bytes_in_flight: u64,
    /// All budgeted slots (free + in flight + cached).
    pub bytes_allocated: u64,
    /// Highest cached + in flight ever seen.
    pub peak_bytes: u64,
    pub peak_allocated: u64,
    /// Bytes landed by `fill` into budgeted slots (= expert bytes read for the cache).
    pub bytes_filled: u64,
    pub resident_bytes: u64,
    pub resident_entries: u64,
}

impl CacheStats {
    pub fn hit_rate(&self) -> f64 {
        self.total.hit_rate()
    }
}

/// Result of [`ExpertCache::lookup`].
pub enum Lookup<B: SlotBuf> {
    /// Cached: the handle pins the slot until dropped.
    Hit(Pinned<B>),
    /// A read for this key is in flight (reserved, not filled yet).
    Pending,
    /// Not cached: reserve a slot and read it.
    Miss,
}

impl<B: SlotBuf> Lookup<B> {
    pub fn is_hit(&self) -> bool {
        matches!(self, Lookup::Hit(_))
    }
}

struct SlotData<B> {
    /// `None` exactly while a read is in flight (the buffer is with the IO engine).
    buf: Option<B>,
    /// Byte offsets of the expert's segments inside `buf` (from the read completion).
    placed: Vec<usize>,
}

/// A pinned cached expert: its bytes stay valid and its slot unevictable while this
/// handle (or a clone) lives.
pub struct Pinned<B: SlotBuf> {
    key: ExpertKey,
    slot: SlotId,
    data: Arc<SlotData<B>>,
}

impl<B: SlotBuf> Clone for Pinned<B> {
    fn clone(&self) -> Self {
        Pinned {
            key: self.key,
            slot: self.slot,
            data: Arc::clone(&self.data),
        }
    }
}

impl<B: SlotBuf> Pinned<B> {
    pub fn key(&self) -> ExpertKey {
        self.key
    }
    pub fn slot(&self) -> SlotId {
        self.slot
    }
    /// The slot buffer (empty only for the accounting-only `NoBuf`).
    pub fn bytes(&self) -> &[u8] {
        self.data.buf.as_ref().map_or(&[], |b| b.as_slice())
    }
    /// Where each segment of the expert starts in `bytes()`, as passed to `fill`.
    pub fn placed(&self) -> &[usize] {
        &self.data.placed
    }
}

/// Proof of a reserved slot; give it back to `fill` or `release_failed`. Not `Clone`.
#[derive(Debug)]
pub struct Ticket {
    key: ExpertKey,
    slot: SlotId,
}

impl Ticket {
    pub fn key(&self) -> ExpertKey {
        self.key
    }
    pub fn slot(&self) -> SlotId {
        self.slot
    }
}

/// A reserved slot: the ticket, and the slot's buffer to read into (moved into the read
/// request; it comes back in the completion and goes to `fill`).
pub struct Reservation<B> {
    pub ticket: Ticket,
    pub buf: B,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Free,
    Reserved(ExpertKey),
    Cached(ExpertKey),
}

struct Slot<B> {
    class: usize,
    bytes: u64,
    /// Address and length of the slot's buffer (for the [`SlotMemory`] hook).
    mem: (usize, usize),
    resident: bool,
    state: State,
    data: Arc<SlotData<B>>,
}

struct Inner<B> {
    budget: u64,
    classes: Vec<usize>,
    slots: Vec<Option<Slot<B>>>,
    vacant: Vec<u32>,
    /// Free slot indices per class.
    free: Vec<Vec<u32>>,
    map: HashMap<ExpertKey, u32>,
    policy: Box<dyn Policy>,
    allocated: u64,
    cached: u64,
    in_flight: u64,
    stats: CacheStats,
    /// Told about every slot's memory (`set_slot_memory`).
    hook: Option<Arc<dyn SlotMemory>>,
}

/// The expert cache. Thread-safe; every operation takes one short lock.
pub struct ExpertCache<B: SlotBuf> {
    inner: Mutex<Inner<B>>,
}

impl<B: SlotBuf> Drop for ExpertCache<B> {
    /// The hook hears of every slot's release before the slots' buffers are freed.
    fn drop(&mut self) {
        let g = self.inner.get_mut().unwrap_or_else(PoisonError::into_inner);
        if let Some(h) = g.hook.take() {
            for s in g.slots.iter().flatten() {
                if s.mem.1 > 0 {
                    h.removed(s.mem.0, s.mem.1);
                }
            }
        }
    }
}

impl<B: SlotBuf> ExpertCache<B> {
    /// Builds an empty cache. Errors if the budget cannot hold one layer's top-k experts
    /// of the largest size class ([`min_budget`]).
    pub fn new(cfg: CacheConfig, policy: Box<dyn Policy>) -> Result<Self, CacheError> {
        if cfg.slot_sizes.is_empty() {
            return Err(CacheError::Config("no slot size classes"));
        }
        if cfg.slot_sizes.contains(&0) {
            return Err(CacheError::Config("a slot size class of 0 bytes"));
        }
        if cfg.top_k == 0 {
            return Err(CacheError::Config("top_k is 0"));
        }
        let slot_sizes: Vec<usize> = cfg.slot_sizes.iter().map(|&b| B::slot_size(b)).collect();
        let largest = slot_sizes.iter().copied().max().unwrap_or(0) as u64;
        let min = min_budget(cfg.top_k, largest);
        if cfg.budget < min {
            return Err(CacheError::BudgetBelowMinimum {
                budget: cfg.budget,
                min,
                top_k: cfg.top_k,
                slot_bytes: largest,
            });
        }
        let stats = CacheStats {
            policy: policy.name(),
            budget: cfg.budget,
            per_layer: vec![LayerStats::default(); cfg.n_layer as usize],
            ..CacheStats::default()
        };
        Ok(ExpertCache {
            inner: Mutex::new(Inner {
                budget: cfg.budget,
                free: vec![Vec::new(); cfg.slot_sizes.len()],
                classes: slot_sizes,
                slots: Vec::new(),
                vacant: Vec::new(),
                map: HashMap::new(),
                policy,
                allocated: 0,
                cached: 0,
                in_flight: 0,
                stats,
                hook: None,
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner<B>> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Looks `key` up, counting a hit, miss or pending read and telling the policy.
    /// A hit returns a pinning handle.
    pub fn lookup(&self, key: ExpertKey) -> Lookup<B> {
        let mut g = self.lock();
        let inner = &mut *g;
        inner.policy.on_request(key);
        let found = inner.map.get(&key).map(|&i| {
            let s = inner.slots[i as usize]
                .as_ref()
                .expect("mapped slot exists");
            (i, s.state, Arc::clone(&s.data))
        });
        let (res, bump): (Lookup<B>, fn(&mut LayerStats)) = match found {
            Some((i, State::Cached(_), data)) => (
                Lookup::Hit(Pinned {
                    key,
                    slot: SlotId(i),
                    data,
                }),
                |l| l.hits += 1,
            ),
            Some(_) => (Lookup::Pending, |l| l.pending += 1),
            None => (Lookup::Miss, |l| l.misses += 1),
        };
        bump(&mut inner.stats.total);
        if let Some(l) = inner.stats.per_layer.get_mut(key.layer as usize) {
            bump(l);
        }
        res
    }

    /// `key`'s cached entry, pinned, without counting a request or telling the policy
    /// (for a second look after another sequence filled it).
    pub fn peek(&self, key: ExpertKey) -> Option<Pinned<B>> {
        let g = self.lock();
        let &i = g.map.get(&key)?;
        let s = g.slots[i as usize].as_ref()?;
        match s.state {
            State::Cached(_) => Some(Pinned {
                key,
                slot: SlotId(i),
                data: Arc::clone(&s.data),
            }),
            _ => None,
        }
    }

    /// Whether `key` is cached or being read (no statistics, no policy update).
    pub fn contains(&self, key: ExpertKey) -> bool {
        self.lock().map.contains_key(&key)
    }

    /// Reserves a slot of `class` for `key`, evicting unpinned entries by the policy if
    /// the budget is full. The slot counts as in flight until `fill` or `release_failed`.
    pub fn reserve(&self, key: ExpertKey, class: usize) -> Result<Reservation<B>, CacheError> {
        let mut g = self.lock();
        let r = g.reserve(key, class, false);
        g.check();
        r
    }

    /// Reserves a resident slot for `key` (`--resident-layers`): allocated outside the
    /// budget, never evicted, counted in `resident_bytes`.
    pub fn reserve_resident(
        &self,
        key: ExpertKey,
        class: usize,
    ) -> Result<Reservation<B>, CacheError> {
        self.lock().reserve(key, class, true)
    }

    /// The read for `ticket` landed in `buf`: the entry becomes cached (or resident) and
    /// is returned pinned. `placed` = segment offsets in `buf` (kept with the slot).
    /// A buffer of the wrong size is refused and its slot released.
    pub fn fill(&self, ticket: Ticket, buf: B, placed: &[usize]) -> Result<Pinned<B>, CacheError> {
        let mut g = self.lock();
        let r = g.fill(ticket, buf, placed);
        g.check();
        r
    }

    /// The read for `ticket` failed: the slot goes back to its pool (`buf` = the buffer
    /// from the completion) or, if the buffer was lost (`None`), is released. The key
    /// stays uncached.
    pub fn release_failed(&self, ticket: Ticket, buf: Option<B>) {
        let mut g = self.lock();
        g.release(ticket, buf);
        g.check();
    }

    /// Bytes of a slot of `class` (after `SlotBuf::slot_size`), if the class exists.
    pub fn class_bytes(&self, class: usize) -> Option<usize> {
        self.lock().classes.get(class).copied()
    }

    /// Adds `buf` (allocated and populated by the caller, outside the lock) as a free slot
    /// of `class` if the budget has room for it; otherwise hands it back. Lets slot memory
    /// be made ready in the background instead of on the first reads' path.
    pub fn add_free_slot(&self, class: usize, buf: B) -> Result<(), B> {
        let mut g = self.lock();
        let Some(&bytes) = g.classes.get(class) else {
            return Err(buf);
        };
        if buf.size() != bytes || g.allocated + bytes as u64 > g.budget {
            return Err(buf);
        }
        let i = g.new_slot_with(class, false, buf);
        g.free[class].push(i);
        g.check();
        Ok(())
    }

    /// Tell `hook` where every slot's memory is: now for the slots that exist, then as
    /// slots are allocated and released, and for all of them when the cache is dropped
    /// (see [`SlotMemory`]). Replaces an earlier hook, which is told every slot is removed.
    pub fn set_slot_memory(&self, hook: Arc<dyn SlotMemory>) {
        let mut g = self.lock();
        let mems: Vec<(usize, usize)> = g
            .slots
            .iter()
            .flatten()
            .map(|s| s.mem)
            .filter(|m| m.1 > 0)
            .collect();
        if let Some(old) = g.hook.take() {
            for &(a, l) in &mems {
                old.removed(a, l);
            }
        }
        for &(a, l) in &mems {
            hook.added(a, l);
        }
        g.hook = Some(hook);
    }

    /// Starts the policy's statistics of `key` from a saved rate (selections per token).
    pub fn seed(&self, key: ExpertKey, rate: f64) {
        self.lock().policy.seed(key, rate);
    }

    /// One token finished (all layers): advances the policy's decay clock.
    pub fn end_token(&self) {
        let mut g = self.lock();
        g.policy.on_token_end();
        g.stats.tokens += 1;
    }

    pub fn stats(&self) -> CacheStats {
        let g = self.lock();
        let mut s = g.stats.clone();
        s.bytes_cached = g.cached;
        s.bytes_in_flight = g.in_flight;
        s.bytes_allocated = g.allocated;
        s
    }

    pub fn budget(&self) -> u64 {
        self.lock().budget
    }

    /// Slot bytes of each size class.
    pub fn slot_sizes(&self) -> Vec<usize> {
        self.lock().classes.clone()
    }

    /// Verifies the budget invariant from scratch (O(slots)); for tests.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.lock().verify()
    }
}

impl<B: SlotBuf> Inner<B> {
    fn slot(&self, i: u32) -> &Slot<B> {
        self.slots[i as usize]
            .as_ref()
            .expect("slot index refers to a live slot")
    }
    fn slot_mut(&mut self, i: u32) -> &mut Slot<B> {
        self.slots[i as usize]
            .as_mut()
            .expect("slot index refers to a live slot")
    }

    fn new_slot(&mut self, class: usize, resident: bool) -> u32 {
        let buf = B::alloc(self.classes[class]);
        self.new_slot_with(class, resident, buf)
    }

    fn new_slot_with(&mut self, class: usize, resident: bool, buf: B) -> u32 {
        let bytes = self.classes[class];
        debug_assert_eq!(buf.size(), bytes, "SlotBuf::alloc returned a wrong size");
        let mem = (buf.as_slice().as_ptr() as usize, buf.as_slice().len());
        if let Some(h) = &self.hook {
            if mem.1 > 0 {
                h.added(mem.0, mem.1);
            }
        }
        let slot = Slot {
            class,
            bytes: bytes as u64,
            mem,
            resident,
            state: State::Free,
            data: Arc::new(SlotData {
                buf: Some(buf),
                placed: Vec::new(),
            }),
        };
        self.stats.slot_allocations += 1;
        if resident {
            self.stats.resident_bytes += bytes as u64;
        } else {
            self.allocated += bytes as u64;
            self.stats.peak_allocated = self.stats.peak_allocated.max(self.allocated);
        }
        match self.vacant.pop() {
            Some(i) => {
                self.slots[i as usize] = Some(slot);
                i
            }
            None => {
                self.slots.push(Some(slot));
                (self.slots.len() - 1) as u32
            }
        }
    }

    fn drop_slot(&mut self, i: u32) {
        if let Some(s) = self.slots[i as usize].take() {
            if let Some(h) = &self.hook {
                if s.mem.1 > 0 {
                    h.removed(s.mem.0, s.mem.1);
                }
            }
            if s.resident {
                self.stats.resident_bytes -= s.bytes;
            } else {
                self.allocated -= s.bytes;
            }
            self.stats.slot_frees += 1;
            self.vacant.push(i);
        }
    }

    fn evictable(map: &HashMap<ExpertKey, u32>, slots: &[Option<Slot<B>>], k: ExpertKey) -> bool {
        map.get(&k)
            .and_then(|&i| slots[i as usize].as_ref())
            .is_some_and(|s| {
                matches!(s.state, State::Cached(_))
                    && !s.resident
                    && Arc::strong_count(&s.data) == 1
            })
    }

    fn evict(&mut self, key: ExpertKey) {
        let Some(i) = self.map.remove(&key) else {
            return;
        };
        self.policy.on_remove(key);
        let s = self.slot_mut(i);
        debug_assert!(matches!(s.state, State::Cached(_)) && !s.resident);
        s.state = State::Free;
        let (class, bytes) = (s.class, s.bytes);
        self.cached -= bytes;
        self.free[class].push(i);
        self.stats.total.evictions += 1;
        if let Some(l) = self.stats.per_layer.get_mut(key.layer as usize) {
            l.evictions += 1;
        }
    }

    fn reserve(
        &mut self,
        key: ExpertKey,
        class: usize,
        resident: bool,
    ) -> Result<Reservation<B>, CacheError> {
        if class >= self.classes.len() {
            return Err(CacheError::UnknownClass {
                class,
                n_classes: self.classes.len(),
            });
        }
        if self.map.contains_key(&key) {
            return Err(CacheError::AlreadyPresent { key });
        }
        let need = self.classes[class] as u64;
        let i = if resident {
            self.new_slot(class, true)
        } else {
            loop {
                if let Some(i) = self.free[class].pop() {
                    break i;
                }
                if self.allocated + need <= self.budget {
                    break self.new_slot(class, false);
                }
                // Release a free slot of another class before evicting live data.
                if let Some(c) = (0..self.free.len()).find(|&c| !self.free[c].is_empty()) {
                    let j = self.free[c].pop().expect("non-empty");
                    self.drop_slot(j);
                    continue;
                }
                let (map, slots) = (&self.map, &self.slots);
                let victim = self.policy.victim(&mut |k| Self::evictable(map, slots, k));
                match victim {
                    Some(v) if Self::evictable(map, slots, v) => self.evict(v),
                    _ => return Err(self.too_small(key, need)),
                }
            }
        };
        let s = self.slot_mut(i);
        s.state = State::Reserved(key);
        let bytes = s.bytes;
        let buf = Arc::get_mut(&mut s.data)
            .expect("a free slot has no outstanding handles")
            .buf
            .take()
            .expect("a free slot holds its buffer");
        self.map.insert(key, i);
        if !resident {
            self.in_flight += bytes;
            let live = self.cached + self.in_flight;
            self.stats.peak_bytes = self.stats.peak_bytes.max(live);
        }
        Ok(Reservation {
            ticket: Ticket {
                key,
                slot: SlotId(i),
            },
            buf,
        })
    }

    fn too_small(&self, key: ExpertKey, need: u64) -> CacheError {
        let pinned = self
            .slots
            .iter()
            .flatten()
            .filter(|s| {
                !s.resident && matches!(s.state, State::Cached(_)) && Arc::strong_count(&s.data) > 1
            })
            .map(|s| s.bytes)
            .sum();
        CacheError::BudgetTooSmall {
            key,
            need,
            budget: self.budget,
            pinned,
            in_flight: self.in_flight,
        }
    }

    fn fill(&mut self, ticket: Ticket, buf: B, placed: &[usize]) -> Result<Pinned<B>, CacheError> {
        let i = ticket.slot.0;
        let key = ticket.key;
        let s = self.slot(i);
        debug_assert_eq!(s.state, State::Reserved(key));
        let expected = s.bytes as usize;
        if buf.size() != expected {
            let found = buf.size();
            self.release(ticket, None);
            return Err(CacheError::WrongBuffer {
                key,
                expected,
                found,
            });
        }
        let s = self.slot_mut(i);
        s.state = State::Cached(key);
        let (bytes, resident) = (s.bytes, s.resident);
        let d = Arc::get_mut(&mut s.data).expect("a reserved slot has no outstanding handles");
        d.buf = Some(buf);
        d.placed.clear();
        d.placed.extend_from_slice(placed);
        let data = Arc::clone(&s.data);
        if resident {
            self.stats.resident_entries += 1;
        } else {
            self.in_flight -= bytes;
            self.cached += bytes;
            self.stats.bytes_filled += bytes;
            self.policy.on_insert(key);
        }
        Ok(Pinned {
            key,
            slot: ticket.slot,
            data,
        })
    }

    fn release(&mut self, ticket: Ticket, buf: Option<B>) {
        let i = ticket.slot.0;
        debug_assert_eq!(self.slot(i).state, State::Reserved(ticket.key));
        self.map.remove(&ticket.key);
        let s = self.slot_mut(i);
        let (bytes, resident, class) = (s.bytes, s.resident, s.class);
        if !resident {
            self.in_flight -= bytes;
        }
        match buf {
            Some(b) if !resident && b.size() == bytes as usize => {
                let s = self.slot_mut(i);
                s.state = State::Free;
                Arc::get_mut(&mut s.data)
                    .expect("a reserved slot has no outstanding handles")
                    .buf = Some(b);
                self.free[class].push(i);
            }
            _ => self.drop_slot(i),
        }
    }

    /// Cheap invariant check after every mutation (debug builds only).
    fn check(&self) {
        debug_assert!(
            self.cached + self.in_flight <= self.allocated && self.allocated <= self.budget,
            "expert cache budget broken: cached {} + in flight {} , allocated {} > budget {}",
            self.cached,
            self.in_flight,
            self.allocated,
            self.budget
        );
    }

    fn verify(&self) -> Result<(), String> {
        let (mut free, mut res, mut cached, mut alloc) = (0u64, 0u64, 0u64, 0u64);
        for s in self.slots.iter().flatten().filter(|s| !s.resident) {
            alloc += s.bytes;
            match s.state {
                State::Free => free += s.bytes,
                State::Reserved(_) => res += s.bytes,
                State::Cached(_) => cached += s.bytes,
            }
        }
        let ok = alloc == self.allocated
            && res == self.in_flight
            && cached == self.cached
            && free + res + cached == alloc
            && alloc <= self.budget
            && self.stats.peak_allocated <= self.budget;
        if ok {
            Ok(())
        } else {
            Err(format!(
                "free {free} + in flight {res} (counter {}) + cached {cached} (counter {}) \
                 = allocated {alloc} (counter {}), budget {}",
                self.in_flight, self.cached, self.allocated, self.budget
            ))
        }
    }
}
