//! Bad input to the model-running commands gets one clear line on stderr and a non-zero
//! exit: a missing file, an unknown architecture (named, with the known ones listed), a
//! prompt longer than the context, a token id beyond the vocabulary, a budget below the
//! minimum, bad flag values. And `--dump-logits` writes one logits row per evaluated
//! position, byte-identical across thread counts and expert sources.

mod common;

use common::{fixture, sluice, tmp_dir};
use std::process::Output;

use sluice_gguf::{GgmlType, GgufWriter, MetaValue, TensorSpec};

/// Fails with one line on stderr that contains every `needles` item.
fn fails_with(out: &Output, needles: &[&str]) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected failure, stderr: {err}");
    let last = err.lines().last().unwrap_or("");
    assert!(
        last.starts_with("error: "),
        "last line should be the error: {err}"
    );
    for n in needles {
        assert!(last.contains(n), "error line lacks {n:?}: {last}");
    }
}

#[test]
fn missing_model_file() {
    let out = sluice(&["run", "-m", "/nonexistent/model.gguf", "-p", "hi"]);
    fails_with(&out, &["/nonexistent/model.gguf", "no such file"]);
}

#[test]
fn unknown_architecture_is_named_and_known_ones_listed() {
    let dir = tmp_dir("arch");
    let path = dir.join("llama.gguf");
    let meta = vec![(
        "general.architecture".to_string(),
        MetaValue::Str("mamba9".into()),
    )];
    let specs = [TensorSpec::new(
        "token_embd.weight",
        &[32, 4],
        GgmlType::F32,
    )];
    let f = std::fs::File::create(&path).unwrap();
    let mut w = GgufWriter::new(f, &path, &meta, &specs).unwrap();
    w.write_tensor("token_embd.weight", &[0u8; 512]).unwrap();
    w.finish().unwrap();
    let out = sluice(&["run", "-m", path.to_str().unwrap(), "-p", "hi"]);
    fails_with(
        &out,
        &["mamba9", "qwen3moe", "gemma3", path.to_str().unwrap()],
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn prompt_longer_than_context() {
    let toks: Vec<String> = (0..40).map(|i| (i % 200).to_string()).collect();
    let out = sluice(&[
        "run",
        "-m",
        &fixture("a-q8_0.gguf"),
        "--tokens",
        &toks.join(","),
        "-c",
        "16",
        "-n",
        "1",
    ]);
    fails_with(&out, &["40 tokens", "context"]);
}

#[test]
fn token_id_beyond_vocabulary() {
    let out = sluice(&[
        "run",
        "-m",
        &fixture("a-q8_0.gguf"),
        "--tokens",
        "1,2,99999",
        "-n",
        "1",
    ]);
    fails_with(&out, &["99999", "512"]);
}

/// One token of the tiny fixture at `--expert-cache budget`.
fn run_with_budget(budget: &str) -> Output {
    sluice(&[
        "run",
        "-m",
        &fixture("a-q8_0.gguf"),
        "--tokens",
        "1,2",
        "-n",
        "1",
        "--expert-cache",
        budget,
    ])
}

#[test]
fn expert_cache_below_minimum_names_the_minimum() {
    fails_with(&run_with_budget("4K"), &["--expert-cache", "minimum"]);
}

/// One byte under the minimum: both sizes round to the same text, so the budget is said in
/// bytes too (issue 35 item 20: "72.00 KiB is below the minimum 72.00 KiB").
#[test]
fn expert_cache_one_byte_below_minimum_says_bytes() {
    let first = String::from_utf8_lossy(&run_with_budget("4K").stderr).to_string();
    // "... ({min} bytes: one layer's top-k experts must fit at once)"
    let min: u64 = first
        .split(" bytes: one layer")
        .next()
        .and_then(|head| head.rsplit('(').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no minimum in bytes in: {first}"));
    let under = min - 1;
    let out = run_with_budget(&under.to_string());
    fails_with(&out, &["minimum", &format!("({under} bytes)")]);
}

/// A reader that closed stdout ends the command quietly (issue 35 item 10): no panic
/// (`inspect --json`) and no `error: Broken pipe` (`run`), exit 0.
#[test]
fn closed_stdout_ends_quietly() {
    let ids = "1,2,3,4";
    let cases: [&[&str]; 3] = [
        &["inspect", "--json", &fixture("a-q8_0.gguf")],
        &["inspect", &fixture("a-q8_0.gguf")],
        &[
            "run",
            "-m",
            &fixture("a-q8_0.gguf"),
            "--tokens",
            ids,
            "-n",
            "16",
            "--temp",
            "0",
            "--raw",
        ],
    ];
    for args in cases {
        let mut child = common::spawn(args, false);
        // Close the read end before sluice writes anything: its first write gets EPIPE.
        drop(child.stdout.take());
        let out = common::finish(child, Some(Vec::new()));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && !err.contains("panicked") && !err.contains("Broken pipe"),
            "{args:?}: status {:?}, stderr: {err}",
            out.status
        );
    }
}

#[test]
fn bad_streaming_flag_values() {
    let out = sluice(&[
        "run",
        "-m",
        &fixture("a-q8_0.gguf"),
        "--tokens",
        "1",
        "-n",
        "1",
        "--expert-cache",
        "100%",
        "--io",
        "floppy",
    ]);
    fails_with(&out, &["--io floppy"]);
    let out = sluice(&[
        "run",
        "-m",
        &fixture("a-q8_0.gguf"),
        "--tokens",
        "1",
        "-n",
        "1",
        "--expert-cache",
        "100%",
        "--cache-policy",
        "random",
    ]);
    fails_with(&out, &["--cache-policy", "random"]);
}

#[test]
fn dump_logits_writes_one_row_per_evaluated_position() {
    let dir = tmp_dir("dump");
    let d = dir.join("out");
    let out = sluice(&[
        "run",
        "-m",
        &fixture("a-q8_0.gguf"),
        "--tokens",
        "84,104,101",
        "-n",
        "4",
        "--temp",
        "0",
        "--dump-logits",
        d.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("tokens.json")).unwrap()).unwrap();
    let rows = json["n_positions"].as_u64().unwrap() as usize;
    let tokens = json["tokens"].as_array().unwrap().len();
    assert_eq!(rows, tokens);
    assert!(
        (3..=7).contains(&rows),
        "3 prompt tokens + up to 4 generated: {rows}"
    );
    let npy = std::fs::read(d.join("logits.npy")).unwrap();
    let hl = u16::from_le_bytes([npy[8], npy[9]]) as usize;
    assert_eq!(npy.len(), 10 + hl + rows * 512 * 4);
    assert!(!d.join("logits.npy.tmp").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Two runs, and 1 vs 2 threads, dump byte-identical logits (streaming with a tiny cache
/// on one side, everything resident on the other).
#[test]
fn dump_logits_byte_identical_across_threads_and_streaming() {
    let dir = tmp_dir("det");
    let model = fixture("b-q8_0.gguf");
    let run = |name: &str, extra: &[&str]| {
        let d = dir.join(name);
        let mut args = vec![
            "run",
            "-m",
            &model,
            "--raw",
            "-p",
            "The GNU General",
            "-n",
            "8",
            "--temp",
            "0",
            "--dump-logits",
            d.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let out = sluice(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::read(d.join("logits.npy")).unwrap()
    };
    let a = run("a", &["-t", "1"]);
    let b = run("b", &["-t", "2"]);
    // 80 KiB holds about three 24 KiB expert slots: top-3 routing evicts constantly.
    let c = run("c", &["-t", "2", "--expert-cache", "80K", "--io", "pread"]);
    assert_eq!(a, b, "1 vs 2 threads");
    assert_eq!(a, c, "resident vs streaming at the minimum budget");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `run --stats --record-routing` with a small cache: the statistics reconcile bytes read
/// with misses x expert bytes, the trace is written, and `cache-sim` replays it.
#[test]
fn streaming_stats_reconcile_and_trace_replays() {
    let dir = tmp_dir("trace");
    let trace = dir.join("routing.bin");
    let out = sluice(&[
        "run",
        "-m",
        &fixture("a-q8_0.gguf"),
        "--tokens",
        "84,104,101,367",
        "-n",
        "6",
        "--temp",
        "0",
        "--expert-cache",
        "100K",
        "--io",
        "pread",
        "--stats",
        "--record-routing",
        trace.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let reconcile = err
        .lines()
        .find(|l| l.starts_with("reconcile:"))
        .expect("a reconcile line");
    assert!(reconcile.contains("(ok)"), "{reconcile}");
    assert!(err
        .lines()
        .any(|l| l.starts_with("cache:") && l.contains("evictions")));
    assert!(trace.exists());
    common::assert_cache_sim_replays(&trace);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `sluice pack` writes the sidecar next to the model copy, `run` finds it and dumps the
/// same logits as without it (and as with a preloaded profile written by `cache-sim`); a
/// sidecar of another model is refused with one line naming it; `pack` of a file that is
/// not a model fails cleanly.
#[test]
fn pack_sidecar_and_preload_profile_end_to_end() {
    let dir = tmp_dir("pack");
    let model = dir.join("b.gguf");
    std::fs::copy(fixture("b-q8_0.gguf"), &model).unwrap();
    let m = model.to_str().unwrap().to_string();
    let out = sluice(&["pack", &m]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let sidecar = dir.join("b.gguf.slpack");
    assert!(sidecar.exists() && !dir.join("b.gguf.slpack.tmp").exists());
    let trace = dir.join("t.bin");
    let profile = dir.join("p.profile");
    let run = |name: &str, extra: &[&str]| {
        let d = dir.join(name);
        let mut args = vec![
            "run",
            "-m",
            &m,
            "--raw",
            "-p",
            "The GNU General",
            "-n",
            "8",
            "--temp",
            "0",
            "--expert-cache",
            "80K",
            "--io",
            "pread",
            "--dump-logits",
            d.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let out = sluice(&args);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        (
            std::fs::read(d.join("logits.npy")).unwrap(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (packed, note) = run("packed", &["--record-routing", trace.to_str().unwrap()]);
    assert!(note.contains("packed experts"), "{note}");
    let (plain, note) = run("plain", &["--no-pack"]);
    assert!(!note.contains("packed experts"), "{note}");
    assert_eq!(packed, plain, "logits with and without the packed sidecar");
    let out = sluice(&[
        "cache-sim",
        trace.to_str().unwrap(),
        "--write-profile",
        profile.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (warm, note) = run("warm", &["--preload-profile", profile.to_str().unwrap()]);
    assert!(note.contains("preloaded"), "{note}");
    assert_eq!(packed, warm, "logits with a preloaded profile");
    // A sidecar of another model.
    let other = dir.join("other.slpack");
    let out = sluice(&[
        "pack",
        &fixture("a-q8_0.gguf"),
        "-o",
        other.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = sluice(&[
        "run",
        "-m",
        &m,
        "-p",
        "hi",
        "-n",
        "1",
        "--expert-cache",
        "80K",
        "--pack",
        other.to_str().unwrap(),
    ]);
    fails_with(&out, &["other.slpack", "does not match"]);
    // Not a GGUF: one line naming the file, nothing written.
    let junk = dir.join("junk.gguf");
    std::fs::write(&junk, b"not a model").unwrap();
    let out = sluice(&["pack", junk.to_str().unwrap()]);
    fails_with(&out, &["junk.gguf"]);
    assert!(!dir.join("junk.gguf.slpack").exists() && !dir.join("junk.gguf.slpack.tmp").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `bench --csv`: the header names every column the rows have (streaming columns included),
/// and a second run appends rows without a second header.
#[test]
fn bench_csv_header_matches_rows() {
    let dir = tmp_dir("bench-csv");
    let csv = dir.join("b.csv");
    let m = fixture("a-q8_0.gguf");
    for _ in 0..2 {
        let out = sluice(&[
            "bench",
            "-m",
            &m,
            "-p",
            "4",
            "-n",
            "2",
            "-r",
            "1",
            "--expert-cache",
            "60%",
            "--csv",
            csv.to_str().unwrap(),
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = std::fs::read_to_string(&csv).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines.len(),
        1 + 2 * 2,
        "one header, two tests x two runs: {text}"
    );
    let cols = lines[0].split(',').count();
    assert!(lines[0].starts_with("model,") && lines[0].contains("hit_rate"));
    let header: Vec<&str> = lines[0].split(',').collect();
    let gpu = header
        .iter()
        .position(|&c| c == "gpu")
        .expect("a gpu column");
    for c in ["gpu_hit_rate", "gpu_upload_bytes", "gpu_upload_gbps"] {
        assert!(header.contains(&c), "no {c} column: {}", lines[0]);
    }
    for l in &lines[1..] {
        assert!(!l.starts_with("model,"), "second header: {text}");
        assert_eq!(l.split(',').nth(gpu), Some("off"), "no --gpu: {l}");
        assert_eq!(
            l.split(',').count(),
            cols,
            "row {l:?} vs header {:?}",
            lines[0]
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
