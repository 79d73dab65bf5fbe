#!/usr/bin/env python3
"""transformers' float32 logits for a qwen3moe GGUF's weights, optionally rounded again.

    python3 tools/train-moe/oracle.py --gguf-py DIR --gguf MODEL.gguf --manifest manifest.json \
        --tokens tokens.json --out logits.npy [--requant q4_0] [--check REF.npy]

The reference of crates/engine/tests/trained_moe.rs, independent of sluice: the GGUF's
tensors are read and dequantized with llama.cpp's gguf-py (--gguf-py, its folder), every
quantized matrix is optionally rounded once more through --requant with gguf-py's quantizer
(exactly what tools/train-moe/requantize.py writes into the smaller file), mapped back to
transformers' Qwen3MoeForCausalLM (the shape from manifest.json's "model"), and run in
float32 on the tokens of tokens.json. Run it on the lent GPU (torch, transformers 5).

--check REF.npy first compares the logits of the file as it is (no --requant) with REF
(the Q8_0 logits train.py saved from the original checkpoint) and stops if they differ by
more than 1e-3: that proves the GGUF -> transformers mapping before it is trusted.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch


def hf_state(reader, gq, Q, requant, n_layer: int) -> dict:
    """transformers 5 names -> float32 tensors, from the GGUF (llama.cpp's qwen3moe names)."""
    t = {}
    for x in reader.tensors:
        a = gq.dequantize(x.data, x.tensor_type).astype(np.float32)
        if requant is not None and x.tensor_type != Q.F32:
            a = gq.dequantize(gq.quantize(a, requant), requant).reshape(a.shape)
        t[x.name] = torch.from_numpy(np.ascontiguousarray(a))
    s = {
        "model.embed_tokens.weight": t.pop("token_embd.weight"),
        "lm_head.weight": t.pop("output.weight"),
        "model.norm.weight": t.pop("output_norm.weight"),
    }
    for i in range(n_layer):
        b, p = f"blk.{i}.", f"model.layers.{i}."
        for g, h in [("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
                     ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                     ("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm"),
                     ("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
                     ("ffn_gate_inp", "mlp.gate")]:
            s[p + h + ".weight"] = t.pop(b + g + ".weight")
        # GGUF [E, ff, hidden] gate and up -> transformers' gate_up_proj [E, 2 ff, hidden]
        s[p + "mlp.experts.gate_up_proj"] = torch.cat(
            [t.pop(b + "ffn_gate_exps.weight"), t.pop(b + "ffn_up_exps.weight")], dim=1)
        s[p + "mlp.experts.down_proj"] = t.pop(b + "ffn_down_exps.weight")
    if t:
        sys.exit(f"unmapped tensors: {sorted(t)[:5]}")
    return s


@torch.no_grad()
def logits(cfg, state: dict, ids: list[int]) -> np.ndarray:
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM(cfg).float().eval()
    want = model.state_dict()
    if set(want) != set(state):
        sys.exit(f"state mismatch: missing {sorted(set(want) - set(state))[:5]}, "
                 f"extra {sorted(set(state) - set(want))[:5]}")
    for k, v in state.items():
        if tuple(want[k].shape) != tuple(v.shape):
            sys.exit(f"{k}: shape {tuple(v.shape)}, transformers wants {tuple(want[k].shape)}")
    model.load_state_dict(state, strict=True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(dev)
    out = model(input_ids=torch.tensor([ids], device=dev)).logits[0].float().cpu().numpy()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf-py", type=Path, required=True)
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--manifest", type=Path, required=True)
    ap.add_argument("--tokens", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--requant", choices=["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"])
    ap.add_argument("--check", type=Path)
    a = ap.parse_args()
    sys.path.insert(0, str(a.gguf_py))
    import gguf
    import gguf.quants as gq
    from gguf import GGMLQuantizationType as Q
    from transformers import Qwen3MoeConfig

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    shape = {k: v for k, v in json.loads(a.manifest.read_text())["model"].items()
             if k not in ("arch", "parameters")}
    reader = gguf.GGUFReader(a.gguf)
    n_vocab = int(reader.tensors[[x.name for x in reader.tensors].index("output.weight")].shape[1])
    cfg = Qwen3MoeConfig(vocab_size=n_vocab, **shape)
    ids = json.loads(a.tokens.read_text())["ids"]
    if a.check:
        got = logits(cfg, hf_state(reader, gq, Q, None, shape["num_hidden_layers"]), ids)
        ref = np.load(a.check)
        d = float(np.abs(got - ref).max())
        print(f"check: {a.gguf.name} as stored vs {a.check.name}: max |diff| {d:.2e}", flush=True)
        if d > 1e-3:
            sys.exit("check failed: the GGUF -> transformers mapping is wrong")
    req = Q[a.requant.upper()] if a.requant else None
    out = logits(cfg, hf_state(reader, gq, Q, req, shape["num_hidden_layers"]), ids)
    np.save(a.out, out.astype(np.float32))
    print(f"{a.out}: {out.shape}, largest |logit| {np.abs(out).max():.2f}", flush=True)


if __name__ == "__main__":
    main()
