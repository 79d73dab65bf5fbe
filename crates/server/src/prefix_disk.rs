//! Session snapshots kept on disk, so prefix reuse survives a restart (`--prefix-cache-dir`).
//!
//! Owns: [`DiskCache`] (the directory's index, lookups, loading a file back into a
//! [`Snapshot`], crash-safe writes, the directory's size bound) and the file format.
//! Not owned: which snapshots are taken (the scheduler takes them at message boundaries,
//! as for the RAM cache in `prefix`) and their byte form (`sluice_models::state_codec`).
//!
//! One file per snapshot, `<model id>-<tokens hash>.slpc`, little-endian:
//!
//! ```text
//! offset  size  field
//! 0       8     magic "SLPREFIX"
//! 8       4     format version (1)
//! 12      4     reserved (0)
//! 16      8     model id: xxh3-64 of the GGUF's size, header bytes, 64 samples of its
//!               tensor data and the KV precision (see `model_id`)
//! 24      8     n: prompt tokens the snapshot holds
//! 32      8     m: bytes of the encoded snapshot
//! 40      4n    the tokens
//! 40+4n   m     the snapshot (`Snapshot::encode`)
//! end-4   4     crc32 of every byte before it
//! ```
//!
//! A write goes to a temporary file in the directory, is synced, then renamed over the
//! final name (and the directory synced), so a crash leaves either the old state or the
//! new file, never half a file under a final name. At start the directory is scanned
//! (headers and tokens only); the whole file's checksum is checked when a snapshot is
//! loaded. A file that is damaged, truncated, of another format version or of another
//! model is ignored with one line on stderr and never used, so it cannot change an
//! answer; damaged files are removed. The size bound counts every `.slpc` file in the
//! directory (another model's too): the least recently used go first.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use sluice_engine::{Model, SeqState, Snapshot};

const MAGIC: &[u8; 8] = b"SLPREFIX";
const VERSION: u32 = 1;
const HEADER: usize = 40;
const EXT: &str = "slpc";

/// The identity snapshots are keyed by: the model file (size, header, sampled tensor
/// bytes) and the KV precision (a snapshot taken with f16 rows must not be restored into
/// a sequence that keeps f32 rows). Reads the header and 64 pages of the mapped file.
pub fn model_id(model: &Model, kv_f32: bool) -> u64 {
    let bytes = model.map.bytes();
    let g = &model.gguf;
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(b"sluice prefix cache model id v1");
    h.update(&g.file_size.to_le_bytes());
    h.update(&[kv_f32 as u8]);
    let header_end = (g.data_offset as usize).min(bytes.len());
    h.update(&bytes[..header_end]);
    // 64 evenly spaced 4 KiB samples of the tensor data: a file rewritten with other
    // weights but the same header is another model.
    const SAMPLES: usize = 64;
    const PAGE: usize = 4096;
    let data = &bytes[header_end..];
    if !data.is_empty() {
        for i in 0..SAMPLES {
            let at = (data.len() - 1) / (SAMPLES - 1).max(1) * i;
            let at = at.min(data.len() - 1);
            h.update(&data[at..(at + PAGE).min(data.len())]);
        }
    }
    h.digest()
}

/// Why a cache file is not used.
fn ignored(path: &Path, why: &str) {
    eprintln!(
        "prefix cache: {}: ignored ({why}); computing instead",
        path.display()
    );
}

struct DiskEntry {
    path: PathBuf,
    bytes: u64,
    /// Larger = used more recently.
    used: u64,
    /// The prompt tokens the snapshot holds, when it is this model's.
    tokens: Option<Arc<Vec<u32>>>,
}

struct Index {
    entries: Vec<DiskEntry>,
    bytes: u64,
    clock: u64,
}

/// A snapshot waiting to be written (taken during a job, written after its answer).
struct Pending {
    tokens: Vec<u32>,
    snap: Arc<Snapshot>,
}

/// The on-disk prefix cache of one model.
pub struct DiskCache {
    dir: PathBuf,
    bound: u64,
    model_id: u64,
    index: Mutex<Index>,
    pending: Mutex<Vec<Pending>>,
    /// Files written and loaded (for tests and logs).
    pub writes: std::sync::atomic::AtomicU64,
    pub loads: std::sync::atomic::AtomicU64,
}

/// What a lookup found on disk.
pub struct DiskFound {
    pub tokens: Arc<Vec<u32>>,
    path: PathBuf,
}

/// The header fields.
struct Header {
    model_id: u64,
    n_tokens: u64,
    payload: u64,
}

fn parse_header(h: &[u8; HEADER]) -> Result<Header, String> {
    if &h[..8] != MAGIC {
        return Err("not a sluice prefix cache file (bad magic)".into());
    }
    let u32_at = |o: usize| u32::from_le_bytes(h[o..o + 4].try_into().expect("4 bytes"));
    let u64_at = |o: usize| u64::from_le_bytes(h[o..o + 8].try_into().expect("8 bytes"));
    let version = u32_at(8);
    if version != VERSION {
        return Err(format!(
            "format version {version}, this sluice reads {VERSION}"
        ));
    }
    Ok(Header {
        model_id: u64_at(16),
        n_tokens: u64_at(24),
        payload: u64_at(32),
    })
}

/// Total file size the header announces, if it does not overflow.
fn expected_size(h: &Header) -> Option<u64> {
    h.n_tokens
        .checked_mul(4)?
        .checked_add(h.payload)?
        .checked_add(HEADER as u64 + 4)
}

fn tokens_of(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect()
}

/// Header and tokens of `path` (the checksum is checked only when the snapshot is loaded).
fn scan_file(path: &Path, len: u64) -> Result<(Header, Vec<u32>), String> {
    let mut f = File::open(path).map_err(|e| format!("cannot open: {e}"))?;
    let mut h = [0u8; HEADER];
    f.read_exact(&mut h)
        .map_err(|_| format!("truncated: {len} bytes, shorter than the header"))?;
    let hd = parse_header(&h)?;
    let want = expected_size(&hd).ok_or("header sizes overflow")?;
    if want != len {
        return Err(format!(
            "truncated or damaged: {len} bytes, the header says {want}"
        ));
    }
    let mut t = vec![0u8; hd.n_tokens as usize * 4];
    f.read_exact(&mut t)
        .map_err(|e| format!("cannot read: {e}"))?;
    Ok((hd, tokens_of(&t)))
}

impl DiskCache {
    /// Open (creating it if needed) `dir` for the model `model_id`, keeping at most
    /// `bound` bytes of cache files; scans what is already there.
    pub fn open(dir: &Path, bound: u64, model_id: u64) -> Result<DiskCache, String> {
        fs::create_dir_all(dir)
            .map_err(|e| format!("--prefix-cache-dir {}: cannot create: {e}", dir.display()))?;
        let rd = fs::read_dir(dir)
            .map_err(|e| format!("--prefix-cache-dir {}: cannot read: {e}", dir.display()))?;
        let mut found = Vec::new();
        for ent in rd.flatten() {
            let path = ent.path();
            let name = ent.file_name().to_string_lossy().into_owned();
            let Ok(meta) = fs::symlink_metadata(&path) else {
                continue;
            };
            if name.starts_with(".tmp-") && meta.is_file() {
                // A write that never finished (a crash between create and rename); one
                // younger than an hour may be another server's write in progress.
                let old = meta
                    .modified()
                    .ok()
                    .and_then(|t| t.elapsed().ok())
                    .is_some_and(|age| age > std::time::Duration::from_secs(3600));
                if old {
                    let _ = fs::remove_file(&path);
                }
                continue;
            }
            if !meta.is_file() || path.extension().and_then(|e| e.to_str()) != Some(EXT) {
                continue;
            }
            let mtime = meta
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map(|d| d.as_nanos())
                .unwrap_or(0);
            match scan_file(&path, meta.len()) {
                Ok((h, tokens)) => {
                    let mine = h.model_id == model_id;
                    if !mine {
                        ignored(&path, "written for another model file or KV precision");
                    }
                    found.push((mtime, path, meta.len(), mine.then(|| Arc::new(tokens))));
                }
                Err(why) => {
                    ignored(&path, &why);
                    let _ = fs::remove_file(&path);
                }
            }
        }
        // Oldest first: their `used` ranks below everything written from now on.
        found.sort_by_key(|(mtime, ..)| *mtime);
        let mut index = Index {
            entries: Vec::new(),
            bytes: 0,
            clock: 0,
        };
        for (_, path, bytes, tokens) in found {
            index.clock += 1;
            index.bytes += bytes;
            index.entries.push(DiskEntry {
                path,
                bytes,
                used: index.clock,
                tokens,
            });
        }
        let cache = DiskCache {
            dir: dir.to_path_buf(),
            bound,
            model_id,
            index: Mutex::new(index),
            pending: Mutex::new(Vec::new()),
            writes: Default::default(),
            loads: Default::default(),
        };
        // A smaller bound than last time: shrink now.
        cache.evict_to(&mut cache.lock(), 0);
        Ok(cache)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The size bound in bytes.
    pub fn bound(&self) -> u64 {
        self.bound
    }

    /// Bytes of cache files in the directory (as this process counts them).
    pub fn bytes(&self) -> u64 {
        self.lock().bytes
    }

    /// This model's snapshots on disk.
    pub fn len(&self) -> usize {
        self.lock()
            .entries
            .iter()
            .filter(|e| e.tokens.is_some())
            .count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// For `/metrics`: bytes, this model's files, the bound, files written, loaded.
    pub fn gauges(&self) -> [u64; 5] {
        use std::sync::atomic::Ordering::Relaxed;
        [
            self.bytes(),
            self.len() as u64,
            self.bound,
            self.writes.load(Relaxed),
            self.loads.load(Relaxed),
        ]
    }

    /// Whether a snapshot of exactly these tokens is on disk (or waiting to be written).
    pub fn contains(&self, tokens: &[u32]) -> bool {
        let on_disk = self
            .lock()
            .entries
            .iter()
            .any(|e| e.tokens.as_deref().map(|t| t.as_slice()) == Some(tokens));
        on_disk
            || self
                .pending
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .any(|p| p.tokens == tokens)
    }

    /// Whether a snapshot of about `bytes` could be kept within the bound.
    pub fn fits(&self, bytes: u64) -> bool {
        bytes > 0 && bytes < self.bound
    }

    /// The longest snapshot on disk whose tokens are a prefix of `prompt`, longer than
    /// `longer_than` tokens and at most `max_len`.
    pub fn lookup(&self, prompt: &[u32], longer_than: usize, max_len: usize) -> Option<DiskFound> {
        let idx = self.lock();
        idx.entries
            .iter()
            .filter_map(|e| Some((e, e.tokens.as_ref()?)))
            .filter(|(_, t)| t.len() > longer_than && t.len() <= max_len && prompt.starts_with(t))
            .max_by_key(|(_, t)| t.len())
            .map(|(e, t)| DiskFound {
                tokens: t.clone(),
                path: e.path.clone(),
            })
    }

    /// Read `found` back into `fresh` (a new sequence state of this model, made with the
    /// server's context and KV precision). Any problem (a damaged, truncated or foreign
    /// file) is said in one line, the file is dropped from the cache, and None returned.
    pub fn load(&self, found: &DiskFound, fresh: &mut SeqState) -> Option<()> {
        match self.read_into(found, fresh) {
            Ok(()) => {
                let mut idx = self.lock();
                idx.clock += 1;
                let clock = idx.clock;
                if let Some(e) = idx.entries.iter_mut().find(|e| e.path == found.path) {
                    e.used = clock;
                }
                // The file's time records the use, so the order survives a restart.
                if let Ok(f) = File::options().write(true).open(&found.path) {
                    let _ = f.set_modified(std::time::SystemTime::now());
                }
                self.loads
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Some(())
            }
            Err(why) => {
                ignored(&found.path, &why);
                fresh.clear();
                let _ = fs::remove_file(&found.path);
                let mut idx = self.lock();
                if let Some(i) = idx.entries.iter().position(|e| e.path == found.path) {
                    let e = idx.entries.swap_remove(i);
                    idx.bytes -= e.bytes;
                }
                None
            }
        }
    }

    fn read_into(&self, found: &DiskFound, fresh: &mut SeqState) -> Result<(), String> {
        let mut buf = Vec::new();
        File::open(&found.path)
            .and_then(|mut f| f.read_to_end(&mut buf))
            .map_err(|e| format!("cannot read: {e}"))?;
        if buf.len() < HEADER + 4 {
            return Err(format!("truncated: {} bytes", buf.len()));
        }
        let (body, crc) = buf.split_at(buf.len() - 4);
        let stored = u32::from_le_bytes(crc.try_into().expect("4 bytes"));
        let computed = crc32fast::hash(body);
        if stored != computed {
            return Err(format!(
                "checksum mismatch: stored {stored:08x}, computed {computed:08x}"
            ));
        }
        let h = parse_header(body[..HEADER].try_into().expect("header"))?;
        if h.model_id != self.model_id {
            return Err("written for another model file or KV precision".into());
        }
        if expected_size(&h) != Some(buf.len() as u64) {
            return Err("the header's sizes do not match the file".into());
        }
        let t_end = HEADER + h.n_tokens as usize * 4;
        if tokens_of(&body[HEADER..t_end]) != *found.tokens {
            return Err("the tokens changed since the directory was scanned".into());
        }
        fresh
            .decode_snapshot(&body[t_end..])
            .map_err(|e| format!("snapshot: {e}"))
    }

    /// Keep `snap` (of `tokens`) to be written by [`DiskCache::flush`].
    pub fn queue(&self, tokens: Vec<u32>, snap: Arc<Snapshot>) {
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Pending { tokens, snap });
    }

    /// Write every queued snapshot (called by a worker once its answer is sent, so the
    /// write never delays a token). Errors are said on stderr; the server goes on.
    pub fn flush(&self) {
        loop {
            let next = self.pending.lock().unwrap_or_else(|e| e.into_inner()).pop();
            let Some(p) = next else { return };
            if let Err(e) = self.write(&p.tokens, &p.snap) {
                eprintln!("prefix cache: {}: not written: {e}", self.dir.display());
            }
        }
    }

    fn write(&self, tokens: &[u32], snap: &Snapshot) -> Result<(), String> {
        if self
            .lock()
            .entries
            .iter()
            .any(|e| e.tokens.as_deref().map(|t| t.as_slice()) == Some(tokens))
        {
            return Ok(());
        }
        let mut buf = Vec::with_capacity(HEADER + tokens.len() * 4);
        buf.extend_from_slice(MAGIC);
        buf.extend_from_slice(&VERSION.to_le_bytes());
        buf.extend_from_slice(&0u32.to_le_bytes());
        buf.extend_from_slice(&self.model_id.to_le_bytes());
        buf.extend_from_slice(&(tokens.len() as u64).to_le_bytes());
        buf.extend_from_slice(&0u64.to_le_bytes()); // payload size, set below
        for t in tokens {
            buf.extend_from_slice(&t.to_le_bytes());
        }
        let start = buf.len();
        if !snap.encode(&mut buf) {
            // A device backend's state (`--gpu`): kept in RAM only.
            return Ok(());
        }
        let payload = (buf.len() - start) as u64;
        buf[32..40].copy_from_slice(&payload.to_le_bytes());
        let crc = crc32fast::hash(&buf);
        buf.extend_from_slice(&crc.to_le_bytes());
        let size = buf.len() as u64;
        if size > self.bound {
            return Ok(());
        }
        let th = xxhash_rust::xxh3::xxh3_64(bytemuck_tokens(tokens).as_slice());
        let name = format!("{:016x}-{th:016x}.{EXT}", self.model_id);
        let path = self.dir.join(&name);
        let tmp = self.dir.join(format!(".tmp-{}-{name}", std::process::id()));
        let r = (|| {
            let mut f = File::create(&tmp)?;
            f.write_all(&buf)?;
            f.sync_all()?;
            drop(f);
            fs::rename(&tmp, &path)?;
            // The rename itself is durable once the directory is synced.
            File::open(&self.dir)?.sync_all()
        })();
        if let Err(e) = r {
            let _ = fs::remove_file(&tmp);
            return Err(format!("{}: {e}", path.display()));
        }
        let mut idx = self.lock();
        idx.clock += 1;
        let used = idx.clock;
        idx.bytes += size;
        idx.entries.push(DiskEntry {
            path: path.clone(),
            bytes: size,
            used,
            tokens: Some(Arc::new(tokens.to_vec())),
        });
        self.evict_to(&mut idx, 0);
        self.writes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Remove least recently used files until the directory holds at most
    /// `bound - room` bytes.
    fn evict_to(&self, idx: &mut Index, room: u64) {
        while idx.bytes + room > self.bound && !idx.entries.is_empty() {
            let (i, _) = idx
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.used)
                .expect("not empty");
            let e = idx.entries.swap_remove(i);
            idx.bytes -= e.bytes;
            if let Err(err) = fs::remove_file(&e.path) {
                if err.kind() != std::io::ErrorKind::NotFound {
                    eprintln!("prefix cache: {}: cannot remove: {err}", e.path.display());
                }
            }
        }
    }
}

/// Tokens as bytes (little-endian), for the file name's hash.
fn bytemuck_tokens(tokens: &[u32]) -> Vec<u8> {
    tokens.iter().flat_map(|t| t.to_le_bytes()).collect()
}
