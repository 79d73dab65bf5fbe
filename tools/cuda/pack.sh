#!/usr/bin/env bash
# Build the release binary and the CUDA test binaries and put them, stripped and gzipped, with the
# fixtures they read and device-check.sh, into DEST (for a GPU machine without Rust).
#   [OLD=path/to/older/sluice] tools/cuda/pack.sh DEST
# (OLD: an older release binary to compare with, packed as sluice-old.)
set -euo pipefail
DEST=${1:?usage: tools/cuda/pack.sh DEST}
cd "$(dirname "$0")/../.."
cargo build --release -p sluice-cli
mapfile -t BINS < <(cargo test --release -p sluice-cuda --no-run --message-format=json 2>/dev/null |
    python3 -c 'import sys, json
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"] + " " + m["executable"])')
mkdir -p "$DEST"
strip -o "$DEST/sluice" target/release/sluice
gzip -9f "$DEST/sluice"
if [ -n "${OLD:-}" ]; then
    strip -o "$DEST/sluice-old" "$OLD"
    gzip -9f "$DEST/sluice-old"
fi
for b in "${BINS[@]}"; do
    strip -o "$DEST/${b%% *}" "${b#* }"
    gzip -9f "$DEST/${b%% *}"
done
# Every fixture directory a GPU test reads (gpu_logits, no_gpu: all six architectures'
# files, their reference logits and tokens; tools/tests/pack-fixtures.sh keeps this list
# complete). NO_FIXTURES=1 skips the copy where the repository travels with DEST (then run
# device-check.sh with SLUICE_FIXTURES=path/to/tests/fixtures).
GPU_FIXTURE_DIRS=(qwen3moe gemma3 deepseek4 qwen4exp glm5next glm_dsa)
if [ -z "${NO_FIXTURES:-}" ]; then
    for d in "${GPU_FIXTURE_DIRS[@]}"; do
        mkdir -p "$DEST/fixtures/$d"
        cp -r "tests/fixtures/$d/." "$DEST/fixtures/$d/"
    done
fi
cp tools/cuda/device-check.sh "$DEST/"
du -sh "$DEST"
