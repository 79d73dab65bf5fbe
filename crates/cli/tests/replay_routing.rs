//! `sluice bench --replay-routing TRACE` (issue 32 item 2): a trace `sluice run
//! --record-routing` wrote on the trained MoE replays on a `sluice synth` file of the same
//! routing geometry; the replayed run's own `--record-routing` trace holds exactly the
//! trace's experts, the start-up line and the CSV say the routing was replayed; a synth of
//! another geometry, `--gpu` and `--lookahead` are refused with the flag named.

mod common;

use std::path::Path;

use common::{sluice, tmp_dir};

fn trained() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/trained-moe/trained-moe-q4_0.gguf")
        .to_string_lossy()
        .into_owned()
}

/// Per token, the expert ids of a v1 routing trace (format: crates/tier/src/trace.rs),
/// whatever its batching.
fn token_ids(path: &Path) -> Vec<Vec<u16>> {
    let b = std::fs::read(path).unwrap();
    let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap()) as usize;
    let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap()) as usize;
    assert_eq!(&b[..4], b"SLRT");
    let (n_layer, top_k, name_len) = (u32_at(8), u32_at(16), u32_at(20));
    let n_batches = u64_at(32);
    let mut off = 40 + name_len;
    let n_moe = (0..n_layer).filter(|l| u64_at(off + 8 * l) > 0).count();
    off += 8 * n_layer;
    let per = n_moe * top_k;
    let mut out = Vec::new();
    for _ in 0..n_batches {
        let n = u32_at(off);
        off += 4;
        for _ in 0..n {
            out.push(
                (0..per)
                    .map(|i| u16::from_le_bytes([b[off + 2 * i], b[off + 2 * i + 1]]))
                    .collect(),
            );
            off += 2 * per;
        }
    }
    assert_eq!(off, b.len());
    out
}

fn synth(dir: &Path, experts: &str) -> String {
    let out = dir.join(format!("synth-{experts}.gguf"));
    let o = sluice(&[
        "synth",
        "-o",
        out.to_str().unwrap(),
        "--preset",
        "tiny",
        "--layers",
        "8",
        "--hidden",
        "64",
        "--experts",
        experts,
        "--top-k",
        "4",
        "--expert-ff",
        "64",
        "--quant",
        "Q8_0",
        "--force",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    out.to_string_lossy().into_owned()
}

#[test]
fn bench_replays_the_traced_experts_and_says_so() {
    let dir = tmp_dir("replay");
    let trace = dir.join("real.slrt");
    let o = sluice(&[
        "run",
        "-m",
        &trained(),
        "--raw",
        "-p",
        "import os\n\n\ndef walk(path):\n",
        "-n",
        "12",
        "--temp",
        "0",
        "--record-routing",
        trace.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let want = token_ids(&trace);
    let n = want.len();
    assert!(n > 12, "prompt + decode tokens: {n}");

    let m = synth(&dir, "32");
    let csv = dir.join("b.csv");
    let replayed = dir.join("replayed.slrt");
    // pp 20 + tg 2n: the trace wraps to its start.
    let tg = (2 * n).to_string();
    let o = sluice(&[
        "bench",
        "-m",
        &m,
        "-t",
        "1",
        "-p",
        "20",
        "-n",
        &tg,
        "-r",
        "1",
        "--no-warmup",
        "--expert-cache",
        "30%",
        "--io",
        "pread",
        "--replay-routing",
        trace.to_str().unwrap(),
        "--record-routing",
        replayed.to_str().unwrap(),
        "--csv",
        csv.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("routing replayed from") && err.contains("no logits are claimed"),
        "start-up line: {err}"
    );
    assert!(stdout.contains("wrapped to its start"), "{stdout}");
    let got = token_ids(&replayed);
    assert_eq!(got.len(), 20 + 2 * n);
    for (t, ids) in got.iter().enumerate() {
        assert_eq!(ids, &want[t % n], "token {t}: not the trace's experts");
    }
    let text = std::fs::read_to_string(&csv).unwrap();
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let col = header.iter().position(|h| *h == "routing").unwrap();
    for row in lines {
        let row: Vec<&str> = row.split(',').collect();
        assert_eq!(header.len(), row.len());
        assert_eq!(row[col], "replay:real.slrt");
    }

    // Another geometry (16 experts a layer), --gpu, --lookahead: refused, nothing run.
    let other = synth(&dir, "16");
    let base = |model: &str| {
        vec![
            "bench".to_string(),
            "-m".into(),
            model.into(),
            "-p".into(),
            "4".into(),
            "-n".into(),
            "0".into(),
            "-r".into(),
            "1".into(),
            "--no-warmup".into(),
            "--replay-routing".into(),
            trace.to_string_lossy().into_owned(),
        ]
    };
    for (model, extra, what) in [
        (&other, vec![], "32 experts"),
        (&m, vec!["--gpu"], "--gpu"),
        (
            &m,
            vec!["--expert-cache", "50%", "--lookahead"],
            "--lookahead",
        ),
    ] {
        let mut args = base(model);
        args.extend(extra.iter().map(|s| s.to_string()));
        let refs: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
        let o = sluice(&refs);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{extra:?}: accepted");
        assert!(
            err.contains("--replay-routing") && err.contains("real.slrt") && err.contains(what),
            "{extra:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
