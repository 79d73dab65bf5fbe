#!/usr/bin/env python3
"""Record the routing traces of tests/fixtures/routing/ (issue 32): the trained MoE of
tests/fixtures/trained-moe/ (real routers) on three kinds of text, prefill and decode.

    python3 tools/routing/record-traces.py [--sluice target/release/sluice] [--out DIR]
        [--model GGUF] [--name-prefix PREFIX] [--kinds code,prose,chat] [--threads N]
        [--prefill-tokens N] [--decode-tokens N] [--texts DIR | --dump-texts DIR]
    python3 tools/routing/record-traces.py --cut-from DIR --out DIR2 [--prefill-tokens N] ...

--dump-texts writes the three texts as KIND.txt and stops; --texts reads them back (the lent
GPU has no python3.11 sources: tools/routing/train-and-trace.sh); --cut-from shortens
traces this script wrote (the first N tokens of each) without recording.

Texts (all on a stock Debian with python3.11; nothing downloaded):
  code   Python: the standard library files the model was *not* trained on (the 21 files
         tools/train-moe/train.py holds out by a hash of their path), concatenated in path
         order (PSF License 2).
  prose  /usr/share/common-licenses/GPL-3 (verbatim copying permitted).
  chat   a multi-turn ChatML conversation built from those held-out files: each user turn
         asks what a function does, each assistant turn answers with its docstring and its
         source (PSF License 2).

Per text two traces, each `sluice run --record-routing` runs concatenated (the model's
context is 2048 tokens):
  KIND-prefill  the text as prompts of WINDOW characters (`-n 0`: prefill batches of 512
                tokens only), consecutive windows until PREFILL_TOKENS tokens.
  KIND-decode   a prompt of the text's first PROMPT characters, then the model's own
                sampled continuation (temperature 0.8, seeded), decode batches only (the
                prompt's batches are cut off), until DECODE_TOKENS tokens.
Each trace is written xz-compressed as KIND-PHASE.slrt.xz (`xz -dk` gives the file
`sluice cache-sim` and `sluice bench --replay-routing` read).

With --model another qwen3moe of the same geometry (e.g. a `sluice synth` file) the same
texts give that model's traces (random routing for a synth), for the comparison in
tests/fixtures/routing/README.md.
"""

import argparse
import ast
import hashlib
import lzma
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STDLIB = Path("/usr/lib/python3.11")
PROSE = Path("/usr/share/common-licenses/GPL-3")
WINDOW = 4000  # characters per prefill prompt (well under 2048 tokens for every text)
PROMPT = 400  # characters of prompt before a decode run
PREFILL_TOKENS = 4000
DECODE_TOKENS = 3000
DECODE_RUN = 750  # tokens generated per decode run (several runs, different seeds)


def held_out_files() -> list[Path]:
    """The standard library files train.py held out (same names, same hash rule)."""
    names = []
    for root, _dirs, files in os.walk(STDLIB):
        for f in files:
            if not f.endswith(".py"):
                continue
            rel = "./" + os.path.relpath(os.path.join(root, f), STDLIB)
            if "/site-packages/" in rel or "/dist-packages/" in rel:
                continue
            names.append(rel)
    names.sort()
    held = [n for n in names if hashlib.sha1(n.encode()).digest()[0] % 50 == 0]
    return [STDLIB / n[2:] for n in held]


def code_text() -> str:
    return "".join(p.read_text(errors="replace") for p in held_out_files())


def prose_text() -> str:
    return PROSE.read_text()


def chat_text() -> str:
    turns = []
    for p in held_out_files():
        src = p.read_text(errors="replace")
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        mod = p.stem if p.stem != "__init__" else p.parent.name
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            body = ast.get_source_segment(src, node)
            if not doc or not body or len(body) > 1500:
                continue
            turns.append(
                f"<|im_start|>user\nWhat does `{mod}.{node.name}` do, and how is it written?"
                f"<|im_end|>\n<|im_start|>assistant\n{doc.strip()}\n\nIt is written like "
                f"this:\n\n```python\n{body}\n```<|im_end|>\n"
            )
    return "".join(turns)


def parse_trace(b: bytes):
    """(header bytes, [(n_tokens, ids bytes)]) of a v1 trace (see crates/tier/src/trace.rs)."""
    magic, ver, n_layer, n_expert, top_k, name_len, n_tok, n_batch = struct.unpack_from(
        "<4s5IQQ", b
    )
    assert magic == b"SLRT" and ver == 1
    off = 40 + name_len
    sizes = struct.unpack_from(f"<{n_layer}Q", b, off)
    off += 8 * n_layer
    per_token = 2 * top_k * sum(1 for s in sizes if s > 0)
    head = b[:off]
    batches = []
    for _ in range(n_batch):
        (n,) = struct.unpack_from("<I", b, off)
        off += 4
        batches.append((n, b[off : off + n * per_token]))
        off += n * per_token
    assert off == len(b) and sum(n for n, _ in batches) == n_tok
    return head, batches, per_token


def write_trace(path: Path, head: bytes, batches, limit: int):
    """Batches up to `limit` tokens (the last one cut) with the counts patched, xz'd."""
    out, n_tok, kept = bytearray(), 0, 0
    per_token = None
    for n, ids in batches:
        if n_tok >= limit:
            break
        per_token = len(ids) // n
        n = min(n, limit - n_tok)
        out += struct.pack("<I", n) + ids[: n * per_token]
        n_tok += n
        kept += 1
    h = bytearray(head)
    struct.pack_into("<QQ", h, 24, n_tok, kept)
    path.write_bytes(lzma.compress(bytes(h) + bytes(out), preset=9 | lzma.PRESET_EXTREME))
    return n_tok, kept


def record(sluice: str, model: str, prompt: str, tmp: Path, extra: list[str], threads: int = 2) -> bytes:
    trace = tmp / "run.slrt"
    cmd = [sluice, "run", "-m", model, "--raw", "-p", prompt, "--record-routing", str(trace),
           "-c", "2048", "-t", str(threads), "--batch", "512"] + extra
    r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd[:4])} ...: exit {r.returncode}\n{r.stderr}")
    return trace.read_bytes()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sluice", default=str(ROOT / "target/release/sluice"))
    ap.add_argument("--model", default=str(ROOT / "tests/fixtures/trained-moe/trained-moe-q4_0.gguf"))
    ap.add_argument("--out", default=str(ROOT / "tests/fixtures/routing"))
    ap.add_argument("--name-prefix", default="")
    ap.add_argument("--texts", type=Path,
                    help="read KIND.txt from this folder instead of building the texts "
                         "(a machine without python3.11's sources: the lent GPU)")
    ap.add_argument("--dump-texts", type=Path, help="write KIND.txt to this folder and stop")
    ap.add_argument("--cut-from", type=Path,
                    help="record nothing: cut the traces of this folder (as written by this "
                         "script) to --prefill-tokens / --decode-tokens into --out")
    ap.add_argument("--kinds", default="code,prose,chat")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill-tokens", type=int, default=PREFILL_TOKENS)
    ap.add_argument("--decode-tokens", type=int, default=DECODE_TOKENS)
    a = ap.parse_args()
    kinds = a.kinds.split(",")
    if a.cut_from:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        for kind in kinds:
            for phase, limit in (("prefill", a.prefill_tokens), ("decode", a.decode_tokens)):
                name = f"{a.name_prefix}{kind}-{phase}.slrt.xz"
                head, batches, _ = parse_trace(lzma.decompress((a.cut_from / name).read_bytes()))
                n, nb = write_trace(Path(a.out) / name, head, batches, limit)
                print(f"{name}: {n} tokens in {nb} batches", file=sys.stderr)
        return
    build = {"code": code_text, "prose": prose_text, "chat": chat_text}
    if a.texts:
        texts = {k: (a.texts / f"{k}.txt").read_text() for k in kinds}
    else:
        texts = {k: build[k]() for k in kinds}
    if a.dump_texts:
        a.dump_texts.mkdir(parents=True, exist_ok=True)
        for k, t in texts.items():
            (a.dump_texts / f"{k}.txt").write_text(t)
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        for kind, text in texts.items():
            # Prefill: consecutive windows of the text, each a fresh run of its prompt only.
            head, batches, at = None, [], 0
            while sum(n for n, _ in batches) < a.prefill_tokens:
                if at >= len(text):
                    sys.exit(f"{kind}: text too short for {a.prefill_tokens} tokens")
                window = text[at : at + WINDOW]
                h, bs, _ = parse_trace(record(a.sluice, a.model, window, tmp, ["-n", "0"], a.threads))
                head = head or h
                batches += bs
                at += WINDOW
            n, nb = write_trace(out / f"{a.name_prefix}{kind}-prefill.slrt.xz", head, batches, a.prefill_tokens)
            print(f"{kind}-prefill: {n} tokens in {nb} batches", file=sys.stderr)
            # Decode: the model's own continuation of the text's start, several seeds.
            head, batches, seed = None, [], 1
            while sum(n for n, _ in batches) < a.decode_tokens:
                h, bs, _ = parse_trace(record(a.sluice, a.model, text[:PROMPT], tmp,
                                              ["-n", str(DECODE_RUN), "--temp", "0.8", "--seed", str(seed)],
                                              a.threads))
                head = head or h
                # The prompt (under 512 tokens) is the first batch, then one batch per
                # decode step.
                assert bs[0][0] > 1 and all(n == 1 for n, _ in bs[1:]), [n for n, _ in bs]
                batches += bs[1:]
                seed += 1
            n, nb = write_trace(out / f"{a.name_prefix}{kind}-decode.slrt.xz", head, batches, a.decode_tokens)
            print(f"{kind}-decode: {n} tokens in {nb} batches", file=sys.stderr)


if __name__ == "__main__":
    main()
