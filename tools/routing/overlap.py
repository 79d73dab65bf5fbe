#!/usr/bin/env python3
"""Expert-set overlap of consecutive tokens in routing traces (issue 32 item 3): the number
that says whether batching drafted tokens (speculative decoding) could save expert reads.

    python3 tools/routing/overlap.py TRACE[.xz] ...
    python3 tools/routing/overlap.py --spread TRACE[.xz] ...

Per trace, over its tokens in order (the decode traces hold decode steps only) and every
MoE layer:
  overlap   mean |S_t & S_t+1| / k: share of a token's k experts the next token also uses
            (chance level for independent uniform choices: k / n_expert);
  union/N   for windows of N = 2, 4, 8 consecutive tokens, distinct experts per layer over
            N*k: the share of reads a verifier batching N tokens would still make if
            nothing were cached (1.0 = no saving; k/n_expert-based chance shown next to it).
With --spread, per trace instead: how many of a layer's experts the whole trace uses
(distinct, min / median / max over the MoE layers) and the effective number
exp(entropy of the layer's expert popularity) (n_expert for uniform use), with the first and
last layers' distinct counts: a collapsed router (one that picks nearly the same experts
whatever the token) shows as few effective experts.
Reads the v1 format of crates/tier/src/trace.rs; plain Python, no dependencies.
"""

import collections
import lzma
import math
import struct
import sys


def read(path):
    b = open(path, "rb").read()
    if path.endswith(".xz"):
        b = lzma.decompress(b)
    magic, ver, n_layer, n_expert, top_k, name_len, n_tok, n_batch = struct.unpack_from(
        "<4s5IQQ", b
    )
    if magic != b"SLRT" or ver != 1:
        sys.exit(f"{path}: not a v1 sluice routing trace")
    off = 40 + name_len
    sizes = struct.unpack_from(f"<{n_layer}Q", b, off)
    off += 8 * n_layer
    n_moe = sum(1 for s in sizes if s > 0)
    per = n_moe * top_k
    tokens = []
    for _ in range(n_batch):
        (n,) = struct.unpack_from("<I", b, off)
        off += 4
        for t in range(n):
            ids = struct.unpack_from(f"<{per}H", b, off + 2 * t * per)
            tokens.append([frozenset(ids[l * top_k : (l + 1) * top_k]) for l in range(n_moe)])
        off += 2 * n * per
    return n_expert, top_k, n_moe, tokens


def expected_union(n, k, m):
    """Expected distinct experts among m independent uniform k-subsets of n."""
    # A given expert is outside one uniform k-subset with probability 1 - k/n.
    return n * (1 - (1 - k / n) ** m)


def spread(paths):
    print("| trace | tokens | distinct experts/layer (min / median / max) | effective experts/layer "
          "(min / median / max) | distinct, first 4 layers | distinct, last 4 layers |")
    print("|---|---:|---:|---:|---:|---:|")
    for path in paths:
        n, _k, n_moe, toks = read(path)
        used, eff = [], []
        for l in range(n_moe):
            c = collections.Counter(e for t in toks for e in t[l])
            tot = sum(c.values())
            used.append(len(c))
            eff.append(math.exp(-sum(v / tot * math.log(v / tot) for v in c.values())))
        mid = lambda xs: sorted(xs)[len(xs) // 2]
        name = "/".join(path.split("/")[-2:])
        print(f"| {name} | {len(toks)} | {min(used)} / {mid(used)} / {max(used)} of {n} | "
              f"{min(eff):.1f} / {mid(eff):.1f} / {max(eff):.1f} | "
              f"{' '.join(map(str, used[:4]))} | {' '.join(map(str, used[-4:]))} |")


def main():
    if sys.argv[1:2] == ["--spread"]:
        return spread(sys.argv[2:])
    print("| trace | tokens | overlap (chance) | union/2 | union/4 | union/8 | chance union/4 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for path in sys.argv[1:]:
        n, k, n_moe, toks = read(path)
        ov = [
            len(a[l] & b[l]) / k for a, b in zip(toks, toks[1:]) for l in range(n_moe)
        ]
        unions = []
        for w in (2, 4, 8):
            u = []
            for s in range(0, len(toks) - w + 1, w):
                for l in range(n_moe):
                    u.append(len(frozenset().union(*(t[l] for t in toks[s : s + w]))) / (w * k))
            unions.append(sum(u) / max(1, len(u)))
        name = "/".join(path.split("/")[-2:])
        print(
            f"| {name} | {len(toks)} | {sum(ov) / max(1, len(ov)):.3f} ({k / n:.3f}) | "
            f"{unions[0]:.3f} | {unions[1]:.3f} | {unions[2]:.3f} | "
            f"{expected_union(n, k, 4) / (4 * k):.3f} |"
        )


if __name__ == "__main__":
    main()
