//! The expert tier: where routed experts live between the SSD and the compute thread.
//!
//! Owns: the RAM cache of experts with a hard byte budget ([`ExpertCache`]), its eviction
//! policies ([`Policy`]: expected next use with predicted selections (`xl`, default), expected
//! next use, LRU, LFU with decay, LRU-2), the routing trace format written by
//! `--record-routing` ([`trace`]) and its replay in place of the router ([`replay`]), the offline cache simulator with Belady's optimum
//! ([`sim`]) and byte-size parsing for budgets ([`parse_size`]); the description of every
//! tensor group that may live outside RAM ([`groups`]), the [`ExpertSource`] interface the
//! MoE block reads units through, and the SSD-streaming source ([`streaming`]).
//!
//! Does not own: reading bytes (that is `sluice-io`'s `IoEngine`; a reservation hands its
//! slot buffer to a read request and gets it back in the completion), nor deciding which
//! experts to run (the architectures' routers).

pub mod cache;
pub mod groups;
pub mod key;
pub mod pack;
pub mod ple;
pub mod policy;
pub mod profile;
pub mod replay;
pub mod sim;
pub mod size;
pub mod slot;
pub mod source;
pub mod streaming;
pub mod trace;
pub mod xlayer;

pub use cache::{
    min_budget, CacheConfig, CacheError, CacheStats, ExpertCache, ExpertKey, LayerStats, Lookup,
    Pinned, Reservation, SlotId, Ticket,
};
pub use ple::{open_ple, PleIo, PleOptions, PleSource, PleStats};
pub use policy::{Lfu, Lru, Lru2, NextUse, Policy, PolicyKind};
pub use profile::{Profile, ProfileError};

pub use groups::{RowTable, StackedPart, StreamableGroups, UnitGroup, UnitLayer};
pub use pack::{PackError, PackFile, PackLayer};
pub use replay::{Geometry, ReplayBatch, RoutingReplay};
pub use sim::{simulate, simulate_belady, simulate_kind, SimResult};
pub use size::{parse_size, parse_size_bytes, SizeError, SizeSpec};
pub use slot::{NoBuf, SlotBuf, SlotMemory};
pub use source::{BatchFn, ExpertSource, ExpertView, Stop, StreamError, MAX_PARTS};
pub use streaming::{StreamConfig, StreamStats, StreamingExperts};
pub use trace::{RoutingRecorder, RoutingTrace, TraceError, TraceHeader};
