//! Routing traces: which experts the router chose, per token per layer
//! (`--record-routing FILE`), for the offline cache simulator and hot-expert profiles.
//!
//! Owns: the file format (version 1, below), its validating reader ([`RoutingTrace`]) and
//! the writer ([`RoutingRecorder`]: buffered, written under `FILE.tmp`, renamed on
//! `finish`, so a crash never leaves a half file under the real name).
//!
//! Format v1, all integers little-endian:
//! ```text
//! offset size
//!  0     4    magic "SLRT"
//!  4     4    version = 1
//!  8     4    n_layer              1 ..= 4096
//! 12     4    n_expert             1 ..= 65536
//! 16     4    top_k                1 ..= min(n_expert, 256)
//! 20     4    name_len             0 ..= 1024
//! 24     8    n_tokens             sum of the batches' token counts
//! 32     8    n_batches
//! 40     name_len   model name, UTF-8
//! ..     8 x n_layer  expert bytes per layer (one routed expert; 0 = layer without
//!                     routed experts, not recorded; at least one layer is non-zero)
//! then n_batches batches, each:
//!        4    n                    tokens in the batch (>= 1; 1 for decode)
//!        2 x n x n_moe x top_k    expert ids (u16), token-major, then MoE layer in
//!                                 order, then the k ids in router order; the k ids of a
//!                                 layer are distinct and < n_expert
//! nothing after the last batch.
//! ```
//! `n_moe` = number of layers with non-zero expert bytes.

use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use thiserror::Error;

pub const MAGIC: [u8; 4] = *b"SLRT";
pub const VERSION: u32 = 1;
pub const MAX_LAYERS: u32 = 4096;
pub const MAX_EXPERTS: u32 = 65536;
pub const MAX_TOP_K: u32 = 256;
pub const MAX_NAME: u32 = 1024;
const FIXED_HEADER: usize = 40;

#[derive(Debug, Error)]
pub enum TraceError {
    #[error("routing trace {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a sluice routing trace: magic {found:?}, expected \"SLRT\"")]
    BadMagic { path: PathBuf, found: [u8; 4] },
    #[error("routing trace {path}: version {found}, this build reads version {supported}")]
    Version {
        path: PathBuf,
        found: u32,
        supported: u32,
    },
    #[error("routing trace {path}: bad header: {what}")]
    Header { path: PathBuf, what: String },
    #[error(
        "routing trace {path}: truncated at byte {offset}: {what} needs {need} bytes, {have} left"
    )]
    Truncated {
        path: PathBuf,
        offset: u64,
        what: &'static str,
        need: u64,
        have: u64,
    },
    #[error("routing trace {path}: token {token} layer {layer}: expert {expert} out of range (n_expert {n_expert})")]
    BadExpert {
        path: PathBuf,
        token: u64,
        layer: u32,
        expert: u32,
        n_expert: u32,
    },
    #[error("routing trace {path}: token {token} layer {layer}: expert {expert} selected twice")]
    DuplicateExpert {
        path: PathBuf,
        token: u64,
        layer: u32,
        expert: u32,
    },
    #[error("routing trace {path}: {what}: header says {header}, file has {found}")]
    Count {
        path: PathBuf,
        what: &'static str,
        header: u64,
        found: u64,
    },
    #[error(
        "routing trace {path}: {extra} unexpected bytes after the last batch (at byte {offset})"
    )]
    TrailingBytes {
        path: PathBuf,
        offset: u64,
        extra: u64,
    },
    #[error("routing trace {path}: not a regular file (a device, FIFO or directory); a trace is a file written by --record-routing")]
    NotRegular { path: PathBuf },
    #[error("routing trace {path}: the header says {n_tokens} tokens in {n_batches} batches = {expected} bytes, the file has {found} bytes")]
    Size {
        path: PathBuf,
        n_tokens: u64,
        n_batches: u64,
        expected: u128,
        found: u64,
    },
    #[error("routing trace {path} cannot replay on this model: {what}")]
    Geometry { path: PathBuf, what: String },
    #[error("recording routing trace {path}: {what}")]
    Record { path: PathBuf, what: String },
}

/// What a trace says about the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceHeader {
    pub model: String,
    pub n_layer: u32,
    pub n_expert: u32,
    pub top_k: u32,
    /// Bytes of one routed expert (gate + up + down) per layer; 0 = no routed experts.
    pub expert_bytes: Vec<u64>,
}

impl TraceHeader {
    /// Layers with routed experts, in order.
    pub fn moe_layers(&self) -> Vec<u32> {
        (0..self.n_layer)
            .filter(|&l| self.expert_bytes.get(l as usize).is_some_and(|&b| b > 0))
            .collect()
    }

    /// Bytes of all routed experts of the model (what `25%` budgets are a share of).
    pub fn total_expert_bytes(&self) -> u64 {
        self.expert_bytes
            .iter()
            .map(|&b| b.saturating_mul(self.n_expert as u64))
            .fold(0u64, u64::saturating_add)
    }

    /// Ids per token: MoE layers x top_k.
    pub fn ids_per_token(&self) -> usize {
        self.moe_layers().len() * self.top_k as usize
    }

    fn validate(&self, path: &Path) -> Result<(), TraceError> {
        let bad = |what: String| {
            Err(TraceError::Header {
                path: path.to_path_buf(),
                what,
            })
        };
        if self.n_layer == 0 || self.n_layer > MAX_LAYERS {
            return bad(format!("n_layer {} not in 1..={MAX_LAYERS}", self.n_layer));
        }
        if self.n_expert == 0 || self.n_expert > MAX_EXPERTS {
            return bad(format!(
                "n_expert {} not in 1..={MAX_EXPERTS}",
                self.n_expert
            ));
        }
        let kmax = self.n_expert.min(MAX_TOP_K);
        if self.top_k == 0 || self.top_k > kmax {
            return bad(format!("top_k {} not in 1..={kmax}", self.top_k));
        }
        if self.model.len() > MAX_NAME as usize {
            return bad(format!(
                "model name of {} bytes (max {MAX_NAME})",
                self.model.len()
            ));
        }
        if self.expert_bytes.len() != self.n_layer as usize {
            return bad(format!(
                "{} expert sizes for {} layers",
                self.expert_bytes.len(),
                self.n_layer
            ));
        }
        if let Some((l, b)) = self
            .expert_bytes
            .iter()
            .enumerate()
            .find(|(_, &b)| b > 1 << 40)
        {
            return bad(format!("layer {l}: expert of {b} bytes (max 1 TiB)"));
        }
        if self.expert_bytes.iter().all(|&b| b == 0) {
            return bad("no layer has routed experts (all expert sizes are 0)".into());
        }
        Ok(())
    }

    fn encode(&self, n_tokens: u64, n_batches: u64) -> Vec<u8> {
        let mut v =
            Vec::with_capacity(FIXED_HEADER + self.model.len() + 8 * self.expert_bytes.len());
        v.extend_from_slice(&MAGIC);
        for x in [
            VERSION,
            self.n_layer,
            self.n_expert,
            self.top_k,
            self.model.len() as u32,
        ] {
            v.extend_from_slice(&x.to_le_bytes());
        }
        v.extend_from_slice(&n_tokens.to_le_bytes());
        v.extend_from_slice(&n_batches.to_le_bytes());
        v.extend_from_slice(self.model.as_bytes());
        for b in &self.expert_bytes {
            v.extend_from_slice(&b.to_le_bytes());
        }
        v
    }
}

/// A whole routing trace in memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutingTrace {
    pub header: TraceHeader,
    /// Tokens per batch, in order (1 for decode steps).
    pub batches: Vec<u32>,
    /// `n_tokens x ids_per_token` expert ids, token-major.
    ids: Vec<u16>,
    per_token: usize,
}

struct Cursor<'a> {
    b: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl Cursor<'_> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&[u8], TraceError> {
        let have = self.b.len() - self.pos;
        if have < n {
            return Err(TraceError::Truncated {
                path: self.path.to_path_buf(),
                offset: self.pos as u64,
                what,
                need: n as u64,
                have: have as u64,
            });
        }
        let s = &self.b[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, TraceError> {
        let s = self.take(4, what)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }
    fn u64(&mut self, what: &'static str) -> Result<u64, TraceError> {
        let s = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        Ok(u64::from_le_bytes(a))
    }
}

impl RoutingTrace {
    /// Reads and validates a trace file. Only a regular file is read, and only after its
    /// header is checked and the size it implies (header + batches) matches the file's: a
    /// device, a FIFO or a file whose header lies is refused before its body is read, so
    /// memory stays bounded by a size the header vouches for.
    pub fn read(path: &Path) -> Result<RoutingTrace, TraceError> {
        let io = |source| TraceError::Io {
            path: path.to_path_buf(),
            source,
        };
        let md = std::fs::metadata(path).map_err(io)?;
        if !md.is_file() {
            return Err(TraceError::NotRegular {
                path: path.to_path_buf(),
            });
        }
        let len = md.len();
        let file = File::open(path).map_err(io)?;
        let max_header = (FIXED_HEADER + MAX_NAME as usize + 8 * MAX_LAYERS as usize) as u64;
        let mut head = Vec::new();
        (&file)
            .take(max_header.min(len))
            .read_to_end(&mut head)
            .map_err(io)?;
        let mut c = Cursor {
            b: &head,
            pos: 0,
            path,
        };
        let (header, n_tokens, n_batches) = Self::parse_header(&mut c)?;
        let per_token = (header.moe_layers().len() * header.top_k as usize) as u128;
        let expected = c.pos as u128 + 4 * n_batches as u128 + 2 * per_token * n_tokens as u128;
        if expected != len as u128 {
            return Err(TraceError::Size {
                path: path.to_path_buf(),
                n_tokens,
                n_batches,
                expected,
                found: len,
            });
        }
        let mut bytes = Vec::with_capacity(len as usize);
        (&file)
            .seek(SeekFrom::Start(0))
            .and_then(|_| (&file).take(len).read_to_end(&mut bytes))
            .map_err(io)?;
        Self::parse(&bytes, path)
    }

    /// The header: (header, n_tokens, n_batches); `c` is left after it.
    fn parse_header(c: &mut Cursor<'_>) -> Result<(TraceHeader, u64, u64), TraceError> {
        let path = c.path;
        let magic = c.take(4, "magic")?;
        if magic != MAGIC {
            return Err(TraceError::BadMagic {
                path: path.to_path_buf(),
                found: [magic[0], magic[1], magic[2], magic[3]],
            });
        }
        let version = c.u32("version")?;
        if version != VERSION {
            return Err(TraceError::Version {
                path: path.to_path_buf(),
                found: version,
                supported: VERSION,
            });
        }
        let n_layer = c.u32("n_layer")?;
        let n_expert = c.u32("n_expert")?;
        let top_k = c.u32("top_k")?;
        let name_len = c.u32("name_len")?;
        let n_tokens = c.u64("n_tokens")?;
        let n_batches = c.u64("n_batches")?;
        let header_err = |what: String| TraceError::Header {
            path: path.to_path_buf(),
            what,
        };
        if name_len > MAX_NAME {
            return Err(header_err(format!(
                "model name of {name_len} bytes (max {MAX_NAME})"
            )));
        }
        if n_layer == 0 || n_layer > MAX_LAYERS {
            return Err(header_err(format!(
                "n_layer {n_layer} not in 1..={MAX_LAYERS}"
            )));
        }
        let model = std::str::from_utf8(c.take(name_len as usize, "model name")?)
            .map_err(|_| header_err("model name is not UTF-8".into()))?
            .to_string();
        let mut expert_bytes = Vec::with_capacity(n_layer as usize);
        for _ in 0..n_layer {
            expert_bytes.push(c.u64("expert bytes per layer")?);
        }
        let header = TraceHeader {
            model,
            n_layer,
            n_expert,
            top_k,
            expert_bytes,
        };
        header.validate(path)?;
        Ok((header, n_tokens, n_batches))
    }

    /// Parses and validates trace bytes (`path` only names the source in errors).
    pub fn parse(bytes: &[u8], path: &Path) -> Result<RoutingTrace, TraceError> {
        let mut c = Cursor {
            b: bytes,
            pos: 0,
            path,
        };
        let (header, n_tokens, n_batches) = Self::parse_header(&mut c)?;
        let header_err = |what: String| TraceError::Header {
            path: path.to_path_buf(),
            what,
        };
        let (n_expert, top_k) = (header.n_expert, header.top_k);
        let moe = header.moe_layers();
        let per_token = moe.len() * top_k as usize;
        let k = top_k as usize;
        let mut batches = Vec::new();
        let mut ids: Vec<u16> = Vec::with_capacity((bytes.len() - c.pos) / 2);
        let mut seen = vec![u64::MAX; n_expert as usize];
        let mut token = 0u64;
        while c.pos < bytes.len() {
            if batches.len() as u64 == n_batches {
                return Err(TraceError::TrailingBytes {
                    path: path.to_path_buf(),
                    offset: c.pos as u64,
                    extra: (bytes.len() - c.pos) as u64,
                });
            }
            let n = c.u32("batch token count")?;
            if n == 0 {
                return Err(header_err(format!("batch {} has 0 tokens", batches.len())));
            }
            let need = (n as usize).saturating_mul(per_token * 2);
            let data = c.take(need, "batch expert ids")?;
            for t in 0..n as usize {
                for (li, &layer) in moe.iter().enumerate() {
                    let base = (t * per_token + li * k) * 2;
                    // `seen[e] == stamp` marks e as already chosen in this (token, layer).
                    let stamp = token * moe.len() as u64 + li as u64;
                    for j in 0..k {
                        let o = base + 2 * j;
                        let e = u16::from_le_bytes([data[o], data[o + 1]]);
                        let eu = e as u32;
                        if eu >= n_expert {
                            return Err(TraceError::BadExpert {
                                path: path.to_path_buf(),
                                token,
                                layer,
                                expert: eu,
                                n_expert,
                            });
                        }
                        if seen[e as usize] == stamp {
                            return Err(TraceError::DuplicateExpert {
                                path: path.to_path_buf(),
                                token,
                                layer,
                                expert: eu,
                            });
                        }
                        seen[e as usize] = stamp;
                        ids.push(e);
                    }
                }
                token += 1;
            }
            batches.push(n);
        }
        if batches.len() as u64 != n_batches {
            return Err(TraceError::Count {
                path: path.to_path_buf(),
                what: "batches",
                header: n_batches,
                found: batches.len() as u64,
            });
        }
        if token != n_tokens {
            return Err(TraceError::Count {
                path: path.to_path_buf(),
                what: "tokens",
                header: n_tokens,
                found: token,
            });
        }
        Ok(RoutingTrace {
            header,
            batches,
            ids,
            per_token,
        })
    }

    pub fn n_tokens(&self) -> usize {
        self.ids.len().checked_div(self.per_token).unwrap_or(0)
    }

    /// Expert ids of token `t`: MoE layer by layer, `top_k` each.
    pub fn token(&self, t: usize) -> &[u16] {
        &self.ids[t * self.per_token..(t + 1) * self.per_token]
    }

    /// The trace without its first `n` tokens (a batch cut in two keeps its tail), or
    /// `None` if that leaves nothing.
    pub fn skip_tokens(&self, n: usize) -> Option<RoutingTrace> {
        if n >= self.n_tokens() {
            return None;
        }
        let mut batches = Vec::new();
        let mut at = 0usize;
        for &b in &self.batches {
            let end = at + b as usize;
            if end > n {
                batches.push((end - at.max(n)) as u32);
            }
            at = end;
        }
        Some(RoutingTrace {
            header: self.header.clone(),
            batches,
            ids: self.ids[n * self.per_token..].to_vec(),
            per_token: self.per_token,
        })
    }

    /// Serializes to the v1 file format.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = self
            .header
            .encode(self.n_tokens() as u64, self.batches.len() as u64);
        let mut t = 0;
        for &n in &self.batches {
            v.extend_from_slice(&n.to_le_bytes());
            for id in &self.ids[t * self.per_token..(t + n as usize) * self.per_token] {
                v.extend_from_slice(&id.to_le_bytes());
            }
            t += n as usize;
        }
        v
    }

    /// Builds a trace from per-token ids (`tokens[t]` = MoE layer by layer, top_k each),
    /// one decode batch per token. Validates like the reader.
    pub fn from_tokens(header: TraceHeader, tokens: &[Vec<u16>]) -> Result<Self, TraceError> {
        let mut bytes = header.encode(tokens.len() as u64, tokens.len() as u64);
        for t in tokens {
            bytes.extend_from_slice(&1u32.to_le_bytes());
            for id in t {
                bytes.extend_from_slice(&id.to_le_bytes());
            }
        }
        Self::parse(&bytes, Path::new("<memory>"))
    }
}

/// Writes a routing trace while the engine runs. Per batch: `begin_batch(n)`, then
/// `record_layer` once for each MoE layer (any order), then `end_batch()`; `finish()`
/// patches the counts, syncs and renames `FILE.tmp` to `FILE`.
pub struct RoutingRecorder {
    dest: PathBuf,
    tmp: PathBuf,
    out: BufWriter<File>,
    header: TraceHeader,
    moe: Vec<u32>,
    batch: Vec<u16>,
    batch_tokens: u32,
    done: Vec<bool>,
    n_tokens: u64,
    n_batches: u64,
    /// Renamed into place: the temporary file is no longer ours to remove.
    finished: bool,
}

impl Drop for RoutingRecorder {
    /// A recorder dropped without `finish` (the run failed) removes its temporary file.
    fn drop(&mut self) {
        if !self.finished {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

impl RoutingRecorder {
    pub fn create(path: &Path, header: TraceHeader) -> Result<Self, TraceError> {
        header.validate(path)?;
        if std::fs::metadata(path).is_ok_and(|m| !m.is_file()) {
            return Err(TraceError::Record {
                path: path.to_path_buf(),
                what: "exists and is not a regular file (a directory or device)".into(),
            });
        }
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        let io = |source| TraceError::Io {
            path: tmp.clone(),
            source,
        };
        let mut out = BufWriter::new(File::create(&tmp).map_err(io)?);
        out.write_all(&header.encode(0, 0)).map_err(io)?;
        let moe = header.moe_layers();
        Ok(RoutingRecorder {
            dest: path.to_path_buf(),
            tmp,
            out,
            done: vec![false; moe.len()],
            moe,
            header,
            batch: Vec::new(),
            batch_tokens: 0,
            n_tokens: 0,
            n_batches: 0,
            finished: false,
        })
    }

    fn err(&self, what: String) -> TraceError {
        TraceError::Record {
            path: self.dest.clone(),
            what,
        }
    }

    /// Starts a batch of `n_tokens` tokens (1 for a decode step).
    pub fn begin_batch(&mut self, n_tokens: u32) -> Result<(), TraceError> {
        if self.batch_tokens != 0 {
            return Err(self.err("begin_batch before the previous batch ended".into()));
        }
        if n_tokens == 0 {
            return Err(self.err("a batch of 0 tokens".into()));
        }
        self.batch_tokens = n_tokens;
        self.batch.clear();
        self.batch.resize(
            n_tokens as usize * self.moe.len() * self.header.top_k as usize,
            0,
        );
        self.done.fill(false);
        Ok(())
    }

    /// The router's choices for `layer`: `n_tokens x top_k` ids, token-major.
    pub fn record_layer(&mut self, layer: u32, experts: &[u32]) -> Result<(), TraceError> {
        let k = self.header.top_k as usize;
        let n = self.batch_tokens as usize;
        let Some(li) = self.moe.iter().position(|&l| l == layer) else {
            return Err(self.err(format!("layer {layer} has no routed experts")));
        };
        if n == 0 {
            return Err(self.err("record_layer outside a batch".into()));
        }
        if self.done[li] {
            return Err(self.err(format!("layer {layer} recorded twice in one batch")));
        }
        if experts.len() != n * k {
            return Err(self.err(format!(
                "layer {layer}: {} ids for {n} tokens x top_k {k}",
                experts.len()
            )));
        }
        let per_token = self.moe.len() * k;
        for t in 0..n {
            let sel = &experts[t * k..(t + 1) * k];
            for (j, &e) in sel.iter().enumerate() {
                if e >= self.header.n_expert || sel[..j].contains(&e) {
                    return Err(self.err(format!(
                        "layer {layer}: expert {e} out of range or repeated (n_expert {})",
                        self.header.n_expert
                    )));
                }
                self.batch[t * per_token + li * k + j] = e as u16;
            }
        }
        self.done[li] = true;
        Ok(())
    }

    /// Ends the batch (every MoE layer must have been recorded) and writes it.
    pub fn end_batch(&mut self) -> Result<(), TraceError> {
        if self.batch_tokens == 0 {
            return Err(self.err("end_batch outside a batch".into()));
        }
        if let Some(li) = self.done.iter().position(|d| !d) {
            return Err(self.err(format!("batch ended without layer {}", self.moe[li])));
        }
        let io = |source| TraceError::Io {
            path: self.tmp.clone(),
            source,
        };
        self.out
            .write_all(&self.batch_tokens.to_le_bytes())
            .map_err(io)?;
        for id in &self.batch {
            self.out.write_all(&id.to_le_bytes()).map_err(io)?;
        }
        self.n_tokens += self.batch_tokens as u64;
        self.n_batches += 1;
        self.batch_tokens = 0;
        Ok(())
    }

    /// One decode token: `per_layer[i]` = the top_k ids of the i-th MoE layer.
    pub fn record_token(&mut self, per_layer: &[&[u32]]) -> Result<(), TraceError> {
        if per_layer.len() != self.moe.len() {
            return Err(self.err(format!(
                "{} layers given, the model has {} MoE layers",
                per_layer.len(),
                self.moe.len()
            )));
        }
        self.begin_batch(1)?;
        for (i, ids) in per_layer.iter().enumerate() {
            self.record_layer(self.moe[i], ids)?;
        }
        self.end_batch()
    }

    /// Writes the counts, syncs, renames to the final name; returns it. A batch still
    /// open is dropped.
    pub fn finish(mut self) -> Result<PathBuf, TraceError> {
        let tmp = self.tmp.clone();
        let io = |source| TraceError::Io {
            path: tmp.clone(),
            source,
        };
        self.out.flush().map_err(io)?;
        let f = self.out.get_mut();
        f.seek(SeekFrom::Start(24)).map_err(io)?;
        f.write_all(&self.n_tokens.to_le_bytes()).map_err(io)?;
        f.write_all(&self.n_batches.to_le_bytes()).map_err(io)?;
        f.sync_all().map_err(io)?;
        std::fs::rename(&tmp, &self.dest).map_err(|source| TraceError::Io {
            path: self.dest.clone(),
            source,
        })?;
        self.finished = true;
        Ok(self.dest.clone())
    }
}
