//! `sluice serve` refuses limits that cannot mean anything at start, with a one-line error
//! naming the flag, instead of serving (issue 35 items 9 and 17). Every wait is bounded.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Hang detection only: a refused start exits at once; a server that starts never does.
const WATCHDOG: Duration = Duration::from_secs(60);

fn fixture() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/qwen3moe/a-q8_0.gguf")
        .to_string_lossy()
        .into_owned()
}

/// Runs `sluice serve -m FIXTURE --port 0 EXTRA`; returns (exited non-zero, stderr).
/// A server still running after the watchdog is killed and counts as accepted.
fn serve_start(extra: &[&str]) -> (bool, String) {
    let fx = fixture();
    let mut args = vec!["serve", "-m", &fx, "--port", "0"];
    args.extend_from_slice(extra);
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let refused = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break !st.success();
        }
        if t0.elapsed() > WATCHDOG {
            child.kill().unwrap();
            child.wait().unwrap();
            return (false, "still serving after the watchdog".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    use std::io::Read;
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    (refused, err)
}

fn assert_refused(extra: &[&str], flag: &str) {
    let (refused, err) = serve_start(extra);
    assert!(refused, "{extra:?} was accepted: {err}");
    assert!(
        err.contains(flag),
        "{extra:?}: error does not name {flag}: {err}"
    );
    assert!(!err.contains("panicked"), "{extra:?}: {err}");
}

#[test]
fn serve_refuses_zero_ctx() {
    assert_refused(&["--ctx", "0"], "--ctx");
}

#[test]
fn serve_refuses_zero_max_body() {
    assert_refused(&["--max-body", "0"], "--max-body");
}

#[test]
fn serve_refuses_zero_max_tokens() {
    assert_refused(&["--max-tokens", "0"], "--max-tokens");
}

#[test]
fn serve_refuses_absurd_parallel() {
    assert_refused(&["--parallel", "100000"], "--parallel");
    assert_refused(&["--parallel", "0"], "--parallel");
}
