//! Byte sources for model files.
//!
//! Owns: every way sluice gets bytes off the disk (mmap today; pread pool, io_uring and
//! O_DIRECT for the expert tier later) and the unsafe code that needs. The other crates
//! stay free of `unsafe` by going through this one.

mod mmap;

pub use mmap::{MapError, MappedFile};
