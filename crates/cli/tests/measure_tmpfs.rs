//! `--measure` on a file whose pages cannot be dropped (tmpfs) says so and prints no
//! "corrected" rate (issue 35 item 19); before, it printed a corrected rate although
//! every page stayed resident. Skipped where /dev/shm is not a tmpfs.

mod common;

use common::{fixture, sluice};

fn dev_shm_is_tmpfs() -> bool {
    std::fs::read_to_string("/proc/self/mountinfo").is_ok_and(|m| {
        m.lines().any(|l| {
            let (left, right) = l.split_once(" - ").unwrap_or(("", ""));
            left.split_whitespace().nth(4) == Some("/dev/shm")
                && right.split_whitespace().next() == Some("tmpfs")
        })
    })
}

#[test]
fn measure_on_tmpfs_says_the_drop_had_no_effect() {
    if !dev_shm_is_tmpfs() {
        eprintln!("note: /dev/shm is not a tmpfs; skipping");
        return;
    }
    let copy = format!("/dev/shm/sluice-measure-{}.gguf", std::process::id());
    std::fs::copy(fixture("a-q8_0.gguf"), &copy).unwrap();
    let out = sluice(&[
        "bench",
        "-m",
        &copy,
        "-t",
        "1",
        "-p",
        "0",
        "-n",
        "8",
        "-r",
        "1",
        "--no-warmup",
        "--measure",
        "--measure-every",
        "2",
    ]);
    let _ = std::fs::remove_file(&copy);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("no effect") && err.contains("tmpfs"),
        "the report does not say the drop had no effect: {err}"
    );
    assert!(!err.contains("tok/s, corrected"), "a corrected rate: {err}");
}
