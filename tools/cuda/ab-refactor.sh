#!/usr/bin/env bash
# Before / after check of a refactor of the CUDA backend on a GPU machine without Rust, in
# one device call: two sluice binaries, OLD (before) and NEW (after).
#
#   [SECTIONS="logits tests bench"] [JOBS=12] tools/cuda/ab-refactor.sh OLD NEW [OUT]
#
# logits: every fixture (.gguf) of qwen3moe, gemma3, deepseek4, qwen4exp, glm5next and
#   glm_dsa under $SLUICE_FIXTURES (default: the tests/fixtures of the checkout this script
#   lies in; gemma3 has none there, so it counts 0 unless a .gguf is put in its directory),
#   with each fixture's prompt (qwen4exp / glm5next: both, short and long), run greedily on
#   the GPU for 8 new tokens with --dump-logits, by OLD and by NEW, with SLUICE_CUDA_MMA=0
#   (f32 operands) and with the default tensor cores; the qwen3moe fixtures also through the
#   products-only path (SLUICE_CUDA_FORWARD=0: mv_*) and its tiled kernel
#   (SLUICE_CUDA_FORWARD=0 SLUICE_CUDA_TILED=1: mm_*). Each pair of logits.npy is compared
#   byte for byte (cmp); a run that fails on both sides counts as a failure. JOBS runs at
#   once (each process compiles the kernels with NVRTC first).
# tests: device-check.sh's `tests` section (the GPU test binaries packed beside NEW:
#   no_gpu, gpu_kernels, gpu_logits, gpu_blocks; `tools/cuda/pack.sh DIR`).
# bench: the synthetic Qwen3-30B-A3B Q4_K (`sluice synth --preset qwen3-30b-a3b --quant
#   Q4_K`, made here once, kept in /tmp), `bench --gpu -p 256 -n 32 -r 2` by OLD, NEW, OLD,
#   NEW, rows into OUT/bench-ab.csv, then each binary's mean pp / tg and NEW / OLD.
#
# Writes OUT/ab-refactor.log (the summary lines start with "AB"), OUT/bench-ab.csv and the
# failed runs' stderr under OUT/logits-failures/. Exit status 1 when any logits pair differs
# or a run failed.
set -u
OLD=$(realpath "${1:?usage: ab-refactor.sh OLD NEW [OUT]}")
NEW=$(realpath "${2:?usage: ab-refactor.sh OLD NEW [OUT]}")
OUT=$(realpath -m "${3:-${OUT:-.}}")
mkdir -p "$OUT"
LOG=$OUT/ab-refactor.log
SECTIONS=${SECTIONS:-logits tests bench}
JOBS=${JOBS:-12}
HERE=$(cd "$(dirname "$0")" && pwd)
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
say() { echo "$*" | tee -a "$LOG"; }
status=0

if [ -z "${SLUICE_FIXTURES:-}" ]; then
    d=$HERE
    while [ "$d" != / ] && [ ! -d "$d/tests/fixtures/qwen3moe" ]; do d=$(dirname "$d"); done
    SLUICE_FIXTURES=$d/tests/fixtures
fi
export SLUICE_FIXTURES
say "AB old=$OLD new=$NEW fixtures=$SLUICE_FIXTURES"
# NVRTC: the loader path, else the toolkit or the pip wheel's lib directory.
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
    $(python3 -c 'import nvidia, os; print(" ".join(os.path.join(p, "cu13", "lib") for p in nvidia.__path__))' 2>/dev/null); do
    if [ -e "$d/libnvrtc.so.13" ] || [ -e "$d/libnvrtc.so.12" ]; then
        export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
    fi
done

# ids FIXTURE_DIR [PROMPT]: a fixture's prompt ids, comma-separated.
ids() {
    python3 - "$1" "${2:-}" <<'PY'
import json, os, sys
d, prompt = sys.argv[1], sys.argv[2]
f = f"{d}/tokens.json" if os.path.exists(f"{d}/tokens.json") else f"{d}/manifest.json"
m = json.load(open(f))
ids = m["prompts"][prompt] if prompt else m["ids"]
if isinstance(ids, dict):
    ids = ids["ids"]
print(",".join(map(str, ids)))
PY
}

if want logits; then
    W=$(mktemp -d /tmp/ab-logits.XXXX)
    mkdir -p "$OUT/logits-failures"
    # One line per case: NAME MODEL TOKENS ENV (ENV: comma-separated VAR=VALUE, or -).
    cases=$W/cases
    : > "$cases"
    for arch in qwen3moe gemma3 deepseek4 qwen4exp glm5next glm_dsa; do
        dir=$SLUICE_FIXTURES/$arch
        prompts=("")
        [ -f "$dir/manifest.json" ] && grep -q '"prompts"' "$dir/manifest.json" && prompts=(short long)
        n=0
        for f in "$dir"/*.gguf; do
            [ -e "$f" ] || continue
            for p in "${prompts[@]}"; do
                toks=$(ids "$dir" "$p")
                name=$arch-$(basename "$f" .gguf)${p:+-$p}
                echo "$name-mma0 $f $toks SLUICE_CUDA_MMA=0" >> "$cases"
                echo "$name-mma $f $toks -" >> "$cases"
                if [ "$arch" = qwen3moe ]; then
                    echo "$name-products $f $toks SLUICE_CUDA_FORWARD=0" >> "$cases"
                    echo "$name-tiled $f $toks SLUICE_CUDA_FORWARD=0,SLUICE_CUDA_TILED=1" >> "$cases"
                fi
                n=$((n + 1))
            done
        done
        say "AB logits: $arch: $n fixture prompts"
    done
    # one WHICH NAME MODEL TOKENS ENV: one run into $W/WHICH/NAME.
    one() {
        local which=$1 name=$2 model=$3 toks=$4 envs=$5 bin
        [ "$which" = old ] && bin=$OLD || bin=$NEW
        local -a e=()
        [ "$envs" != - ] && IFS=, read -r -a e <<< "$envs"
        mkdir -p "$W/$which"
        env "${e[@]}" "$bin" run -m "$model" --tokens "$toks" -n 8 --temp 0 --gpu \
            --dump-logits "$W/$which/$name" > "$W/$which/$name.out" 2>&1 ||
            echo "rc=$?" >> "$W/$which/$name.failed"
    }
    export -f one
    export OLD NEW W
    # The kernels' PTX is the same for both binaries unless the .cu changed: one run first
    # fills the driver's JIT cache, so the parallel runs only compile with NVRTC.
    export CUDA_CACHE_PATH=${CUDA_CACHE_PATH:-/tmp/ab-cuda-cache} CUDA_CACHE_MAXSIZE=${CUDA_CACHE_MAXSIZE:-4294967296}
    t0=$(date +%s)
    read -r wname wmodel wtoks _ < "$cases"
    "$NEW" run -m "$wmodel" --tokens "$wtoks" -n 1 --temp 0 --gpu > "$W/warmup.txt" 2>&1
    say "AB logits: warm-up run rc=$? in $(( $(date +%s) - t0 )) s ($wname)"
    t0=$(date +%s)
    awk '{print "old", $0; print "new", $0}' "$cases" |
        xargs -P "$JOBS" -L 1 bash -c 'one "$@"' _
    say "AB logits: $(wc -l < "$cases") cases x 2 binaries in $(( $(date +%s) - t0 )) s"
    same=0; differ=0; failed=0
    while read -r name _ _ _; do
        o=$W/old/$name/logits.npy n=$W/new/$name/logits.npy
        if [ -e "$W/old/$name.failed" ] || [ -e "$W/new/$name.failed" ] || [ ! -s "$o" ] || [ ! -s "$n" ]; then
            failed=$((failed + 1))
            say "AB FAILED $name"
            cp "$W/old/$name.out" "$OUT/logits-failures/$name.old.txt" 2>/dev/null
            cp "$W/new/$name.out" "$OUT/logits-failures/$name.new.txt" 2>/dev/null
        elif cmp -s "$o" "$n" && cmp -s "$W/old/$name/tokens.json" "$W/new/$name/tokens.json"; then
            same=$((same + 1))
        else
            differ=$((differ + 1))
            cmpl=$HERE/cmp_logits.py
            [ -e "$cmpl" ] || cmpl=$(dirname "$SLUICE_FIXTURES")/../tools/cuda/cmp_logits.py
            say "AB DIFFER $name ($(python3 "$cmpl" "$o" "$n" 2>&1 | tail -1))"
        fi
    done < "$cases"
    # The device line each side printed for one case (whole forward or products).
    say "AB logits: device line: $(grep -m1 -i 'gpu\|cuda' "$W/new/$(head -1 "$cases" | cut -d' ' -f1).out")"
    say "AB logits: $same identical, $differ differ, $failed failed (of $(wc -l < "$cases"))"
    [ $((differ + failed)) -eq 0 ] || status=1
    rm -rf "$W"
fi

if want bench; then
    M=/tmp/q3-30b-q4k.gguf
    if [ ! -e $M ]; then
        t0=$(date +%s)
        "$NEW" synth -o $M --preset qwen3-30b-a3b --quant Q4_K --force > "$OUT/synth.txt" 2>&1
        say "AB synth: rc=$? in $(( $(date +%s) - t0 )) s"
    fi
    CSV=$OUT/bench-ab.csv
    for which in old new old new; do
        [ "$which" = old ] && bin=$OLD || bin=$NEW
        before=$( [ -e "$CSV" ] && wc -l < "$CSV" || echo 0)
        timeout 300 "$bin" bench -m $M -p 256 -n 32 -r 2 --gpu --csv "$CSV" >> "$LOG" 2>&1
        say "AB bench $which: rc=$? rows $before -> $(wc -l < "$CSV")"
        # Tag the rows this run added.
        python3 - "$CSV" "$before" "$which" <<'PY'
import sys
path, before, which = sys.argv[1], int(sys.argv[2]), sys.argv[3]
lines = open(path).read().splitlines()
start = max(before, 1)
out = lines[:start] + [l + f",{which}" if not l.endswith((",old", ",new")) else l for l in lines[start:]]
open(path, "w").write("\n".join(out) + "\n")
PY
    done
    python3 - "$CSV" <<'PY' | tee -a "$LOG"
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head, body = rows[0], rows[1:]
print("AB bench header:", ",".join(head))
# Per (binary, test) the mean of the runs' median tokens per second.
col, test = head.index("median_tps"), head.index("test")
means = {}
for r in body:
    means.setdefault((r[-1], r[test]), []).append(float(r[col]))
for t in sorted({k[1] for k in means}):
    o, n = means.get(("old", t), []), means.get(("new", t), [])
    if o and n:
        mo, mn = sum(o) / len(o), sum(n) / len(n)
        print(f"AB bench {t}: old {mo:.2f} new {mn:.2f} ({' '.join(f'{x:.2f}' for x in o)} | {' '.join(f'{x:.2f}' for x in n)}) new/old {mn / mo:.4f}")
PY
fi

if want tests; then
    # device-check.sh beside NEW (the pack's), its log into OUT.
    d=$(dirname "$NEW")
    (cd "$d" && OUT="$OUT" bash device-check.sh tests > /dev/null 2>&1)
    say "AB tests: $(grep -c '^rc=0' "$OUT/cuda-check.log") commands rc=0, $(grep '^rc=' "$OUT/cuda-check.log" | grep -vc '^rc=0') not"
    grep -E '^(== |rc=|test result)' "$OUT/cuda-check.log" | tee -a "$LOG" > /dev/null
fi
say "AB done status=$status"
exit $status
