#!/usr/bin/env bash
# Dump --dump-logits of Gemma 3 270M and every fixture of the six architectures
# (qwen3moe, gemma3, deepseek4, qwen4exp, glm_dsa, glm5next) into OUT_DIR, for
# byte-for-byte before/after comparison of refactors:
#   tools/refactor/dump-all-logits.sh SLUICE_BIN OUT_DIR
#   cmp -r OUT_BEFORE OUT_AFTER   (or: diff -r)
# Per model and prompt: resident (-t 2), chunked prefill (-b 3), and streamed through an
# expert cache below the expert bytes (60%, --io pread) at -t 1 and at -t 2. A streamed
# run refused by the model (a budget under its minimum, a dense model) leaves a
# NAME.refused file holding its exit status instead, so the comparison still covers it.
set -euo pipefail
cd "$(dirname "$0")/../.."
bin="$1"; out="$2"
mkdir -p "$out"

# dump NAME MODEL TOKENS: the four runs of one model and prompt.
dump() {
  local name="$1" model="$2" toks="$3"
  "$bin" run -m "$model" --tokens "$toks" --temp 0 -n 8 --dump-logits "$out/$name" -t 2 >/dev/null 2>&1
  "$bin" run -m "$model" --tokens "$toks" --temp 0 -n 8 --dump-logits "$out/$name-chunk3" -t 2 -b 3 >/dev/null 2>&1
  local t
  for t in 1 2; do
    local rc=0
    "$bin" run -m "$model" --tokens "$toks" --temp 0 -n 8 --dump-logits "$out/$name-stream-t$t" \
      -t "$t" --expert-cache 60% --io pread >/dev/null 2>&1 || rc=$?
    if [ "$rc" != 0 ]; then echo "$rc" > "$out/$name-stream-t$t.refused"; fi
  done
}

# ids FIXTURE_DIR [PROMPT]: a fixture's prompt ids, comma-separated.
ids() {
  python3 - "$1" "${2:-}" <<'PY'
import json, sys
d, prompt = sys.argv[1], sys.argv[2]
try:
    m = json.load(open(f"{d}/tokens.json"))  # qwen3moe's prompt
except FileNotFoundError:
    m = json.load(open(f"{d}/manifest.json"))
if isinstance(m, list):
    ids = m
elif prompt:
    ids = m["prompts"][prompt]
else:
    ids = m["ids"]
if isinstance(ids, dict):
    ids = ids["ids"]
print(",".join(map(str, ids)))
PY
}

G="$(tools/get-gemma.sh)"
dump gemma3 "$G" 2,818,5279,529,506,4944,563,236743
"$bin" run -m "$G" --raw -p "The capital of France is" -n 16 --temp 0 -t 2 > "$out/gemma-greedy.txt" 2>/dev/null

F=tests/fixtures
for arch in qwen3moe deepseek4 glm_dsa; do
  toks=$(ids "$F/$arch")
  for f in "$F/$arch"/*.gguf; do dump "$arch-$(basename "$f" .gguf)" "$f" "$toks"; done
done
for arch in qwen4exp glm5next; do
  for p in short long; do
    toks=$(ids "$F/$arch" "$p")
    for f in "$F/$arch"/*.gguf; do dump "$arch-$(basename "$f" .gguf)-$p" "$f" "$toks"; done
  done
done
ls "$out"
