#!/usr/bin/env python3
"""Compare two `sluice run --dump-logits DIR` files (DIR/logits.npy): per position
max |a - b| / max |b|, the median and worst over positions, and how many positions have
the same top-1. Plain Python (no numpy), so it runs on a bare GPU machine.

usage: cmp_logits.py A/logits.npy B/logits.npy
"""
import array
import ast
import struct
import sys


def load(path):
    b = open(path, "rb").read()
    if b[:6] != b"\x93NUMPY":
        sys.exit(f"{path}: not a .npy file")
    hl = struct.unpack("<H", b[8:10])[0]
    h = ast.literal_eval(b[10 : 10 + hl].decode())
    if h["descr"] != "<f4" or h["fortran_order"]:
        sys.exit(f"{path}: expected little-endian f32 in C order, found {h}")
    a = array.array("f")
    a.frombytes(b[10 + hl :])
    return a, tuple(h["shape"])


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    a, sa = load(sys.argv[1])
    b, sb = load(sys.argv[2])
    if sa != sb:
        sys.exit(f"shapes differ: {sa} vs {sb}")
    n, v = sa[0], sa[-1]
    rel, agree = [], 0
    for p in range(n):
        ra, rb = a[p * v : (p + 1) * v], b[p * v : (p + 1) * v]
        m = max(abs(x) for x in rb) or 1.0
        rel.append(max(abs(x - y) for x, y in zip(ra, rb)) / m)
        agree += max(range(v), key=ra.__getitem__) == max(range(v), key=rb.__getitem__)
    rel.sort()
    print(
        f"{n} positions: max|a-b|/max|b| median {rel[n // 2]:.3e} worst {rel[-1]:.3e}; "
        f"top-1 equal {agree}/{n}"
    )


main()
