//! Sidecar files that are not regular files (issue 35, item 8): a FIFO, directory or
//! device named like a pack sidecar or given as a popularity profile is refused with an
//! error naming it, never opened (opening a FIFO blocks until a writer appears, so `run`
//! hung for good). Every case runs under a watchdog: a hang fails the test.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use sluice_tier::{PackFile, Profile, UnitGroup};

/// Seconds after which a case counts as hung (a watchdog, not a timing assertion: each
/// case finishes in microseconds).
const WATCHDOG_SECS: u64 = 120;

fn tmp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("sluice-tier-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn mkfifo(p: &Path) {
    let st = std::process::Command::new("mkfifo")
        .arg(p)
        .status()
        .unwrap();
    assert!(st.success());
}

/// Runs `f` on its own thread; its error message, or a failure if it hangs or succeeds.
fn error_within_watchdog<T: Send + 'static>(
    what: &str,
    f: impl FnOnce() -> Result<T, String> + Send + 'static,
) -> String {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f().err());
    });
    match rx.recv_timeout(Duration::from_secs(WATCHDOG_SECS)) {
        Ok(Some(e)) => e,
        Ok(None) => panic!("{what}: accepted"),
        Err(_) => panic!("{what}: still blocked after {WATCHDOG_SECS} s"),
    }
}

#[test]
fn a_fifo_or_directory_named_as_a_pack_sidecar_is_refused_without_blocking() {
    let dir = tmp_dir("pack-fifo");
    let model = dir.join("m.gguf");
    std::fs::write(&model, b"not read").unwrap();
    let fifo = sluice_tier::pack::default_path(&model);
    mkfifo(&fifo);
    let sub = dir.join("d.slpack");
    std::fs::create_dir_all(&sub).unwrap();
    for p in [fifo.clone(), sub, PathBuf::from("/dev/zero")] {
        let (pc, mc) = (p.clone(), model.clone());
        let e = error_within_watchdog(&p.display().to_string(), move || {
            PackFile::open(&pc, &mc, &[], 0, &UnitGroup::default())
                .map(|_| ())
                .map_err(|e| e.to_string())
        });
        assert!(!e.contains('\n'), "not one line: {e}");
        assert!(e.contains(&p.display().to_string()), "path not named: {e}");
        assert!(e.contains("not a regular file"), "{e}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_fifo_given_as_a_popularity_profile_is_refused_without_blocking() {
    let dir = tmp_dir("profile-fifo");
    let fifo = dir.join("hot.profile");
    mkfifo(&fifo);
    let p = fifo.clone();
    let e = error_within_watchdog("profile FIFO", move || {
        Profile::read(&p).map(|_| ()).map_err(|e| e.to_string())
    });
    assert!(
        e.contains(&fifo.display().to_string()),
        "path not named: {e}"
    );
    assert!(e.contains("not a regular file"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
