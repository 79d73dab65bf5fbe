//! `sluice inspect FILE [--json]`: what is in a GGUF file, read from its header only.
//! `sluice inspect FILE --dump-tensor NAME --output OUT.npy`: one tensor dequantized to f32.
//!
//! Owns: the metadata summary (long arrays abbreviated), the tensor table and the split of
//! tensor bytes by role (routed experts, per-layer embedding tables, embeddings/output,
//! resident), as text or as one JSON object; the tensor dump (`.npy`, written atomically).

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use sluice_gguf::{GgufFile, MetaValue, TensorInfo};

/// Arguments of `sluice inspect`.
#[derive(clap::Args)]
pub struct Args {
    /// The GGUF file.
    pub file: PathBuf,
    /// Print one JSON object instead of text.
    #[arg(long, conflicts_with = "dump_tensor")]
    pub json: bool,
    /// Dequantize this tensor to float32 and write it as a NumPy `.npy` file (needs
    /// `--output`), in its logical shape: row-major, the outer dimensions first.
    #[arg(long, value_name = "NAME", requires = "output")]
    pub dump_tensor: Option<String>,
    /// Where `--dump-tensor` writes the `.npy` file (replaced atomically).
    #[arg(long, value_name = "OUT.npy", requires = "dump_tensor")]
    pub output: Option<PathBuf>,
}

/// Arrays longer than this are abbreviated.
const ARRAY_SHOWN_FULL: usize = 8;
/// Elements shown of an abbreviated array.
const ARRAY_HEAD: usize = 3;
/// Characters shown of a long string.
const STRING_SHOWN: usize = 60;

/// What a tensor's bytes are for, as far as memory planning goes.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Role {
    /// `blk.N.ffn_{gate,up,down}_exps.weight`: streamed from SSD.
    RoutedExperts,
    /// Per-layer embedding tables (`per_layer_token_embd`, n-gram / PLE tables).
    Ple,
    /// `token_embd.weight`, `output.weight`.
    Embeddings,
    /// Everything else: always in RAM.
    Resident,
}

impl Role {
    const ALL: [Role; 4] = [
        Role::RoutedExperts,
        Role::Ple,
        Role::Embeddings,
        Role::Resident,
    ];

    fn key(self) -> &'static str {
        match self {
            Role::RoutedExperts => "routed_experts",
            Role::Ple => "ple",
            Role::Embeddings => "embeddings",
            Role::Resident => "resident",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Role::RoutedExperts => "routed experts",
            Role::Ple => "PLE tables",
            Role::Embeddings => "embeddings/output",
            Role::Resident => "resident",
        }
    }
}

/// The layer of a routed-expert tensor name `blk.N.ffn_{gate,up,down}_exps.weight`.
fn expert_layer(name: &str) -> Option<u64> {
    let rest = name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer = layer.parse().ok()?;
    matches!(
        rest,
        "ffn_gate_exps.weight" | "ffn_up_exps.weight" | "ffn_down_exps.weight"
    )
    .then_some(layer)
}

/// The role of a tensor, from its name.
pub fn role_of(name: &str) -> Role {
    if expert_layer(name).is_some() {
        return Role::RoutedExperts;
    }
    let is_ple = name.contains("per_layer_token_embd")
        || name.contains("ngram")
        || name.split(['.', '_']).any(|part| part == "ple");
    if is_ple {
        Role::Ple
    } else if name == "token_embd.weight" || name == "output.weight" {
        Role::Embeddings
    } else {
        Role::Resident
    }
}

/// Expert count and bytes of one expert (gate+up+down slices of one layer).
struct Experts {
    count: u64,
    one_expert_bytes: u64,
    layers: u64,
}

fn experts(f: &GgufFile) -> Result<Option<Experts>> {
    let stacked: Vec<(&TensorInfo, u64)> = f
        .tensors
        .iter()
        .filter_map(|t| Some((t, expert_layer(&t.name)?)))
        .collect();
    let Some(&(first, layer)) = stacked.first() else {
        return Ok(None);
    };
    let mut one = 0;
    for (t, l) in &stacked {
        if *l == layer {
            let r = f.expert_range(t, 0)?;
            one += r.end - r.start;
        }
    }
    let mut layers: Vec<u64> = stacked.iter().map(|&(_, l)| l).collect();
    layers.sort_unstable();
    layers.dedup();
    Ok(Some(Experts {
        count: first.dims.get(2).copied().unwrap_or(0),
        one_expert_bytes: one,
        layers: layers.len() as u64,
    }))
}

fn short_str(s: &str) -> String {
    if s.chars().count() <= STRING_SHOWN {
        format!("{s:?}")
    } else {
        let head: String = s.chars().take(STRING_SHOWN).collect();
        format!("{head:?}... ({} bytes)", s.len())
    }
}

/// One-line text form of a value, long arrays abbreviated.
fn value_text(v: &MetaValue) -> String {
    match v {
        MetaValue::Str(s) => short_str(s),
        MetaValue::Array(a) => {
            let n = a.values.len();
            let shown = if n > ARRAY_SHOWN_FULL { ARRAY_HEAD } else { n };
            let mut items: Vec<String> = a.values[..shown].iter().map(value_text).collect();
            if shown < n {
                items.push("...".to_string());
            }
            let ty = match a.elem_type.name() {
                "string" => "strings".to_string(),
                "array" => "arrays".to_string(),
                t => t.to_string(),
            };
            format!("[{n} {ty}: {}]", items.join(", "))
        }
        MetaValue::F32(x) => format!("{x}"),
        MetaValue::F64(x) => format!("{x}"),
        MetaValue::Bool(b) => format!("{b}"),
        other => other
            .as_i64()
            .map(|i| i.to_string())
            .or_else(|| other.as_u64().map(|u| u.to_string()))
            .unwrap_or_default(),
    }
}

/// JSON form of a value, long arrays abbreviated to their head.
fn value_json(v: &MetaValue) -> Value {
    match v {
        MetaValue::Str(s) if s.chars().count() > STRING_SHOWN => {
            json!({ "len": s.len(), "head": s.chars().take(STRING_SHOWN).collect::<String>() })
        }
        MetaValue::Str(s) => json!(s),
        MetaValue::Array(a) => {
            let n = a.values.len();
            let shown = if n > ARRAY_SHOWN_FULL { ARRAY_HEAD } else { n };
            json!({
                "elem_type": a.elem_type.name(),
                "len": n,
                "values": a.values[..shown].iter().map(value_json).collect::<Vec<_>>(),
                "abbreviated": shown < n,
            })
        }
        MetaValue::F32(x) => json!(x),
        MetaValue::F64(x) => json!(x),
        MetaValue::Bool(b) => json!(b),
        other => other
            .as_i64()
            .map(|i| json!(i))
            .or_else(|| other.as_u64().map(|u| json!(u)))
            .unwrap_or(Value::Null),
    }
}

fn human(bytes: u64) -> String {
    crate::common::human_with(bytes, 1)
}

fn pct(part: u64, total: u64) -> f64 {
    if total == 0 {
        0.0
    } else {
        100.0 * part as f64 / total as f64
    }
}

/// Edit distance between two names (bytes), for "did you mean" suggestions.
fn edit_distance(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    let mut cur = vec![0; b.len() + 1];
    for (i, &ca) in a.iter().enumerate() {
        cur[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        std::mem::swap(&mut prev, &mut cur);
    }
    prev[b.len()]
}

/// Up to 3 tensor names close to `name`: nearest by edit distance (within a third of the
/// longer name), or else names containing `name`.
pub fn close_names<'a>(name: &str, names: impl Iterator<Item = &'a str>) -> Vec<&'a str> {
    let names: Vec<&str> = names.collect();
    let mut scored: Vec<(usize, &str)> = names
        .iter()
        .map(|&n| (edit_distance(name, n), n))
        .filter(|&(d, n)| d <= name.len().max(n.len()).div_ceil(3))
        .collect();
    scored.sort();
    let mut out: Vec<&str> = scored.into_iter().map(|(_, n)| n).take(3).collect();
    if out.is_empty() && !name.is_empty() {
        out = names
            .into_iter()
            .filter(|n| n.contains(name))
            .take(3)
            .collect();
    }
    out
}

/// The `.npy` (format 1.0) header of a little-endian f32 C-order array of `shape`.
pub fn npy_header(shape: &[u64]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_txt = if dims.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let mut dict = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_txt}, }}");
    // magic (6) + version (2) + header length (2) + dict + padding + '\n' = multiple of 64.
    let unpadded = 10 + dict.len() + 1;
    dict.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
    dict.push('\n');
    let mut h = b"\x93NUMPY\x01\x00".to_vec();
    h.extend_from_slice(&(dict.len() as u16).to_le_bytes());
    h.extend_from_slice(dict.as_bytes());
    h
}

/// Rows dequantized per read of the tensor (bounded memory for large tensors).
const DUMP_CHUNK_BYTES: u64 = 8 << 20;

/// Write tensor `name` of `f` dequantized to f32 as `.npy` at `out` (temp file + rename).
fn dump_tensor(f: &GgufFile, name: &str, out: &Path) -> Result<()> {
    let Some(t) = f.tensor(name) else {
        let close = close_names(name, f.tensors.iter().map(|t| t.name.as_str()));
        if close.is_empty() {
            bail!(
                "no tensor named '{name}' in {} ({} tensors; `sluice inspect FILE` lists them)",
                f.path.display(),
                f.tensors.len()
            );
        }
        bail!(
            "no tensor named '{name}' in {}; did you mean {}?",
            f.path.display(),
            close
                .iter()
                .map(|n| format!("'{n}'"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    };
    if !sluice_kernels::is_supported(t.ty) {
        bail!(
            "tensor '{name}' has type {}, which --dump-tensor cannot dequantize (supported: the \
             float and quantized weight types sluice runs)",
            t.ty.name()
        );
    }
    let cols = t.dims.first().copied().unwrap_or(1) as usize;
    let n_rows = t.n_rows();
    let row_bytes = t.row_bytes();
    if row_bytes == 0 || row_bytes * n_rows != t.n_bytes {
        bail!(
            "tensor '{name}' ({} {:?}) has no whole-block rows",
            t.ty.name(),
            t.dims
        );
    }
    let shape: Vec<u64> = t.dims.iter().rev().copied().collect();
    let range = f.tensor_range(t);
    let mut src =
        std::fs::File::open(&f.path).with_context(|| format!("opening {}", f.path.display()))?;
    src.seek(SeekFrom::Start(range.start))
        .with_context(|| format!("seeking to tensor '{name}' in {}", f.path.display()))?;

    let file_name = out
        .file_name()
        .with_context(|| format!("--output {} is not a file path", out.display()))?;
    let tmp = out.with_file_name(format!(
        ".{}.tmp.{}",
        file_name.to_string_lossy(),
        std::process::id()
    ));
    let mut write = || -> Result<()> {
        let file =
            std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
        w.write_all(&npy_header(&shape))?;
        let rows_per_chunk = (DUMP_CHUNK_BYTES / row_bytes).max(1);
        let mut raw = Vec::new();
        let mut vals = Vec::new();
        let mut bytes = Vec::new();
        let mut done = 0;
        while done < n_rows {
            let rows = rows_per_chunk.min(n_rows - done);
            raw.resize((rows * row_bytes) as usize, 0);
            src.read_exact(&mut raw)
                .with_context(|| format!("reading tensor '{name}' from {}", f.path.display()))?;
            vals.resize(rows as usize * cols, 0.0f32);
            for (r, v) in raw
                .chunks_exact(row_bytes as usize)
                .zip(vals.chunks_exact_mut(cols))
            {
                sluice_kernels::dequantize_row(t.ty, r, v)?;
            }
            bytes.clear();
            bytes.extend(vals.iter().flat_map(|x| x.to_le_bytes()));
            w.write_all(&bytes)?;
            done += rows;
        }
        let file = w.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        Ok(())
    };
    if let Err(e) = write() {
        let _ = std::fs::remove_file(&tmp);
        return Err(e.context(format!("writing {}", out.display())));
    }
    std::fs::rename(&tmp, out)
        .with_context(|| format!("renaming {} to {}", tmp.display(), out.display()))?;
    eprintln!(
        "wrote {name} ({} {:?} -> float32 {:?}) to {}",
        t.ty.name(),
        t.dims,
        shape,
        out.display()
    );
    Ok(())
}

/// Run `sluice inspect`.
pub fn run(args: Args) -> Result<()> {
    let f = GgufFile::open(&args.file)?;
    if let (Some(name), Some(out)) = (&args.dump_tensor, &args.output) {
        return dump_tensor(&f, name, out);
    }
    let total: u64 = f.tensors.iter().map(|t| t.n_bytes).sum();
    let mut by_role = [0u64; 4];
    let mut n_by_role = [0u64; 4];
    for t in &f.tensors {
        let i = Role::ALL
            .iter()
            .position(|&r| r == role_of(&t.name))
            .unwrap_or(3);
        by_role[i] += t.n_bytes;
        n_by_role[i] += 1;
    }
    let experts = experts(&f)?;
    let arch = f.architecture().ok();

    if args.json {
        let mut roles = serde_json::Map::new();
        for (i, r) in Role::ALL.iter().enumerate() {
            roles.insert(
                r.key().to_string(),
                json!({ "bytes": by_role[i], "tensors": n_by_role[i], "percent": pct(by_role[i], total) }),
            );
        }
        let out = json!({
            "file": f.path.display().to_string(),
            "architecture": arch,
            "file_size": f.file_size,
            "version": f.version,
            "alignment": f.alignment,
            "data_offset": f.data_offset,
            "tensor_bytes": total,
            "metadata": f.metadata.iter().map(|(k, v)| json!({
                "key": k, "type": v.meta_type().name(), "value": value_json(v),
            })).collect::<Vec<_>>(),
            "tensors": f.tensors.iter().map(|t| json!({
                "name": t.name, "type": t.ty.name(), "dims": t.dims,
                "offset": f.tensor_range(t).start, "bytes": t.n_bytes, "role": role_of(&t.name).key(),
            })).collect::<Vec<_>>(),
            "roles": roles,
            "experts": experts.as_ref().map(|e| json!({
                "count": e.count, "layers": e.layers, "one_expert_bytes": e.one_expert_bytes,
            })),
        });
        crate::common::emit(&format!("{out}\n"))?;
        return Ok(());
    }

    let mut s = String::new();
    use std::fmt::Write as _;
    let _ = writeln!(s, "file:          {}", f.path.display());
    let _ = writeln!(s, "architecture:  {}", arch.unwrap_or("(none)"));
    let _ = writeln!(
        s,
        "size:          {} bytes ({}), GGUF v{}, alignment {}, data section at {}",
        f.file_size,
        human(f.file_size),
        f.version,
        f.alignment,
        f.data_offset
    );
    let _ = writeln!(s, "\nmetadata ({} keys):", f.metadata.len());
    for (k, v) in &f.metadata {
        let _ = writeln!(s, "  {k} = {}", value_text(v));
    }
    let name_w = f
        .tensors
        .iter()
        .map(|t| t.name.len())
        .max()
        .unwrap_or(4)
        .max(4);
    let _ = writeln!(s, "\ntensors ({}, {} bytes):", f.tensors.len(), total);
    let _ = writeln!(
        s,
        "  {:name_w$}  {:7}  {:24}  {:>14}  {:>12}",
        "name", "type", "shape", "file offset", "bytes"
    );
    for t in &f.tensors {
        let shape = format!("{:?}", t.dims);
        let _ = writeln!(
            s,
            "  {:name_w$}  {:7}  {:24}  {:>14}  {:>12}",
            t.name,
            t.ty.name(),
            shape,
            f.tensor_range(t).start,
            t.n_bytes
        );
    }
    let _ = writeln!(s, "\nbytes by role (of {} tensor bytes):", total);
    for (i, r) in Role::ALL.iter().enumerate() {
        let _ = writeln!(
            s,
            "  {:18} {:>14} bytes {:>10} {:5.1}%  ({} tensors)",
            r.label(),
            by_role[i],
            human(by_role[i]),
            pct(by_role[i], total),
            n_by_role[i]
        );
    }
    match &experts {
        Some(e) => {
            let _ = writeln!(
                s,
                "  experts: {} per layer in {} layers; one expert (gate+up+down of one layer) = {} bytes ({})",
                e.count,
                e.layers,
                e.one_expert_bytes,
                human(e.one_expert_bytes)
            );
        }
        None => {
            let _ = writeln!(s, "  experts: none (dense model)");
        }
    }
    crate::common::emit(&s)?;
    Ok(())
}
