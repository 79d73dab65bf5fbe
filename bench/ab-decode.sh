#!/usr/bin/env bash
# Decode speed of two sluice binaries and llama.cpp on one file, alternated round by round
# (A, B, llama-bench), so drift of the machine (other load, memory bandwidth of a shared
# host) hits all three alike; prints each tool's per-round tok/s on one line.
#
#   bench/ab-decode.sh OLD_SLUICE NEW_SLUICE MODEL.gguf [TG] [ROUNDS] [THREADS]
#   e.g. bench/ab-decode.sh /tmp/sluice-old target/release/sluice q8.gguf 32 5
#   A_FLAGS / B_FLAGS: extra flags for A / B (e.g. A_FLAGS='--weight-load mmap' with the same
#   binary twice compares two settings of one build).
#
# Each run is `sluice bench -p 0 -n TG -r 2` / `llama-bench -p 0 -n TG -r 2` (warm, the file
# in the page cache). llama.cpp: the pinned build of tools/get-llama-cpp.sh --build (this
# CPU's flags). Run it on a quiet machine and give the medians with the load average.
set -euo pipefail
cd "$(dirname "$0")/.."
a="${1:?usage: bench/ab-decode.sh OLD NEW MODEL [TG] [ROUNDS] [THREADS]}" b="${2:?new}"
model="${3:?model}" tg="${4:-32}" rounds="${5:-5}" threads="${6:-2}"
llama="$(tools/get-llama-cpp.sh)/build/bin/llama-bench"
[ -x "$llama" ] || { echo "llama-bench not built: run tools/get-llama-cpp.sh --build" >&2; exit 2; }
echo "cpu: $(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2-); load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "$(basename "$model"), tg$tg, $threads threads, $rounds rounds"
sl() { "$1" bench -m "$model" -t "$threads" -p 0 -n "$tg" -r 2 $2 2>/dev/null | awk -F'|' -v t="tg$tg" '$5 ~ t {gsub(/ /,"",$6); print $6}'; }
ll() { "$llama" -m "$model" -t "$threads" -p 0 -n "$tg" -r 2 -o md 2>/dev/null | awk -F'|' -v t="tg$tg" '$0 ~ t {split($(NF-1), v, " "); print v[1]}'; }
ra="" rb="" rl=""
for _ in $(seq "$rounds"); do
  ra="$ra $(sl "$a" "${A_FLAGS:-}")"; rb="$rb $(sl "$b" "${B_FLAGS:-}")"; rl="$rl $(ll)"
done
echo "A ($a ${A_FLAGS:-}):$ra"
echo "B ($b ${B_FLAGS:-}):$rb"
echo "llama.cpp:$rl"
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
