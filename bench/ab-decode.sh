#!/usr/bin/env bash
# Decode (and optionally prefill) speed of two sluice binaries and llama.cpp on one file,
# alternated round by round (A, B, llama-bench), so drift of the machine (other load, memory
# bandwidth of a shared host) hits all three alike; prints each tool's per-round tok/s on one
# line (`pp/tg` when PP is set).
#
#   bench/ab-decode.sh OLD_SLUICE NEW_SLUICE MODEL.gguf [TG] [ROUNDS] [THREADS]
#   e.g. bench/ab-decode.sh /tmp/sluice-old target/release/sluice q8.gguf 32 5
#   A_FLAGS / B_FLAGS: extra flags for A / B (e.g. A_FLAGS='--weight-load mmap' with the same
#   binary twice compares two settings of one build).
#   PP=128: prefill too (`-p 128`; default 0, decode only).
#   ISAS='avx2 avx512': A and B once per SIMD tier (SLUICE_ISA) in each round, e.g. the AVX2
#   tier on an AVX-512 machine against an AVX2-only llama.cpp (issue 31's tables).
#   LLAMA_BENCH: the llama-bench to run. For an AVX2-only build on an AVX-512 machine:
#     grep -m1 '^flags' /proc/cpuinfo | sed 's/ avx512[a-z_0-9]*//g' > /tmp/cpuinfo
#     SLUICE_CACHE=/tmp/ll2 SLUICE_CPUINFO=/tmp/cpuinfo tools/get-llama-cpp.sh --build
#
# Each run is `sluice bench -p PP -n TG -r 2` / `llama-bench -p PP -n TG -r 2` (warm, the file
# in the page cache). llama.cpp: by default the pinned build of tools/get-llama-cpp.sh --build
# (this CPU's flags). Run it on a quiet machine and give the medians with the load average.
set -euo pipefail
cd "$(dirname "$0")/.."
a="${1:?usage: bench/ab-decode.sh OLD NEW MODEL [TG] [ROUNDS] [THREADS]}" b="${2:?new}"
model="${3:?model}" tg="${4:-32}" rounds="${5:-5}" threads="${6:-2}" pp="${PP:-0}"
llama="${LLAMA_BENCH:-$(tools/get-llama-cpp.sh)/build/bin/llama-bench}"
[ -x "$llama" ] || { echo "llama-bench not found at $llama: run tools/get-llama-cpp.sh --build or set LLAMA_BENCH" >&2; exit 2; }
echo "cpu: $(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2-); load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "$(basename "$model"), pp$pp tg$tg, $threads threads, $rounds rounds"
# One line of `pp/tg` (or `tg`) per run.
sl() { env ${3:+SLUICE_ISA=$3} "$1" bench -m "$model" -t "$threads" -p "$pp" -n "$tg" -r 2 $2 2>/dev/null |
  awk -F'|' '$5 ~ /pp[0-9]|tg[0-9]/ {gsub(/ /,"",$6); s = s (s ? "/" : "") $6} END {print s}'; }
ll() { "$llama" -m "$model" -t "$threads" -p "$pp" -n "$tg" -r 2 -o md 2>/dev/null |
  awk -F'|' '/pp[0-9]|tg[0-9]/ {split($(NF-1), v, " "); s = s (s ? "/" : "") v[1]} END {print s}'; }
# Tiers: the CPU's best unless ISAS names some ("best" = no SLUICE_ISA).
read -r -a isas <<< "${ISAS:-best}"
declare -A ra rb
rl=""
for _ in $(seq "$rounds"); do
  for isa in "${isas[@]}"; do
    t="$isa"; [ "$t" = best ] && t=""
    ra[$isa]="${ra[$isa]:-} $(sl "$a" "${A_FLAGS:-}" "$t")"
    rb[$isa]="${rb[$isa]:-} $(sl "$b" "${B_FLAGS:-}" "$t")"
  done
  rl="$rl $(ll)"
done
for isa in "${isas[@]}"; do
  tier=""; [ "$isa" = best ] || tier=", SLUICE_ISA=$isa"
  echo "A ($a ${A_FLAGS:-}$tier):${ra[$isa]}"
  echo "B ($b ${B_FLAGS:-}$tier):${rb[$isa]}"
done
echo "llama.cpp:$rl"
