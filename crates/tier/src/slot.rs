//! Slot storage for the expert cache: the [`SlotBuf`] trait and two test/simulation impls,
//! and the [`SlotMemory`] hook.
//!
//! Owns: what a cache slot's buffer must provide, and how a compute backend is told where
//! slot memory is (e.g. to page-lock it for fast host-to-device copies) without this crate
//! depending on that backend. The engine plugs in `sluice_io::AlignedBuf`
//! (4096-aligned, so O_DIRECT reads land in it directly) with a three-line impl once that
//! type lands on main:
//!
//! ```text
//! impl SlotBuf for sluice_io::AlignedBuf {
//!     fn alloc(bytes: usize) -> Self { AlignedBuf::new(bytes) }
//!     fn as_slice(&self) -> &[u8] { AlignedBuf::as_slice(self) }
//!     fn size(&self) -> usize { self.capacity() }
//!     fn slot_size(bytes: usize) -> usize { bytes.next_multiple_of(4096) }
//! }
//! ```
//! (a class's bytes should be `required_capacity(segments)` of its experts' reads).

/// A slot's byte buffer. Allocated once per slot by the cache, then reused for every
/// expert that slot ever holds (moved out to the IO engine while a read is in flight,
/// moved back by `fill`).
pub trait SlotBuf: Send + Sync + 'static {
    /// Allocates a buffer of exactly `bytes` bytes (its `size()` must equal `bytes`).
    fn alloc(bytes: usize) -> Self;
    /// The buffer's bytes.
    fn as_slice(&self) -> &[u8];
    /// Size in bytes, as accounted against the budget.
    fn size(&self) -> usize;
    /// What `alloc(bytes)` really allocates (e.g. rounded up to the alignment); the
    /// cache rounds its size classes with this so the budget counts real bytes.
    fn slot_size(bytes: usize) -> usize {
        bytes
    }
}

impl SlotBuf for Vec<u8> {
    fn alloc(bytes: usize) -> Self {
        vec![0; bytes]
    }
    fn as_slice(&self) -> &[u8] {
        self
    }
    fn size(&self) -> usize {
        self.len()
    }
}

/// Told where every cache slot's memory is (`ExpertCache::set_slot_memory`): a GPU
/// backend page-locks it so host-to-device copies of slots run at pinned speed. Called
/// under the cache's lock, for the slots that exist when the hook is set and then for each
/// slot as it is allocated or released; what the hook does never changes what is computed.
pub trait SlotMemory: Send + Sync {
    /// `len` bytes at address `addr` are a slot's buffer; they stay allocated (and the
    /// buffer never moves) until `removed(addr, len)` is called for them.
    fn added(&self, addr: usize, len: usize);
    /// The slot at `addr` is about to be freed: stop using its memory.
    fn removed(&self, addr: usize, len: usize);
}

/// Accounting-only buffer: remembers its size, holds no memory. The simulator runs the
/// real [`ExpertCache`](super::ExpertCache) bookkeeping with it at any budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoBuf(pub usize);

impl SlotBuf for NoBuf {
    fn alloc(bytes: usize) -> Self {
        NoBuf(bytes)
    }
    fn as_slice(&self) -> &[u8] {
        &[]
    }
    fn size(&self) -> usize {
        self.0
    }
}
