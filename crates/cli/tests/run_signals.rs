//! How `run` answers signals (issue 35 item 8): one SIGTERM ends it, also at the chat
//! prompt (so `timeout` and `kill` stop it), and a signal during a long prefill acts
//! between chunks, not when the whole prompt is done. Every process runs under the
//! watchdog of `common`.

mod common;

use common::{exited, finish, fixture, spawn};
use std::io::BufRead;
use std::process::{Child, Output};
use std::sync::mpsc;
use std::time::Duration;

/// Start `sluice args`, wait for its "loaded" line (the handlers are in place by then),
/// send `signal`, and return the output (stdin left open) with all of stderr.
fn signal_after_load(args: &[&str], signal: &str) -> (Output, String) {
    let mut child: Child = spawn(args, false);
    let mut se = std::io::BufReader::new(child.stderr.take().unwrap());
    let (tx, rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        loop {
            let mut line = String::new();
            if se.read_line(&mut line).unwrap_or(0) == 0 {
                return all;
            }
            if line.starts_with("loaded ") {
                let _ = tx.send(());
            }
            all.push_str(&line);
        }
    });
    let loaded = rx.recv_timeout(Duration::from_secs(common::WATCHDOG_SECS));
    if loaded.is_ok() {
        let st = std::process::Command::new("kill")
            .args([signal, &child.id().to_string()])
            .status()
            .unwrap();
        assert!(st.success());
    } else {
        let _ = child.kill();
    }
    let out = finish(child, None);
    let err = reader.join().unwrap();
    assert!(loaded.is_ok(), "no \"loaded\" line: {err}");
    (out, err)
}

#[test]
fn one_sigterm_ends_the_chat() {
    // Interactive chat waiting on a stdin that never ends: before, SIGTERM only set the
    // stop flag of an answer that was not running, and `run` waited for input for good.
    let m = fixture("a-q8_0.gguf");
    let (out, err) = signal_after_load(&["run", "-m", &m, "-n", "3", "--temp", "0"], "-TERM");
    assert_eq!(exited(&out), 143, "{err}");
}

/// `signal` right after loading, during a 6000-token prompt prefilled in chunks of 8 (Gemma):
/// `run` exits `code` saying `said`, with fewer than the whole prompt evaluated. Before, the
/// prefill ran to the end of the prompt whatever the signal.
fn long_prefill_stopped_by(signal: &str, code: i32, said: &str) {
    let Some(g) = common::gemma() else { return };
    const N: usize = 6000;
    let ids: Vec<String> = (0..N)
        .map(|i| (100 + (i * 7) % 20000).to_string())
        .collect();
    let ids = ids.join(",");
    let (out, err) = signal_after_load(
        &[
            "run", "-m", &g, "--tokens", &ids, "-n", "4", "-b", "8", "-c", "8192", "--temp", "0",
        ],
        signal,
    );
    assert_eq!(exited(&out), code, "{err}");
    assert!(err.contains(said), "{err}");
    let line = err
        .lines()
        .find(|l| l.starts_with("prefill: "))
        .unwrap_or_else(|| panic!("no prefill line: {err}"));
    let done: usize = line["prefill: ".len()..]
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        done < N,
        "the whole prompt was evaluated after {signal}: {line}"
    );
}

#[test]
fn sigterm_during_a_long_prefill_stops_it_between_chunks() {
    long_prefill_stopped_by("-TERM", 143, "terminated after 0 generated tokens");
}

#[test]
fn ctrl_c_during_a_long_prefill_stops_it_between_chunks() {
    long_prefill_stopped_by("-INT", 130, "interrupted after 0 generated tokens");
}
