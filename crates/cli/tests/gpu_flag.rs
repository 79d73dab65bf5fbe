//! `--gpu` on a machine without a usable GPU: one line saying why, then the CPU run with
//! logits byte-identical to a run without the flag. On a machine with one, the run says
//! which GPU it uses. `--gpu-expert-cache` without `--gpu` is refused.

mod common;

use common::{fixture, sluice, tmp_dir};
use std::path::Path;

fn has_nvidia_node() -> bool {
    Path::new("/dev/nvidia0").exists()
}

#[test]
fn gpu_flag_without_a_gpu_says_so_and_runs_on_the_cpu() {
    let dir = tmp_dir("gpu-flag");
    let model = fixture("a-q8_0.gguf");
    let run = |extra: &[&str], out: &Path| {
        let mut args = vec![
            "run",
            "-m",
            &model,
            "--tokens",
            "344,435,16,106,240,341",
            "-n",
            "4",
            "--temp",
            "0",
            "--dump-logits",
            out.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        sluice(&args)
    };
    let (cpu_dir, gpu_dir) = (dir.join("cpu"), dir.join("gpu"));
    let cpu = run(&[], &cpu_dir);
    assert!(
        cpu.status.success(),
        "{}",
        String::from_utf8_lossy(&cpu.stderr)
    );
    let gpu = run(&["--gpu"], &gpu_dir);
    let err = String::from_utf8_lossy(&gpu.stderr);
    assert!(gpu.status.success(), "{err}");
    if has_nvidia_node() {
        assert!(
            err.lines()
                .any(|l| l.starts_with("gpu: ") || l.starts_with("--gpu: ")),
            "{err}"
        );
    } else {
        let lines: Vec<&str> = err.lines().filter(|l| l.contains("--gpu")).collect();
        assert_eq!(lines.len(), 1, "one line about --gpu: {err}");
        assert!(lines[0].ends_with("running on the CPU"), "{}", lines[0]);
        let a = std::fs::read(cpu_dir.join("logits.npy")).unwrap();
        let b = std::fs::read(gpu_dir.join("logits.npy")).unwrap();
        assert!(a == b, "--gpu without a GPU changed the logits");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn gpu_expert_cache_needs_gpu() {
    let model = fixture("a-q8_0.gguf");
    let out = sluice(&[
        "run",
        "-m",
        &model,
        "--tokens",
        "1,2",
        "-n",
        "1",
        "--gpu-expert-cache",
        "1M",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.lines()
            .last()
            .unwrap_or("")
            .contains("--gpu-expert-cache needs --gpu"),
        "{err}"
    );
}
