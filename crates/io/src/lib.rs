//! Byte sources for model files.
//!
//! Owns: every way sluice gets bytes off the disk (mmap for the resident tensors; the IO
//! engine for the expert tier: io_uring, a pread pool and an mmap baseline, O_DIRECT,
//! read-ahead hints, IO statistics) plus the page-cache tools used by honest measurement,
//! the SIGBUS guard of the maps (a model file truncated under a running process ends it
//! with an error naming the file, never a bare signal), and the unsafe code all of that
//! needs. The other crates stay free of `unsafe`.

mod aligned;
mod anon;
mod completion;
mod engine;
mod fileio;
mod hint;
mod mmap;
pub mod pagecache;
mod pool;
mod request;
mod sigbus;
mod stats;
mod uring;

pub use aligned::{AlignedBuf, ALIGN};
pub use engine::open_engine;
pub use mmap::{MapError, MappedFile};
pub use pagecache::{block_device_read_bytes, drop_page_cache, proc_self_io_read_bytes, residency};
pub use request::{
    required_capacity, Backend, IoConfig, IoEngine, IoError, ReadDone, ReadReq, Segment,
};
pub use stats::IoStats;
