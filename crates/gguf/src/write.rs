//! The streaming GGUF writer.
//!
//! Owns: encoding a header from metadata + tensor specs with aligned offsets, then taking
//! each tensor's bytes in order (alignment padding inserted, sizes checked), so files of any
//! size can be written without holding them in memory. The planned header is re-parsed by
//! the reader before anything is written, so the writer never emits a file the reader
//! rejects.

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::read::{align_up, alignment_of, parse_header, tensor_size, SliceSource, GGUF_MAGIC};
use crate::{GgmlType, GgufError, GgufFile, MetaArray, MetaValue, TensorInfo};

/// A tensor to be written: its header entry without the offset (the writer lays out data).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    /// ggml order: `dims[0]` is the row length.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
}

impl TensorSpec {
    pub fn new(name: impl Into<String>, dims: &[u64], ty: GgmlType) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            dims: dims.to_vec(),
            ty,
        }
    }
}

impl From<&TensorInfo> for TensorSpec {
    fn from(t: &TensorInfo) -> TensorSpec {
        TensorSpec::new(t.name.clone(), &t.dims, t.ty)
    }
}

/// Writes one GGUF file: the header at construction, then each tensor's bytes in order.
///
/// ```no_run
/// # use sluice_gguf::{GgufWriter, TensorSpec, GgmlType, MetaValue};
/// # fn main() -> Result<(), sluice_gguf::GgufError> {
/// let out = std::fs::File::create("x.gguf").unwrap();
/// let meta = vec![("general.architecture".to_string(), MetaValue::Str("llama".into()))];
/// let specs = [TensorSpec::new("a", &[4], GgmlType::F32)];
/// let mut w = GgufWriter::new(out, "x.gguf".as_ref(), &meta, &specs)?;
/// w.write_tensor("a", &[0u8; 16])?;
/// w.finish()?;
/// # Ok(()) }
/// ```
pub struct GgufWriter<W: Write> {
    out: W,
    plan: GgufFile,
    /// Index of the tensor whose bytes come next.
    next: usize,
    /// Bytes of tensor `next` written so far.
    written: u64,
    /// Bytes of the data section written so far (including padding).
    data_pos: u64,
}

impl<W: Write> GgufWriter<W> {
    /// A GGUF v3 writer; see [`GgufWriter::with_version`].
    pub fn new(
        out: W,
        path: &Path,
        metadata: &[(String, MetaValue)],
        tensors: &[TensorSpec],
    ) -> Result<Self, GgufError> {
        Self::with_version(out, path, 3, metadata, tensors)
    }

    /// Validate and lay out the header (alignment from `general.alignment`, default 32;
    /// tensors packed in the given order at aligned offsets), write it with the padding up
    /// to the data section, and return a writer waiting for the first tensor's bytes.
    /// `path` names the destination in errors.
    pub fn with_version(
        mut out: W,
        path: &Path,
        version: u32,
        metadata: &[(String, MetaValue)],
        tensors: &[TensorSpec],
    ) -> Result<Self, GgufError> {
        if version != 2 && version != 3 {
            return Err(GgufError::WriteVersion {
                path: path.to_path_buf(),
                found: version,
            });
        }
        let alignment = alignment_of(metadata, path)?;
        let mut infos = Vec::with_capacity(tensors.len());
        let mut cursor = 0u64;
        for s in tensors {
            let n_bytes = tensor_size(&s.name, &s.dims, s.ty, path)?;
            let overflow = || GgufError::SizeOverflow {
                path: path.to_path_buf(),
                tensor: s.name.clone(),
                dims: s.dims.clone(),
            };
            infos.push(TensorInfo {
                name: s.name.clone(),
                dims: s.dims.clone(),
                ty: s.ty,
                offset: cursor,
                n_bytes,
            });
            cursor = cursor
                .checked_add(n_bytes)
                .and_then(|e| align_up(e, alignment))
                .ok_or_else(overflow)?;
        }

        let mut header = Vec::new();
        header.extend_from_slice(&GGUF_MAGIC);
        header.extend_from_slice(&version.to_le_bytes());
        header.extend_from_slice(&(infos.len() as u64).to_le_bytes());
        header.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
        for (key, value) in metadata {
            put_str(&mut header, key);
            header.extend_from_slice(&value.meta_type().id().to_le_bytes());
            put_value(&mut header, key, value, path)?;
        }
        for t in &infos {
            put_str(&mut header, &t.name);
            header.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                header.extend_from_slice(&d.to_le_bytes());
            }
            header.extend_from_slice(&t.ty.id().to_le_bytes());
            header.extend_from_slice(&t.offset.to_le_bytes());
        }
        let too_big = || GgufError::SizeOverflow {
            path: path.to_path_buf(),
            tensor: String::new(),
            dims: Vec::new(),
        };
        let data_offset = align_up(header.len() as u64, alignment).ok_or_else(too_big)?;
        let file_size = data_offset.checked_add(cursor).ok_or_else(too_big)?;

        // The reader is the judge: every limit it enforces applies to what we write.
        let plan = parse_header(SliceSource::new(&header), path, file_size)?;
        debug_assert_eq!(plan.tensors, infos);
        debug_assert_eq!(plan.data_offset, data_offset);

        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            what: "writing the header".to_string(),
            source,
        };
        out.write_all(&header).map_err(io)?;
        write_zeros(&mut out, data_offset - header.len() as u64).map_err(io)?;
        Ok(GgufWriter {
            out,
            plan,
            next: 0,
            written: 0,
            data_pos: 0,
        })
    }

    /// The file being written, as the reader will see it (offsets, sizes, data offset).
    pub fn layout(&self) -> &GgufFile {
        &self.plan
    }

    /// The tensor whose bytes come next, if any.
    pub fn next_tensor(&self) -> Option<&TensorInfo> {
        self.plan.tensors.get(self.next)
    }

    fn path(&self) -> PathBuf {
        self.plan.path.clone()
    }

    fn io(&self, source: std::io::Error) -> GgufError {
        GgufError::Io {
            path: self.path(),
            what: format!(
                "writing data at offset {}",
                self.plan.data_offset + self.data_pos
            ),
            source,
        }
    }

    /// Append `chunk` to the current tensor's bytes. When the tensor is complete the
    /// padding up to the next aligned offset is written and the next tensor becomes current.
    pub fn write_data(&mut self, chunk: &[u8]) -> Result<(), GgufError> {
        if chunk.is_empty() {
            return Ok(());
        }
        let Some(t) = self.plan.tensors.get(self.next) else {
            return Err(GgufError::WriteSize {
                path: self.path(),
                tensor: "<none: every tensor is complete>".to_string(),
                expected: 0,
                found: chunk.len() as u64,
            });
        };
        let (n_bytes, offset) = (t.n_bytes, t.offset);
        let found = self.written + chunk.len() as u64;
        if found > n_bytes {
            return Err(GgufError::WriteSize {
                path: self.path(),
                tensor: t.name.clone(),
                expected: n_bytes,
                found,
            });
        }
        self.out.write_all(chunk).map_err(|e| self.io(e))?;
        self.written = found;
        self.data_pos = offset + found;
        if found == n_bytes {
            let end = self
                .plan
                .tensors
                .get(self.next + 1)
                .map_or(self.plan.file_size - self.plan.data_offset, |n| n.offset);
            write_zeros(&mut self.out, end - self.data_pos).map_err(|e| self.io(e))?;
            self.data_pos = end;
            self.next += 1;
            self.written = 0;
        }
        Ok(())
    }

    fn expect_start(&self, name: &str) -> Result<u64, GgufError> {
        match self.plan.tensors.get(self.next) {
            Some(t) if t.name == name && self.written == 0 => Ok(t.n_bytes),
            next => Err(GgufError::WriteOrder {
                path: self.path(),
                expected: next.map_or("<end of file>".to_string(), |t| {
                    if self.written == 0 {
                        t.name.clone()
                    } else {
                        format!("rest of {}", t.name)
                    }
                }),
                found: name.to_string(),
            }),
        }
    }

    /// Write the whole of tensor `name`, which must be the next one.
    pub fn write_tensor(&mut self, name: &str, data: &[u8]) -> Result<(), GgufError> {
        let n_bytes = self.expect_start(name)?;
        if data.len() as u64 != n_bytes {
            return Err(GgufError::WriteSize {
                path: self.path(),
                tensor: name.to_string(),
                expected: n_bytes,
                found: data.len() as u64,
            });
        }
        self.write_data(data)
    }

    /// Stream exactly the bytes of tensor `name` (the next one) from `src`.
    pub fn copy_tensor<R: Read>(&mut self, name: &str, src: &mut R) -> Result<(), GgufError> {
        let n_bytes = self.expect_start(name)?;
        let mut buf = vec![0u8; (1 << 20).min(n_bytes as usize)];
        let mut left = n_bytes;
        while left > 0 {
            let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
            let got = src.read(&mut buf[..want]).map_err(|source| GgufError::Io {
                path: self.path(),
                what: format!("reading the data of tensor {name:?}"),
                source,
            })?;
            if got == 0 {
                return Err(GgufError::WriteSize {
                    path: self.path(),
                    tensor: name.to_string(),
                    expected: n_bytes,
                    found: n_bytes - left,
                });
            }
            self.write_data(&buf[..got])?;
            left -= got as u64;
        }
        Ok(())
    }

    /// Check every tensor was written, flush, and return the output.
    pub fn finish(mut self) -> Result<W, GgufError> {
        if let Some(t) = self.plan.tensors.get(self.next) {
            return Err(GgufError::WriteIncomplete {
                path: self.path(),
                expected: self.plan.tensors.len(),
                found: self.next,
                next: t.name.clone(),
            });
        }
        self.out.flush().map_err(|e| self.io(e))?;
        Ok(self.out)
    }

    /// Write `file` (same version, metadata and tensor order) to `out`, copying each
    /// tensor's bytes from `src` (the original file, read at `file.tensor_range(t)`).
    /// Tensors are re-laid out packed in order, which is what llama.cpp and gguf-py write,
    /// so a file from either comes back byte for byte.
    pub fn rewrite<R: Read + Seek>(
        file: &GgufFile,
        src: &mut R,
        out: W,
        path: &Path,
    ) -> Result<W, GgufError> {
        let specs: Vec<TensorSpec> = file.tensors.iter().map(TensorSpec::from).collect();
        let mut w = GgufWriter::with_version(out, path, file.version, &file.metadata, &specs)?;
        let src_io = |source| GgufError::Io {
            path: file.path.clone(),
            what: "seeking to tensor data".to_string(),
            source,
        };
        for t in &file.tensors {
            let start = file.tensor_range(t).start;
            if src.stream_position().map_err(src_io)? != start {
                src.seek(SeekFrom::Start(start)).map_err(src_io)?;
            }
            w.copy_tensor(&t.name, src)?;
        }
        w.finish()
    }
}

fn write_zeros<W: Write>(out: &mut W, n: u64) -> std::io::Result<()> {
    std::io::copy(&mut std::io::repeat(0).take(n), out).map(|_| ())
}

fn put_str(buf: &mut Vec<u8>, s: &str) {
    buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
}

fn put_value(buf: &mut Vec<u8>, key: &str, v: &MetaValue, path: &Path) -> Result<(), GgufError> {
    match v {
        MetaValue::U8(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I8(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Bool(x) => buf.push(u8::from(*x)),
        MetaValue::Str(s) => put_str(buf, s),
        MetaValue::U64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Array(MetaArray { elem_type, values }) => {
            buf.extend_from_slice(&elem_type.id().to_le_bytes());
            buf.extend_from_slice(&(values.len() as u64).to_le_bytes());
            for e in values {
                if e.meta_type() != *elem_type {
                    return Err(GgufError::WrongType {
                        path: path.to_path_buf(),
                        key: key.to_string(),
                        expected: elem_type.name(),
                        found: format!("array element of type {}", e.type_description()),
                    });
                }
                put_value(buf, key, e, path)?;
            }
        }
    }
    Ok(())
}
