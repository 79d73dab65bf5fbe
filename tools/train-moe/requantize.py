#!/usr/bin/env python3
"""Re-quantize a GGUF's block-quantized matrices to another 32-element block format.

    python3 tools/train-moe/requantize.py --gguf-py DIR IN.gguf OUT.gguf --to q4_0

Every tensor stored as Q8_0 is dequantized and quantized again to --to (Q4_0, Q4_1, Q5_0
or Q5_1: formats whose 32-element blocks fit rows of 128, where the 256-element K-quants do
not) with gguf-py's own quantizer (llama.cpp's `gguf-py/gguf/quants.py`, bit-exact with
ggml's reference quantizers); F32 tensors (norms, routers) and every metadata key are copied
unchanged, except `general.file_type`. This is how tests/fixtures/trained-moe/'s model was
shrunk from Q8_0 without retraining: its float32 checkpoint lived only on the lent GPU, so
the Q8_0 values are the weights (tools/train-moe/oracle.py rounds them the same way for the
transformers reference).

--gguf-py is llama.cpp's gguf-py folder (`$(tools/get-llama-cpp.sh)/gguf-py`); it needs numpy.
"""

import argparse
import sys
from pathlib import Path

FILE_TYPES = {"q4_0": 2, "q4_1": 3, "q5_0": 8, "q5_1": 9}  # llama_ftype MOSTLY_*


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf-py", type=Path, required=True)
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--to", choices=sorted(FILE_TYPES), required=True)
    a = ap.parse_args()
    sys.path.insert(0, str(a.gguf_py))
    import gguf
    import gguf.quants as gq
    from gguf import GGMLQuantizationType as Q

    to = Q[a.to.upper()]
    r = gguf.GGUFReader(a.src)
    arch = r.fields[gguf.Keys.General.ARCHITECTURE].contents()
    if a.dst.exists():
        sys.exit(f"{a.dst}: exists; not overwriting")
    tmp = a.dst.with_suffix(a.dst.suffix + ".tmp")
    w = gguf.GGUFWriter(tmp, arch)
    for f in r.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue
        vt = f.types[0]
        sub = f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None
        val = FILE_TYPES[a.to] if f.name == gguf.Keys.General.FILE_TYPE else f.contents()
        w.add_key_value(f.name, val, vt, sub_type=sub)
    n = 0
    for t in r.tensors:
        if t.tensor_type == Q.Q8_0:
            x = gq.dequantize(t.data, Q.Q8_0)
            if x.shape[-1] % 32:
                sys.exit(f"{a.src}: tensor {t.name} rows of {x.shape[-1]} do not fit 32-element blocks")
            w.add_tensor(t.name, gq.quantize(x, to), raw_dtype=to)
            n += 1
        elif t.tensor_type == Q.F32:
            w.add_tensor(t.name, t.data)
        else:
            sys.exit(f"{a.src}: tensor {t.name} is {t.tensor_type.name}; only Q8_0 and F32 are handled")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(a.dst)
    print(f"{a.dst}: {n} tensors Q8_0 -> {to.name}, {a.dst.stat().st_size} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
