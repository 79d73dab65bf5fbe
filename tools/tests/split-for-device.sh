#!/usr/bin/env bash
# Checks tools/cuda/split-for-device.sh: a file split into parts (one directory each) joins
# back byte for byte with its sha256 checked; a missing part fails and leaves no output;
# a non-empty destination is refused.
#
#   tools/tests/split-for-device.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
head -c 3000000 /dev/urandom > "$tmp/file"
tools/cuda/split-for-device.sh "$tmp/file" "$tmp/d" 1 2>/dev/null
n=$(find "$tmp/d" -mindepth 1 -maxdepth 1 -type d | wc -l)
[ "$n" -ge 3 ] || { echo "split-for-device: $n part directories, expected 3 or more" >&2; exit 1; }
mkdir "$tmp/parts"
cp "$tmp"/d/*/p* "$tmp/parts/"
bash "$tmp/d/join.sh" "$tmp/parts" "$tmp/out" > /dev/null
cmp -s "$tmp/file" "$tmp/out" || { echo "split-for-device: joined file differs" >&2; exit 1; }
rm "$tmp/parts/p001"
if bash "$tmp/d/join.sh" "$tmp/parts" "$tmp/out2" > /dev/null 2>&1; then
  echo "split-for-device: a missing part was not noticed" >&2
  exit 1
fi
[ ! -e "$tmp/out2" ] && [ ! -e "$tmp/out2.tmp" ] || { echo "split-for-device: output left after a failed join" >&2; exit 1; }
if tools/cuda/split-for-device.sh "$tmp/file" "$tmp/d" 1 2>/dev/null; then
  echo "split-for-device: a non-empty destination was not refused" >&2
  exit 1
fi
echo "split-for-device: ok ($n parts)"
