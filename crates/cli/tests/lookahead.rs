//! `--lookahead` / `--no-lookahead` reach the streaming tier: with lookahead on, `bench
//! --stats` reports router-lookahead predictions and the bench CSV carries its columns;
//! off, nothing is predicted; the last of the two flags wins.

mod common;

use common::{fixture, sluice, tmp_dir};

#[test]
fn lookahead_flags_switch_predictions() {
    let m = fixture("a-q8_0.gguf");
    let dir = tmp_dir("lookahead");
    for (i, (flags, on)) in [
        (&["--lookahead"][..], true),
        (&["--no-lookahead"][..], false),
        (&["--lookahead", "--no-lookahead"][..], false),
        (&["--no-lookahead", "--lookahead"][..], true),
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
