#!/usr/bin/env bash
# Issue 31's comparison: sluice against llama.cpp on the CPU, for the three files of the
# issue, 2 threads, pp128 and a decode test, alternating sluice / llama-bench twice
# (bench/side-by-side.sh -k 2 -r 2), printing the CPU model, the load average before and
# after each file, and the ratios sluice/llama.cpp. Run it on a QUIET machine: with another
# busy process on a 2-core box llama.cpp's spinning threads collapse and the ratios mean
# nothing (the load average printed says whether the run counts).
#
#   tools/bench/avx2-vs-llama.sh [DIR]
#
# DIR (default ${SLUICE_SCRATCH:-/tmp/sluice-avx2-vs-llama}) holds the two synthetic files
# (7.4 GiB Q8_0 and 3.9 GiB Q4_K, per `sluice synth --dry-run`), made once with
# `sluice synth` and kept for reruns; delete them when done.
# Files: Gemma 3 270M Q4_K_M (tools/get-gemma.sh, tg64), and the qwen3-30b-a3b shape with
# 12 layers in Q8_0 and in Q4_K (tg32). On an AVX-512 machine, SLUICE_ISA=avx2 in the
# environment pins sluice to the AVX2 tier (then build llama.cpp with GGML_AVX512=OFF).
# The llama.cpp build (pinned sources, tuned to this CPU) is tools/get-llama-cpp.sh --build,
# done by bench/side-by-side.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
dir="${1:-${SLUICE_SCRATCH:-/tmp/sluice-avx2-vs-llama}}"
mkdir -p "$dir"
cargo build --release -p sluice-cli >&2
sluice=target/release/sluice
cpu="$(grep -m1 '^model name' /proc/cpuinfo | sed 's/^[^:]*:[[:space:]]*//' || true)"
fam="$(grep -m1 '^cpu family' /proc/cpuinfo | sed 's/^[^:]*:[[:space:]]*//' || true)"
mdl="$(grep -m1 '^model[[:space:]]*:' /proc/cpuinfo | sed 's/^[^:]*:[[:space:]]*//' || true)"
isa=avx2
grep -qw avx512f /proc/cpuinfo && isa="avx512 (set SLUICE_ISA=avx2 for the AVX2 tier)"
echo "cpu: ${cpu:-unknown} (family ${fam:-?} model ${mdl:-?}), cpu isa: $isa, SLUICE_ISA=${SLUICE_ISA:-unset}"
gemma="$(tools/get-gemma.sh)"
q8="$dir/qwen3-30b-a3b-12l-q8_0.gguf"
q4="$dir/qwen3-30b-a3b-12l-q4_k.gguf"
[ -f "$q8" ] || $sluice synth --preset qwen3-30b-a3b --layers 12 --quant Q8_0 -o "$q8" >&2
[ -f "$q4" ] || $sluice synth --preset qwen3-30b-a3b --layers 12 --quant Q4_K -o "$q4" >&2
for spec in "$gemma:64" "$q8:32" "$q4:32"; do
  model="${spec%:*}" tg="${spec##*:}"
  echo
  echo "== $(basename "$model"): load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
  bench/side-by-side.sh "$model" -t 2 -p 128 -n "$tg" -k 2 -r 2
  echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
done
