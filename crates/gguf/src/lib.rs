//! GGUF (versions 2 and 3): read, validate and write model files.
//!
//! Owns: the on-disk format (header, metadata key/values, tensor infos, alignment, data
//! section), its validation against hard limits, and byte ranges of tensors, row ranges and
//! experts of stacked 3-D tensors. It does not map or read tensor data (that is
//! `sluice-io`) and does not interpret tensor contents (that is `sluice-kernels`).
//!
//! Untrusted bytes never panic, abort or allocate more than the file holds.

mod types;

pub use types::GgmlType;
