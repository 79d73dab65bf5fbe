#!/usr/bin/env bash
# CUDA backend check on a GPU machine that has no Rust toolchain (issue 13).
#
# Prepare on the build machine: `tools/cuda/pack.sh DIR` puts into DIR the stripped,
# gzipped `sluice` binary and test binaries (no_gpu, gpu_kernels, gpu_logits, gpu_blocks)
# and this script; the fixtures they read come from the repository checkout DIR lies in
# (or DIR/fixtures with `WITH_FIXTURES=1 pack.sh`, or $SLUICE_FIXTURES). On the GPU machine:
#   cd DIR && [GEMMA=gemma.gguf] bash device-check.sh [tests] [blocks] [gemma] [bench] [stream] [tiers]
# (no section named = all; `blocks`: only the per-block harness, which `tests` runs too).
# With `OLD=/path/to/old/sluice tools/cuda/pack.sh DIR` the older binary travels as
# sluice-old and the tiers section runs its main row with it too (before / after in one
# call). GEMMA: Gemma 3 270M, or a vocabulary-trimmed copy
# (tools/cuda/trim_vocab.py) where the full file is too big to carry.
# Writes everything to ${OUT:-.}/cuda-check.log (bench rows to bench.csv).
set -u
OUT=${OUT:-.}
LOG=$OUT/cuda-check.log
touch "$LOG"
say() { echo "== $*" | tee -a "$LOG"; }
run() { say "$*"; "$@" 2>&1 | tee -a "$LOG"; echo "rc=${PIPESTATUS[0]}" | tee -a "$LOG"; }
want() { [ -z "$SECTIONS" ] || [[ " $SECTIONS " == *" $1 "* ]]; }
SECTIONS="$*"

# NVRTC: the loader path, else the toolkit or the pip wheel's lib directory.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
    $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cu13", "lib") for p in nvidia.__path__))' 2>/dev/null); do
    if [ -e "$d/libnvrtc.so.13" ] || [ -e "$d/libnvrtc.so.12" ]; then
        export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
    fi
done
say "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
run nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
for f in sluice sluice-old no_gpu gpu_kernels gpu_logits gpu_blocks; do
    [ -e "$f.gz" ] && gunzip -f "$f.gz"
    chmod +x "$f" 2>/dev/null
done
# Fixtures: $SLUICE_FIXTURES, else ./fixtures (a pack made with WITH_FIXTURES=1), else the
# tests/fixtures of the checkout this directory lies in.
if [ -z "${SLUICE_FIXTURES:-}" ]; then
    if [ -d fixtures/qwen3moe ]; then
        SLUICE_FIXTURES=$PWD/fixtures
    else
        d=$PWD
        while [ "$d" != / ] && [ ! -d "$d/tests/fixtures/qwen3moe" ]; do d=$(dirname "$d"); done
        SLUICE_FIXTURES=$d/tests/fixtures
    fi
fi
export SLUICE_FIXTURES
say "SLUICE_FIXTURES=$SLUICE_FIXTURES"

if want tests; then
    run timeout 120 ./no_gpu --include-ignored --nocapture
    run timeout 300 ./gpu_kernels --ignored --test-threads 1
    [ -n "${GEMMA:-}" ] && export SLUICE_GEMMA=$GEMMA SLUICE_REQUIRE_MODELS=1
    run timeout 300 ./gpu_logits --ignored --test-threads 1 --nocapture
    # The same whole-forward checks with f32 operands (no tensor cores): DeepSeek V4's and
    # GLM-DSA's discontinuous choices (router, indexer top-k) must then all agree with the
    # reference; with f16 operands near-ties may flip (the tests say which bounds apply).
    SLUICE_CUDA_MMA=0 run timeout 300 ./gpu_logits --ignored --test-threads 1 --nocapture deepseek4 glm_dsa glm5next qwen4exp
    T=$(python3 -c "import json,sys;print(','.join(map(str,json.load(open(sys.argv[1]))['ids'])))" "$SLUICE_FIXTURES/qwen3moe/tokens.json")
    run ./sluice run -m "$SLUICE_FIXTURES/qwen3moe/a-q8_0.gguf" --tokens "$T" -n 8 --temp 0 --gpu --stats
fi

if want tests || want blocks; then
    # Each block kind on random weights, CPU against GPU (gpu_blocks): f16 operands (the
    # default), then f32 operands (no tensor cores), whose bound is 1e-6 of the largest output.
    run timeout 300 ./gpu_blocks --ignored --test-threads 1 --nocapture
    SLUICE_CUDA_MMA=0 run timeout 300 ./gpu_blocks --ignored --test-threads 1 --nocapture
fi

if want gemma && [ -n "${GEMMA:-}" ] && [ -e "${GEMMA:-}" ]; then
    run timeout 200 ./sluice bench -m "$GEMMA" -p 512 -n 128 -r 3 --csv "$OUT/bench.csv"
    run timeout 200 ./sluice bench -m "$GEMMA" -p 512 -n 128 -r 3 --gpu --stats --csv "$OUT/bench.csv"
fi

M=/tmp/q3-30b-q4k.gguf
if want bench || want stream || want tiers; then
    # Synthetic Qwen3-30B-A3B shape (48 layers, 128 experts, top-8), Q4_K: 15.7 GiB.
    [ -e $M ] || run timeout 240 ./sluice synth -o $M --preset qwen3-30b-a3b --quant Q4_K --force
fi
if want bench; then
    run timeout 200 ./sluice bench -m $M -p 256 -n 32 -r 2 --csv "$OUT/bench.csv"
    run timeout 200 ./sluice bench -m $M -p 256 -n 32 -r 2 --gpu --stats --csv "$OUT/bench.csv"
    # The products-only path (what architectures without a decoder plan run), for A/B.
    SLUICE_CUDA_FORWARD=0 run timeout 200 ./sluice bench -m $M -p 256 -n 32 -r 2 --gpu --stats --csv "$OUT/bench.csv"
    SLUICE_CUDA_GRAPHS=0 run timeout 200 ./sluice bench -m $M -p 0 -n 32 -r 2 --gpu --csv "$OUT/bench.csv"
    SLUICE_CUDA_FORWARD=0 SLUICE_CUDA_TILED=1 run timeout 200 ./sluice bench -m $M -p 256 -n 0 -r 2 --gpu --stats --csv "$OUT/bench.csv"
fi
if want stream; then
    # Experts streamed through an 8 GiB RAM cache: the GPU gets each expert's bytes per use.
    run timeout 200 ./sluice bench -m $M -p 0 -n 32 -r 2 --expert-cache 8G --gpu --stats --csv "$OUT/bench.csv"
    run timeout 200 ./sluice bench -m $M -p 0 -n 32 -r 2 --expert-cache 8G --stats --csv "$OUT/bench.csv"
fi
if want tiers; then
    # A VRAM expert tier (4 GiB) over the RAM tier (8 GiB) over the SSD: 15.2 GiB of experts.
    # RAM-tier slots page-locked for the uploads (the default with --gpu); the same with
    # SLUICE_CUDA_PIN=0 (pageable slots, still the copy stream); the old binary if packed.
    run timeout 200 ./sluice bench -m $M -p 0 -n 32 -r 2 --expert-cache 8G --gpu --gpu-expert-cache 4G --stats --csv "$OUT/bench.csv"
    SLUICE_CUDA_PIN=0 run timeout 200 ./sluice bench -m $M -p 0 -n 32 -r 2 --expert-cache 8G --gpu --gpu-expert-cache 4G --stats --csv "$OUT/bench.csv"
    [ -x sluice-old ] && run timeout 200 ./sluice-old bench -m $M -p 0 -n 32 -r 2 --expert-cache 8G --gpu --gpu-expert-cache 4G --stats --csv "$OUT/bench-old.csv"
    # VRAM tier over the memory map (no RAM tier): 8 GiB of the 15.2 GiB.
    run timeout 200 ./sluice bench -m $M -p 64 -n 32 -r 2 --gpu --gpu-expert-cache 8G --stats --csv "$OUT/bench.csv"
fi
say done
