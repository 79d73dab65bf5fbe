//! Packed experts: a sidecar file holding each routed expert's matrices contiguous and
//! 4 KiB aligned, so streaming reads one aligned span per expert instead of one per matrix.
//!
//! Owns: the sidecar format (version 2, below), its atomic writer ([`write_pack`]: written
//! under `FILE.tmp`, synced, renamed; nothing is left under either name on error), its
//! validating reader ([`PackFile::open`]), the binding of a sidecar to the model's expert
//! data ([`unit_hash`], [`PackFile::check_unit`]) and the per-layer layout the streaming
//! source reads ([`PackLayer`]). The model file is never modified and stays loadable by
//! llama.cpp. Only regular files are opened as sidecars ([`open_regular`], also used for
//! popularity profiles): a FIFO named `MODEL.gguf.slpack` is refused, not waited on.
//!
//! Binding to the source data (v2): the header alone does not identify a model's data (two
//! files can share header and tensor table and differ in every expert byte), so the sidecar
//! records, from the GGUF's bytes at pack time,
//! - an xxh3-64 of each unit's bytes (its parts concatenated), checked by the streaming
//!   source against the bytes of the unit's first read from the sidecar (a damaged
//!   sidecar: the read fails with an error naming the sidecar);
//! - an xxh3-64 of a sample of the GGUF's expert data ([`SAMPLE_UNITS`] units evenly spaced
//!   over all packed units, the first [`SAMPLE_BYTES`] bytes of each of their parts),
//!   recomputed from the model at open (a sidecar packed from another file with the same
//!   header: refused at open). Cost at open: at most 64 x 4 x 4 KiB read from the model.
//!
//! Format v2, integers little-endian:
//! ```text
//! offset size
//!  0     4    magic "SLPK"
//!  4     4    version = 1
//!  8     8    model file size in bytes
//! 16     8    model header bytes hashed (the GGUF header, metadata and tensor table:
//!             bytes 0 .. the data section's offset)
//! 24     8    FNV-1a 64 of those bytes
//! 32     4    n_layer (the model's, including layers without routed experts)
//! 36     4    n_packed (layers with routed experts)
//! 40     8    header_len (multiple of 4096; where the data starts)
//! 48     8    total file size of the sidecar
//! 56     8    FNV-1a 64 of this header with this field zero (bytes 0 .. 80 + 64 x n_packed
//!             + 8 x total units)
//! 64     8    xxh3-64 of the sample of the model's expert data (see above)
//! 72     8    reserved (0)
//! 80     64 x n_packed   layer records:
//!        4 layer, 4 n_units, 4 n_parts (1..=4), 4 reserved (0),
//!        8 offset of unit 0, 8 stride (bytes between units, a multiple of 4096),
//!        4 x 8 bytes of each part of one unit (unused ones 0)
//! then   8 x n_units per packed layer, in order: xxh3-64 of each unit's bytes in the model
//! header_len ..   for each packed layer in order, for each unit: its parts concatenated
//!                 in the model's part order, zero-padded to the stride.
//! ```

use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use thiserror::Error;

use crate::groups::UnitGroup;
use crate::source::MAX_PARTS;

pub const MAGIC: [u8; 4] = *b"SLPK";
pub const VERSION: u32 = 2;
/// Alignment of every unit (and of the data start).
pub const ALIGN: u64 = 4096;
const FIXED: usize = 80;
/// Units sampled from the model at open, and bytes from the start of each of their parts.
pub const SAMPLE_UNITS: usize = 64;
pub const SAMPLE_BYTES: u64 = 4096;
const RECORD: usize = 64;

#[derive(Debug, Error)]
pub enum PackError {
    #[error("packed experts {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a sluice packed-experts sidecar: {what}")]
    NotPack { path: PathBuf, what: String },
    #[error("packed experts {path}: version {found}, this build reads version {VERSION}; run `sluice pack` again")]
    Version { path: PathBuf, found: u32 },
    #[error("packed experts {path} does not match model {model}: {what}; run `sluice pack` again or remove the sidecar")]
    Mismatch {
        path: PathBuf,
        model: PathBuf,
        what: String,
    },
    #[error("packed experts {path}: truncated or damaged: {what}; run `sluice pack` again")]
    Damaged { path: PathBuf, what: String },
    #[error("packed experts {path}: layer {layer} expert {expert}: the bytes read do not match the model's (checksum differs); the sidecar is damaged: run `sluice pack` again or remove it")]
    Unit {
        path: PathBuf,
        layer: u32,
        expert: u32,
    },
    #[error("cannot pack {model}: {what}")]
    Model { model: PathBuf, what: String },
}

/// Where one layer's units are in the sidecar.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackLayer {
    pub layer: u32,
    pub n_units: usize,
    /// Offset of unit 0.
    pub base: u64,
    /// Bytes between units (multiple of [`ALIGN`]).
    pub stride: u64,
    /// Bytes of each part of one unit, in the model's part order.
    pub part_bytes: Vec<u64>,
}

impl PackLayer {
    /// Offset of unit `u`.
    pub fn offset(&self, u: usize) -> u64 {
        self.base + u as u64 * self.stride
    }
    /// Bytes of one unit (its parts, without padding).
    pub fn unit_bytes(&self) -> u64 {
        self.part_bytes.iter().sum()
    }
}

/// A validated sidecar.
#[derive(Debug, Clone)]
pub struct PackFile {
    pub path: PathBuf,
    /// Per model layer (`None` = no routed experts).
    pub layers: Vec<Option<PackLayer>>,
    /// Per model layer, the xxh3-64 of each unit's bytes in the model (empty = no routed
    /// experts).
    pub unit_hashes: Vec<Vec<u64>>,
}

/// The hash a unit's bytes (its parts concatenated, without padding) are bound by.
pub fn unit_hash(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// The xxh3-64 of the model's sampled expert bytes (see the module header), or an error
/// naming the part that lies beyond `mapped`.
/// `read(start, end)` gives the model's bytes `start..end` (None: beyond the file).
fn sample_hash(
    len: u64,
    read: &mut dyn FnMut(u64, u64) -> Option<Vec<u8>>,
    group: &UnitGroup,
) -> Result<u64, String> {
    let all: Vec<(usize, usize)> = group
        .layers
        .iter()
        .enumerate()
        .filter_map(|(l, u)| u.as_ref().map(|u| (l, u.n_units)))
        .flat_map(|(l, n)| (0..n).map(move |e| (l, e)))
        .collect();
    let n = all.len().min(SAMPLE_UNITS);
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for k in 0..n {
        let (l, e) = all[k * all.len() / n];
        let u = group.layers[l].as_ref().expect("listed above");
        for i in 0..u.parts.len() {
            let r = u.part_range(i, e);
            let end = r.end.min(r.start + SAMPLE_BYTES);
            let bytes = read(r.start, end).ok_or_else(|| {
                format!(
                    "layer {l} expert {e} matrix {}: bytes {}..{end} beyond the file's {len}",
                    u.parts[i].name, r.start,
                )
            })?;
            h.update(&bytes);
        }
    }
    Ok(h.digest())
}

/// FNV-1a 64.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The default sidecar path of a model: `MODEL.gguf.slpack` next to it.
pub fn default_path(model: &Path) -> PathBuf {
    let mut s = model.as_os_str().to_owned();
    s.push(".slpack");
    PathBuf::from(s)
}

/// The layout a sidecar for `group` has: per-layer records and the total size.
fn plan(group: &UnitGroup, header_len: u64) -> Result<(Vec<Option<PackLayer>>, u64), String> {
    let mut pos = header_len;
    let mut out = Vec::with_capacity(group.layers.len());
    for (l, layer) in group.layers.iter().enumerate() {
        let Some(u) = layer else {
            out.push(None);
            continue;
        };
        if u.parts.is_empty() || u.parts.len() > MAX_PARTS {
            return Err(format!("layer {l}: {} matrices per expert", u.parts.len()));
        }
        let part_bytes: Vec<u64> = u.parts.iter().map(|p| p.bytes_per_unit).collect();
        let stride = part_bytes.iter().sum::<u64>().next_multiple_of(ALIGN);
        out.push(Some(PackLayer {
            layer: l as u32,
            n_units: u.n_units,
            base: pos,
            stride,
            part_bytes,
        }));
        pos += stride * u.n_units as u64;
    }
    Ok((out, pos))
}

fn header_len_for(n_packed: usize, n_units: usize) -> u64 {
    ((FIXED + RECORD * n_packed + 8 * n_units) as u64).next_multiple_of(ALIGN)
}

/// The bytes of unit `e` of layer `l` in the model (its parts concatenated).
fn source_unit<'a>(
    mapped: &'a [u8],
    group: &UnitGroup,
    l: usize,
    e: usize,
) -> Result<Vec<&'a [u8]>, String> {
    let u = group.layers[l].as_ref().expect("a packed layer");
    (0..u.parts.len())
        .map(|i| {
            let r = u.part_range(i, e);
            mapped.get(r.start as usize..r.end as usize).ok_or_else(|| {
                format!(
                    "layer {l} expert {e} matrix {}: bytes {}..{} beyond the file's {}",
                    u.parts[i].name,
                    r.start,
                    r.end,
                    mapped.len()
                )
            })
        })
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn encode_header(
    model_size: u64,
    model_header: &[u8],
    sample: u64,
    layers: &[Option<PackLayer>],
    hashes: &[u64],
    header_len: u64,
    total: u64,
) -> Vec<u8> {
    let packed: Vec<&PackLayer> = layers.iter().flatten().collect();
    let mut h = Vec::with_capacity(header_len as usize);
    h.extend_from_slice(&MAGIC);
    h.extend_from_slice(&VERSION.to_le_bytes());
    h.extend_from_slice(&model_size.to_le_bytes());
    h.extend_from_slice(&(model_header.len() as u64).to_le_bytes());
    h.extend_from_slice(&fnv1a(model_header).to_le_bytes());
    h.extend_from_slice(&(layers.len() as u32).to_le_bytes());
    h.extend_from_slice(&(packed.len() as u32).to_le_bytes());
    h.extend_from_slice(&header_len.to_le_bytes());
    h.extend_from_slice(&total.to_le_bytes());
    h.extend_from_slice(&0u64.to_le_bytes());
    h.extend_from_slice(&sample.to_le_bytes());
    h.extend_from_slice(&0u64.to_le_bytes());
    for p in &packed {
        h.extend_from_slice(&p.layer.to_le_bytes());
        h.extend_from_slice(&(p.n_units as u32).to_le_bytes());
        h.extend_from_slice(&(p.part_bytes.len() as u32).to_le_bytes());
        h.extend_from_slice(&0u32.to_le_bytes());
        h.extend_from_slice(&p.base.to_le_bytes());
        h.extend_from_slice(&p.stride.to_le_bytes());
        for i in 0..MAX_PARTS {
            h.extend_from_slice(&p.part_bytes.get(i).copied().unwrap_or(0).to_le_bytes());
        }
    }
    for x in hashes {
        h.extend_from_slice(&x.to_le_bytes());
    }
    let sum = fnv1a(&h);
    h[56..64].copy_from_slice(&sum.to_le_bytes());
    h.resize(header_len as usize, 0);
    h
}

/// Writes the sidecar for the model whose whole file is `mapped` (its data section starts
/// at `data_offset`, its routed experts are `group`) to `out`, atomically. Returns the
/// sidecar's size.
pub fn write_pack(
    model: &Path,
    mapped: &[u8],
    data_offset: u64,
    group: &UnitGroup,
    out: &Path,
) -> Result<u64, PackError> {
    let bad_model = |what: String| PackError::Model {
        model: model.to_path_buf(),
        what,
    };
    if group.is_empty() {
        return Err(bad_model("the model has no routed experts".into()));
    }
    if data_offset as usize > mapped.len() {
        return Err(bad_model("data offset beyond the end of the file".into()));
    }
    let n_packed = group.layers.iter().flatten().count();
    let n_units: usize = group.layers.iter().flatten().map(|u| u.n_units).sum();
    let header_len = header_len_for(n_packed, n_units);
    let (layers, total) = plan(group, header_len).map_err(bad_model)?;
    let sample = sample_hash(
        mapped.len() as u64,
        &mut |a, b| mapped.get(a as usize..b as usize).map(<[u8]>::to_vec),
        group,
    )
    .map_err(bad_model)?;
    // Pass 1: the units' hashes from the model's bytes (they go in the header).
    let mut hashes = Vec::with_capacity(n_units);
    for (l, p) in layers.iter().enumerate() {
        let Some(p) = p else { continue };
        for e in 0..p.n_units {
            let parts = source_unit(mapped, group, l, e).map_err(bad_model)?;
            let mut h = xxhash_rust::xxh3::Xxh3::new();
            for b in parts {
                h.update(b);
            }
            hashes.push(h.digest());
        }
    }
    let header = encode_header(
        mapped.len() as u64,
        &mapped[..data_offset as usize],
        sample,
        &layers,
        &hashes,
        header_len,
        total,
    );
    let mut tmp = out.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let io_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| PackError::Io { path, source }
    };
    let result = (|| -> Result<(), PackError> {
        let f = File::create(&tmp).map_err(io_err(&tmp))?;
        let mut w = BufWriter::with_capacity(8 << 20, f);
        w.write_all(&header).map_err(io_err(&tmp))?;
        let zeros = vec![0u8; ALIGN as usize];
        for (l, p) in layers.iter().enumerate() {
            let Some(p) = p else {
                continue;
            };
            for e in 0..p.n_units {
                for bytes in source_unit(mapped, group, l, e).map_err(bad_model)? {
                    w.write_all(bytes).map_err(io_err(&tmp))?;
                }
                let pad = (p.stride - p.unit_bytes()) as usize;
                w.write_all(&zeros[..pad]).map_err(io_err(&tmp))?;
            }
        }
        let f = w.into_inner().map_err(|e| PackError::Io {
            path: tmp.clone(),
            source: e.into_error(),
        })?;
        f.sync_all().map_err(io_err(&tmp))?;
        std::fs::rename(&tmp, out).map_err(io_err(out))?;
        Ok(())
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(total)
}

/// Opens `path` for reading only if it is a regular file: a FIFO, device, socket or
/// directory (named like a sidecar, by accident or not) is refused with an
/// [`std::io::ErrorKind::InvalidInput`] error saying so, never opened (opening a FIFO
/// blocks until a writer appears). Checked before the open and again on the opened file
/// (opened non-blocking, so a FIFO swapped in between cannot block either).
pub fn open_regular(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let not_regular = || {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file (a directory, FIFO, device or socket)",
        )
    };
    if !std::fs::metadata(path)?.is_file() {
        return Err(not_regular());
    }
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    if !f.metadata()?.is_file() {
        return Err(not_regular());
    }
    Ok(f)
}

impl PackFile {
    /// Opens and checks `path` against the model (its whole file is `mapped`, its data
    /// section starts at `data_offset`, its routed experts are `group`): header, layout and
    /// a sample of the expert data (see the module header). Any difference is an error
    /// naming the sidecar.
    pub fn open(
        path: &Path,
        model: &Path,
        mapped: &[u8],
        data_offset: u64,
        group: &UnitGroup,
    ) -> Result<PackFile, PackError> {
        let model_size = mapped.len() as u64;
        let model_header = mapped.get(..data_offset as usize).unwrap_or(&[]);
        let p = path.to_path_buf();
        let io_err = |source| PackError::Io {
            path: p.clone(),
            source,
        };
        let mut f = match open_regular(path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::InvalidInput => {
                return Err(PackError::NotPack {
                    path: p.clone(),
                    what: e.to_string(),
                })
            }
            Err(e) => return Err(io_err(e)),
        };
        let meta = f.metadata().map_err(io_err)?;
        let file_len = meta.len();
        let mut fixed = [0u8; FIXED];
        if file_len < FIXED as u64 {
            return Err(PackError::NotPack {
                path: p.clone(),
                what: format!("{file_len} bytes, shorter than the {FIXED}-byte header"),
            });
        }
        f.read_exact(&mut fixed).map_err(io_err)?;
        if fixed[0..4] != MAGIC {
            return Err(PackError::NotPack {
                path: p.clone(),
                what: format!("magic {:?}, expected \"SLPK\"", &fixed[0..4]),
            });
        }
        let u32_at = |b: &[u8], o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let u64_at = |b: &[u8], o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        let version = u32_at(&fixed, 4);
        if version != VERSION {
            return Err(PackError::Version {
                path: p.clone(),
                found: version,
            });
        }
        let mismatch = |what: String| PackError::Mismatch {
            path: p.clone(),
            model: model.to_path_buf(),
            what,
        };
        let damaged = |what: String| PackError::Damaged {
            path: p.clone(),
            what,
        };
        let n_packed = u32_at(&fixed, 36) as usize;
        let header_len = u64_at(&fixed, 40);
        let total = u64_at(&fixed, 48);
        if n_packed > 65536
            || header_len < header_len_for(n_packed, 0)
            || header_len > file_len
            || header_len % ALIGN != 0
        {
            return Err(damaged(format!(
                "header length {header_len} for {n_packed} layers"
            )));
        }
        let mut rec = vec![0u8; header_len as usize - FIXED];
        f.seek(SeekFrom::Start(FIXED as u64)).map_err(io_err)?;
        f.read_exact(&mut rec).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                damaged(format!("file of {file_len} bytes ends inside the header"))
            } else {
                io_err(e)
            }
        })?;
        // The records and the unit hashes (their count is known once the records are).
        let n_units: usize = rec[..RECORD * n_packed]
            .chunks_exact(RECORD)
            .map(|r| u32_at(r, 4) as usize)
            .sum();
        if header_len != header_len_for(n_packed, n_units) {
            return Err(damaged(format!(
                "header length {header_len} for {n_packed} layers of {n_units} experts"
            )));
        }
        rec.truncate(RECORD * n_packed + 8 * n_units);
        let mut whole = fixed.to_vec();
        whole[56..64].fill(0);
        whole.extend_from_slice(&rec);
        if fnv1a(&whole) != u64_at(&fixed, 56) {
            return Err(damaged("header checksum does not match".into()));
        }
        if file_len != total {
            return Err(damaged(format!(
                "the header says {total} bytes, the file has {file_len}"
            )));
        }
        let size = u64_at(&fixed, 8);
        if size != model_size {
            return Err(mismatch(format!(
                "packed for a model of {size} bytes, this one has {model_size}"
            )));
        }
        let hl = u64_at(&fixed, 16);
        if hl != model_header.len() as u64 || u64_at(&fixed, 24) != fnv1a(model_header) {
            return Err(mismatch(
                "checksum of the GGUF header and tensor table differs".into(),
            ));
        }
        let n_layer = u32_at(&fixed, 32) as usize;
        if n_layer != group.layers.len() {
            return Err(mismatch(format!(
                "{n_layer} layers in the sidecar, {} in the model",
                group.layers.len()
            )));
        }
        // The layout must be exactly what this build would write for this model.
        let (want, want_total) = plan(group, header_len).map_err(&mismatch)?;
        let mut got: Vec<Option<PackLayer>> = vec![None; n_layer];
        for r in rec[..RECORD * n_packed].chunks_exact(RECORD) {
            let layer = u32_at(r, 0);
            let n_parts = (u32_at(r, 8) as usize).min(MAX_PARTS);
            let entry = PackLayer {
                layer,
                n_units: u32_at(r, 4) as usize,
                base: u64_at(r, 16),
                stride: u64_at(r, 24),
                part_bytes: (0..n_parts).map(|i| u64_at(r, 32 + 8 * i)).collect(),
            };
            match got.get_mut(layer as usize) {
                Some(slot @ None) => *slot = Some(entry),
                _ => return Err(damaged(format!("bad layer record for layer {layer}"))),
            }
        }
        if got != want || want_total != total {
            let l = (0..n_layer).find(|&l| got[l] != want[l]).unwrap_or(0);
            return Err(mismatch(format!(
                "layer {l}: the sidecar's expert layout differs from the model's"
            )));
        }
        // The samples are read from the model file (one small read each) rather than
        // touched through the map, whose fault-in reads ahead far more than 4 KiB.
        let src = File::open(model).ok();
        let sample = sample_hash(
            model_size,
            &mut |a, b| {
                use std::os::unix::fs::FileExt;
                let mut v = vec![0u8; (b - a) as usize];
                match &src {
                    Some(f) => f.read_exact_at(&mut v, a).ok().map(|()| v),
                    None => mapped.get(a as usize..b as usize).map(<[u8]>::to_vec),
                }
            },
            group,
        )
        .map_err(&mismatch)?;
        if sample != u64_at(&fixed, 64) {
            return Err(mismatch(
                "it was packed from other expert data (a sample of the model's experts differs)"
                    .into(),
            ));
        }
        let mut hashes = rec[RECORD * n_packed..]
            .chunks_exact(8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")));
        let unit_hashes = got
            .iter()
            .map(|l| match l {
                Some(l) => hashes.by_ref().take(l.n_units).collect(),
                None => Vec::new(),
            })
            .collect();
        Ok(PackFile {
            path: p,
            layers: got,
            unit_hashes,
        })
    }

    /// Checks the bytes of unit `expert` of `layer` as read from the sidecar (its parts
    /// concatenated) against the hash of the model's bytes recorded at pack time.
    pub fn check_unit(&self, layer: u32, expert: u32, bytes: &[u8]) -> Result<(), PackError> {
        let want = self
            .unit_hashes
            .get(layer as usize)
            .and_then(|h| h.get(expert as usize));
        if want == Some(&unit_hash(bytes)) {
            return Ok(());
        }
        Err(PackError::Unit {
            path: self.path.clone(),
            layer,
            expert,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::groups::{StackedPart, UnitLayer};

    fn group() -> UnitGroup {
        UnitGroup {
            layers: vec![
                None,
                Some(UnitLayer {
                    n_units: 3,
                    parts: vec![
                        StackedPart {
                            name: "a".into(),
                            start: 100,
                            stride: 10,
                            bytes_per_unit: 10,
                        },
                        StackedPart {
                            name: "b".into(),
                            start: 130,
                            stride: 7,
                            bytes_per_unit: 7,
                        },
                    ],
                }),
            ],
        }
    }

    fn model() -> Vec<u8> {
        (0..200u32).map(|i| (i * 7 + 3) as u8).collect()
    }

    #[test]
    fn round_trip_and_refusals() {
        let dir = std::env::temp_dir().join(format!("sluice-pack-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let m = model();
        let g = group();
        let out = dir.join("m.slpack");
        let mp = Path::new("m.gguf");
        let n = write_pack(mp, &m, 50, &g, &out).unwrap();
        assert_eq!(std::fs::metadata(&out).unwrap().len(), n);
        assert!(!dir.join("m.slpack.tmp").exists());
        let pf = PackFile::open(&out, mp, &m, 50, &g).unwrap();
        let l = pf.layers[1].as_ref().unwrap();
        let bytes = std::fs::read(&out).unwrap();
        for e in 0..3 {
            let o = l.offset(e) as usize;
            assert_eq!(o % 4096, 0);
            // Independent oracle: the model's slices, by hand.
            let a = &m[100 + 10 * e..110 + 10 * e];
            let b = &m[130 + 7 * e..137 + 7 * e];
            assert_eq!(&bytes[o..o + 10], a);
            assert_eq!(&bytes[o + 10..o + 17], b);
        }
        // Another model header: refused, naming the sidecar.
        let mut m2 = m.clone();
        m2[3] ^= 1;
        let e = PackFile::open(&out, mp, &m2, 50, &g).unwrap_err();
        assert!(matches!(e, PackError::Mismatch { .. }), "{e}");
        assert!(e.to_string().contains("m.slpack"), "{e}");
        let mut m3 = m.clone();
        m3.push(0);
        let e = PackFile::open(&out, mp, &m3, 50, &g).unwrap_err();
        assert!(matches!(e, PackError::Mismatch { .. }), "{e}");
        // Same header and size, other expert data (sampled at open): refused.
        let mut m4 = m.clone();
        m4[131] ^= 0x10;
        let e = PackFile::open(&out, mp, &m4, 50, &g).unwrap_err();
        assert!(matches!(e, PackError::Mismatch { .. }), "{e}");
        assert!(e.to_string().contains("m.slpack"), "{e}");
        // Unit hashes are the model's bytes' (oracle: the model's slices by hand).
        for e in 0..3 {
            let mut unit = m[100 + 10 * e..110 + 10 * e].to_vec();
            unit.extend_from_slice(&m[130 + 7 * e..137 + 7 * e]);
            assert_eq!(pf.unit_hashes[1][e], xxhash_rust::xxh3::xxh3_64(&unit));
            assert!(pf.check_unit(1, e as u32, &unit).is_ok());
            unit[3] ^= 1;
            let err = pf.check_unit(1, e as u32, &unit).unwrap_err();
            assert!(matches!(err, PackError::Unit { .. }), "{err}");
            assert!(err.to_string().contains("m.slpack"), "{err}");
        }
        // A version-1 sidecar: refused, asking for `sluice pack`.
        let mut v1 = bytes.clone();
        v1[4..8].copy_from_slice(&1u32.to_le_bytes());
        std::fs::write(&out, &v1).unwrap();
        let e = PackFile::open(&out, mp, &m, 50, &g).unwrap_err();
        assert!(matches!(e, PackError::Version { found: 1, .. }), "{e}");
        assert!(e.to_string().contains("sluice pack"), "{e}");
        // Truncated: refused.
        std::fs::write(&out, &bytes[..bytes.len() - 1]).unwrap();
        let e = PackFile::open(&out, mp, &m, 50, &g).unwrap_err();
        assert!(matches!(e, PackError::Damaged { .. }), "{e}");
        std::fs::write(&out, &bytes[..100]).unwrap();
        assert!(PackFile::open(&out, mp, &m, 50, &g).is_err());
        // A failed write leaves nothing behind.
        let bad = dir.join("no-such-dir").join("x.slpack");
        assert!(write_pack(mp, &m, 50, &g, &bad).is_err());
        assert!(!bad.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
