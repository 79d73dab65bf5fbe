#!/usr/bin/env python3
"""The cache-sim table of tests/fixtures/routing/README.md: every policy's misses as a
multiple of Belady's optimum, per trace and budget, from `sluice cache-sim`'s report.

    python3 tools/routing/sim-table.py [--sluice BIN] [--budgets 10%,25%,50%]
        [--horizon 8L,1,4,16,64] TRACE[.xz] ...

A `.xz` trace is decompressed to a temporary file first. Prints one markdown row per
(trace, budget): Belady's misses per token, then each policy's misses / Belady's (and the
hindsight-rate yardstick `oracle-rate`), the best online policy marked. With --horizon, the
known-future yardsticks instead of the policies: `horizon:N` knows the next N tokens' (NL:
N layers') routing exactly (Belady's rule within it, `next`'s beyond), next to `next`.
"""

import argparse
import lzma
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
POLICIES = ["next", "xl", "lru", "lfu", "lru2"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sluice", default=str(ROOT / "target/release/sluice"))
    ap.add_argument("--budgets", default="10%,25%,50%")
    ap.add_argument("--horizon", help="known-future yardsticks, e.g. 8L,1,4,16,64")
    ap.add_argument("traces", nargs="+")
    a = ap.parse_args()
    policies = ["next"] if a.horizon else POLICIES
    extra = ["horizon:" + h for h in a.horizon.split(",")] if a.horizon else ["oracle-rate"]
    cols = policies + extra
    print("| trace | budget | belady misses/token | " + " | ".join(cols) + " |")
    print("|---|---:|---:|" + "---:|" * len(cols))
    with tempfile.TemporaryDirectory() as td:
        for t in a.traces:
            path = Path(t)
            if path.suffix == ".xz":
                raw = Path(td) / path.stem
                raw.write_bytes(lzma.decompress(path.read_bytes()))
                path = raw
            cmd = [a.sluice, "cache-sim", str(path), "--budget", a.budgets,
                   "--policy", ",".join(policies)]
            if a.horizon:
                cmd += ["--horizon", a.horizon]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                sys.exit(f"{t}: {r.stderr}")
            for block in r.stdout.strip().split("\n\n"):
                tokens = int(re.search(r"\((\d+) tokens", block).group(1))
                budget = re.search(r"\(([\d.]+)% of routed experts\)", block).group(1)
                misses = {m.group(1): int(m.group(2)) for m in
                          re.finditer(r"^(\S+)\s+(\d+)\s+[\d.]+%", block, re.M)}
                best = min(policies, key=lambda p: misses[p])
                opt = max(1, misses["belady"])
                cells = [
                    (f"**{misses[p] / opt:.2f}**" if p == best and len(policies) > 1
                     else f"{misses[p] / opt:.2f}")
                    for p in cols
                ]
                name = "/".join(Path(t).parts[-2:]).removesuffix(".xz").removesuffix(".slrt")
                print(f"| {name} | {float(budget):.0f}% | {misses['belady'] / tokens:.2f} | "
                      + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
