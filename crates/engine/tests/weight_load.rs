//! `--weight-load copy` (the default on the CPU) moves the weights the compute reads
//! through the memory map into anonymous huge-page memory at load. The bytes must be the
//! file's: logits bit-identical to `--weight-load mmap`, resident and with the experts
//! streamed (where only what lies outside the streamed groups moves, and the experts are
//! still read from the file); and a row table with its own reader (qwen4exp's PLE table,
//! `--ple-io direct`, the default) is never copied.

mod common;

use common::{fixture_in, qwen3moe_fixture, qwen3moe_tokens, same_bits};
use sluice_engine::load::{Budget, LoadOptions, PackChoice, StreamOptions, WeightLoad};
use sluice_engine::session::Session;
use sluice_engine::tier::{PolicyKind, SizeSpec, StreamingExperts};
use sluice_engine::{Logits, Model};
use sluice_io::{Backend, IoConfig};
use std::path::{Path, PathBuf};

fn streamed_at_minimum(path: &Path) -> StreamOptions {
    let m = Model::load(path).unwrap();
    let min = StreamingExperts::min_budget(&m.groups.experts, m.cfg.n_expert_used);
    StreamOptions {
        budget: Budget::Size(SizeSpec::Bytes(min)),
        budget_text: format!("{min}"),
        policy: PolicyKind::Lru,
        resident_layers: 0,
        io: IoConfig {
            backend: Backend::Pread,
            direct: false,
            depth: 4,
            inflight_bytes: 0,
            threads: 2,
            high_priority: false,
        },
        hash_prefetch: true,
        lookahead: false,
        pack: PackChoice::Off,
        preload_profile: None,
    }
}

fn options(path: &Path, stream: Option<StreamOptions>, how: WeightLoad) -> LoadOptions {
    LoadOptions {
        ple: Default::default(),
        path: path.to_path_buf(),
        threads: 2,
        ctx: 256,
        stream,
        record_routing: None,
        sequences: 1,
        device: Default::default(),
        weight_load: how,
    }
}

/// Prefill half of `toks`, then decode the rest one by one: every position's logits, and
/// the bytes the load moved into RAM.
fn run(opts: LoadOptions, toks: &[u32]) -> (Vec<f32>, u64, Vec<String>) {
    let loaded = opts.load().unwrap();
    let mut s = Session::new(&loaded, 256, false, 8);
    let (prompt, rest) = toks.split_at(toks.len() / 2);
    let mut out = s.prefill(prompt, Logits::All).unwrap();
    for &t in rest {
        out.extend(s.prefill(&[t], Logits::All).unwrap());
    }
    (out, loaded.model.map.copied_bytes(), loaded.notes.clone())
}

fn compare(path: PathBuf, toks: &[u32]) {
    let (want, none, _) = run(options(&path, None, WeightLoad::Map), toks);
    assert_eq!(none, 0, "mmap must copy nothing");
    let (got, copied, notes) = run(options(&path, None, WeightLoad::Copy), toks);
    let data = std::fs::metadata(&path).unwrap().len();
    // All of the data section bar the partial pages at its ends (and before it, the header).
    assert!(
        copied > 0 && copied <= data,
        "{}: {copied} of {data} bytes copied; notes {notes:?}",
        path.display()
    );
    assert!(
        notes.iter().any(|n| n.contains("copied into RAM")),
        "{notes:?}"
    );
    assert!(
        same_bits(&want, &got),
        "{}: resident logits differ",
        path.display()
    );

    let stream = || Some(streamed_at_minimum(&path));
    let (want_s, _, _) = run(options(&path, stream(), WeightLoad::Map), toks);
    let (got_s, copied_s, _) = run(options(&path, stream(), WeightLoad::Copy), toks);
    let m = Model::load(&path).unwrap();
    let experts = m.groups.experts.total_bytes();
    assert!(
        copied_s > 0 && copied_s + experts <= data,
        "{}: streaming copied {copied_s} bytes, experts are {experts} of {data}",
        path.display()
    );
    assert!(
        same_bits(&want_s, &got_s),
        "{}: streamed logits differ",
        path.display()
    );
    assert!(
        same_bits(&want, &got_s),
        "{}: streamed != resident",
        path.display()
    );
}

#[test]
fn copied_weights_give_the_mapped_logits_qwen3moe() {
    compare(qwen3moe_fixture("a-q8_0.gguf"), &qwen3moe_tokens());
}

#[test]
fn copied_weights_give_the_mapped_logits_trained_moe() {
    let path = fixture_in("trained-moe", "trained-moe-q4_0.gguf");
    let toks: Vec<u32> = (0..24).map(|i| (i * 37 + 11) % 1000).collect();
    compare(path, &toks);
}

#[test]
fn a_row_table_with_its_own_reader_is_not_copied() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen4exp");
    let path = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "gguf"))
        .expect("a qwen4exp fixture");
    let m = Model::load(&path).unwrap();
    let table: u64 = m
        .groups
        .row_tables
        .iter()
        .map(|t| t.row_bytes * t.n_rows)
        .sum();
    assert!(table > 0, "{}: no row table", path.display());
    let data = m.gguf.file_size - m.gguf.data_offset;
    drop(m);
    // The default `--ple-io direct`: the table has its own reader.
    let loaded = options(&path, None, WeightLoad::Copy).load().unwrap();
    let copied = loaded.model.map.copied_bytes();
    assert!(
        copied > 0 && copied + table <= data,
        "{copied} copied, table {table}, data {data}"
    );
}
