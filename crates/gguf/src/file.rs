//! A parsed GGUF header and the queries on it.
//!
//! Owns: opening a file, typed metadata getters and byte ranges of tensors, row ranges and
//! experts. The types (`GgufFile`, `TensorInfo`) are in `header.rs`, parsing in `read.rs`.

use std::io::BufReader;
use std::ops::Range;
use std::path::Path;

use crate::header::{GgufFile, TensorInfo};
use crate::read::{parse_header, ReaderSource, SliceSource};
use crate::{GgufError, MetaValue};

impl GgufFile {
    /// Read and validate the header of the file at `path` (tensor data is not read).
    pub fn open(path: &Path) -> Result<GgufFile, GgufError> {
        let io = |what: &str| {
            let what = what.to_string();
            move |source| GgufError::Io {
                path: path.to_path_buf(),
                what,
                source,
            }
        };
        // A FIFO, device or socket could block on open or never end: refuse it first.
        let md = std::fs::metadata(path).map_err(io("opening"))?;
        if !md.is_file() {
            return Err(io("opening")(std::io::Error::other(
                "not a regular file (a directory, FIFO, device or socket)",
            )));
        }
        let file = std::fs::File::open(path).map_err(io("opening"))?;
        let file_size = file.metadata().map_err(io("reading metadata"))?.len();
        let src = ReaderSource::new(BufReader::with_capacity(1 << 16, file), file_size);
        parse_header(src, path, file_size)
    }

    /// Parse and validate a whole file held in memory; `path` only names it in errors.
    pub fn parse(bytes: &[u8], path: &Path) -> Result<GgufFile, GgufError> {
        parse_header(SliceSource::new(bytes), path, bytes.len() as u64)
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    fn require(&self, key: &str) -> Result<&MetaValue, GgufError> {
        self.get(key).ok_or_else(|| GgufError::MissingKey {
            path: self.path.clone(),
            key: key.to_string(),
        })
    }

    fn wrong(&self, key: &str, expected: &'static str, v: &MetaValue) -> GgufError {
        GgufError::WrongType {
            path: self.path.clone(),
            key: key.to_string(),
            expected,
            found: match v {
                MetaValue::Array(_) | MetaValue::Str(_) => v.type_description(),
                _ => format!("{} {v:?}", v.type_description()),
            },
        }
    }

    /// An integer value >= 0 of any integer type.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.require(key)?;
        v.as_u64()
            .ok_or_else(|| self.wrong(key, "a non-negative integer", v))
    }

    /// An integer value in `0..=u32::MAX` of any integer type.
    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        let v = self.require(key)?;
        v.as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .ok_or_else(|| self.wrong(key, "an integer in 0..=u32::MAX", v))
    }

    /// An `f32` (or `f64`, rounded) value.
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        let v = self.require(key)?;
        v.as_f32().ok_or_else(|| self.wrong(key, "f32", v))
    }

    /// A string value.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| self.wrong(key, "string", v))
    }

    /// A bool value.
    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        let v = self.require(key)?;
        v.as_bool().ok_or_else(|| self.wrong(key, "bool", v))
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> Result<&str, GgufError> {
        self.get_str("general.architecture")
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Absolute byte range of `t`'s data in the file.
    pub fn tensor_range(&self, t: &TensorInfo) -> Range<u64> {
        let start = self.data_offset.saturating_add(t.offset);
        start..start.saturating_add(t.n_bytes)
    }

    /// Absolute byte range of rows `rows` of `t` (a row is `dims[0]` elements).
    pub fn rows_range(&self, t: &TensorInfo, rows: Range<u64>) -> Result<Range<u64>, GgufError> {
        let n_rows = t.n_rows();
        if rows.start > rows.end || rows.end > n_rows {
            return Err(GgufError::RowsOutOfRange {
                path: self.path.clone(),
                tensor: t.name.clone(),
                start: rows.start,
                end: rows.end,
                n_rows,
            });
        }
        let base = self.tensor_range(t).start;
        let rb = t.row_bytes();
        Ok(base.saturating_add(rows.start.saturating_mul(rb))
            ..base.saturating_add(rows.end.saturating_mul(rb)))
    }

    /// Absolute byte range of expert `expert` of a stacked 3-D tensor with dims
    /// `[cols, rows, n_expert]`: `rows * row_bytes` bytes.
    pub fn expert_range(&self, t: &TensorInfo, expert: u64) -> Result<Range<u64>, GgufError> {
        if t.dims.len() != 3 {
            return Err(GgufError::NotStacked {
                path: self.path.clone(),
                tensor: t.name.clone(),
                n_dims: t.dims.len(),
            });
        }
        let (rows, n_expert) = (t.dims[1], t.dims[2]);
        if expert >= n_expert {
            return Err(GgufError::ExpertOutOfRange {
                path: self.path.clone(),
                tensor: t.name.clone(),
                expert,
                n_expert,
            });
        }
        self.rows_range(
            t,
            expert.saturating_mul(rows)..(expert + 1).saturating_mul(rows),
        )
    }
}
