#!/bin/bash
# Flat perf profiles (cpu-clock) of sluice bench at 8 and 16 threads on 12-layer 30B-A3B cuts, on
# the lent machine. Carry .devrun/sluice-sym (`strip --strip-debug -o .devrun/sluice-sym
# target/release/sluice`) and, where the machine has no perf, .devrun/perfpk.tar.xz (perf and its
# non-libc libraries in perfpk/, perfpk/lib/). Run: bash bench/device-profile.sh; log in $OUT/prof.log.
set -u
OUT=${OUT:-/tmp}; LOG=$OUT/prof.log
S=$PWD/.devrun/sluice-sym
if command -v perf >/dev/null; then P=(perf); else
  tar -C /tmp -xJf .devrun/perfpk.tar.xz; P=(env LD_LIBRARY_PATH=/tmp/perfpk/lib /tmp/perfpk/perf); fi
"${P[@]}" --version >> $LOG 2>&1
for q in Q4_K Q8_0; do
  M=/tmp/cut-$q.gguf
  $S synth --preset qwen3-30b-a3b --layers 12 --quant $q -o $M 2>&1 | tail -1 >> $LOG
  for t in 8 16; do for test in "-p 128 -n 0" "-p 0 -n 32"; do
    echo "== $q threads $t $test" >> $LOG
    "${P[@]}" record -e cpu-clock -F 499 -o /tmp/p.data $S bench -m $M -t $t $test -r 3 2>/dev/null | grep -E "^\| cut" >> $LOG
    "${P[@]}" report -i /tmp/p.data --sort symbol 2>/dev/null | grep -E "^ +[0-9]" | head -22 >> $LOG
  done; done
  rm -f $M
done
echo done >> $LOG
