//! Issue 35 item 2: a pack sidecar is bound to the expert data it was packed from. Through
//! the CLI, on `sluice synth` models that share header and tensor table (seed 0 and seed 1):
//! a sidecar packed from the other seed, placed where `run` picks it up by default, and a
//! sidecar with damaged expert data both end the run with one error line naming the
//! sidecar (never logits); a correct sidecar gives logits identical, bit for bit, to none.

mod common;

use std::path::Path;
use std::process::Output;

use common::{sluice, tmp_dir};

fn succeeds(out: &Output) {
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A non-zero exit whose stderr's last line is the one error naming `needle`, no panic.
fn refused_naming(out: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected a refusal, stderr: {err}");
    assert!(!err.contains("panicked"), "{err}");
    let last = err.lines().last().unwrap_or("");
    assert!(
        last.starts_with("error: ") && last.contains(needle),
        "last line should be the error naming {needle}: {err}"
    );
    assert_eq!(
        err.lines().filter(|l| l.starts_with("error")).count(),
        1,
        "one error line: {err}"
    );
}

fn synth(m: &Path, seed: &str) {
    succeeds(&sluice(&[
        "synth",
        "-o",
        m.to_str().unwrap(),
        "--layers",
        "2",
        "--hidden",
        "256",
        "--experts",
        "8",
        "--top-k",
        "2",
        "--expert-ff",
        "256",
        "--seed",
        seed,
    ]));
}

/// `run` over a few tokens, streaming experts; the logits go to `dump`/logits.npy.
fn run(m: &Path, dump: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "run",
        "-m",
        m.to_str().unwrap(),
        "--tokens",
        "1,2,3,4,5,6",
        "-n",
        "1",
        "--temp",
        "0",
        "--expert-cache",
        "100%",
        "--dump-logits",
        dump.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    sluice(&args)
}

#[test]
fn sidecar_from_other_data_or_damaged_is_refused_correct_one_identical() {
    let dir = tmp_dir("pack-bind");
    let m0 = dir.join("m0.gguf");
    let m1 = dir.join("m1.gguf");
    synth(&m0, "0");
    synth(&m1, "1");
    let side0 = dir.join("m0.gguf.slpack");
    // Without a sidecar, then with the correct one (picked up by default).
    let none = dir.join("none");
    succeeds(&run(&m0, &none, &["--no-pack"]));
    succeeds(&sluice(&["pack", m0.to_str().unwrap()]));
    assert!(side0.exists());
    let good = dir.join("good");
    succeeds(&run(&m0, &good, &[]));
    let want = std::fs::read(none.join("logits.npy")).unwrap();
    assert!(want.len() > 1024);
    assert_eq!(
        std::fs::read(good.join("logits.npy")).unwrap(),
        want,
        "a correct sidecar must give the same logits, bit for bit"
    );
    let packed = std::fs::read(&side0).unwrap();

    // Another seed's sidecar under m0's default sidecar name.
    succeeds(&sluice(&["pack", m1.to_str().unwrap()]));
    std::fs::copy(dir.join("m1.gguf.slpack"), &side0).unwrap();
    let foreign = dir.join("foreign");
    refused_naming(&run(&m0, &foreign, &[]), "m0.gguf.slpack");
    assert!(!foreign.join("logits.npy").exists());

    // A flipped byte in every 4 KiB page of the expert data (every expert starts on one).
    let header_len = u64::from_le_bytes(packed[40..48].try_into().unwrap()) as usize;
    let mut bad = packed.clone();
    for at in (header_len + 7..bad.len()).step_by(4096) {
        bad[at] ^= 0x04;
    }
    std::fs::write(&side0, &bad).unwrap();
    let flipped = dir.join("flipped");
    refused_naming(&run(&m0, &flipped, &[]), "m0.gguf.slpack");
    assert!(!flipped.join("logits.npy").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}
