#!/usr/bin/env python3
"""Turn `cargo bench -p sluice-kernels --bench matvec -- 'expert/|memory_read'` output
(criterion's text on stdin) into a markdown table of GB/s (10^9 bytes/s, the middle
estimate): one row per format, columns shape x threads, and the memory read bandwidth."""
import re
import sys

UNITS = {"B/s": 1, "KiB/s": 2**10, "MiB/s": 2**20, "GiB/s": 2**30, "TiB/s": 2**40}
rows, cols, mem = {}, [], {}
name = None
for line in sys.stdin:
    m = re.match(r"^(\S+/\S+)\s*(time:|$)", line.strip())
    if m and "/" in m.group(1):
        name = m.group(1)
    t = re.search(r"thrpt:\s*\[\s*[\d.]+ \S+\s+([\d.]+) (\S+)\s+[\d.]+ \S+\s*\]", line)
    if t and name:
        gbs = float(t.group(1)) * UNITS[t.group(2)] / 1e9
        parts = name.split("/")
        if parts[0] == "expert" and len(parts) == 4:
            col = f"{parts[2]} {parts[3]}"
            if col not in cols:
                cols.append(col)
            rows.setdefault(parts[1], {})[col] = gbs
        elif parts[0] == "memory_read":
            mem[parts[-1]] = gbs
        name = None
if mem:
    print("Memory read (256 MiB, GB/s): " + ", ".join(f"{k} {v:.1f}" for k, v in mem.items()))
    print()
print("| format | " + " | ".join(cols) + " |")
print("|---|" + "---:|" * len(cols))
for ty, r in rows.items():
    print(f"| {ty} | " + " | ".join(f"{r[c]:.1f}" if c in r else "-" for c in cols) + " |")
