#!/usr/bin/env bash
# Build the release binary and the CUDA test binaries and put them, stripped and gzipped, with
# device-check.sh (and with WITH_FIXTURES=1 the fixtures they read) into DEST (for a GPU
# machine without Rust).
#   [OLD=path/to/older/sluice] [WITH_FIXTURES=1] tools/cuda/pack.sh DEST
# (OLD: an older release binary to compare with, packed as sluice-old; `bash ab-refactor.sh
# ./sluice-old ./sluice OUT` there compares the two: logits, GPU tests, bench.)
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
# Every fixture directory a GPU test reads (gpu_logits, gpu_blocks, no_gpu: all six
# architectures' files, their reference logits and tokens; tools/tests/pack-fixtures.sh keeps
# this list complete). They are tracked in the repository (~34 MiB), so by default they are
# not copied: device-check.sh reads them from the checkout DEST lies in (the device runs in a
# copy of the working tree; put DEST under it, e.g. target/pack, and carry that), keeping
# the pack to the gzipped binaries. WITH_FIXTURES=1 copies them for a GPU machine without
# the repository.
GPU_FIXTURE_DIRS=(qwen3moe gemma3 deepseek4 qwen4exp glm5next glm_dsa)
if [ -n "${WITH_FIXTURES:-}" ]; then
    for d in "${GPU_FIXTURE_DIRS[@]}"; do
        mkdir -p "$DEST/fixtures/$d"
        cp -r "tests/fixtures/$d/." "$DEST/fixtures/$d/"
    done
fi
cp tools/cuda/device-check.sh tools/cuda/ab-refactor.sh tools/cuda/cmp_logits.py "$DEST/"
du -sh "$DEST"
