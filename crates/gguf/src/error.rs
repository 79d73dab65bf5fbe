//! The one error type of this crate.
//!
//! Owns: `GgufError`. Every variant's Display is one line that names the file and the key or
//! tensor concerned and says what was expected and what was found. Names that come from the
//! file are printed with `{:?}` so control characters in hostile files cannot break the line.

use std::path::PathBuf;

use crate::GgmlType;

/// Everything that can go wrong reading, validating, querying or writing a GGUF file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// The operating system failed to open, read or write the file.
    #[error("{}: I/O error while {what}: {source}", .path.display())]
    Io {
        path: PathBuf,
        what: String,
        #[source]
        source: std::io::Error,
    },

    /// The first four bytes are not `GGUF`.
    #[error("{}: not a GGUF file: expected magic \"GGUF\", found {found:?}", .path.display())]
    BadMagic { path: PathBuf, found: Vec<u8> },

    /// A version other than 2 or 3.
    #[error("{}: unsupported GGUF version: expected 2 or 3, found {found}", .path.display())]
    UnsupportedVersion { path: PathBuf, found: u32 },

    /// The file ends before a field it announces.
    #[error(
        "{}: truncated at offset {offset} reading {what}: expected {needed} bytes, found {available}",
        .path.display()
    )]
    Truncated {
        path: PathBuf,
        offset: u64,
        what: String,
        needed: u64,
        available: u64,
    },

    /// The tensor count exceeds the hard limit or what the remaining bytes could hold.
    #[error(
        "{}: tensor count: expected at most {limit} (2^20, and 32 bytes per tensor info left in the file), found {found}",
        .path.display()
    )]
    TooManyTensors {
        path: PathBuf,
        found: u64,
        limit: u64,
    },

    /// The metadata key count exceeds the hard limit or what the remaining bytes could hold.
    #[error(
        "{}: metadata key count: expected at most {limit} (2^20, and 13 bytes per key left in the file), found {found}",
        .path.display()
    )]
    TooManyKeys {
        path: PathBuf,
        found: u64,
        limit: u64,
    },

    /// A string longer than the limit or than the bytes left in the file.
    #[error("{}: {what}: string length expected at most {limit}, found {found}", .path.display())]
    StringTooLong {
        path: PathBuf,
        what: String,
        found: u64,
        limit: u64,
    },

    /// An array longer than the remaining bytes could hold.
    #[error("{}: key {key:?}: array length expected at most {limit}, found {found}", .path.display())]
    ArrayTooLong {
        path: PathBuf,
        key: String,
        found: u64,
        limit: u64,
    },

    /// More array elements in the whole metadata than the hard limit.
    #[error(
        "{}: key {key:?}: metadata array elements in total expected at most {limit}, found {found}",
        .path.display()
    )]
    TooManyValues {
        path: PathBuf,
        key: String,
        found: u64,
        limit: u64,
    },

    /// Arrays nested deeper than the limit.
    #[error("{}: key {key:?}: array nesting depth expected at most {limit}, found {found}", .path.display())]
    NestingTooDeep {
        path: PathBuf,
        key: String,
        found: u32,
        limit: u32,
    },

    /// A metadata value type id outside 0..=12.
    #[error("{}: key {key:?}: metadata value type expected 0..=12, found {found}", .path.display())]
    UnknownMetaType {
        path: PathBuf,
        key: String,
        found: u32,
    },

    /// A bool byte other than 0 or 1.
    #[error("{}: key {key:?}: bool expected 0 or 1, found {found}", .path.display())]
    InvalidBool {
        path: PathBuf,
        key: String,
        found: u8,
    },

    /// A string that is not UTF-8.
    #[error("{}: {what} at offset {offset}: expected UTF-8, found invalid bytes", .path.display())]
    InvalidUtf8 {
        path: PathBuf,
        what: String,
        offset: u64,
    },

    /// The same key twice.
    #[error("{}: key {key:?}: expected once, found twice", .path.display())]
    DuplicateKey { path: PathBuf, key: String },

    /// `general.alignment` is zero, not a power of two or of a non-integer type.
    #[error(
        "{}: key \"general.alignment\": expected a nonzero power of two (u32), found {found}",
        .path.display()
    )]
    BadAlignment { path: PathBuf, found: String },

    /// A tensor with 0 or more than 4 dimensions.
    #[error("{}: tensor {tensor:?}: n_dims expected 1..=4, found {found}", .path.display())]
    BadDimCount {
        path: PathBuf,
        tensor: String,
        found: u32,
    },

    /// A dimension of size zero.
    #[error("{}: tensor {tensor:?}: dimensions expected nonzero, found {dims:?}", .path.display())]
    ZeroDim {
        path: PathBuf,
        tensor: String,
        dims: Vec<u64>,
    },

    /// The element count or byte size does not fit in 63 bits.
    #[error(
        "{}: tensor {tensor:?}: element count / byte size expected below 2^63, found overflowing dims {dims:?}",
        .path.display()
    )]
    SizeOverflow {
        path: PathBuf,
        tensor: String,
        dims: Vec<u64>,
    },

    /// The row length is not a whole number of quant blocks.
    #[error(
        "{}: tensor {tensor:?}: row length expected a multiple of {block} ({ty} block size), found {row_len}",
        .path.display()
    )]
    RowNotBlockMultiple {
        path: PathBuf,
        tensor: String,
        ty: GgmlType,
        row_len: u64,
        block: u64,
    },

    /// A tensor type id this crate does not know.
    #[error("{}: tensor {tensor:?}: expected a known ggml type id, found {id}", .path.display())]
    UnknownTensorType {
        path: PathBuf,
        tensor: String,
        id: u32,
    },

    /// The same tensor name twice.
    #[error("{}: tensor {tensor:?}: expected a unique name, found it twice", .path.display())]
    DuplicateTensor { path: PathBuf, tensor: String },

    /// A tensor offset that is not a multiple of the alignment.
    #[error(
        "{}: tensor {tensor:?}: offset expected a multiple of {alignment}, found {offset}",
        .path.display()
    )]
    MisalignedTensor {
        path: PathBuf,
        tensor: String,
        offset: u64,
        alignment: u64,
    },

    /// A tensor whose bytes end beyond the end of the file.
    #[error(
        "{}: tensor {tensor:?}: data expected to end within the file ({file_size} bytes), found end at {end}",
        .path.display()
    )]
    TensorBeyondEof {
        path: PathBuf,
        tensor: String,
        end: u128,
        file_size: u64,
    },

    /// Two tensors share bytes.
    #[error(
        "{}: tensor {tensor:?}: expected no overlap, found its data at {start} inside tensor {other:?} (ends at {other_end})",
        .path.display()
    )]
    TensorOverlap {
        path: PathBuf,
        tensor: String,
        other: String,
        start: u64,
        other_end: u64,
    },

    /// The (aligned) data section starts beyond the end of the file.
    #[error(
        "{}: data section expected to start within the file ({file_size} bytes), found offset {data_offset}",
        .path.display()
    )]
    DataBeyondEof {
        path: PathBuf,
        data_offset: u64,
        file_size: u64,
    },

    /// A key that was asked for is absent.
    #[error("{}: key {key:?}: expected present, found missing", .path.display())]
    MissingKey { path: PathBuf, key: String },

    /// A key has a value of another type (or out of the requested type's range).
    #[error("{}: key {key:?}: expected {expected}, found {found}", .path.display())]
    WrongType {
        path: PathBuf,
        key: String,
        expected: &'static str,
        found: String,
    },

    /// `expert_range` on a tensor that is not 3-D.
    #[error(
        "{}: tensor {tensor:?}: expected a 3-D stacked expert tensor, found {n_dims} dims",
        .path.display()
    )]
    NotStacked {
        path: PathBuf,
        tensor: String,
        n_dims: usize,
    },

    /// An expert index past the last expert.
    #[error("{}: tensor {tensor:?}: expert expected < {n_expert}, found {expert}", .path.display())]
    ExpertOutOfRange {
        path: PathBuf,
        tensor: String,
        expert: u64,
        n_expert: u64,
    },

    /// A row range outside the tensor.
    #[error(
        "{}: tensor {tensor:?}: row range expected within 0..{n_rows}, found {start}..{end}",
        .path.display()
    )]
    RowsOutOfRange {
        path: PathBuf,
        tensor: String,
        start: u64,
        end: u64,
        n_rows: u64,
    },

    /// Writer: tensor data given out of order.
    #[error("{}: writer: expected data for tensor {expected:?}, found {found:?}", .path.display())]
    WriteOrder {
        path: PathBuf,
        expected: String,
        found: String,
    },

    /// Writer: a tensor got a different number of bytes than its dims and type require.
    #[error("{}: writer: tensor {tensor:?}: expected {expected} bytes, found {found}", .path.display())]
    WriteSize {
        path: PathBuf,
        tensor: String,
        expected: u64,
        found: u64,
    },

    /// Writer: `finish` before every tensor was written.
    #[error(
        "{}: writer: expected all {expected} tensors written, found {found} (next {next:?})",
        .path.display()
    )]
    WriteIncomplete {
        path: PathBuf,
        expected: usize,
        found: usize,
        next: String,
    },

    /// Writer: version other than 2 or 3 requested.
    #[error("{}: writer: version expected 2 or 3, found {found}", .path.display())]
    WriteVersion { path: PathBuf, found: u32 },
}
