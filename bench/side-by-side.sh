#!/usr/bin/env bash
# Side-by-side speed of sluice and llama.cpp on the same GGUF, same threads, same test
# sizes, alternating A B A B so drift (thermal, page cache, other load) hits both equally.
#
#   bench/side-by-side.sh MODEL.gguf [-t THREADS] [-p PROMPT_TOKENS] [-n GEN_TOKENS] [-k ROUNDS] [-r REPS] [-C] [-M BYTES]
#
# -C: cold page cache: `sync; echo 3 > /proc/sys/vm/drop_caches` (needs root) before every
# run of either tool, no warm-up run, and one repetition per run (later repetitions would
# find the cache warm): use -k for more samples. Without -C both tools run warm (each does
# its own warm-up run first).
#
# -M BYTES (suffixes K/M/G, powers of 1024): run both tools inside one memory cgroup limited to
# BYTES (cgroup v2 `memory.max`, else v1 `memory.limit_in_bytes`; needs root). The page cache a
# tool fills counts against the limit, so llama.cpp, which has no byte budget of its own, gets
# the same RAM as sluice's --expert-cache plus resident weights: the "same memory" comparison on
# a machine whose RAM would otherwise hold the whole file (the page cache is dropped once at
# the start: pages cached earlier stay charged elsewhere). Pick BYTES >= sluice's peak RSS
# (`--stats` prints it) or the kernel kills sluice; the summary prints both tools' peak use.
#
# Builds the pinned llama.cpp (llama-cpp-python 0.3.36's vendored copy, tuned to this CPU's
# flags, without AMX) into ${SLUICE_CACHE:-$HOME/.cache/sluice} via tools/get-llama-cpp.sh --build
# (rebuilt when the cached build was made for another CPU), builds sluice in
# release mode, then runs ROUNDS rounds of (sluice bench, llama-bench). Each tool repeats
# each test REPS (3) times per round; the ratio printed is median(sluice) / median(llama.cpp)
# over all samples of all rounds. Extra sluice flags can be passed in SLUICE_FLAGS and
# extra llama-bench flags in LLAMA_FLAGS. The summary names the CPU and llama.cpp's build flags.
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:?usage: bench/side-by-side.sh MODEL.gguf [-t N] [-p N] [-n N] [-k ROUNDS]}"
shift
threads=2 pp=128 tg=64 rounds=3 reps=3 cold=0 memlimit=
while getopts "t:p:n:k:r:CM:" o; do
  case $o in
    t) threads=$OPTARG ;; p) pp=$OPTARG ;; n) tg=$OPTARG ;; k) rounds=$OPTARG ;;
    r) reps=$OPTARG ;; C) cold=1 ;; M) memlimit=$OPTARG ;;
    *) echo "unknown flag" >&2; exit 2 ;;
  esac
done
drop_caches() {
  if [ "$cold" = 1 ]; then
    sync
    echo 3 > /proc/sys/vm/drop_caches || { echo "error: -C needs root (cannot write /proc/sys/vm/drop_caches)" >&2; exit 1; }
  fi
}
# A memory cgroup for -M: prints the directory (v2 under the unified hierarchy, else v1).
cg=""
if [ -n "$memlimit" ]; then
  bytes="$(python3 -c 'import sys; s=sys.argv[1].strip().upper(); m={"K":1<<10,"M":1<<20,"G":1<<30}; print(int(float(s[:-1])*m[s[-1]]) if s[-1] in m else int(s))' "$memlimit")" \
    || { echo "error: -M $memlimit: not a size (e.g. 9G)" >&2; exit 2; }
  for root in /sys/fs/cgroup /sys/fs/cgroup/unified; do
    if [ -f "$root/cgroup.controllers" ] && grep -qw memory "$root/cgroup.controllers"; then
      echo +memory > "$root/cgroup.subtree_control" 2>/dev/null || true
      cg="$root/sluice-sbs-$$"; mkdir -p "$cg"
      echo "$bytes" > "$cg/memory.max" 2>/dev/null || true
      echo 0 > "$cg/memory.swap.max" 2>/dev/null || true
      if [ "$(cat "$cg/memory.max" 2>/dev/null)" != "$bytes" ]; then
        rmdir "$cg" 2>/dev/null || true
        echo "error: -M: cannot set memory.max under $root (memory controller not delegated?)" >&2; exit 1
      fi
      cgpeak="$cg/memory.peak"; break
    fi
  done
  if [ -z "$cg" ] && [ -d /sys/fs/cgroup/memory ]; then
    cg="/sys/fs/cgroup/memory/sluice-sbs-$$"; mkdir -p "$cg" && echo "$bytes" > "$cg/memory.limit_in_bytes" \
      || { echo "error: -M: cannot set $cg/memory.limit_in_bytes (needs root)" >&2; exit 1; }
    cgpeak="$cg/memory.max_usage_in_bytes"
  fi
  [ -n "$cg" ] && [ -d "$cg" ] || { echo "error: -M needs a writable memory cgroup (v1 or v2) and root" >&2; exit 1; }
  echo "memory limit: $bytes bytes (cgroup $cg)" >&2
  # Page cache is charged to the cgroup that first read it: pages of MODEL cached before
  # (by `synth`, an earlier run) would be free for llama.cpp. Start from an empty cache.
  sync
  echo 3 > /proc/sys/vm/drop_caches || { echo "error: -M needs root (cannot write /proc/sys/vm/drop_caches)" >&2; exit 1; }
fi
# Runs "$@" inside the -M cgroup (or plainly without -M); prints the cgroup's peak use after.
limited() {
  if [ -z "$cg" ]; then "$@"; return; fi
  [ -f "$cg/memory.max_usage_in_bytes" ] && echo 0 > "$cg/memory.max_usage_in_bytes" 2>/dev/null || true
  local rc=0
  sh -c 'echo $$ > "$1/cgroup.procs"; shift; exec "$@"' sh "$cg" "$@" || rc=$?
  [ -f "$cgpeak" ] && echo "  peak memory in the cgroup: $(( $(cat "$cgpeak") / 1048576 )) MiB" >&2
  return $rc
}
sluice_cold=() llama_cold=()
if [ "$cold" = 1 ]; then sluice_cold=(--no-warmup); llama_cold=(--no-warmup); reps=1; fi
[ -f "$model" ] || { echo "error: $model: no such file" >&2; exit 1; }
ll="$(tools/get-llama-cpp.sh --build)"
llama_bench="$ll/build/bin/llama-bench"
[ -x "$llama_bench" ] || { echo "error: $llama_bench was not built" >&2; exit 1; }
cpu="$(grep -m1 '^model name' /proc/cpuinfo | sed 's/^[^:]*:[[:space:]]*//' || true)"
llama_flags="$(tools/get-llama-cpp.sh --built-flags)"
echo "cpu: ${cpu:-unknown}" >&2
echo "llama.cpp build flags: $llama_flags" >&2
cargo build --release -p sluice-cli >&2
sluice=target/release/sluice
out="$(mktemp -d)"
trap 'rm -rf "$out"; [ -n "$cg" ] && rmdir "$cg" 2>/dev/null || true' EXIT
for r in $(seq 1 "$rounds"); do
  echo "round $r/$rounds: sluice" >&2
  drop_caches
  # shellcheck disable=SC2086
  limited $sluice bench -m "$model" -t "$threads" -p "$pp" -n "$tg" -r "$reps" "${sluice_cold[@]}" --csv "$out/sluice.csv" ${SLUICE_FLAGS:-} >&2
  echo "round $r/$rounds: llama.cpp" >&2
  drop_caches
  # shellcheck disable=SC2086
  limited "$llama_bench" -m "$model" -t "$threads" -p "$pp" -n "$tg" -r "$reps" "${llama_cold[@]}" -o json ${LLAMA_FLAGS:-} > "$out/llama-$r.json"
done
cp "$out/sluice.csv" "${SIDE_BY_SIDE_CSV:-/dev/null}" 2>/dev/null || true
python3 - "$out" "$pp" "$tg" "$threads" "$model" "${cpu:-unknown}" "$llama_flags" "$memlimit" <<'PY'
import csv, glob, json, statistics, sys
out, pp, tg, threads, model = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
cpu, llama_flags = sys.argv[6], sys.argv[7]
s = {"pp": [], "tg": []}
for row in csv.DictReader(open(f"{out}/sluice.csv")):
    s[row["test"][:2]] += [float(x) for x in row["samples"].split(";")]
l = {"pp": [], "tg": []}
for f in sorted(glob.glob(f"{out}/llama-*.json")):
    for t in json.load(open(f)):
        kind = "pp" if t["n_gen"] == 0 else "tg"
        l[kind] += [float(x) for x in t["samples_ts"]]
print(f"model: {model}, threads: {threads}" + (f", memory limit {sys.argv[8]} (both tools, one cgroup)" if sys.argv[8] else ""))
print(f"cpu: {cpu}")
print(f"llama.cpp build flags: {llama_flags}")
print("| test | sluice t/s (median) | llama.cpp t/s (median) | ratio sluice/llama.cpp | samples |")
print("|---|---:|---:|---:|---:|")
for kind, n in (("pp", pp), ("tg", tg)):
    if n == 0 or not s[kind] or not l[kind]:
        continue
    a, b = statistics.median(s[kind]), statistics.median(l[kind])
    print(f"| {kind}{n} | {a:.2f} | {b:.2f} | {a/b:.3f} | {len(s[kind])} / {len(l[kind])} |")
PY
