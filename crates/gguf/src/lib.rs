//! GGUF (versions 2 and 3): read, validate and write model files.
//!
//! Owns: the on-disk format (header, metadata key/values, tensor infos, alignment, data
//! section), its validation against hard limits, and byte ranges of tensors, row ranges and
//! experts of stacked 3-D tensors. It does not map or read tensor data (that is
//! `sluice-io`) and does not interpret tensor contents (that is `sluice-kernels`).
//!
//! Untrusted bytes never panic, abort or allocate more than the file holds.

mod error;
mod file;
mod header;
mod meta;
mod read;
mod types;
mod write;

pub use error::GgufError;
pub use header::{GgufFile, TensorInfo};
pub use meta::{MetaArray, MetaType, MetaValue};
pub use read::{
    DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_ARRAY_DEPTH, MAX_DIMS, MAX_KEYS, MAX_NAME_LEN,
    MAX_STRING_LEN, MAX_TENSORS, MAX_TOTAL_ARRAY_VALUES,
};
pub use types::GgmlType;
pub use write::{GgufWriter, TensorSpec};
