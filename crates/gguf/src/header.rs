//! The data of a validated GGUF header: `GgufFile` (metadata, tensor infos, layout) and
//! `TensorInfo`. `read.rs` builds them, `file.rs` queries them; neither imports the other's
//! types through this one.

use std::path::PathBuf;

use crate::{GgmlType, MetaValue};

/// One tensor as described by the header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the row length (contiguous).
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Relative to the data section.
    pub offset: u64,
    /// Bytes of data (validated: `row_bytes * n_rows`).
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Product of all dims (saturating; exact for parsed tensors).
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().fold(1u64, |a, &d| a.saturating_mul(d))
    }

    /// Product of `dims[1..]` (1 for a 1-D tensor).
    pub fn n_rows(&self) -> u64 {
        self.dims
            .iter()
            .skip(1)
            .fold(1u64, |a, &d| a.saturating_mul(d))
    }

    /// Bytes of one row of `dims[0]` elements (0 for a tensor that did not come from a
    /// validated header and has no whole-block rows).
    pub fn row_bytes(&self) -> u64 {
        self.dims
            .first()
            .and_then(|&n| self.ty.row_bytes(n))
            .unwrap_or(0)
    }
}

/// A validated GGUF header.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    /// In file order.
    pub metadata: Vec<(String, MetaValue)>,
    /// In file order.
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_offset: u64,
    pub file_size: u64,
}
