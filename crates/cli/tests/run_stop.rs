//! `run --stop TEXT`: the answer ends where a stop string first appears, which is not
//! printed (the quickstart's Gemma answer stops at the end of its line, issue 32). Checked
//! against the same greedy run without a stop string: the stopped output is exactly that
//! text up to the stop string's first occurrence.

mod common;

use common::{gemma, sluice};

fn stdout_of(args: &[&str]) -> String {
    let out = sluice(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn stop_string_ends_the_answer_before_it() {
    let Some(g) = gemma() else { return };
    let prompt = "Question: What is the capital of France?\nAnswer:";
    let base = [
        "run", "-m", &g, "--raw", "-p", prompt, "-n", "24", "--temp", "0",
    ];
    let full = stdout_of(&base);
    for (flag, stop) in [("\\n", "\n"), ("Question", "Question")] {
        let mut args = base.to_vec();
        args.extend(["--stop", flag]);
        let stopped = stdout_of(&args);
        let cut = full
            .find(stop)
            .unwrap_or_else(|| panic!("the unstopped answer has no {stop:?}: {full:?}"));
        // run ends its output with one newline of its own.
        assert_eq!(stopped, format!("{}\n", &full[..cut]), "--stop {flag}");
    }
}

#[test]
fn empty_or_badly_escaped_stop_is_refused() {
    for bad in ["", "\\q"] {
        let out = sluice(&["run", "-m", "/nonexistent.gguf", "-p", "x", "--stop", bad]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "--stop {bad:?} accepted");
        assert!(err.contains("--stop"), "{err}");
    }
}
