#!/usr/bin/env bash
# Issue 32 item 4: sluice with replayed routing against llama.cpp on a file larger than RAM,
# cold (page cache dropped, no warm-up) and then warm, 2 threads by default.
#
#   bench/replay-vs-llama.sh MODEL.gguf TRACE.slrt BUDGET [TOKENS] [THREADS]
#   e.g. xz -dc tests/fixtures/routing/30b/code-decode.slrt.xz > /tmp/code-decode.slrt
#        bench/replay-vs-llama.sh q30-q8.gguf /tmp/code-decode.slrt 25% 16
#
# sluice streams its experts under --expert-cache BUDGET with every token's experts taken
# from TRACE (`--replay-routing`: an IO benchmark, no logits claimed); llama.cpp routes with
# the file's own routers and reads through the page cache (all of RAM, no budget), so its
# speed does not depend on routing. Order: drop, sluice cold; drop, llama.cpp cold;
# llama.cpp warm (the page cache as its cold run left it); sluice warm (one in-process
# warm-up pass of TOKENS first). Needs root for drop_caches; pair with bench/fio-vs-sluice.sh
# (SLUICE_FLAGS="--replay-routing TRACE") for the disk's ceiling in the same session.
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:?usage: bench/replay-vs-llama.sh MODEL TRACE BUDGET [TOKENS] [THREADS]}"
trace="${2:?trace}" budget="${3:?budget}" tokens="${4:-16}" threads="${5:-2}"
sluice=${SLUICE:-target/release/sluice}
llama="$(tools/get-llama-cpp.sh)/build/bin/llama-bench"
[ -x "$llama" ] || { echo "llama-bench not built: run tools/get-llama-cpp.sh --build" >&2; exit 2; }
drop() { sync; echo 3 > /proc/sys/vm/drop_caches || { echo "needs root for drop_caches" >&2; exit 1; }; }
echo "cpu: $(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2-); load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "model $(basename "$model") ($(du -h "$model" | cut -f1)), RAM $(free -g | awk '/Mem:/{print $2}') GiB, trace $(basename "$trace"), budget $budget, $threads threads, tg$tokens"
s=(bench -m "$model" -t "$threads" -p 0 -n "$tokens" -r 1 --expert-cache "$budget" --replay-routing "$trace" --stats)
l=(-m "$model" -t "$threads" -p 0 -n "$tokens" -r 1 -o md)
pick() { grep -E "\| *tg$tokens|hit rate|^io: " || true; }
drop; echo "sluice cold:"; "$sluice" "${s[@]}" --no-warmup 2>&1 | pick
drop; echo "llama.cpp cold:"; "$llama" "${l[@]}" --no-warmup 2>&1 | pick
echo "llama.cpp warm:"; "$llama" "${l[@]}" 2>&1 | pick
echo "sluice warm:"; "$sluice" "${s[@]}" 2>&1 | pick
