//! Helpers shared by the CLI integration tests: a scratch directory and the built binary,
//! always run under a watchdog (a hang fails the test instead of hanging the suite).
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Seconds after which a sluice process is killed and its test fails (a watchdog, not a
/// timing assertion: every case finishes in a fraction of this).
pub const WATCHDOG_SECS: u64 = 300;

/// Virtual-memory limit (KiB) of [`sluice_limited`]: far above what the tiny models need,
/// far below what an unbounded read would reach.
pub const VM_LIMIT_KIB: u64 = 4 << 20;

/// The real Gemma 3 270M (`SLUICE_GEMMA`), or None (the test then skips, saying so);
/// with `SLUICE_REQUIRE_MODELS=1` a missing model fails the test instead.
pub fn gemma() -> Option<String> {
    match std::env::var("SLUICE_GEMMA") {
        Ok(g) => Some(g),
        Err(_) if std::env::var("SLUICE_REQUIRE_MODELS").as_deref() == Ok("1") => {
            panic!("SLUICE_GEMMA is not set (and SLUICE_REQUIRE_MODELS=1)")
        }
        Err(_) => {
            eprintln!("note: SLUICE_GEMMA not set; skipping");
            None
        }
    }
}

/// Path of a tiny qwen3moe fixture (`tests/fixtures/qwen3moe/NAME`).
pub fn fixture(name: &str) -> String {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/qwen3moe")
        .join(name)
        .to_string_lossy()
        .into_owned()
}

/// A fresh scratch directory for one test (per test binary, by process id).
pub fn tmp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("sluice-cli-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Run the built `sluice` binary (stdin empty) under the watchdog.
pub fn sluice(args: &[&str]) -> Output {
    let child = spawn(args, false);
    finish(child, Some(Vec::new()))
}

/// Run the built `sluice` binary under the watchdog and a virtual-memory ulimit, with
/// `stdin` as its standard input.
pub fn sluice_limited(args: &[&str], stdin: &[u8]) -> Output {
    let child = spawn(args, true);
    finish(child, Some(stdin.to_vec()))
}

/// Start `sluice` with piped stdin/stdout/stderr (under the VM ulimit if `limit`). The
/// child's pid is sluice's own (the shell execs it), so signals sent to it reach sluice.
pub fn spawn(args: &[&str], limit: bool) -> Child {
    let bin = env!("CARGO_BIN_EXE_sluice");
    let mut cmd = if limit {
        let mut c = Command::new("sh");
        c.arg("-c")
            .arg(format!("ulimit -v {VM_LIMIT_KIB} && exec \"$0\" \"$@\""))
            .arg(bin);
        c
    } else {
        Command::new(bin)
    };
    cmd.args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Feed `stdin` (then close it; None leaves it open), collect the output (stdout or stderr
/// empty if the caller took it), and kill the
/// child if it outlives the watchdog (the test then fails, saying so).
pub fn finish(mut child: Child, stdin: Option<Vec<u8>>) -> Output {
    let feeder = match (child.stdin.take(), stdin) {
        (Some(mut s), Some(data)) => Some(std::thread::spawn(move || {
            let _ = s.write_all(&data);
        })),
        (Some(s), None) => {
            std::mem::forget(s);
            None
        }
        _ => None,
    };
    // stdout may already have been taken by the caller (who then drains it)
    let out_pipe = child.stdout.take();
    let err_pipe = child.stderr.take();
    let out_t = std::thread::spawn(move || {
        let mut v = Vec::new();
        if let Some(mut p) = out_pipe {
            let _ = p.read_to_end(&mut v);
        }
        v
    });
    let err_t = std::thread::spawn(move || {
        let mut v = Vec::new();
        if let Some(mut p) = err_pipe {
            let _ = p.read_to_end(&mut v);
        }
        v
    });
    let deadline = Instant::now() + Duration::from_secs(WATCHDOG_SECS);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("sluice did not finish within {WATCHDOG_SECS} s (killed): it hangs");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    if let Some(f) = feeder {
        let _ = f.join();
    }
    Output {
        status,
        stdout: out_t.join().unwrap(),
        stderr: err_t.join().unwrap(),
    }
}

/// The process ended by itself (an exit status, not a signal such as SIGBUS, SIGABRT or
/// SIGKILL from the OOM killer).
pub fn exited(out: &Output) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    match out.status.code() {
        Some(c) => c,
        None => panic!(
            "sluice was killed by signal {:?}; stderr: {}",
            out.status.signal(),
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

/// How long `http` waits for a response.
pub const HTTP_TIMEOUT: Duration = Duration::from_secs(120);

/// One HTTP/1.1 request (Connection: close, read timeout `HTTP_TIMEOUT`); returns status
/// and body.
pub fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(HTTP_TIMEOUT)).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap();
    let body = out.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
    (status, body.to_string())
}

/// `sluice cache-sim` replays the routing trace at `trace` (a table with Belady and LRU).
pub fn assert_cache_sim_replays(trace: &std::path::Path) {
    let sim = sluice(&["cache-sim", trace.to_str().unwrap(), "--budget", "50%"]);
    let text =
        String::from_utf8_lossy(&sim.stdout).to_string() + &String::from_utf8_lossy(&sim.stderr);
    assert!(sim.status.success(), "{text}");
    assert!(text.contains("belady") && text.contains("lru"), "{text}");
}
