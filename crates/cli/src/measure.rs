//! `--measure`: honest decode numbers on Linux (the seeds' measure mode).
//!
//! Owns: dropping the model's expert pages from the page cache at decode start and every N
//! tokens (`posix_fadvise DONTNEED`), reporting page-cache residency before and after,
//! true storage reads (`/proc/self/io` read_bytes and the block device's sector counter),
//! the time spent invalidating, and the corrected rate tokens / (decode time -
//! invalidation time). When dropping cannot work or did not (the file is on tmpfs or
//! ramfs, whose pages are the file itself; or most pages stayed resident after the drop)
//! it says so and reports the raw rate only: a "corrected" rate would correct nothing.
//! Without `--measure` none of this runs.

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
    /// Why dropping the pages had no effect (None: it did).
    pub ineffective: Option<String>,
}

impl MeasureReport {
    /// tokens / (decode time - invalidation time)
    pub fn corrected_rate(&self) -> f64 {
        self.tokens as f64 / (self.decode_secs - self.invalidate_secs).max(1e-9)
    }

    /// tokens / decode time
    pub fn raw_rate(&self) -> f64 {
        self.tokens as f64 / self.decode_secs.max(1e-9)
    }

    /// The rate to report: corrected when the drop worked, raw when it had no effect.
    pub fn rate(&self) -> f64 {
        match self.ineffective {
            None => self.corrected_rate(),
            Some(_) => self.raw_rate(),
        }
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
        match &self.ineffective {
            None => eprintln!(
                "measure: {} invalidations during decode took {:.3} s of {:.3} s; raw {:.2} tok/s, corrected {:.2} tok/s",
                self.invalidations,
                self.invalidate_secs,
                self.decode_secs,
                self.raw_rate(),
                self.corrected_rate()
            ),
            Some(why) => eprintln!(
                "measure: dropping the pages had no effect ({why}): these are warm-cache numbers, not storage reads; raw {:.2} tok/s in {:.3} s, no corrected rate",
                self.raw_rate(),
                self.decode_secs
            ),
        }
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

/// The file system type holding `path` according to `/proc/self/mountinfo` text: the
/// deepest mount point above it (the last one mounted there when several are).
fn fs_type_in(mountinfo: &str, path: &Path) -> Option<String> {
    // Mount points escape space, tab, newline and backslash as \ooo octal.
    let unescape = |s: &str| -> String {
        let b = s.as_bytes();
        let mut out = Vec::with_capacity(b.len());
        let mut i = 0;
        while i < b.len() {
            let oct = b
                .get(i + 1..i + 4)
                .filter(|d| d[0] <= b'3' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
            match (b[i], oct) {
                (b'\\', Some(d)) => {
                    out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                    i += 4;
                }
                (c, _) => {
                    out.push(c);
                    i += 1;
                }
            }
        }
        String::from_utf8_lossy(&out).into_owned()
    };
    let mut best: Option<(usize, String)> = None;
    for line in mountinfo.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let (Some(mount), Some(fstype)) = (
            left.split_whitespace().nth(4),
            right.split_whitespace().next(),
        ) else {
            continue;
        };
        let mount = unescape(mount);
        if path.starts_with(&mount) && best.as_ref().is_none_or(|(n, _)| mount.len() >= *n) {
            best = Some((mount.len(), fstype.to_string()));
        }
    }
    best.map(|(_, t)| t)
}

/// Why dropping the pages of `path` cannot work or did not: a file system whose pages
/// are the file (tmpfs, ramfs), or more than half the pages still resident after the
/// drop (`after`: resident, total).
fn ineffective(fs_type: Option<&str>, path: &Path, after: (u64, u64)) -> Option<String> {
    if let Some(t @ ("tmpfs" | "ramfs")) = fs_type {
        return Some(format!(
            "{} is on {t}: its pages live only in RAM and cannot be dropped",
            path.display()
        ));
    }
    if after.1 > 0 && after.0 * 2 > after.1 {
        return Some(format!(
            "{:.1}% of the pages of {} were still in the page cache after the drop",
            100.0 * after.0 as f64 / after.1 as f64,
            path.display()
        ));
    }
    None
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
            ineffective: {
                let abs = std::fs::canonicalize(&self.path).unwrap_or_else(|_| self.path.clone());
                let fs = std::fs::read_to_string("/proc/self/mountinfo")
                    .ok()
                    .and_then(|m| fs_type_in(&m, &abs));
                ineffective(fs.as_deref(), &self.path, self.resident_after_drop)
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{fs_type_in, ineffective, inward_pages};
    use std::path::Path;

    /// Lines as the kernel writes them (proc(5)), with a stacked and an escaped mount.
    const MOUNTINFO: &str = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
25 22 0:23 / /dev/shm rw,nosuid shared:2 - tmpfs tmpfs rw
30 25 0:27 / /dev/shm rw,nosuid - tmpfs shm rw
31 22 0:28 / /mnt/my\\040disk rw - xfs /dev/sdb1 rw
32 22 0:29 / /mnt/ram rw - ramfs ramfs rw
33 22 0:30 / /devx rw - btrfs /dev/sdc rw
";

    #[test]
    fn fs_type_is_the_deepest_mount_above_the_file() {
        let t = |p: &str| fs_type_in(MOUNTINFO, Path::new(p));
        assert_eq!(t("/dev/shm/m.gguf").as_deref(), Some("tmpfs"));
        assert_eq!(t("/home/u/m.gguf").as_deref(), Some("ext4"));
        assert_eq!(t("/mnt/my disk/m.gguf").as_deref(), Some("xfs"));
        assert_eq!(t("/mnt/ram/m.gguf").as_deref(), Some("ramfs"));
        // A path component, not a string prefix: /dev/shmx is not under /dev/shm.
        assert_eq!(t("/dev/shmx/m.gguf").as_deref(), Some("ext4"));
        assert_eq!(t("/devx/m.gguf").as_deref(), Some("btrfs"));
        assert_eq!(fs_type_in("", Path::new("/a")), None);
    }

    #[test]
    fn drop_without_effect_is_named() {
        let p = Path::new("/x/m.gguf");
        let why = ineffective(Some("tmpfs"), p, (0, 100)).unwrap();
        assert!(why.contains("tmpfs") && why.contains("/x/m.gguf"), "{why}");
        assert!(ineffective(Some("ramfs"), p, (0, 100)).is_some());
        // On a disk: judged by what the drop left resident.
        let why = ineffective(Some("ext4"), p, (100, 100)).unwrap();
        assert!(why.contains("100.0%"), "{why}");
        assert!(ineffective(Some("ext4"), p, (51, 100)).is_some());
        assert!(ineffective(Some("ext4"), p, (50, 100)).is_none());
        assert!(ineffective(Some("ext4"), p, (4, 100)).is_none());
        assert!(ineffective(None, p, (0, 0)).is_none());
    }

    #[test]
    fn ranges_merge_and_round_inward() {
        let v = inward_pages(vec![5000..9000, 100..5000, 9000..20000, 30000..30100], 4096);
        assert_eq!(v, vec![4096..16384]);
    }
}
