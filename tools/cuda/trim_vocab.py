#!/usr/bin/env python3
"""Copy a GGUF with its vocabulary cut to the first N tokens (token_embd rows, tied output,
tokenizer arrays), every other tensor and key unchanged: a real model's layers in a file
small enough to carry to a GPU machine (Gemma 3 270M: 253 MB -> ~76 MB with N = 16384).
Token ids below N mean what they meant; logits cover those N tokens only. With LAYERS, only
the first LAYERS blocks are kept (`block_count` set to match; Gemma 3 270M with N = 8192
and LAYERS = 6, five sliding-window layers and one global: ~25 MB).

    python3 tools/cuda/trim_vocab.py IN.gguf OUT.gguf N [LAYERS]   (needs the gguf package)
"""
import sys

import numpy as np
import gguf


def main():
    src, dst, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    layers = int(sys.argv[4]) if len(sys.argv) > 4 else None
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = f.types[0]
        val = f.contents()
        sub = None
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = f.types[-1]
            if key.startswith("tokenizer.ggml.") and len(val) > n and key != "tokenizer.ggml.merges":
                val = val[:n]
        if key.endswith(".vocab_size"):
            val = n
        if layers is not None and key.endswith(".block_count"):
            val = min(int(val), layers)
        w.add_key_value(key, val, vtype, sub_type=sub)
    for t in r.tensors:
        if layers is not None and t.name.startswith("blk.") and int(t.name.split(".")[1]) >= layers:
            continue
        data = t.data
        if t.name in ("token_embd.weight", "output.weight"):
            data = data[:n]
        w.add_tensor(t.name, np.ascontiguousarray(data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
