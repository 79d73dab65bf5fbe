#!/bin/bash
# Issue 15 on the lent GPU machine's CPU: sluice vs llama.cpp on the synthetic Qwen3-30B-A3B,
# resident (RES_THREADS) and at a 25% expert budget in the same memory (BUDGET_THREADS: both
# tools in one cgroup v2 limited to sluice's peak RSS + 0.5 GiB, page cache dropped first;
# llama.cpp `--repack 0`, pp128 capped at 70 s and tg16 at 45 s: a missing row means it did
# not finish in time). Everything is logged to $OUT/i15-QUANT.log as it happens.
#
# Prepare here: `strip -o .devrun/sluice target/release/sluice`, and llama.cpp's CPU build
# (tools/get-llama-cpp.sh --build) copied to .devrun/llama (llama-bench + its .so files).
# Run there (the device tool, carrying .devrun/sluice, .devrun/llama and this script):
#   bash bench/device-moe-cpu.sh QUANT RES_THREADS... -- BUDGET_THREADS...
# e.g. `bash bench/device-moe-cpu.sh Q4_K 8 16 -- 8 16` (about 5.5 minutes; Q8_0 about 7).
set -u
D=$PWD/.devrun; export LD_LIBRARY_PATH=$D/llama
OUT=${OUT:-/tmp}; LOG=$OUT/i15-$1.log
log() { echo "[$(date +%T)] $*" >> "$LOG"; }
q=$1; shift
res=(); bud=(); mode=res
for a in "$@"; do if [ "$a" = "--" ]; then mode=bud; elif [ $mode = res ]; then res+=("$a"); else bud+=("$a"); fi; done
log "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) x $(nproc); amx flags: $(grep -o -w 'amx_[a-z0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' ')"
log "sluice: $($D/sluice --version 2>&1)"
M=/tmp/q3-$q.gguf
[ -f $M ] || { rm -f /tmp/q3-*.gguf; $D/sluice synth --preset qwen3-30b-a3b --quant $q -o $M 2>&1 | tail -1 >> "$LOG"; }
ls -la $M >> "$LOG"
filt() { grep -E "^\| |hit rate|peak RSS|disk busy|waited" | grep -v -- "---"; }
for t in "${res[@]}"; do
  log "== resident $q threads $t: sluice"
  $D/sluice bench -m $M -t $t -p 128 -n 32 -r 3 2>&1 | filt >> "$LOG"
  log "== resident $q threads $t: llama.cpp (default repack)"
  timeout 150 $D/llama/llama-bench -m $M -t $t -p 128 -n 32 -r 3 2>&1 | filt >> "$LOG"
done
[ ${#bud[@]} -gt 0 ] || { log done; exit 0; }
root=/sys/fs/cgroup; echo +memory > $root/cgroup.subtree_control 2>/dev/null
cg=$root/sbs; mkdir -p $cg
limited() { sh -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' sh "$cg" "$@"; }
rss=$($D/sluice bench -m $M -t ${bud[-1]} -p 16 -n 4 -r 1 --expert-cache 25% --stats 2>&1 | sed -n 's/.*peak RSS \([0-9.]*\) GiB.*/\1/p')
lim=$(python3 -c "print(int(($rss + 0.5) * 2**30))")
log "sluice peak RSS at 25%: $rss GiB; cgroup limit $lim bytes (+0.5 GiB)"
for t in "${bud[@]}"; do
  sync; echo 3 > /proc/sys/vm/drop_caches
  echo max > $cg/memory.max; echo $lim > $cg/memory.max
  log "== 25% $q threads $t: sluice (in cgroup)"
  limited $D/sluice bench -m $M -t $t -p 128 -n 32 -r 2 --expert-cache 25% --stats 2>&1 | filt >> "$LOG"
  log "   cgroup peak $(( $(cat $cg/memory.peak) / 1048576 )) MiB"
  log "== 25% $q threads $t: llama.cpp pp128 (in cgroup, --repack 0, 70 s cap)"
  limited timeout 70 $D/llama/llama-bench -m $M -t $t -p 128 -n 0 -r 1 --repack 0 2>&1 | filt >> "$LOG"; log "   rc $?"
  log "== 25% $q threads $t: llama.cpp tg16 (in cgroup, --repack 0, 45 s cap)"
  limited timeout 45 $D/llama/llama-bench -m $M -t $t -p 0 -n 16 -r 1 --repack 0 2>&1 | filt >> "$LOG"; log "   rc $?"
done
echo max > $cg/memory.max
log done
