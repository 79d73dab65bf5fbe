//! Evaluation helpers: perplexity the way llama.cpp's `llama-perplexity` computes it, and
//! `--dump-logits` files.
//!
//! Owns: chunking a token stream for perplexity, scoring the second half of each chunk,
//! and writing logits as `.npy` (float32) atomically (temporary name, then rename).

use std::io::Write;
use std::path::Path;

use sluice_models::Logits;

use crate::session::Session;
use crate::EngineError;

/// Result of a perplexity run.
#[derive(Debug, Clone)]
pub struct Perplexity {
    /// Running estimate after each chunk (what llama.cpp prints as `[i]value`).
    pub per_chunk: Vec<f64>,
    /// Final estimate: exp(total NLL / scored tokens).
    pub ppl: f64,
    /// Tokens scored.
    pub scored: usize,
}

/// Perplexity of `tokens` in chunks of `n_ctx`, as llama.cpp does it: each chunk starts
/// with BOS (replacing its first token) when `bos` is given, is evaluated from an empty
/// sequence, and only the predictions for its second half are scored. The session sets the
/// prefill chunk size and KV precision; its context must hold `n_ctx` positions.
/// `progress(i, n, estimate)` is called after each chunk.
pub fn perplexity(
    session: &mut Session<'_>,
    tokens: &[u32],
    n_ctx: usize,
    bos: Option<u32>,
    mut progress: impl FnMut(usize, usize, f64),
) -> Result<Perplexity, EngineError> {
    let n_vocab = session.model().cfg.n_vocab;
    let n_chunk = tokens.len() / n_ctx;
    let first = n_ctx / 2;
    let mut nll = 0.0f64;
    let mut count = 0usize;
    let mut per_chunk = Vec::with_capacity(n_chunk);
    for c in 0..n_chunk {
        let start = c * n_ctx;
        let mut chunk = tokens[start..start + n_ctx].to_vec();
        if let Some(b) = bos {
            chunk[0] = b;
        }
        session.reset();
        let logits = session.prefill(&chunk, Logits::All)?;
        for j in first..n_ctx - 1 {
            let row = &logits[j * n_vocab..(j + 1) * n_vocab];
            let target = tokens[start + j + 1] as usize;
            nll -= log_softmax_at(row, target);
            count += 1;
        }
        let est = (nll / count as f64).exp();
        per_chunk.push(est);
        progress(c + 1, n_chunk, est);
    }
    let ppl = if count > 0 {
        (nll / count as f64).exp()
    } else {
        f64::NAN
    };
    Ok(Perplexity {
        per_chunk,
        ppl,
        scored: count,
    })
}

/// log(softmax(row)[i]) computed in f64.
pub fn log_softmax_at(row: &[f32], i: usize) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
    row[i] as f64 - max - sum.ln()
}

/// Write `data` (`rows x cols` float32, row-major) to `path` as a NumPy `.npy` file,
/// through a temporary file renamed into place so a failed run leaves nothing half-written.
pub fn write_npy_f32(path: &Path, data: &[f32], rows: usize, cols: usize) -> std::io::Result<()> {
    assert_eq!(data.len(), rows * cols, "npy shape does not match the data");
    let mut header =
        format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({rows}, {cols}), }}");
    // magic(6) + version(2) + header length(2) + header + '\n' must be a multiple of 64.
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - unpadded % 64) % 64));
    header.push('\n');
    let tmp = path.with_extension("npy.tmp");
    let result = (|| {
        let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
        f.write_all(b"\x93NUMPY\x01\x00")?;
        f.write_all(&(header.len() as u16).to_le_bytes())?;
        f.write_all(header.as_bytes())?;
        for v in data {
            f.write_all(&v.to_le_bytes())?;
        }
        f.into_inner().map_err(|e| e.into_error())?.sync_all()
    })();
    match result {
        Ok(()) => std::fs::rename(&tmp, path),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// Read a float32 `.npy` file written by NumPy or [`write_npy_f32`]: returns (data, shape).
/// Only little-endian float32 C-order arrays are accepted.
pub fn read_npy_f32(path: &Path) -> Result<(Vec<f32>, Vec<usize>), String> {
    let b = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let bad = |what: &str| format!("{}: not a float32 .npy file: {what}", path.display());
    if b.len() < 10 || &b[..6] != b"\x93NUMPY" {
        return Err(bad("bad magic"));
    }
    let (hl, start) = match b[6] {
        1 => (u16::from_le_bytes([b[8], b[9]]) as usize, 10),
        2 | 3 if b.len() >= 12 => (u32::from_le_bytes([b[8], b[9], b[10], b[11]]) as usize, 12),
        _ => return Err(bad("unknown version")),
    };
    let header = b
        .get(start..start + hl)
        .and_then(|h| std::str::from_utf8(h).ok())
        .ok_or_else(|| bad("truncated header"))?;
    if !header.contains("'<f4'") || header.contains("'fortran_order': True") {
        return Err(bad(
            "only little-endian float32 C-order arrays are supported",
        ));
    }
    let shape_txt = header
        .split("'shape':")
        .nth(1)
        .and_then(|s| s.split(')').next())
        .ok_or_else(|| bad("no shape"))?;
    let shape: Vec<usize> = shape_txt
        .trim()
        .trim_start_matches('(')
        .split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| s.trim().parse::<usize>().map_err(|_| bad("bad shape")))
        .collect::<Result<_, _>>()?;
    let n: usize = shape.iter().product();
    let data = &b[start + hl..];
    if data.len() != n * 4 {
        return Err(bad(&format!("{} data bytes for {n} floats", data.len())));
    }
    let v = data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Ok((v, shape))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_matches_hand_computation() {
        // softmax([0, ln 3]) = [1/4, 3/4]
        let row = [0.0f32, 3.0f32.ln()];
        assert!((log_softmax_at(&row, 0) - 0.25f64.ln()).abs() < 1e-6);
        assert!((log_softmax_at(&row, 1) - 0.75f64.ln()).abs() < 1e-6);
    }

    #[test]
    fn npy_header_is_aligned_and_data_follows() {
        let dir = std::env::temp_dir().join(format!("sluice-npy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("x.npy");
        write_npy_f32(&p, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 2, 3).unwrap();
        let b = std::fs::read(&p).unwrap();
        assert_eq!(&b[..6], b"\x93NUMPY");
        let hl = u16::from_le_bytes([b[8], b[9]]) as usize;
        assert_eq!((10 + hl) % 64, 0);
        let header = std::str::from_utf8(&b[10..10 + hl]).unwrap();
        assert!(header.contains("'shape': (2, 3)"));
        assert_eq!(b.len(), 10 + hl + 24);
        assert_eq!(
            f32::from_le_bytes(b[10 + hl + 20..].try_into().unwrap()),
            6.0
        );
        let (data, shape) = read_npy_f32(&p).unwrap();
        assert_eq!(shape, vec![2, 3]);
        assert_eq!(data, vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
