//! Every model-loading flag means the same in `run`, `bench` and `serve`, or is refused
//! where it does not apply (issue 29 item 3, issue 35 items 5 and 9): `serve --gpu` prints
//! the device line `run --gpu` prints (on a machine without CUDA: the same reason, then the
//! CPU); combinations that cannot work are refused with a message naming the flags;
//! `serve --record-routing` writes a trace `cache-sim` replays and `serve --stats` reports
//! at exit; a `--parallel` whose KV caches do not fit is refused at start, saying how much
//! they need. Every wait is bounded (a server that starts when it should not is stopped and
//! the test fails, saying so).

mod common;
use common::http;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{fixture, sluice, tmp_dir};

const TIMEOUT: Duration = Duration::from_secs(120);

/// A `sluice serve` child with its stderr lines arriving on a channel.
struct Serving {
    child: Child,
    lines: mpsc::Receiver<String>,
    /// Every stderr line read so far.
    seen: Vec<String>,
}

impl Drop for Serving {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// How a `sluice serve` start ended.
enum Start {
    /// The process exited by itself: its status code and stderr.
    Exited(i32, String),
    /// The model loaded (the `loaded ...` line): the server, still running.
    Loaded(Serving),
}

/// `sluice serve -m MODEL --port 0 -t 1 EXTRA`, until it exits or says it loaded.
fn serve(model: &str, extra: &[&str]) -> Start {
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["serve", "-m", model, "--port", "0", "-t", "1"])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut s = Serving {
        child,
        lines: rx,
        seen: Vec::new(),
    };
    let t0 = Instant::now();
    loop {
        match s.lines.recv_timeout(Duration::from_millis(50)) {
            Ok(line) => {
                let loaded = line.starts_with("loaded ");
                s.seen.push(line);
                if loaded {
                    return Start::Loaded(s);
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let st = s.child.wait().unwrap();
                let code = st.code().expect("serve exited by itself, not by a signal");
                return Start::Exited(code, s.seen.join("\n"));
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        assert!(t0.elapsed() < TIMEOUT, "serve neither loaded nor exited");
    }
}

impl Serving {
    /// The address from the `listening on` line.
    fn addr(&self) -> String {
        self.seen
            .iter()
            .find_map(|l| l.strip_prefix("listening on http://"))
            .expect("serve prints where it listens")
            .trim()
            .to_string()
    }

    /// SIGTERM, then every remaining stderr line and the exit code (bounded).
    fn stop(mut self) -> (i32, String) {
        let pid = self.child.id().to_string();
        assert!(Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success());
        let t0 = Instant::now();
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            assert!(t0.elapsed() < TIMEOUT, "serve did not exit after SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        };
        // The reader thread ends at EOF once the process is gone.
        while let Ok(l) = self.lines.recv_timeout(TIMEOUT) {
            self.seen.push(l);
        }
        (
            status.code().expect("exited, not killed"),
            self.seen.join("\n"),
        )
    }
}

/// The lines about the device (`--gpu: ...` when no GPU is usable, `gpu: ...` when one
/// is), each number masked as one `#` (kernel compile and upload times differ between
/// runs: the first compiles, later ones find NVRTC's cache).
fn device_lines(stderr: &str) -> Vec<String> {
    stderr
        .lines()
        .filter(|l| l.starts_with("--gpu:") || l.starts_with("gpu:"))
        .map(|l| {
            let mut out = String::new();
            for c in l.chars() {
                let in_number = out.ends_with('#');
                if c.is_ascii_digit() || (c == '.' && in_number) {
                    if !in_number {
                        out.push('#');
                    }
                } else {
                    out.push(c);
                }
            }
            out
        })
        .collect()
}

/// Asserts `serve EXTRA` is refused (exits non-zero by itself, no panic) with a message
/// naming every one of `names`.
fn assert_serve_refused(extra: &[&str], names: &[&str]) {
    match serve(&fixture("a-q8_0.gguf"), extra) {
        Start::Loaded(s) => {
            let (_, err) = s.stop();
            panic!("serve {extra:?} was accepted and served: {err}");
        }
        Start::Exited(code, err) => {
            assert_ne!(code, 0, "{extra:?}: {err}");
            assert!(!err.contains("panicked"), "{extra:?}: {err}");
            for n in names {
                assert!(
                    err.contains(n),
                    "{extra:?}: the error does not name {n}: {err}"
                );
            }
        }
    }
}

/// Asserts `run EXTRA` (a one-token generation on the tiny fixture) is refused naming
/// every one of `names`.
fn assert_run_refused(extra: &[&str], names: &[&str]) {
    let fx = fixture("a-q8_0.gguf");
    let mut args = vec!["run", "-m", &fx, "--tokens", "1,2", "-n", "1"];
    args.extend_from_slice(extra);
    let out = sluice(&args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_ne!(common::exited(&out), 0, "{extra:?} was accepted: {err}");
    assert!(!err.contains("panicked"), "{extra:?}: {err}");
    for n in names {
        assert!(
            err.contains(n),
            "{extra:?}: the error does not name {n}: {err}"
        );
    }
}

#[test]
fn serve_gpu_prints_the_device_line_run_prints() {
    let fx = fixture("a-q8_0.gguf");
    let out = sluice(&["run", "-m", &fx, "--tokens", "1,2", "-n", "1", "--gpu"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let ran = device_lines(&err);
    assert!(
        !ran.is_empty(),
        "run --gpu says nothing about the device: {err}"
    );
    let s = match serve(&fx, &["--gpu"]) {
        Start::Loaded(s) => s,
        Start::Exited(code, err) => panic!("serve --gpu exited {code}: {err}"),
    };
    let (code, err) = s.stop();
    assert_eq!(code, 0, "{err}");
    assert_eq!(device_lines(&err), ran, "serve --gpu: {err}");
}

#[test]
fn combinations_that_cannot_work_are_refused_in_run_and_serve() {
    let needs_gpu: &[&str] = &["--gpu-expert-cache", "1M"];
    assert_run_refused(needs_gpu, &["--gpu-expert-cache", "--gpu"]);
    assert_serve_refused(needs_gpu, &["--gpu-expert-cache", "--gpu"]);
    let needs_cache: &[&str] = &["--resident-layers", "1"];
    assert_run_refused(needs_cache, &["--resident-layers", "--expert-cache"]);
    assert_serve_refused(needs_cache, &["--resident-layers", "--expert-cache"]);
    // Flags that shape the streaming tier mean nothing without one.
    for f in [
        &["--io", "pread"][..],
        &["--no-pack"][..],
        &["--cache-policy", "lru"][..],
    ] {
        assert_run_refused(f, &["--expert-cache", f[0]]);
        assert_serve_refused(f, &["--expert-cache", f[0]]);
    }
    // --measure times one decode (run, bench); a server has /metrics instead.
    assert_serve_refused(&["--measure"], &["--measure"]);
    assert_run_refused(&["--measure-every", "4"], &["--measure"]);
    // A routing trace is one sequence's: with several at once it would interleave them.
    let dir = tmp_dir("load-flags-refused");
    let trace = dir.join("t.bin");
    assert_serve_refused(
        &[
            "--parallel",
            "2",
            "--record-routing",
            trace.to_str().unwrap(),
        ],
        &["--record-routing", "--parallel"],
    );
    assert!(!trace.exists());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn serve_record_routing_and_stats_report_at_exit() {
    let dir = tmp_dir("load-flags-trace");
    let trace = dir.join("served.bin");
    let s = match serve(
        &fixture("a-q8_0.gguf"),
        &[
            "--expert-cache",
            "100K",
            "--io",
            "pread",
            "--stats",
            "--record-routing",
            trace.to_str().unwrap(),
        ],
    ) {
        Start::Loaded(s) => s,
        Start::Exited(code, err) => panic!("serve exited {code}: {err}"),
    };
    let addr = s.addr();
    let (st, body) = http(
        &addr,
        "POST",
        "/v1/completions",
        r#"{"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0}"#,
    );
    assert_eq!(st, 200, "{body}");
    let (code, err) = s.stop();
    assert_eq!(code, 0, "{err}");
    // --stats: the same report as run's, over what was served.
    let reconcile = err
        .lines()
        .find(|l| l.starts_with("reconcile:"))
        .unwrap_or_else(|| panic!("no --stats report at exit: {err}"));
    assert!(reconcile.contains("(ok)"), "{reconcile}");
    assert!(
        err.lines()
            .any(|l| l.starts_with("cache:") && l.contains("evictions")),
        "{err}"
    );
    // --record-routing: written at exit, and cache-sim replays it.
    assert!(trace.exists(), "no routing trace written: {err}");
    common::assert_cache_sim_replays(&trace);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn serve_parallel_whose_kv_does_not_fit_is_refused() {
    // 2 layers x 8 KV heads x 128 dims, keys and values, f32 rows: 16 KiB a position, so
    // 1024 sequences of 2^20 positions need 16 TiB: more than any machine this runs on.
    let dir = tmp_dir("load-flags-kv");
    let model = dir.join("long.gguf");
    let m = model.to_str().unwrap();
    let out = sluice(&[
        "synth",
        "--preset",
        "tiny",
        "--layers",
        "2",
        "--heads",
        "8",
        "--kv-heads",
        "8",
        "--head-dim",
        "128",
        "--context",
        "1048576",
        "-o",
        m,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for extra in [&[][..], &["--expert-cache", "auto"][..]] {
        let mut args = vec!["--parallel", "1024", "-c", "1048576"];
        args.extend_from_slice(extra);
        match serve(m, &args) {
            Start::Loaded(s) => {
                let (_, err) = s.stop();
                panic!("serve {args:?} started: {err}");
            }
            Start::Exited(code, err) => {
                assert_ne!(code, 0, "{err}");
                let line = err
                    .lines()
                    .find(|l| l.starts_with("error:"))
                    .unwrap_or_else(|| panic!("no error line: {err}"));
                assert!(
                    line.contains("--parallel") && line.contains("1024 sequences"),
                    "{line}"
                );
                assert!(
                    line.contains("16.00 TiB"),
                    "says how much they need: {line}"
                );
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}
