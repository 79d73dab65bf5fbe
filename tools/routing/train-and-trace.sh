#!/usr/bin/env bash
# Issue 32 (1b), on the lent GPU in one call: train the MoE of Qwen3-30B-A3B's routing
# geometry (tools/train-moe/train.py --geometry 30b-routing: 48 layers, 128 experts, top-8),
# convert it, record its routing traces with sluice (tools/routing/record-traces.py) and
# measure router lookahead on it. The model (167 MB) never leaves the device: only the
# traces, the manifest and the log come back.
#
#   tools/routing/train-and-trace.sh D OUT [MINUTES] [LIMIT]
#
# MINUTES of training (default 7); LIMIT (default 560) is the second of the command by which
# the script ends itself: tracing and lookahead get what is left of it and are cut at it,
# so the call's own limit never kills it with nothing written. Measured on an H200
# (2026-12-03, MINUTES 7, training stopped at 296 s): train.py 42 s besides the training
# (self-check, tokenizer, final evaluation, conversion), tracing 29 s, lookahead 16 s; a full
# 7 minutes should end near 510 s.
#
# D holds what the device lacks: sluice.xz (a stripped release build from here),
# cpython-3.11-lib.tar.xz and llama/ (as in tools/train-moe/README.md), texts.tar.xz
# (`record-traces.py --dump-texts texts`, tarred: the device has no python3.11 sources).
# Writes to OUT as soon as each exists (the device returns at most 8 files): log.txt (train.py,
# the tracers and the lookahead run, with the elapsed seconds of each phase), manifest.json,
# traces/KIND-PHASE.slrt.xz (6 files).
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
D=${1:?usage: train-and-trace.sh D OUT [MINUTES] [LIMIT]}
OUT=${2:?usage: train-and-trace.sh D OUT [MINUTES] [LIMIT]}
MIN=${3:-7}
LIMIT=${4:-560}
LOG="$OUT/log.txt"
export PYTHONUNBUFFERED=1
# Dense expert activations of 48 layers are ~64 GB: avoid fragmentation.
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
phase() { echo "== ${SECONDS} s: $*" | tee -a "$LOG"; }
phase "unpacking D (training ${MIN} min, limit ${LIMIT} s)"
python3 - "$D" <<'PY' 2>&1 | tee -a "$LOG" || exit 1
import lzma, os, sys, tarfile
d = sys.argv[1]
with open(f"{d}/sluice", "wb") as f:
    f.write(lzma.open(f"{d}/sluice.xz").read())
os.chmod(f"{d}/sluice", 0o755)
tarfile.open(f"{d}/texts.tar.xz").extractall(d)
PY
phase "train.py"
python3 "$here/train-moe/train.py" --data "$D/cpython-3.11-lib.tar.xz" --llama "$D/llama" \
    --out /tmp/q30 --minutes "$MIN" --geometry 30b-routing --name q30 --eval-every 100 \
    --gguf-path /tmp/q30-q8_0.gguf --no-oracle 2>&1 | tee -a "$LOG" || exit 1
cp /tmp/q30/manifest.json "$OUT/manifest.json" || exit 1
left=$((LIMIT - SECONDS))
phase "tracing (${left} s left)"
[ "$left" -gt 20 ] || exit 1
# The three kinds of text in parallel (16 cores); each trace is deterministic per kind and
# lands in OUT/traces as soon as it is complete.
for k in code prose chat; do
    timeout -k 5 "$left" python3 "$here/routing/record-traces.py" --sluice "$D/sluice" \
        --model /tmp/q30-q8_0.gguf --texts "$D/texts" --kinds "$k" --threads 5 \
        --out "$OUT/traces" >>"$LOG" 2>&1 &
done
wait
left=$((LIMIT - SECONDS))
phase "lookahead (${left} s left)"
[ "$left" -gt 5 ] || exit 1
# Router lookahead on real routing: the prompt of code-decode, as in tests/fixtures/routing/README.md.
P="$(head -c 400 "$D/texts/code.txt")"
timeout -k 2 "$left" "$D/sluice" run -m /tmp/q30-q8_0.gguf --raw -p "$P" -n 1000 --temp 0.8 \
    --seed 1 -c 2048 -t 4 --expert-cache 25% --io pread --lookahead --stats >>"$LOG" 2>&1
phase "done"
