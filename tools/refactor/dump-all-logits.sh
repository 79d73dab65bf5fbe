#!/usr/bin/env bash
# Dump --dump-logits of Gemma 3 270M and every qwen3moe fixture (resident and streaming)
# into OUT_DIR, for byte-for-byte before/after comparison of refactors:
#   tools/refactor/dump-all-logits.sh SLUICE_BIN OUT_DIR
#   cmp -r OUT_BEFORE OUT_AFTER   (or: diff -r)
set -euo pipefail
cd "$(dirname "$0")/../.."
bin="$1"; out="$2"
mkdir -p "$out"
G="$(tools/get-gemma.sh)"
"$bin" run -m "$G" --tokens 2,818,5279,529,506,4944,563,236743 --temp 0 -n 8 --dump-logits "$out/gemma" -t 2 >/dev/null 2>&1
"$bin" run -m "$G" --raw -p "The capital of France is" -n 16 --temp 0 -t 2 > "$out/gemma-greedy.txt" 2>/dev/null
toks=$(python3 -c 'import json;d=json.load(open("tests/fixtures/qwen3moe/tokens.json"));print(",".join(map(str,d if isinstance(d,list) else d["ids"])))')
for f in tests/fixtures/qwen3moe/*.gguf; do
  n=$(basename "$f" .gguf)
  "$bin" run -m "$f" --tokens "$toks" --temp 0 -n 8 --dump-logits "$out/$n" -t 2 >/dev/null 2>&1
  # streaming at a budget that forces evictions (skipped where the file's minimum is higher)
  "$bin" run -m "$f" --tokens "$toks" --temp 0 -n 8 --dump-logits "$out/$n-stream" -t 1 --expert-cache 60% --io pread >/dev/null 2>&1 || true
done
ls "$out"
