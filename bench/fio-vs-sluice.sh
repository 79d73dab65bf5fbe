#!/usr/bin/env bash
# Delivered read bandwidth of sluice's expert streaming against fio at the same block size
# and queue depth, in the same window (issue 12): fio, then a cold sluice decode, then fio
# again. Block size = sluice's bytes read / read tasks (rounded to 4 KiB), queue depth =
# its effective depth (rounded). Needs root for drop_caches (falls back to fadvise).
#
#   bench/fio-vs-sluice.sh MODEL.gguf BUDGET [THREADS] [TOKENS]
#   e.g. SLUICE_FLAGS="--no-lookahead" bench/fio-vs-sluice.sh q30.gguf 10% 2 32
set -euo pipefail
model="$1" budget="$2" threads="${3:-2}" tokens="${4:-32}"
BIN=${SLUICE:-target/release/sluice}
command -v fio >/dev/null || { echo "fio not found: install it (apt-get install fio)" >&2; exit 2; }
cpu="$(grep -m1 '^model name' /proc/cpuinfo | sed 's/^[^:]*:[[:space:]]*//' || true)"
echo "cpu: $cpu; model: $(basename "$model") ($(du -h "$model" | cut -f1)); budget $budget; $threads threads; $(date -u +%FT%TZ)"
cold() {
  sync
  if ! echo 3 > /proc/sys/vm/drop_caches 2>/dev/null; then
    python3 -c "import os,sys; fd=os.open(sys.argv[1], os.O_RDONLY); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)" "$model"
  fi
}
fio_gbps() { # BS QD -> GB/s (10^9 bytes/s)
  fio --name=ref --filename="$model" --readonly --rw=randread --bs="$1" --iodepth="$2" \
    --ioengine=io_uring --direct=1 --runtime=8 --time_based --output-format=json 2>/dev/null |
    python3 -c 'import json,sys; j=json.load(sys.stdin); print("%.2f" % (j["jobs"][0]["read"]["bw_bytes"]/1e9))'
}
cold
# shellcheck disable=SC2086
log=$("$BIN" bench -m "$model" -t "$threads" -p 0 -n "$tokens" -r 1 --no-warmup --expert-cache "$budget" --stats ${SLUICE_FLAGS:-} 2>&1)
io=$(grep -m1 '^io: ' <<<"$log")
echo "$log" | grep -E '^\| .*tg|^io: |^cache: |^compute: |expert hit rate' || true
read -r tasks readmib qd delivered busy < <(python3 - "$io" <<'PY'
import re, sys
s = sys.argv[1]
g = lambda k: float(re.search(k, s).group(1))
print(int(g(r"tasks (\d+)")), g(r"read ([\d.]+) MiB"), g(r"qd ([\d.]+)"), g(r"delivered ([\d.]+) GB/s"), g(r"\(([\d.]+)% of wall\)"))
PY
)
bs=$(python3 -c "import sys; t=int(sys.argv[1]); m=float(sys.argv[2]); b=int(m*1048576/max(t,1)); print(max(4096, (b+2048)//4096*4096))" "$tasks" "$readmib")
qdi=$(python3 -c "import sys; print(max(1, round(float(sys.argv[1]))))" "$qd")
before=$(fio_gbps "$bs" "$qdi")
after=$(fio_gbps "$bs" "$qdi")
python3 - "$delivered" "$before" "$after" "$bs" "$qdi" "$busy" <<'PY'
import sys
d, b, a, bs, qd, busy = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
ref = (b + a) / 2
print(f"block {bs/1048576:.2f} MiB, queue depth {qd}: fio {b:.2f} / {a:.2f} GB/s (before / after), "
      f"sluice delivered {d:.2f} GB/s = {100*d/max(ref,1e-9):.0f}% of fio; disk busy {busy}% of decode")
PY
