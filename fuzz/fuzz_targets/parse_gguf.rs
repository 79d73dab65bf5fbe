//! Fuzz target: `GgufFile::parse` on arbitrary bytes must return Ok or Err, never panic,
//! abort or over-allocate; whatever it accepts must survive the writer round trip.

#![no_main]

use libfuzzer_sys::fuzz_target;
use sluice_gguf::{GgufFile, GgufWriter};

fuzz_target!(|data: &[u8]| {
    let path = std::path::Path::new("fuzz.gguf");
    let Ok(f) = GgufFile::parse(data, path) else {
        return;
    };
    // Accepted files: every query is total, and rewriting gives a file the reader accepts
    // with the same header.
    for t in &f.tensors {
        let r = f.tensor_range(t);
        assert!(r.end <= f.file_size);
        let _ = f.rows_range(t, 0..t.n_rows());
        let _ = f.expert_range(t, 0);
    }
    let mut src = std::io::Cursor::new(data);
    let out = GgufWriter::rewrite(&f, &mut src, Vec::new(), path).expect("rewrite of a valid file");
    let g = GgufFile::parse(&out, path).expect("rewritten file parses");
    assert_eq!(g.metadata.len(), f.metadata.len());
    assert_eq!(g.tensors.len(), f.tensors.len());
});
