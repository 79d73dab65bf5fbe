#!/usr/bin/env bash
# Issue 32 (1b), on the lent GPU in one call: train the MoE of Qwen3-30B-A3B's routing
# geometry (tools/train-moe/train.py --geometry 30b-routing: 48 layers, 128 experts, top-8),
# convert it, record its routing traces with sluice (tools/routing/record-traces.py) and
# measure router lookahead on it. The model (160 MB) never leaves the device: only the
# traces, the manifest and the logs come back.
#
#   tools/routing/train-and-trace.sh D OUT [MINUTES]     (minutes of training, default 4.4:
#   train.py took 299 s in all with it on an H200, tracing adds about a minute)
#
# D holds what the device lacks: sluice.xz (a stripped release build from here),
# cpython-3.11-lib.tar.xz and llama/ (as in tools/train-moe/README.md), texts.tar.xz
# (`record-traces.py --dump-texts texts`, tarred: the device has no python3.11 sources).
# Writes to OUT: train.log, manifest.json, record.log, lookahead.txt, traces.tar.
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
D=${1:?usage: train-and-trace.sh D OUT [MINUTES]}
OUT=${2:?usage: train-and-trace.sh D OUT [MINUTES]}
MIN=${3:-4.4}
export PYTHONUNBUFFERED=1
# Dense expert activations of 48 layers are ~64 GB: avoid fragmentation.
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
python3 - "$D" <<'EOF' || exit 1
import lzma, os, sys, tarfile
d = sys.argv[1]
with open(f"{d}/sluice", "wb") as f:
    f.write(lzma.open(f"{d}/sluice.xz").read())
os.chmod(f"{d}/sluice", 0o755)
tarfile.open(f"{d}/texts.tar.xz").extractall(d)
EOF
python3 "$here/train-moe/train.py" --data "$D/cpython-3.11-lib.tar.xz" --llama "$D/llama" \
    --out /tmp/q30 --minutes "$MIN" --geometry 30b-routing --name q30 --eval-every 200 \
    --gguf-path /tmp/q30-q8_0.gguf --no-oracle 2>&1 | tee "$OUT/train.log" || exit 1
cp /tmp/q30/manifest.json "$OUT/manifest.json" || exit 1
# The three kinds of text in parallel (16 cores); each trace is deterministic per kind.
for k in code prose chat; do
    python3 "$here/routing/record-traces.py" --sluice "$D/sluice" --model /tmp/q30-q8_0.gguf \
        --texts "$D/texts" --kinds "$k" --threads 5 --out /tmp/traces >"/tmp/rec-$k.log" 2>&1 &
done
wait
cat /tmp/rec-*.log | tee "$OUT/record.log"
tar -cf "$OUT/traces.tar" -C /tmp/traces .
# Router lookahead on real routing: the prompt of code-decode, as in tests/fixtures/routing/README.md.
P="$(head -c 400 "$D/texts/code.txt")"
"$D/sluice" run -m /tmp/q30-q8_0.gguf --raw -p "$P" -n 1000 --temp 0.8 --seed 1 -c 2048 \
    -t 4 --expert-cache 25% --io pread --lookahead --stats >"$OUT/lookahead.txt" 2>&1
