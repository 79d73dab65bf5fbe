//! `--lookahead` / `--no-lookahead` reach the streaming tier: with lookahead on, `bench
//! --stats` reports router-lookahead predictions and the bench CSV carries its columns;
//! off, nothing is predicted; the two flags together are refused (issue 35 item 20).

mod common;

use common::{fixture, sluice, tmp_dir};

#[test]
fn lookahead_flags_switch_predictions() {
    let m = fixture("a-q8_0.gguf");
    let dir = tmp_dir("lookahead");
    for (i, (flags, on)) in [
        (&["--lookahead"][..], true),
        (&["--no-lookahead"][..], false),
    ]
    .into_iter()
    .enumerate()
    {
        let csv = dir.join(format!("b{i}.csv"));
        let mut args = vec![
            "bench",
            "-m",
            &m,
            "-t",
            "1",
            "-p",
            "0",
            "-n",
            "8",
            "-r",
            "1",
            "--no-warmup",
            "--expert-cache",
            "60%",
            "--io",
            "pread",
            "--stats",
            "--csv",
            csv.to_str().unwrap(),
        ];
        args.extend_from_slice(flags);
        let out = sluice(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{flags:?}: {err}");
        assert_eq!(
            err.contains("lookahead (router of layer L+1"),
            on,
            "{flags:?}: lookahead line in --stats: {err}"
        );
        let text = std::fs::read_to_string(&csv).unwrap();
        let mut lines = text.lines();
        let header: Vec<&str> = lines.next().unwrap().split(',').collect();
        let row: Vec<&str> = lines.next().unwrap().split(',').collect();
        assert_eq!(header.len(), row.len(), "{flags:?}: CSV header and row");
        let col = |name: &str| row[header.iter().position(|h| *h == name).unwrap()];
        let accuracy: f64 = col("la_accuracy").parse().unwrap();
        assert_eq!(accuracy > 0.0, on, "{flags:?}: accuracy {accuracy}");
        assert!(col("la_issued").parse::<u64>().is_ok());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--lookahead --no-lookahead` (either order) is refused, naming both flags, in every
/// command that takes them; before, the last one silently won.
#[test]
fn lookahead_and_no_lookahead_together_are_refused() {
    let m = fixture("a-q8_0.gguf");
    // What each command would otherwise do quickly (serve: refuse --ctx 0, so that a
    // server that starts does not wait for the watchdog).
    let rest: [(&str, &[&str]); 3] = [
        ("run", &["--raw", "-p", "a b", "-n", "1"]),
        ("bench", &["-p", "0", "-n", "1", "-r", "1", "--no-warmup"]),
        ("serve", &["--port", "0", "--ctx", "0"]),
    ];
    for (cmd, extra) in rest {
        for pair in [
            ["--lookahead", "--no-lookahead"],
            ["--no-lookahead", "--lookahead"],
        ] {
            let mut args = vec![cmd, "-m", &m, "-t", "1", "--expert-cache", "60%"];
            args.extend_from_slice(extra);
            args.extend_from_slice(&pair);
            let out = sluice(&args);
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{cmd} {pair:?} was accepted: {err}");
            assert!(
                err.contains("--lookahead") && err.contains("--no-lookahead"),
                "{cmd} {pair:?}: {err}"
            );
            assert!(!err.contains("panicked"), "{err}");
        }
    }
}
