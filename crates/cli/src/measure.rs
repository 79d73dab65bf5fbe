//! `--measure`: honest decode numbers on Linux (the seeds' measure mode).
//!
//! Owns: dropping the model's expert pages from the page cache at decode start and every N
//! tokens (`posix_fadvise DONTNEED`), reporting page-cache residency before and after,
//! true storage reads (`/proc/self/io` read_bytes and the block device's sector counter),
//! the time spent invalidating, and the corrected rate tokens / (decode time -
//! invalidation time). Without `--measure` none of this runs.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use sluice_engine::Model;
use sluice_io::{pagecache, MappedFile};

/// Counters of one measured decode.
pub struct Measure<'m> {
    map: &'m MappedFile,
    path: PathBuf,
    ranges: Vec<Range<u64>>,
    every: usize,
    invalidate: Duration,
    invalidations: u64,
    resident_before: (u64, u64),
    resident_after_drop: (u64, u64),
    proc_io_start: Option<u64>,
    blk_start: Option<u64>,
    since_drop: usize,
}

/// What the measured decode did, ready to print.
pub struct MeasureReport {
    pub tokens: usize,
    pub decode_secs: f64,
    pub invalidate_secs: f64,
    pub invalidations: u64,
    pub resident_before: (u64, u64),
    pub resident_after_drop: (u64, u64),
    pub resident_end: (u64, u64),
    pub proc_io_read: Option<u64>,
    pub block_read: Option<u64>,
}

impl MeasureReport {
    /// tokens / (decode time - invalidation time)
    pub fn corrected_rate(&self) -> f64 {
        self.tokens as f64 / (self.decode_secs - self.invalidate_secs).max(1e-9)
    }

    pub fn print(&self) {
        let pct = |r: (u64, u64)| 100.0 * r.0 as f64 / r.1.max(1) as f64;
        eprintln!(
            "measure: expert pages resident {:.1}% before decode, {:.1}% after the drop, {:.1}% at the end",
            pct(self.resident_before),
            pct(self.resident_after_drop),
            pct(self.resident_end)
        );
        let gb =
            |v: Option<u64>| v.map_or("n/a".to_string(), |b| format!("{:.3} GB", b as f64 * 1e-9));
        eprintln!(
            "measure: storage reads during decode: /proc/self/io {} | block device {} (the device counter includes other processes)",
            gb(self.proc_io_read),
            gb(self.block_read)
        );
        eprintln!(
            "measure: {} invalidations during decode took {:.3} s of {:.3} s; raw {:.2} tok/s, corrected {:.2} tok/s",
            self.invalidations,
            self.invalidate_secs,
            self.decode_secs,
            self.tokens as f64 / self.decode_secs.max(1e-9),
            self.corrected_rate()
        );
    }
}

/// The file ranges `--measure` invalidates: the routed experts, or the whole file for a
/// dense model (whose weights are then all read through the page cache). Touching ranges
/// are merged and each is rounded inward to whole pages: with `--expert-cache` the
/// resident tensors around them are locked in RAM page by page, and a locked page cannot
/// be dropped (madvise fails with EINVAL), so a page shared with one is left alone.
pub fn expert_ranges(model: &Model) -> Vec<Range<u64>> {
    let v = model.groups.expert_ranges();
    if v.is_empty() {
        std::iter::once(0..model.gguf.file_size).collect()
    } else {
        inward_pages(v, pagecache::page_size())
    }
}

/// Sort and merge touching ranges, then round each inward to multiples of `page`
/// (ranges left empty are dropped).
fn inward_pages(mut v: Vec<Range<u64>>, page: u64) -> Vec<Range<u64>> {
    v.sort_by_key(|r| r.start);
    let mut merged: Vec<Range<u64>> = Vec::with_capacity(v.len());
    for r in v {
        match merged.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => merged.push(r),
        }
    }
    merged
        .into_iter()
        .map(|r| r.start.div_ceil(page) * page..r.end / page * page)
        .filter(|r| r.start < r.end)
        .collect()
}

fn residency(path: &Path, ranges: &[Range<u64>]) -> (u64, u64) {
    ranges.iter().fold((0, 0), |acc, r| {
        match pagecache::residency(path, r.clone()) {
            Ok((a, b)) => (acc.0 + a, acc.1 + b),
            Err(_) => acc,
        }
    })
}

impl<'m> Measure<'m> {
    /// Record residency, drop the ranges from the page cache, and snapshot the counters.
    pub fn start(
        map: &'m MappedFile,
        ranges: Vec<Range<u64>>,
        every: usize,
    ) -> Result<Measure<'m>> {
        let path = map.path();
        let resident_before = residency(path, &ranges);
        let mut m = Measure {
            map,
            path: path.to_path_buf(),
            ranges,
            every,
            invalidate: Duration::ZERO,
            invalidations: 0,
            resident_before,
            resident_after_drop: (0, 0),
            proc_io_start: None,
            blk_start: None,
            since_drop: 0,
        };
        m.drop_now()?;
        // The drop before decode starts is not part of decode time: count only later ones.
        m.invalidate = Duration::ZERO;
        m.invalidations = 0;
        m.resident_after_drop = residency(path, &m.ranges);
        m.proc_io_start = pagecache::proc_self_io_read_bytes().ok();
        m.blk_start = pagecache::block_device_read_bytes(path).ok();
        Ok(m)
    }

    fn drop_now(&mut self) -> Result<()> {
        for r in &self.ranges {
            self.invalidate += self
                .map
                .evict(r.start as usize..r.end as usize)
                .with_context(|| {
                    format!(
                        "--measure: cannot drop {} from the page cache",
                        self.path.display()
                    )
                })?;
        }
        self.invalidations += 1;
        self.since_drop = 0;
        Ok(())
    }

    /// One more token decoded: invalidate again every `every` tokens.
    pub fn token(&mut self) -> Result<()> {
        self.since_drop += 1;
        if self.every > 0 && self.since_drop >= self.every {
            self.drop_now()?;
        }
        Ok(())
    }

    /// Stop measuring: `tokens` decoded in `decode_secs` (including invalidations).
    pub fn finish(&self, tokens: usize, decode_secs: f64) -> MeasureReport {
        let proc_io = pagecache::proc_self_io_read_bytes().ok();
        let blk = pagecache::block_device_read_bytes(&self.path).ok();
        MeasureReport {
            tokens,
            decode_secs,
            invalidate_secs: self.invalidate.as_secs_f64(),
            invalidations: self.invalidations,
            resident_before: self.resident_before,
            resident_after_drop: self.resident_after_drop,
            resident_end: residency(&self.path, &self.ranges),
            proc_io_read: proc_io
                .zip(self.proc_io_start)
                .map(|(a, b)| a.saturating_sub(b)),
            block_read: blk.zip(self.blk_start).map(|(a, b)| a.saturating_sub(b)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::inward_pages;

    #[test]
    fn ranges_merge_and_round_inward() {
        let v = inward_pages(vec![5000..9000, 100..5000, 9000..20000, 30000..30100], 4096);
        assert_eq!(v, vec![4096..16384]);
    }
}
