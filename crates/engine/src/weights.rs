//! Resident weights in RAM: the bytes every token reads, moved out of the page cache into
//! anonymous huge-page memory at load (`--weight-load copy`, the default on the CPU).
//!
//! Owns: [`WeightLoad`] (the choice) and [`copy_resident`]: which ranges (what the compute
//! reads through the memory map: with streaming, everything outside the streamable groups;
//! without, the whole data section except row tables read through their own reader),
//! whether they fit (without streaming the copy must leave the KV caches and a reserve in
//! MemAvailable; with streaming the memory plan already counted them as resident, and they
//! stay locked), and the note saying what happened. The bytes and their addresses do not
//! change, so neither do the logits (`crates/engine/tests/weight_load.rs`).
//!
//! Why: through the file map a decode walks 4 KiB page-cache pages (see
//! `sluice_io`'s `anon.rs` for the measurement: 1.1-1.25x decode on Zen 3).

use std::ops::Range;
use std::time::Instant;

use sluice_models::Model;

use crate::load::human;

/// How the weights the compute reads through the memory map are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightLoad {
    /// Copied at load into anonymous memory with transparent huge pages, when they fit
    /// (otherwise left in the map, with a note saying why).
    #[default]
    Copy,
    /// Read through the memory map (page cache), as llama.cpp's default does.
    Map,
}

impl WeightLoad {
    pub fn label(self) -> &'static str {
        match self {
            WeightLoad::Copy => "copy",
            WeightLoad::Map => "mmap",
        }
    }
}

impl std::fmt::Display for WeightLoad {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

impl std::str::FromStr for WeightLoad {
    type Err = String;
    fn from_str(s: &str) -> Result<WeightLoad, String> {
        match s {
            "copy" => Ok(WeightLoad::Copy),
            "mmap" | "map" => Ok(WeightLoad::Map),
            _ => Err(format!("{s:?}: expected copy or mmap")),
        }
    }
}

/// Byte ranges of the file the compute reads through the map: the data section minus
/// the streamed expert groups (when `streaming`) and minus `elsewhere` (row tables with
/// their own reader).
fn map_read_ranges(model: &Model, streaming: bool, elsewhere: &[Range<u64>]) -> Vec<Range<u64>> {
    let (start, end) = (model.gguf.data_offset, model.gguf.file_size);
    let mut skip: Vec<Range<u64>> = elsewhere.to_vec();
    if streaming {
        skip.extend(model.groups.expert_ranges());
    }
    skip.sort_by_key(|r| r.start);
    let mut out = Vec::new();
    let mut pos = start;
    for r in skip {
        if r.start > pos {
            out.push(pos..r.start.min(end));
        }
        pos = pos.max(r.end);
    }
    if pos < end {
        out.push(pos..end);
    }
    out.retain(|r| r.start < r.end);
    out
}

/// Copy what the compute reads through the map into RAM (see the module header); returns
/// the note. `available` is MemAvailable now and `kv` what the KV caches and state will
/// take; without streaming the copy is skipped when it would leave less than a reserve
/// of 10% (at least 1 GiB) of `available`.
pub(crate) fn copy_resident(
    model: &mut Model,
    streaming: bool,
    elsewhere: &[Range<u64>],
    available: u64,
    kv: u64,
) -> String {
    let ranges = map_read_ranges(model, streaming, elsewhere);
    let bytes: u64 = ranges.iter().map(|r| r.end - r.start).sum();
    let reserve = (available / 10).max(1 << 30);
    if !streaming && bytes.saturating_add(kv).saturating_add(reserve) > available {
        return format!(
            "weights: {} read through the memory map (copying them into RAM would leave less than {} of the {} available; --expert-cache streams the experts instead)",
            human(bytes),
            human(reserve),
            human(available)
        );
    }
    let t0 = Instant::now();
    let usize_ranges: Vec<Range<usize>> = ranges
        .iter()
        .map(|r| r.start as usize..r.end as usize)
        .collect();
    let result = model.map.copy_into_ram(&usize_ranges);
    if streaming {
        // The moved pages are new memory: lock them as `lock_resident` locked the old.
        for r in &usize_ranges {
            let _ = model.map.lock(r.clone());
        }
    }
    match result {
        Ok(moved) => format!(
            "weights: {} copied into RAM (huge pages) in {:.2} s",
            human(moved),
            t0.elapsed().as_secs_f64()
        ),
        Err(e) => format!(
            "weights: {} of {} copied into RAM, the rest read through the memory map ({e})",
            human(model.map.copied_bytes()),
            human(bytes)
        ),
    }
}
