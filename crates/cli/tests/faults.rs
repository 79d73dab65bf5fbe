//! Fault injection (issue 14): broken weights and hyper-parameters, special files, hostile
//! sizes, thread extremes, signals. Every case runs under a watchdog (a hang fails it) and
//! the unbounded-read cases under a virtual-memory ulimit; none may end with a signal, and
//! none may exit 0 with garbage.

mod common;

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::Output;

use common::{exited, finish, fixture, sluice, sluice_limited, spawn, tmp_dir};
use sluice_gguf::{GgufFile, GgufWriter, MetaValue, TensorSpec};

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Exits non-zero by itself (no signal) with an `error:` line containing every needle.
fn fails_with(out: &Output, needles: &[&str]) {
    let err = stderr(out);
    let code = exited(out);
    assert_ne!(code, 0, "expected failure, stderr: {err}");
    let line = err
        .lines()
        .rev()
        .find(|l| l.starts_with("error: "))
        .unwrap_or_else(|| panic!("no error line: {err}"));
    for n in needles {
        assert!(line.contains(n), "error line lacks {n:?}: {line}");
    }
}

fn succeeds(out: &Output) -> String {
    let err = stderr(out);
    assert_eq!(exited(out), 0, "stderr: {err}");
    err
}

/// A copy of `src` with metadata changed by `meta` and tensor bytes by `data`.
fn rewrite(
    src: &str,
    dst: &Path,
    meta: impl Fn(&mut Vec<(String, MetaValue)>),
    data: impl Fn(&str, &mut [u8]),
) {
    let f = GgufFile::open(Path::new(src)).unwrap();
    let mut md = f.metadata.clone();
    meta(&mut md);
    let specs: Vec<TensorSpec> = f.tensors.iter().map(TensorSpec::from).collect();
    let out = std::fs::File::create(dst).unwrap();
    let mut w = GgufWriter::new(out, dst, &md, &specs).unwrap();
    let mut file = std::fs::File::open(src).unwrap();
    for t in &f.tensors {
        let r = f.tensor_range(t);
        let mut buf = vec![0u8; (r.end - r.start) as usize];
        file.seek(SeekFrom::Start(r.start)).unwrap();
        file.read_exact(&mut buf).unwrap();
        data(&t.name, &mut buf);
        w.write_tensor(&t.name, &buf).unwrap();
    }
    w.finish().unwrap();
}

fn set_meta(md: &mut [(String, MetaValue)], key: &str, v: MetaValue) {
    let e = md.iter_mut().find(|(k, _)| k == key).unwrap();
    e.1 = v;
}

fn fill_f32(buf: &mut [u8], v: f32) {
    for c in buf.chunks_exact_mut(4) {
        c.copy_from_slice(&v.to_le_bytes());
    }
}

const TOKENS: &str = "84,104,101,367,98,77";

fn run_tokens(model: &str, extra: &[&str]) -> Output {
    let mut args = vec![
        "run", "-m", model, "--tokens", TOKENS, "-n", "4", "--temp", "0",
    ];
    args.extend_from_slice(extra);
    sluice(&args)
}

// ---- item 1: NaN / Inf -------------------------------------------------------------

#[test]
fn nan_weights_stop_with_position_and_layer() {
    let dir = tmp_dir("nan-w");
    let m = dir.join("nan.gguf");
    rewrite(
        &fixture("a-f32.gguf"),
        &m,
        |_| {},
        |name, b| {
            if name == "blk.1.attn_output.weight" {
                fill_f32(b, f32::NAN)
            }
        },
    );
    let m = m.to_str().unwrap();
    let out = run_tokens(m, &[]);
    fails_with(&out, &["non-finite", "position 0", "layer 1", m]);
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("!!"),
        "garbage printed"
    );
    // streaming too
    let out = run_tokens(m, &["--expert-cache", "100%", "--io", "pread"]);
    fails_with(&out, &["non-finite", "layer 1"]);
    // perplexity must not print PPL = NaN
    let text = dir.join("t.txt");
    std::fs::write(
        &text,
        "the quick brown fox jumps over the lazy dog. ".repeat(20),
    )
    .unwrap();
    let out = sluice(&[
        "perplexity",
        "-m",
        m,
        "-f",
        text.to_str().unwrap(),
        "-c",
        "16",
    ]);
    fails_with(&out, &["non-finite"]);
    assert!(!String::from_utf8_lossy(&out.stdout).contains("PPL"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn inf_embedding_row_names_its_position() {
    let dir = tmp_dir("inf-emb");
    let m = dir.join("inf.gguf");
    // token 101 is the third of TOKENS: its embedding row (64 floats) becomes +Inf
    rewrite(
        &fixture("a-f32.gguf"),
        &m,
        |_| {},
        |name, b| {
            if name == "token_embd.weight" {
                fill_f32(&mut b[101 * 64 * 4..102 * 64 * 4], f32::INFINITY)
            }
        },
    );
    let out = run_tokens(m.to_str().unwrap(), &[]);
    fails_with(&out, &["non-finite", "position 2", "token embedding"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn broken_hyperparameters_are_refused_at_load_naming_the_key() {
    let dir = tmp_dir("hparams");
    let cases: &[(&str, MetaValue, &str)] = &[
        (
            "qwen3moe.attention.layer_norm_rms_epsilon",
            MetaValue::F32(f32::NAN),
            "layer_norm_rms_epsilon",
        ),
        (
            "qwen3moe.attention.layer_norm_rms_epsilon",
            MetaValue::F32(-1e-6),
            "layer_norm_rms_epsilon",
        ),
        (
            "qwen3moe.rope.freq_base",
            MetaValue::F32(0.0),
            "rope.freq_base",
        ),
        (
            "qwen3moe.rope.freq_base",
            MetaValue::F32(f32::NAN),
            "rope.freq_base",
        ),
        (
            "qwen3moe.rope.freq_base",
            MetaValue::F32(f32::INFINITY),
            "rope.freq_base",
        ),
    ];
    for (i, (key, v, needle)) in cases.iter().enumerate() {
        let m = dir.join(format!("h{i}.gguf"));
        rewrite(
            &fixture("a-f32.gguf"),
            &m,
            |md| set_meta(md, key, v.clone()),
            |_, _| {},
        );
        let out = run_tokens(m.to_str().unwrap(), &[]);
        fails_with(&out, &[needle, m.to_str().unwrap()]);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn perplexity_tiny_ctx_is_refused_not_nan() {
    let dir = tmp_dir("ppl-ctx");
    let text = dir.join("t.txt");
    std::fs::write(
        &text,
        "the quick brown fox jumps over the lazy dog. ".repeat(20),
    )
    .unwrap();
    for c in ["1", "2"] {
        let out = sluice(&[
            "perplexity",
            "-m",
            &fixture("a-q8_0.gguf"),
            "-f",
            text.to_str().unwrap(),
            "-c",
            c,
        ]);
        fails_with(&out, &["--ctx"]);
        assert!(!String::from_utf8_lossy(&out.stdout).contains("PPL"));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn perplexity_ctx_is_capped_at_the_model_context() {
    // the fixtures' context is 256: --ctx 100000 runs with 256 (as --help says)
    let dir = tmp_dir("ppl-cap");
    let text = dir.join("t.txt");
    std::fs::write(
        &text,
        "the quick brown fox jumps over the lazy dog. ".repeat(80),
    )
    .unwrap();
    let out = sluice(&[
        "perplexity",
        "-m",
        &fixture("a-q8_0.gguf"),
        "-f",
        text.to_str().unwrap(),
        "-c",
        "100000",
    ]);
    let err = succeeds(&out);
    assert!(err.contains("chunks of 256"), "{err}");
    let ppl = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(ppl.contains("PPL = ") && !ppl.contains("NaN"), "{ppl}");
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---- item 2: unbounded reads --------------------------------------------------------

#[test]
fn cache_sim_refuses_special_files_and_lying_headers_without_reading_them() {
    let out = sluice_limited(&["cache-sim", "--budget", "25%", "/dev/zero"], b"");
    fails_with(&out, &["/dev/zero", "not a regular file"]);
    // a valid header claiming far more tokens than the file holds: refused from the
    // header, before reading the rest
    let dir = tmp_dir("sim-lie");
    let p = dir.join("t.bin");
    let mut b = Vec::new();
    b.extend_from_slice(b"SLRT");
    for x in [1u32, 2, 8, 2, 0] {
        b.extend_from_slice(&x.to_le_bytes());
    }
    b.extend_from_slice(&(1u64 << 40).to_le_bytes()); // n_tokens
    b.extend_from_slice(&1u64.to_le_bytes()); // n_batches
    b.extend_from_slice(&1000u64.to_le_bytes());
    b.extend_from_slice(&1000u64.to_le_bytes());
    b.extend_from_slice(&[0u8; 64]);
    std::fs::write(&p, &b).unwrap();
    let out = sluice_limited(&["cache-sim", "--budget", "25%", p.to_str().unwrap()], b"");
    fails_with(&out, &[p.to_str().unwrap(), "bytes"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn perplexity_refuses_endless_and_binary_text_files() {
    for f in ["/dev/urandom", "/dev/zero"] {
        let out = sluice_limited(
            &[
                "perplexity",
                "-m",
                &fixture("a-q8_0.gguf"),
                "-f",
                f,
                "-c",
                "16",
            ],
            b"",
        );
        fails_with(&out, &[f, "not a regular file"]);
    }
    let dir = tmp_dir("ppl-bin");
    let p = dir.join("bin.txt");
    std::fs::write(&p, b"hello \xff\xfe world").unwrap();
    let out = sluice(&[
        "perplexity",
        "-m",
        &fixture("a-q8_0.gguf"),
        "-f",
        p.to_str().unwrap(),
        "-c",
        "16",
    ]);
    fails_with(&out, &[p.to_str().unwrap(), "UTF-8", "byte 6"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---- item 13: special files ----------------------------------------------------------

fn mkfifo(p: &Path) {
    let st = std::process::Command::new("mkfifo")
        .arg(p)
        .status()
        .unwrap();
    assert!(st.success());
}

#[test]
fn special_files_as_model_or_text_are_refused_without_hanging() {
    let dir = tmp_dir("special");
    let fifo = dir.join("fifo");
    mkfifo(&fifo);
    let loop_a = dir.join("loop-a");
    std::os::unix::fs::symlink(dir.join("loop-b"), &loop_a).unwrap();
    std::os::unix::fs::symlink(&loop_a, dir.join("loop-b")).unwrap();
    let fifo_s = fifo.to_str().unwrap();
    for m in [fifo_s, "/dev/zero", "/dev/urandom"] {
        let out = sluice_limited(&["run", "-m", m, "-p", "hi"], b"");
        fails_with(&out, &[m, "not a regular file"]);
        let out = sluice_limited(&["inspect", m], b"");
        fails_with(&out, &[m, "not a regular file"]);
    }
    let out = sluice_limited(
        &["perplexity", "-m", &fixture("a-q8_0.gguf"), "-f", fifo_s],
        b"",
    );
    fails_with(&out, &[fifo_s, "not a regular file"]);
    let l = loop_a.to_str().unwrap();
    let out = sluice(&["run", "-m", l, "-p", "hi"]);
    fails_with(&out, &[l, "symbolic links"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---- items 3, 5, 14: threads, resident layers, streaming-only flags -------------------

#[test]
fn thread_counts_beyond_the_machine_are_refused() {
    let out = sluice_limited(
        &[
            "run",
            "-m",
            &fixture("a-q8_0.gguf"),
            "--tokens",
            "1,2",
            "-n",
            "1",
            "-t",
            "100000",
        ],
        b"",
    );
    fails_with(&out, &["-t: 100000", "cores", "at most"]);
    let out = sluice_limited(
        &[
            "run",
            "-m",
            &fixture("a-q8_0.gguf"),
            "--tokens",
            "1,2",
            "-n",
            "1",
            "--expert-cache",
            "100%",
            "--io",
            "pread",
            "--io-threads",
            "100000",
        ],
        b"",
    );
    fails_with(&out, &["--io-threads: 100000", "at most"]);
}

#[test]
fn resident_layers_beyond_the_model_or_without_streaming_are_refused() {
    // the fixtures have 2 MoE layers
    let m = fixture("a-q8_0.gguf");
    let base = ["run", "-m", m.as_str(), "--tokens", "1,2", "-n", "1"];
    let with = |extra: &[&str]| {
        let mut a = base.to_vec();
        a.extend_from_slice(extra);
        sluice(&a)
    };
    fails_with(
        &with(&["--expert-cache", "100%", "--resident-layers", "3"]),
        &["--resident-layers", "3", "2 layers"],
    );
    fails_with(
        &with(&["--resident-layers", "3"]),
        &["--resident-layers", "--expert-cache"],
    );
    fails_with(
        &with(&["--resident-layers", "1"]),
        &["--resident-layers", "--expert-cache"],
    );
    // streaming-only flag values are checked without --expert-cache too
    fails_with(
        &with(&["--cache-policy", "bogus"]),
        &["--cache-policy bogus"],
    );
    fails_with(&with(&["--io", "foo"]), &["--io foo"]);
    // within range and streaming: runs, and says how many were read at start
    let err = succeeds(&with(&[
        "--expert-cache",
        "100%",
        "--resident-layers",
        "2",
        "--temp",
        "0",
    ]));
    assert!(err.contains("2 resident layers"), "{err}");
}

// ---- item 6: --measure with streaming -------------------------------------------------

#[test]
fn measure_works_with_expert_cache() {
    let m = fixture("a-q8_0.gguf");
    for io in ["pread", "mmap"] {
        let err = succeeds(&sluice(&[
            "run",
            "-m",
            &m,
            "--tokens",
            TOKENS,
            "-n",
            "6",
            "--temp",
            "0",
            "--expert-cache",
            "100K",
            "--io",
            io,
            "--measure",
            "--measure-every",
            "2",
        ]));
        assert!(err.contains("measure: expert pages resident"), "{err}");
        // A corrected rate, or (where the drop cannot evict: the mmap backend keeps the
        // expert pages mapped) the line saying the drop had no effect (issue 35 item 19).
        assert!(
            err.contains("invalidations during decode")
                || err.contains("dropping the pages had no effect"),
            "{err}"
        );
    }
}

// ---- item 12: sampler values --------------------------------------------------------

#[test]
fn sampler_values_are_validated() {
    let m = fixture("a-q8_0.gguf");
    let cases: &[(&str, &str)] = &[
        ("--temp", "nan"),
        ("--temp", "inf"),
        ("--repeat-penalty", "0"),
        ("--repeat-penalty", "-1"),
        ("--repeat-penalty", "nan"),
        ("--top-p", "nan"),
        ("--min-p", "nan"),
    ];
    for (flag, v) in cases {
        let out = sluice(&["run", "-m", &m, "--tokens", "1,2", "-n", "2", flag, v]);
        fails_with(&out, &[&format!("{flag} {v}")]);
    }
}

// ---- item 11: output paths checked before the work -----------------------------------

#[test]
fn output_paths_are_checked_before_the_work() {
    let dir = tmp_dir("outpaths");
    let m = fixture("a-q8_0.gguf");
    let missing = dir.join("no/such/dir/trace.bin");
    let out = sluice(&[
        "run",
        "-m",
        &m,
        "--tokens",
        "1,2",
        "-n",
        "2",
        "--record-routing",
        missing.to_str().unwrap(),
    ]);
    fails_with(&out, &["--record-routing", missing.to_str().unwrap()]);
    assert!(!stderr(&out).contains("prefill:"), "{}", stderr(&out));
    // a directory as the trace file: refused up front, nothing left behind
    let out = sluice(&[
        "run",
        "-m",
        &m,
        "--tokens",
        "1,2",
        "-n",
        "2",
        "--record-routing",
        dir.to_str().unwrap(),
    ]);
    fails_with(&out, &["--record-routing", dir.to_str().unwrap()]);
    assert!(!stderr(&out).contains("prefill:"));
    let mut tmp = dir.clone().into_os_string();
    tmp.push(".tmp");
    assert!(!PathBuf::from(tmp).exists(), "a DIR.tmp was left behind");
    // bench --csv onto a directory
    let out = sluice(&[
        "bench",
        "-m",
        &m,
        "-p",
        "4",
        "-n",
        "2",
        "--csv",
        dir.to_str().unwrap(),
    ]);
    fails_with(&out, &["--csv", dir.to_str().unwrap()]);
    assert!(!String::from_utf8_lossy(&out.stdout).contains("tok/s"));
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---- item 15: Ctrl-C in a one-shot run -----------------------------------------------

#[test]
fn ctrl_c_in_one_shot_run_exits_130_with_a_note() {
    let dir = tmp_dir("sigint");
    let m = dir.join("m.gguf");
    // big enough context that generation cannot end before the signal lands
    let o = sluice(&[
        "synth",
        "-o",
        m.to_str().unwrap(),
        "--layers",
        "2",
        "--hidden",
        "256",
        "--experts",
        "4",
        "--top-k",
        "2",
        "--expert-ff",
        "256",
        "--context",
        "65536",
    ]);
    succeeds(&o);
    let mut child = spawn(
        &[
            "run",
            "-m",
            m.to_str().unwrap(),
            "--raw",
            "-p",
            "hello",
            "-n",
            "60000",
            "-c",
            "65536",
            "--temp",
            "0",
        ],
        false,
    );
    // wait until it has loaded the model (the handler is in place by then), then
    // interrupt; stderr is read by a thread that says when the "loaded" line came
    let mut se = std::io::BufReader::new(child.stderr.take().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        loop {
            let mut line = String::new();
            if std::io::BufRead::read_line(&mut se, &mut line).unwrap_or(0) == 0 {
                return all;
            }
            if line.starts_with("loaded ") {
                let _ = tx.send(());
            }
            all.push_str(&line);
        }
    });
    let loaded = rx.recv_timeout(std::time::Duration::from_secs(common::WATCHDOG_SECS));
    if loaded.is_ok() {
        let st = std::process::Command::new("kill")
            .args(["-INT", &child.id().to_string()])
            .status()
            .unwrap();
        assert!(st.success());
    } else {
        let _ = child.kill();
    }
    let out = finish(child, Some(Vec::new()));
    let err = reader.join().unwrap();
    assert!(loaded.is_ok(), "no \"loaded\" line: {err}");
    assert_eq!(exited(&out), 130, "{err}");
    assert!(err.contains("interrupted"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---- item 7: synth onto special files ------------------------------------------------

#[test]
fn synth_refuses_non_regular_targets() {
    // A FIFO of our own stands in for a device node: if the check ever regresses, the
    // test replaces its own FIFO, never a real /dev entry of the machine running it.
    let dir = tmp_dir("synth-fifo");
    let fifo = dir.join("not-a-file");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("mkfifo runs");
    assert!(made.success(), "mkfifo failed");
    let target = fifo.to_str().unwrap();
    let out = sluice(&["synth", "-o", target, "--force", "--layers", "1"]);
    fails_with(&out, &[target, "not a regular file"]);
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::symlink_metadata(&fifo)
        .unwrap()
        .file_type()
        .is_fifo());
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---- item 9: interactive chat survives bad lines -------------------------------------

#[test]
fn chat_survives_invalid_utf8_and_context_overflow() {
    let m = fixture("a-q8_0.gguf");
    // a line of invalid UTF-8, then a normal line: the second is answered
    let out = sluice_limited(
        &["run", "-m", &m, "-n", "3", "--temp", "0"],
        b"\xff\xfe bad\nhello\n",
    );
    let err = succeeds(&out);
    assert!(err.contains("UTF-8"), "{err}");
    assert_eq!(err.matches("prefill:").count(), 1, "{err}");
    // a turn longer than the context: said, skipped, and the next turn answered
    let long = "word ".repeat(400);
    let input = format!("{long}\nhi\n");
    let out = sluice_limited(
        &["run", "-m", &m, "-n", "3", "--temp", "0", "-c", "128"],
        input.as_bytes(),
    );
    let err = succeeds(&out);
    assert!(err.contains("context"), "{err}");
    assert!(err.matches("prefill:").count() >= 1, "{err}");
}

#[test]
fn synth_cleans_up_on_sigterm() {
    let dir = tmp_dir("synth-term");
    let out = dir.join("big.gguf");
    let mut child = spawn(
        &[
            "synth",
            "-o",
            out.to_str().unwrap(),
            "--layers",
            "16",
            "--experts",
            "64",
            "--quant",
            "F32",
        ],
        false,
    );
    // wait for the temporary file to appear (the handler is installed before it is
    // created), then terminate
    let deadline =
        std::time::Instant::now() + std::time::Duration::from_secs(common::WATCHDOG_SECS);
    let temps = || {
        std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
            .count()
    };
    while temps() == 0 && std::time::Instant::now() < deadline {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    let st = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    let o = finish(child, Some(Vec::new()));
    let err = stderr(&o);
    assert_ne!(exited(&o), 0, "{err}");
    assert!(err.contains("interrupted"), "{err}");
    assert_eq!(temps(), 0, "a temporary file was left behind");
    assert!(!out.exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---- item 8: one BOS on chat prompts ----------------------------------------------------

/// The Gemma chat template writes `<bos>` itself; the prompt must hold it once, as
/// llama.cpp's common_chat_templates_apply gives it (it strips the template's leading BOS
/// text when the vocabulary adds one): [2, 105 <start_of_turn>, ...].
#[test]
fn gemma_chat_prompt_has_one_bos() {
    let Some(g) = common::gemma() else { return };
    let dir = tmp_dir("bos");
    let out = sluice(&[
        "run",
        "-m",
        &g,
        "-p",
        "Hi",
        "-n",
        "1",
        "--temp",
        "0",
        "--dump-logits",
        dir.to_str().unwrap(),
    ]);
    succeeds(&out);
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokens.json")).unwrap()).unwrap();
    let ids: Vec<u64> = j["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(&ids[..2], &[2, 105], "{ids:?}");
    assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 1, "{ids:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---- item 4: the model file truncated under a running process --------------------------

/// Interactive chat on a copy of a fixture: answer one line, truncate the file, send
/// another line. The next forward reads truncated pages of the map (SIGBUS): sluice must
/// end with an error naming the file, not by the signal. Resident and streaming (where
/// the resident weights are a locked map) both.
#[test]
fn truncated_model_file_is_an_error_not_sigbus() {
    use std::io::Write;
    let dir = tmp_dir("truncate");
    for (i, extra) in [&[][..], &["--expert-cache", "100%", "--io", "pread"][..]]
        .iter()
        .enumerate()
    {
        let m = dir.join(format!("m{i}.gguf"));
        std::fs::copy(fixture("a-f32.gguf"), &m).unwrap();
        let ms = m.to_str().unwrap();
        let mut args = vec!["run", "-m", ms, "-n", "2", "--temp", "0"];
        args.extend_from_slice(extra);
        let mut child = spawn(&args, false);
        let mut stdin = child.stdin.take().unwrap();
        let mut se = std::io::BufReader::new(child.stderr.take().unwrap());
        let (tx, rx) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            let mut all = String::new();
            loop {
                let mut line = String::new();
                if std::io::BufRead::read_line(&mut se, &mut line).unwrap_or(0) == 0 {
                    return all;
                }
                if line.contains("prefill:") {
                    let _ = tx.send(());
                }
                all.push_str(&line);
            }
        });
        stdin.write_all(b"hello\n").unwrap();
        stdin.flush().unwrap();
        let answered = rx.recv_timeout(std::time::Duration::from_secs(common::WATCHDOG_SECS));
        if answered.is_ok() {
            std::fs::OpenOptions::new()
                .write(true)
                .open(&m)
                .unwrap()
                .set_len(4096)
                .unwrap();
            let _ = stdin.write_all(b"again\n");
        }
        drop(stdin);
        let out = finish(child, None);
        let err = reader.join().unwrap();
        assert!(answered.is_ok(), "the first line was never answered: {err}");
        let code = exited(&out);
        assert_ne!(code, 0, "{err}");
        assert!(
            err.contains(ms) && err.contains("changed while sluice was running"),
            "{err}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
