#!/usr/bin/env bash
# Checks that tools/cuda/pack.sh ships every fixture directory a GPU test reads
# (`fixtures().join("DIR` in crates/cuda/tests), so device-check.sh never fails on a
# missing file (issue 29: deepseek4 and the seeds' fixtures were left out). No build.
#
#   tools/tests/pack-fixtures.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
shipped="$(sed -n 's/^GPU_FIXTURE_DIRS=(\(.*\))$/\1/p' tools/cuda/pack.sh)"
[ -n "$shipped" ] || { echo "pack-fixtures: GPU_FIXTURE_DIRS not found in tools/cuda/pack.sh"; exit 1; }
fails=0
for d in $(grep -rohE 'fixtures\(\)\.join\("[A-Za-z0-9_]+' crates/cuda/tests | sed 's/.*join("//' | sort -u); do
  if [[ " $shipped " != *" $d "* ]]; then
    echo "pack-fixtures: crates/cuda/tests read fixtures/$d but tools/cuda/pack.sh does not ship it"
    fails=1
  fi
  [ -d "tests/fixtures/$d" ] || { echo "pack-fixtures: tests/fixtures/$d does not exist"; fails=1; }
done
[ "$fails" = 0 ] && echo "pack-fixtures: ok ($shipped)"
exit "$fails"
