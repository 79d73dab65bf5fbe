#!/usr/bin/env bash
# Thread scaling of MoE compute: sluice (one or more builds) and llama-bench on the same
# resident GGUF at several thread counts, alternating, with the CPU named. Made to run on a
# machine without a Rust toolchain (e.g. the lent GPU machine's 16-core CPU): pass built
# binaries in.
#
#   bench/thread-scaling.sh MODEL.gguf "2 8 16" LLAMA_BENCH SLUICE_A [SLUICE_B ...]
#
# MODEL is made if missing with SLUICE_A's `synth` (SYNTH_FLAGS, default: the Qwen3-30B-A3B
# shape cut to 12 layers, Q8_0). Each (binary, threads) runs `bench -p PP -n TG -r REPS`
# (PP=128 TG=32 REPS=3 by default); prints one table row per run (tok/s medians).
set -euo pipefail
model="$1" threads="$2" llama="$3"
shift 3
PP=${PP:-128} TG=${TG:-32} REPS=${REPS:-3}
cpu="$(grep -m1 '^model name' /proc/cpuinfo | sed 's/^[^:]*:[[:space:]]*//' || true)"
echo "cpu: $cpu ($(nproc) logical CPUs); avx512f: $(grep -qw avx512f /proc/cpuinfo && echo yes || echo no)"
if [ ! -f "$model" ]; then
  # shellcheck disable=SC2086
  "$1" synth ${SYNTH_FLAGS:---preset qwen3-30b-a3b --layers 12 --quant Q8_0} -o "$model" >&2
fi
printf '| engine | threads | pp%s tok/s | tg%s tok/s |\n|---|---:|---:|---:|\n' "$PP" "$TG"
for t in $threads; do
  for s in "$@"; do
    row=$("$s" bench -m "$model" -t "$t" -p "$PP" -n "$TG" -r "$REPS" 2>/dev/null | awk -F'|' '/ pp[0-9]/{pp=$6} / tg[0-9]/{tg=$6} END{gsub(/ /,"",pp); gsub(/ /,"",tg); print pp" | "tg}')
    echo "| $(basename "$s") | $t | $row |"
  done
  if [ -x "$llama" ]; then
    row=$("$llama" -m "$model" -t "$t" -p "$PP" -n "$TG" -r "$REPS" -o json 2>/dev/null | python3 -c '
import json,sys
d=json.load(sys.stdin); pp=tg="-"
for r in d:
    if r["n_prompt"]>0 and r["n_gen"]==0: pp="%.2f"%r["avg_ts"]
    if r["n_gen"]>0 and r["n_prompt"]==0: tg="%.2f"%r["avg_ts"]
print(pp+" | "+tg)')
    echo "| llama.cpp | $t | $row |"
  fi
done
