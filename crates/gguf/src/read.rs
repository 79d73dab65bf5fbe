//! The header parser: one implementation over a small cursor trait, used by
//! `GgufFile::open` (buffered file reader) and `GgufFile::parse` (byte slice).
//!
//! Owns: decoding and validating the header (magic, version, counts, metadata, tensor infos,
//! alignment, data section, tensor layout) against hard limits. Every count and length is
//! checked against the bytes left before anything is allocated, all arithmetic is checked,
//! and every failure is a typed `GgufError`.

use std::collections::HashSet;
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::header::{GgufFile, TensorInfo};
use crate::{GgmlType, GgufError, MetaArray, MetaType, MetaValue};

/// The four magic bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of the data section and tensor offsets when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Most tensors a file may declare.
pub const MAX_TENSORS: u64 = 1 << 20;
/// Most metadata keys a file may declare.
pub const MAX_KEYS: u64 = 1 << 20;
/// Longest string value, in bytes.
pub const MAX_STRING_LEN: u64 = 1 << 30;
/// Longest key or tensor name, in bytes (the GGUF spec's key limit).
pub const MAX_NAME_LEN: u64 = 65_535;
/// Deepest nesting of arrays (an array of scalars has depth 1).
pub const MAX_ARRAY_DEPTH: u32 = 8;
/// Most array elements in the whole metadata (bounds memory: ~32 bytes each in RAM).
pub const MAX_TOTAL_ARRAY_VALUES: u64 = 1 << 24;
/// Most tensor dimensions (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: u32 = 4;
/// Fewest bytes a metadata key/value pair takes (key length, type, one byte of value).
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
/// Fewest bytes a tensor info takes (name length, n_dims, one dim, type, offset).
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 8 + 4 + 8;

/// A forward-only byte cursor over the file being parsed.
pub(crate) trait Source {
    /// Absolute offset of the next byte.
    fn pos(&self) -> u64;
    /// Bytes from `pos` to the end of the input.
    fn remaining(&self) -> u64;
    /// Fill `buf`; the caller has checked `buf.len() <= remaining()`.
    fn read_into(&mut self, buf: &mut [u8]) -> std::io::Result<()>;
}

/// A cursor over an in-memory file.
pub(crate) struct SliceSource<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> SliceSource<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        SliceSource { bytes, pos: 0 }
    }
}

impl Source for SliceSource<'_> {
    fn pos(&self) -> u64 {
        self.pos as u64
    }
    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }
    fn read_into(&mut self, buf: &mut [u8]) -> std::io::Result<()> {
        let src = self
            .bytes
            .get(self.pos..self.pos + buf.len())
            .ok_or(std::io::ErrorKind::UnexpectedEof)?;
        buf.copy_from_slice(src);
        self.pos += buf.len();
        Ok(())
    }
}

/// A cursor over a (buffered) reader of known total length.
pub(crate) struct ReaderSource<R> {
    inner: R,
    pos: u64,
    len: u64,
}

impl<R: Read> ReaderSource<R> {
    pub(crate) fn new(inner: R, len: u64) -> Self {
        ReaderSource { inner, pos: 0, len }
    }
}

impl<R: Read> Source for ReaderSource<R> {
    fn pos(&self) -> u64 {
        self.pos
    }
    fn remaining(&self) -> u64 {
        self.len.saturating_sub(self.pos)
    }
    fn read_into(&mut self, buf: &mut [u8]) -> std::io::Result<()> {
        self.inner.read_exact(buf)?;
        self.pos += buf.len() as u64;
        Ok(())
    }
}

/// Round `x` up to a multiple of `align` (a power of two), `None` on overflow.
pub(crate) fn align_up(x: u64, align: u64) -> Option<u64> {
    Some(x.checked_add(align - 1)? & !(align - 1))
}

/// Validates `general.alignment` (absent: the default).
pub(crate) fn alignment_of(
    metadata: &[(String, MetaValue)],
    path: &Path,
) -> Result<u64, GgufError> {
    let Some((_, v)) = metadata.iter().find(|(k, _)| k == "general.alignment") else {
        return Ok(DEFAULT_ALIGNMENT);
    };
    match v.as_u64() {
        Some(a) if a.is_power_of_two() && a <= 1 << 31 => Ok(a),
        _ => Err(GgufError::BadAlignment {
            path: path.to_path_buf(),
            found: format!("{v:?}"),
        }),
    }
}

/// Geometry of one tensor: element count and byte size, validated.
pub(crate) fn tensor_size(
    name: &str,
    dims: &[u64],
    ty: GgmlType,
    path: &Path,
) -> Result<u64, GgufError> {
    let path_buf = || path.to_path_buf();
    if dims.is_empty() || dims.len() > MAX_DIMS as usize {
        return Err(GgufError::BadDimCount {
            path: path_buf(),
            tensor: name.to_string(),
            found: dims.len() as u32,
        });
    }
    if dims.contains(&0) {
        return Err(GgufError::ZeroDim {
            path: path_buf(),
            tensor: name.to_string(),
            dims: dims.to_vec(),
        });
    }
    let overflow = || GgufError::SizeOverflow {
        path: path_buf(),
        tensor: name.to_string(),
        dims: dims.to_vec(),
    };
    let mut n_elements: u64 = 1;
    for &d in dims {
        n_elements = n_elements.checked_mul(d).ok_or_else(overflow)?;
    }
    if n_elements > i64::MAX as u64 {
        return Err(overflow());
    }
    let row_len = dims[0];
    let row_bytes = ty
        .row_bytes(row_len)
        .ok_or_else(|| GgufError::RowNotBlockMultiple {
            path: path_buf(),
            tensor: name.to_string(),
            ty,
            row_len,
            block: ty.block_size(),
        })?;
    let n_rows = n_elements / row_len;
    let n_bytes = row_bytes.checked_mul(n_rows).ok_or_else(overflow)?;
    if n_bytes > i64::MAX as u64 {
        return Err(overflow());
    }
    Ok(n_bytes)
}

struct Parser<'p, S> {
    src: S,
    path: &'p Path,
    total_values: u64,
}

impl<S: Source> Parser<'_, S> {
    fn path(&self) -> PathBuf {
        self.path.to_path_buf()
    }

    fn bytes<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], GgufError> {
        let available = self.src.remaining();
        if available < N as u64 {
            return Err(GgufError::Truncated {
                path: self.path(),
                offset: self.src.pos(),
                what: what(),
                needed: N as u64,
                available,
            });
        }
        let mut b = [0u8; N];
        self.src.read_into(&mut b).map_err(|source| GgufError::Io {
            path: self.path(),
            what: format!("reading {} at offset {}", what(), self.src.pos()),
            source,
        })?;
        Ok(b)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.bytes(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.bytes(what)?))
    }

    /// A length-prefixed UTF-8 string of at most `cap` bytes.
    fn string(&mut self, cap: u64, what: &dyn Fn() -> String) -> Result<String, GgufError> {
        let len = self.u64(&|| format!("length of {}", what()))?;
        let limit = cap.min(self.src.remaining());
        if len > limit {
            return Err(GgufError::StringTooLong {
                path: self.path(),
                what: what(),
                found: len,
                limit,
            });
        }
        let start = self.src.pos();
        // len <= remaining bytes of the input, so this allocation is bounded by the file.
        let mut buf = vec![0u8; len as usize];
        self.src
            .read_into(&mut buf)
            .map_err(|source| GgufError::Io {
                path: self.path(),
                what: format!("reading {} at offset {start}", what()),
                source,
            })?;
        String::from_utf8(buf).map_err(|_| GgufError::InvalidUtf8 {
            path: self.path(),
            what: what(),
            offset: start,
        })
    }

    /// One value of type `ty`; `depth` is the number of arrays enclosing it.
    fn value(&mut self, ty: MetaType, key: &str, depth: u32) -> Result<MetaValue, GgufError> {
        let what = || format!("value of key {key:?}");
        Ok(match ty {
            MetaType::U8 => MetaValue::U8(u8::from_le_bytes(self.bytes(&what)?)),
            MetaType::I8 => MetaValue::I8(i8::from_le_bytes(self.bytes(&what)?)),
            MetaType::U16 => MetaValue::U16(u16::from_le_bytes(self.bytes(&what)?)),
            MetaType::I16 => MetaValue::I16(i16::from_le_bytes(self.bytes(&what)?)),
            MetaType::U32 => MetaValue::U32(u32::from_le_bytes(self.bytes(&what)?)),
            MetaType::I32 => MetaValue::I32(i32::from_le_bytes(self.bytes(&what)?)),
            MetaType::F32 => MetaValue::F32(f32::from_le_bytes(self.bytes(&what)?)),
            MetaType::U64 => MetaValue::U64(u64::from_le_bytes(self.bytes(&what)?)),
            MetaType::I64 => MetaValue::I64(i64::from_le_bytes(self.bytes(&what)?)),
            MetaType::F64 => MetaValue::F64(f64::from_le_bytes(self.bytes(&what)?)),
            MetaType::Bool => match self.bytes::<1>(&what)?[0] {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                found => {
                    return Err(GgufError::InvalidBool {
                        path: self.path(),
                        key: key.to_string(),
                        found,
                    })
                }
            },
            MetaType::String => MetaValue::Str(self.string(MAX_STRING_LEN, &what)?),
            MetaType::Array => MetaValue::Array(self.array(key, depth + 1)?),
        })
    }

    /// An array body (element type, length, elements) at nesting depth `depth` (>= 1).
    fn array(&mut self, key: &str, depth: u32) -> Result<MetaArray, GgufError> {
        if depth > MAX_ARRAY_DEPTH {
            return Err(GgufError::NestingTooDeep {
                path: self.path(),
                key: key.to_string(),
                found: depth,
                limit: MAX_ARRAY_DEPTH,
            });
        }
        let type_id = self.u32(&|| format!("array element type of key {key:?}"))?;
        let elem_type = self.meta_type(type_id, key)?;
        let len = self.u64(&|| format!("array length of key {key:?}"))?;
        let limit = self.src.remaining() / elem_type.min_encoded_size();
        if len > limit {
            return Err(GgufError::ArrayTooLong {
                path: self.path(),
                key: key.to_string(),
                found: len,
                limit,
            });
        }
        self.total_values = self.total_values.saturating_add(len);
        if self.total_values > MAX_TOTAL_ARRAY_VALUES {
            return Err(GgufError::TooManyValues {
                path: self.path(),
                key: key.to_string(),
                found: self.total_values,
                limit: MAX_TOTAL_ARRAY_VALUES,
            });
        }
        // len <= remaining / min element size and <= the total-values cap.
        let mut values = Vec::with_capacity(len as usize);
        for _ in 0..len {
            values.push(self.value(elem_type, key, depth)?);
        }
        Ok(MetaArray { elem_type, values })
    }

    fn meta_type(&self, id: u32, key: &str) -> Result<MetaType, GgufError> {
        MetaType::from_id(id).ok_or_else(|| GgufError::UnknownMetaType {
            path: self.path(),
            key: key.to_string(),
            found: id,
        })
    }

    fn tensor_info(&mut self, index: u64) -> Result<TensorInfo, GgufError> {
        let name = self.string(MAX_NAME_LEN, &|| format!("name of tensor #{index}"))?;
        let what = |field: &str| format!("{field} of tensor {name:?}");
        let n_dims = self.u32(&|| what("n_dims"))?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(GgufError::BadDimCount {
                path: self.path(),
                tensor: name,
                found: n_dims,
            });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(self.u64(&|| what("dims"))?);
        }
        let type_id = self.u32(&|| what("type"))?;
        let offset = self.u64(&|| what("offset"))?;
        let ty = GgmlType::from_id(type_id).ok_or_else(|| GgufError::UnknownTensorType {
            path: self.path(),
            tensor: name.clone(),
            id: type_id,
        })?;
        let n_bytes = tensor_size(&name, &dims, ty, self.path)?;
        Ok(TensorInfo {
            name,
            dims,
            ty,
            offset,
            n_bytes,
        })
    }
}

/// Parse and validate a whole header from `src`; `file_size` is the length of the file the
/// header belongs to (tensor data must lie within it).
pub(crate) fn parse_header<S: Source>(
    src: S,
    path: &Path,
    file_size: u64,
) -> Result<GgufFile, GgufError> {
    let mut p = Parser {
        src,
        path,
        total_values: 0,
    };
    let path_buf = || path.to_path_buf();

    // Magic: report "not a GGUF file" even for files shorter than four bytes.
    let n_magic = p.src.remaining().min(4) as usize;
    let mut magic = [0u8; 4];
    p.src
        .read_into(&mut magic[..n_magic])
        .map_err(|source| GgufError::Io {
            path: path_buf(),
            what: "reading the magic".to_string(),
            source,
        })?;
    if n_magic < 4 || magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic {
            path: path_buf(),
            found: magic[..n_magic].to_vec(),
        });
    }

    let version = p.u32(&|| "version".to_string())?;
    if version != 2 && version != 3 {
        return Err(GgufError::UnsupportedVersion {
            path: path_buf(),
            found: version,
        });
    }
    let n_tensors = p.u64(&|| "tensor count".to_string())?;
    let n_kv = p.u64(&|| "metadata key count".to_string())?;
    let rem = p.src.remaining();
    let tensor_limit = MAX_TENSORS.min(rem / MIN_TENSOR_INFO_BYTES);
    if n_tensors > tensor_limit {
        return Err(GgufError::TooManyTensors {
            path: path_buf(),
            found: n_tensors,
            limit: tensor_limit,
        });
    }
    let kv_limit = MAX_KEYS.min(rem / MIN_KV_BYTES);
    if n_kv > kv_limit {
        return Err(GgufError::TooManyKeys {
            path: path_buf(),
            found: n_kv,
            limit: kv_limit,
        });
    }

    let mut metadata = Vec::with_capacity(n_kv as usize);
    let mut keys = HashSet::with_capacity(n_kv as usize);
    for i in 0..n_kv {
        let key = p.string(MAX_NAME_LEN, &|| format!("metadata key #{i}"))?;
        let type_id = p.u32(&|| format!("value type of key {key:?}"))?;
        let ty = p.meta_type(type_id, &key)?;
        let value = p.value(ty, &key, 0)?;
        if !keys.insert(key.clone()) {
            return Err(GgufError::DuplicateKey {
                path: path_buf(),
                key,
            });
        }
        metadata.push((key, value));
    }
    drop(keys);

    let mut tensors = Vec::with_capacity(n_tensors as usize);
    let mut names = HashSet::with_capacity(n_tensors as usize);
    for i in 0..n_tensors {
        let t = p.tensor_info(i)?;
        if !names.insert(t.name.clone()) {
            return Err(GgufError::DuplicateTensor {
                path: path_buf(),
                tensor: t.name,
            });
        }
        tensors.push(t);
    }
    drop(names);

    let alignment = alignment_of(&metadata, path)?;
    let header_end = p.src.pos();
    // A file without tensors (llama.cpp's vocab-only files) may end before the padding
    // that would precede its empty data section; its data section is then empty at EOF.
    let data_offset = align_up(header_end, alignment)
        .map(|d| {
            if tensors.is_empty() && header_end <= file_size {
                d.min(file_size)
            } else {
                d
            }
        })
        .filter(|&d| d <= file_size)
        .ok_or(GgufError::DataBeyondEof {
            path: path_buf(),
            data_offset: header_end.saturating_add(alignment - 1) & !(alignment - 1),
            file_size,
        })?;
    check_layout(&tensors, alignment, data_offset, file_size, path)?;

    Ok(GgufFile {
        path: path_buf(),
        version,
        metadata,
        tensors,
        alignment,
        data_offset,
        file_size,
    })
}

/// Offsets aligned, data within the file, no two tensors sharing a byte.
pub(crate) fn check_layout(
    tensors: &[TensorInfo],
    alignment: u64,
    data_offset: u64,
    file_size: u64,
    path: &Path,
) -> Result<(), GgufError> {
    for t in tensors {
        if !t.offset.is_multiple_of(alignment) {
            return Err(GgufError::MisalignedTensor {
                path: path.to_path_buf(),
                tensor: t.name.clone(),
                offset: t.offset,
                alignment,
            });
        }
        let end = u128::from(data_offset) + u128::from(t.offset) + u128::from(t.n_bytes);
        if end > u128::from(file_size) {
            return Err(GgufError::TensorBeyondEof {
                path: path.to_path_buf(),
                tensor: t.name.clone(),
                end,
                file_size,
            });
        }
    }
    // All ends fit in u64 now.
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by_key(|&i| tensors[i].offset);
    for w in order.windows(2) {
        let (a, b) = (&tensors[w[0]], &tensors[w[1]]);
        let a_end = a.offset + a.n_bytes;
        if b.offset < a_end {
            return Err(GgufError::TensorOverlap {
                path: path.to_path_buf(),
                tensor: b.name.clone(),
                other: a.name.clone(),
                start: b.offset,
                other_end: a_end,
            });
        }
    }
    Ok(())
}
