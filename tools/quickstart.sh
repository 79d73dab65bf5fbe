#!/usr/bin/env bash
# Build sluice and run the main job: the real Gemma 3 270M (installed from PyPI by
# tools/get-gemma.sh) answers a question. Pass your own question as the first argument.
#
# The PyPI file is the pretrained (base) Gemma 3 270M, not the instruction-tuned one: through
# the chat template it rambles (llama.cpp's llama-completion gives the same tokens), so the
# question goes in as a plain "Question: ... Answer:" completion (`--raw`). For chat with an
# instruction-tuned GGUF: `sluice run -m MODEL.gguf -p "..."` (the template is applied).
# The answer stops at the end of its line (`--stop '\n'`): a base model goes on with
# "Question: ..." of its own otherwise.
#
# `tools/quickstart.sh --moe` shows the engine's own job instead: the small MoE trained here on
# CPython's standard library (tests/fixtures/trained-moe/, committed; 32 experts per layer,
# top-4) continues a Python function with its routed experts streamed from the SSD through
# a cache of 25% of their bytes, and `--stats` prints hits, misses, bytes read and memory.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--moe" ]; then
    cargo build --release -p sluice-cli
    exec target/release/sluice run -m tests/fixtures/trained-moe/trained-moe-q4_0.gguf --raw \
        -p "import os


def list_python_files(path):
" -n 80 --temp 0 --expert-cache 25% --stats
fi
question="${1:-What is the capital of France?}"
model="$(tools/get-gemma.sh)"
cargo build --release -p sluice-cli
target/release/sluice run -m "$model" --raw -p "Question: $question
Answer:" -n 32 --temp 0 --stop '\n'
