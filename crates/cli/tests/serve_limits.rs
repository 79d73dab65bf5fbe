//! `sluice serve` refuses limits that cannot mean anything at start, with a one-line error
//! naming the flag, instead of serving (issue 35 items 9 and 17). Every wait is bounded.

mod common;

use common::{fixture, sluice};

/// Runs `sluice serve -m FIXTURE --port 0 EXTRA` under the suite's watchdog (a server
/// that starts never exits: the watchdog then fails the test, saying it hangs); returns
/// (exited non-zero, stderr).
fn serve_start(extra: &[&str]) -> (bool, String) {
    let fx = fixture("a-q8_0.gguf");
    let mut args = vec!["serve", "-m", &fx, "--port", "0"];
    args.extend_from_slice(extra);
    let out = sluice(&args);
    (
        !out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
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

/// The connection timeouts (issue 35 item 4) refuse 0 at start, naming the flag: a
/// timeout of nothing would close every connection at once.
#[test]
fn serve_refuses_zero_timeouts() {
    for flag in ["--header-timeout", "--body-timeout", "--idle-timeout"] {
        for zero in ["0", "0s", "0ms"] {
            let (refused, err) = serve_start(&[flag, zero]);
            assert!(refused, "{flag} {zero} was accepted: {err}");
            assert!(
                err.contains(flag) && err.contains("more than 0"),
                "{flag} {zero}: {err}"
            );
        }
    }
}
