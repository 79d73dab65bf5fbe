#!/usr/bin/env bash
# Prefill and decode of two sluice binaries on the AVX2 and the AVX-512 tier, and llama.cpp,
# alternated round by round; prints pp/tg tok/s per round (issue 31's tables).
#
#   bench/ab-tiers.sh OLD_SLUICE NEW_SLUICE MODEL.gguf [PP] [TG] [ROUNDS] [THREADS]
#
# Each run is `sluice bench -t THREADS -p PP -n TG -r 2` with SLUICE_ISA=avx2 / avx512 (a
# tier the CPU lacks prints nothing useful: use it on an AVX-512 machine) and `llama-bench`
# with the same counts. LLAMA_BENCH: the llama-bench to run (default: the pinned build of
# tools/get-llama-cpp.sh --build). For an AVX2-only llama.cpp on an AVX-512 machine, build it
# with the AVX-512 flags hidden:
#   grep -m1 '^flags' /proc/cpuinfo | sed 's/ avx512[a-z_0-9]*//g' > /tmp/cpuinfo
#   SLUICE_CACHE=/tmp/ll2 SLUICE_CPUINFO=/tmp/cpuinfo tools/get-llama-cpp.sh --build
# Run it on a quiet machine (pause builds) and report medians with the load average.
set -euo pipefail
cd "$(dirname "$0")/.."
a="${1:?usage: bench/ab-tiers.sh OLD NEW MODEL [PP] [TG] [ROUNDS] [THREADS]}" b="${2:?new}"
model="${3:?model}" pp="${4:-128}" tg="${5:-32}" rounds="${6:-3}" threads="${7:-2}"
llama="${LLAMA_BENCH:-$(tools/get-llama-cpp.sh)/build/bin/llama-bench}"
[ -x "$llama" ] || { echo "llama-bench not found at $llama: run tools/get-llama-cpp.sh --build or set LLAMA_BENCH" >&2; exit 2; }
echo "cpu: $(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2-); load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "$(basename "$model"), pp$pp tg$tg, $threads threads, $rounds rounds (pp/tg tok/s)"
sl() { SLUICE_ISA=$2 "$1" bench -m "$model" -t "$threads" -p "$pp" -n "$tg" -r 2 2>/dev/null |
  awk -F'|' '$5 ~ /pp|tg/ {gsub(/ /,"",$6); printf "%s/", $6}'; }
ll() { "$llama" -m "$model" -t "$threads" -p "$pp" -n "$tg" -r 2 -o md 2>/dev/null |
  awk -F'|' '/pp[0-9]|tg[0-9]/ {split($(NF-1), v, " "); printf "%s/", v[1]}'; }
for r in $(seq "$rounds"); do
  echo "round $r: avx2 old $(sl "$a" avx2) new $(sl "$b" avx2) | avx512 old $(sl "$a" avx512) new $(sl "$b" avx512) | llama $(ll) | load $(cut -d' ' -f1 /proc/loadavg)"
done
