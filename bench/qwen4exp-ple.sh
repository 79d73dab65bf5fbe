#!/usr/bin/env bash
# PLE gather time of a 1024-token prompt, cold page cache, per --ple-io mode, on a
# `sluice synth --preset qwen3.8-flash-next` file (real shape; the 320M-row table as Q4_0
# is 26.8 GiB). Reports the `ple` lines of --stats: "waited" = time the forward pass
# waited for rows (direct: reads issued at batch start, collected before the PLE layer;
# mmap: WILLNEED hints at batch start, page faults at the PLE layer).
#
#   bench/qwen4exp-ple.sh [FILE] [LAYERS]      (writes FILE with synth if it is missing)
set -euo pipefail
F=${1:-/tmp/qwen4exp-synth.gguf}
L=${2:-2}
BIN=${SLUICE:-target/release/sluice}
[ -f "$F" ] || "$BIN" synth -o "$F" --preset qwen3.8-flash-next --layers "$L" --quant Q4_K --ple-quant Q4_0
TOK=$(python3 -c "import random; r=random.Random(7); print(','.join(str(r.randrange(248000)) for _ in range(1024)))")
cold() { python3 -c "import os; fd=os.open('$F', os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)"; }
for args in "direct" "direct --ple-inflight 16" "mmap" "mmap --no-ple-prefetch" "ram"; do
    cold
    echo "== --ple-io $args"
    # shellcheck disable=SC2086
    "$BIN" run -m "$F" --tokens "$TOK" -n 1 --ple-io $args --stats -t 2 --raw --temp 0 -c 2048 -b 1024 2>&1 \
        | grep -E "^(PLE table|prefill|ple)" || true
done
