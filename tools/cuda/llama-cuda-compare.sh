#!/usr/bin/env bash
# sluice --gpu side by side with llama.cpp's CUDA build, in ONE device call (issue 13).
#
# The lent GPU machine is handed back 30 s after a call ends, with everything it built, so the
# llama.cpp build and the measurements must share one call (10 minutes at most).
#
# Prepare here:   tools/cuda/llama-cuda-compare.sh --prepare DIR   (DIR under the repository,
#                 ignored by git, e.g. .devrun): DIR/llama-src.tar.xz (the pinned llama.cpp
#                 sources without docs, models, tests and other backends, ~5 MB) and the
#                 stripped sluice binary.
# Run there:      bash tools/cuda/llama-cuda-compare.sh DIR [GEMMA.gguf]
#                 (carry DIR/llama-src.tar.xz and DIR/sluice). Builds llama-bench with
#                 -DGGML_CUDA=ON for sm_90 on all cores (background log in $OUT/build.log),
#                 writes the synthetic Qwen3-30B-A3B Q4_K meanwhile, then alternates
#                 `llama-bench -ngl 99` and `sluice bench --gpu` (pp256 / tg32, 2 reps) on it
#                 and on GEMMA if given (SKIP_Q3=1: GEMMA only). Everything goes to
#                 ${OUT:-.}/compare.log as it happens.
set -u
if [ "${1:-}" = "--prepare" ]; then
    dest=${2:?usage: llama-cuda-compare.sh --prepare DIR}
    cd "$(dirname "$0")/../.."
    src="$(tools/get-llama-cpp.sh)"
    mkdir -p "$dest"
    ex=()
    for d in build docs models media tools/ui tests gguf-py; do ex+=(--exclude="llama.cpp/$d"); done
    for b in vulkan sycl metal cann opencl hexagon webgpu openvino zdnn musa hip; do
        ex+=(--exclude="llama.cpp/ggml/src/ggml-$b")
    done
    tar -C "$(dirname "$src")" "${ex[@]}" -cJf "$dest/llama-src.tar.xz" "$(basename "$src")"
    cargo build --release -p sluice-cli
    strip -o "$dest/sluice" target/release/sluice
    du -sh "$dest/llama-src.tar.xz" "$dest/sluice"
    exit 0
fi
dir=$(cd "${1:?usage: llama-cuda-compare.sh DIR [GEMMA]}" && pwd)
gemma=${2:-}
OUT=${OUT:-.}
LOG=$OUT/compare.log
log() { echo "[$(date +%T)] $*" | tee -a "$LOG"; }
export NCCL_NVLS_ENABLE=0
work=/tmp/llama-cuda
mkdir -p "$work" && tar -C "$work" -xJf "$dir/llama-src.tar.xz"
src="$work/llama.cpp"
log "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) x $(nproc); gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
(
    # FlashAttention kernels off (GGML_CUDA_FA=OFF, llama-bench -fa 0): their ~60 template
    # instances would not build within one call's 10 minutes next to the rest, and sluice's
    # attention does not run on the GPU yet either.
    cmake -S "$src" -B "$src/build" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DGGML_CUDA_FA=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DCMAKE_BUILD_TYPE=Release &&
        timeout "${BUILD_CAP:-420}" cmake --build "$src/build" -j"$(nproc)" --target llama-bench
) > "$OUT/build.log" 2>&1 &
build=$!
q3=/tmp/q3-q4k.gguf
if [ -n "${SKIP_Q3:-}" ]; then q3=""; else
[ -f "$q3" ] || "$dir/sluice" synth --preset qwen3-30b-a3b --quant Q4_K -o "$q3" 2>&1 | tail -1 | tee -a "$LOG"
fi
log "waiting for the llama.cpp CUDA build"
wait $build
log "build rc $? ($(tail -1 "$OUT/build.log"))"
lb="$src/build/bin/llama-bench"
for m in $q3 $gemma; do
    for round in 1 2; do
        if [ -x "$lb" ]; then
            log "round $round llama.cpp CUDA -ngl 99: $m"
            "$lb" -m "$m" -ngl 99 -fa 0 -p 256 -n 32 -r 2 2>&1 | grep -E '^\| ' | grep -v -- '---' | tee -a "$LOG"
        fi
        log "round $round sluice --gpu: $m"
        "$dir/sluice" bench -m "$m" -p 256 -n 32 -r 2 --gpu 2>&1 | grep -E '^\| |^gpu' | grep -v -- '---' | tee -a "$LOG"
    done
done
log done
