#!/usr/bin/env bash
# Each streaming lever alone and together, on one model at one budget (issue 12's table).
#
#   bench/levers.sh MODEL.gguf [BUDGET] [THREADS] [TOKENS] [ROUNDS]
#
# Runs `sluice bench -p 0 -n TOKENS -r 1 --no-warmup --expert-cache BUDGET` from a cold page
# cache (drop_caches before each run: needs root) for these configurations, alternating them
# ROUNDS times so drift on the shared disk hits each equally:
#
#   base       --cache-policy lru --no-pack --no-lookahead --io-inflight 0
#   +inflight  io_uring's in-flight byte cap at its default (8 MiB)
#   +next      the next-use eviction policy (the default)
#   +pack      the packed sidecar MODEL.gguf.slpack (one read per expert); written with
#              `sluice pack` first if missing (as large as the experts: keep it outside
#              the repository, delete it after)
#   +lookahead router lookahead (off by default)
#   +profile   --preload-profile from a routing trace of a different text (`sluice run`
#              on a fixed prompt, `cache-sim --write-profile`): warm start
#   default    what a plain run uses: next + the cap (no sidecar, no lookahead, no profile)
#   all        next + cap + pack + lookahead + profile
#
# Prints per configuration the median tok/s, hit rate, expert bytes read per token, read
# GB/s delivered, disk busy and the share of decode time compute waited for IO (from
# `bench --csv`), and the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:?usage: bench/levers.sh MODEL.gguf [BUDGET] [THREADS] [TOKENS] [ROUNDS]}"
budget="${2:-10%}" threads="${3:-2}" tokens="${4:-32}" rounds="${5:-2}"
[ -f "$model" ] || { echo "error: $model: no such file" >&2; exit 1; }
cargo build --release -p sluice-cli >&2
sluice=target/release/sluice
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
pack="$model.slpack"
if [ ! -f "$pack" ]; then
  echo "writing $pack (sluice pack)" >&2
  $sluice pack "$model" >&2
fi
echo "recording a routing trace for the profile (sluice run, fixed prompt, 64 tokens)" >&2
$sluice run -m "$model" -t "$threads" --expert-cache "$budget" --temp 0 -n 64 \
  -p "A profile is recorded from a text that the benchmark never sees: the quick brown fox jumps over the lazy dog." \
  --record-routing "$out/trace.slrt" > /dev/null 2>&1
$sluice cache-sim "$out/trace.slrt" --budget "$budget" --policy next --write-profile "$out/profile" >&2
off="--io-inflight 0"
declare -A flags=(
  [base]="--cache-policy lru --no-pack --no-lookahead $off"
  [+inflight]="--cache-policy lru --no-pack --no-lookahead"
  [+next]="--cache-policy next --no-pack --no-lookahead $off"
  [+pack]="--cache-policy lru --pack $pack --no-lookahead $off"
  [+lookahead]="--cache-policy lru --no-pack --lookahead $off"
  [+profile]="--cache-policy lru --no-pack --no-lookahead --preload-profile $out/profile $off"
  [default]="--cache-policy next --no-pack --no-lookahead"
  [all]="--cache-policy next --pack $pack --lookahead --preload-profile $out/profile"
)
order=(base +inflight +next +pack +lookahead +profile default all)
for r in $(seq 1 "$rounds"); do
  for c in "${order[@]}"; do
    echo "round $r/$rounds: $c" >&2
    sync
    echo 3 > /proc/sys/vm/drop_caches || { echo "error: needs root (drop_caches)" >&2; exit 1; }
    # shellcheck disable=SC2086 # flags are word lists
    $sluice bench -m "$model" -t "$threads" -p 0 -n "$tokens" -r 1 --no-warmup \
      --expert-cache "$budget" ${flags[$c]} --csv "$out/$c.csv" > /dev/null 2>&1
  done
done
cpu="$(grep -m1 '^model name' /proc/cpuinfo | sed 's/^[^:]*:[[:space:]]*//' || true)"
python3 - "$out" "$model" "$budget" "$threads" "$tokens" "${cpu:-unknown}" "${order[@]}" <<'PY'
import csv, statistics, sys
out, model, budget, threads, tokens, cpu = sys.argv[1:7]
order = sys.argv[7:]
print(f"model: {model}, budget {budget}, {threads} threads, tg{tokens} cold, cpu: {cpu}")
print("| levers | tok/s (median) | samples | hit rate | GB read / token | read GB/s | disk busy | compute waited for IO |")
print("|---|---:|---|---:|---:|---:|---:|---:|")
for c in order:
    rows = list(csv.DictReader(open(f"{out}/{c}.csv")))
    tps = [float(r["median_tps"]) for r in rows]
    med = lambda k: statistics.median(float(r[k]) for r in rows)
    gbt = statistics.median(float(r["bytes_read"]) / 1e9 / int(r["tokens"]) for r in rows)
    print(f"| {c} | {statistics.median(tps):.2f} | {' / '.join(f'{t:.2f}' for t in tps)} | "
          f"{100 * med('hit_rate'):.1f}% | {gbt:.3f} | {med('read_gbps'):.2f} | "
          f"{100 * med('disk_busy'):.0f}% | {100 * med('io_wait'):.0f}% |")
PY
