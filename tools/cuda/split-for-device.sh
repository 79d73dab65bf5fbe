#!/usr/bin/env bash
# Carry a file larger than one device call's transfer (the 64 MiB working-tree limit, less
# the tree itself) to the GPU machine in parts: xz-compress FILE and split it into parts of
# PART_MB (default 28) megabytes, one directory per call, DEST/1, DEST/2, ... (name each
# in `carry` in turn), plus DEST/sha (FILE's sha256) and DEST/join.sh.
#   tools/cuda/split-for-device.sh FILE DEST [PART_MB]
# On the device, back to back (the machine, and its /tmp, go back 30 s after a call):
#   call k (carry DEST/k):   mkdir -p /tmp/parts && cp DEST/k/p* /tmp/parts/
#   last call (carry DEST/N and DEST's sha + join.sh, or put them in DEST/N):
#                            bash DEST/join.sh /tmp/parts OUT.gguf   (checks the sha256)
# The real Gemma 3 270M (253 MB) went over in nine calls of 0.3 s each (stop 25).
set -euo pipefail
FILE=${1:?usage: tools/cuda/split-for-device.sh FILE DEST [PART_MB]}
DEST=${2:?usage: tools/cuda/split-for-device.sh FILE DEST [PART_MB]}
PART_MB=${3:-28}
[ -f "$FILE" ] || { echo "$FILE: no such file" >&2; exit 1; }
if [ -e "$DEST" ] && [ -n "$(ls -A "$DEST")" ]; then
    echo "$DEST exists and is not empty; choose another" >&2
    exit 1
fi
mkdir -p "$DEST"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "compressing $FILE (xz -6, 2 threads)..." >&2
xz -6 -T2 -c "$FILE" > "$tmp/all.xz"
split -b "$((PART_MB * 1000 * 1000))" -a 3 -d "$tmp/all.xz" "$tmp/p"
i=0
for p in "$tmp"/p*; do
    i=$((i + 1))
    mkdir -p "$DEST/$i"
    mv "$p" "$DEST/$i/"
done
sha256sum "$FILE" | cut -c1-64 > "$DEST/sha"
cat > "$DEST/join.sh" <<'JOIN'
#!/usr/bin/env bash
# join.sh PARTS_DIR OUT: concatenate the parts in order, decompress, check the sha256
# written next to this script.
set -euo pipefail
PARTS=${1:?usage: join.sh PARTS_DIR OUT}
OUT=${2:?usage: join.sh PARTS_DIR OUT}
trap 'rm -f "$OUT.tmp"' ERR
cat "$PARTS"/p* | xz -d -T8 > "$OUT.tmp"
want=$(cat "$(dirname "$0")/sha")
got=$(sha256sum "$OUT.tmp" | cut -c1-64)
[ "$want" = "$got" ] || { echo "$OUT: sha256 $got, expected $want (a part is missing?)" >&2; rm -f "$OUT.tmp"; exit 1; }
mv "$OUT.tmp" "$OUT"
echo "$OUT: $(stat -c %s "$OUT") bytes, sha256 ok"
JOIN
chmod +x "$DEST/join.sh"
echo "$DEST: $i parts of up to $PART_MB MB ($(du -sh "$DEST" | cut -f1)); carry $DEST/1 .. $DEST/$i, one a call" >&2
