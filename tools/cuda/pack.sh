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
mkdir -p "$DEST/fixtures/qwen3moe" "$DEST/fixtures/gemma3"
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
cp tests/fixtures/qwen3moe/{a,b}-q8_0.gguf tests/fixtures/qwen3moe/{a,b}-f32.gguf \
    tests/fixtures/qwen3moe/*.npy tests/fixtures/qwen3moe/tokens.json "$DEST/fixtures/qwen3moe/"
cp tests/fixtures/gemma3/llama_greedy.json "$DEST/fixtures/gemma3/"
cp tools/cuda/device-check.sh "$DEST/"
du -sh "$DEST"
