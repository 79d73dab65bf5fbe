#!/usr/bin/env python3
"""Train a small qwen3moe on CPython's standard library and convert it with llama.cpp.

Issue 32 (1a): a real MoE (real routers, real popularity skew and locality) that writes
recognisable Python, small enough to commit (tests/fixtures/trained-moe/, at most 40 MB).

Run on the lent GPU (tools/train-moe/README.md says how the data and llama.cpp's converter
travel there):

    python3 tools/train-moe/train.py --data .train/cpython-3.11-lib.tar.xz \
        --llama .train/llama --out "$OUT" --minutes 6

Data: every `.py` file of Debian's python3.11 3.11.2 standard library (/usr/lib/python3.11,
site-packages excluded), under the Python Software Foundation License 2 (see
/usr/share/doc/python3.11/copyright). Files are split train / held-out by a hash of their
path (2% held out), so held-out perplexity is measured on files the model never saw.

Steps: (1) a byte-level BPE tokenizer (vocabulary 4096) with Qwen2's pre-tokenizer regex,
trained on the train files with HF `tokenizers`; (2) transformers' Qwen3MoeForCausalLM
(8 layers, hidden 128, 32 experts of 64, top-4, its load-balancing loss: about 8 MB as
Q8_0, so the repository and a pack of test binaries still travel to the lent GPU, whose
limit is 64 MiB for everything) trained with AdamW
in bf16 autocast for a fixed wall-clock budget, keeping the checkpoint with the best
held-out loss; (3) held-out perplexity next to a unigram baseline; (4) a greedy sample from
the float32 model and the logits of the Q8_0-rounded weights on a held-out window (the
oracle for sluice's Q8_0 file); (5) llama.cpp's convert_hf_to_gguf.py to Q8_0 (its BPE
pre-tokenizer check knows only published tokenizers' hashes, so `get_vocab_base_pre` is
told "qwen2": the regex this tokenizer was trained with).
Writes to --out: trained-moe-q8_0.gguf.partNN (15 MB pieces: the device returns files of at
most 16 MiB), manifest.json, reference.npz-like .npy files, train.log.

`--geometry 30b-routing` (issue 32 1b) trains the same recipe in Qwen3-30B-A3B's routing
geometry (48 MoE layers, 128 experts, top-8; hidden 128, experts of 64: 160 M parameters,
about 160 MB as Q8_0) for its routing traces; `--gguf-path` keeps that GGUF on the device
(tools/routing/train-and-trace.sh: trained, converted and traced in one call). That geometry
trains its experts with dense_experts_forward (`--dense-experts`), checked at start against
transformers' own forward on a tiny model on the CPU (check_dense_experts).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import io
import json
import math
import os
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import torch

VOCAB = 4096
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2's pre-tokenizer split (tokenizer.json of Qwen/Qwen2-7B), llama.cpp's "qwen2".
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=32,
    num_experts_per_tok=4,
    norm_topk_prob=True,
    max_position_embeddings=2048,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    attention_bias=False,
    output_router_logits=True,
    router_aux_loss_coef=0.01,
)
# Issue 32 (1b): Qwen3-30B-A3B's routing geometry (48 MoE layers, 128 experts, top-8) at
# the small model's hidden size and expert width, so it trains within one device call; its
# routing traces are what is kept (tests/fixtures/routing/), not the model.
SHAPES = {
    "small": SHAPE,
    "30b-routing": dict(SHAPE, num_hidden_layers=48, num_experts=128, num_experts_per_tok=8),
}
# Peak learning rate per geometry. The 48-layer geometry's first run (lr 2e-3, transformers'
# experts) got worse on held-out text between steps 100 and 178 while the rate was falling,
# and its second diverged to NaN (tools/train-moe/README.md). Both went through torch's
# grouped matmul, which may be the cause; not knowing, it trains at half the rate, and a
# divergence rolls back to the best checkpoint at half the rate again (main's loop).
PEAK_LR = {"small": 2e-3, "30b-routing": 1e-3}
# A held-out loss this far (nats) above the best one counts as a divergence.
DIVERGED = 1.0
MAX_ROLLBACKS = 3
SEQ = 512
BATCH = 32
PROMPT = "def fibonacci(n):\n"


def log(*a):
    print(*a, flush=True)


def read_files(tar_path: Path) -> list[tuple[str, str]]:
    out = []
    with tarfile.open(tar_path) as t:
        for m in t.getmembers():
            if m.isfile() and m.name.endswith(".py"):
                text = t.extractfile(m).read().decode("utf-8", errors="replace")
                out.append((m.name, text))
    out.sort()
    return out


def held_out(name: str) -> bool:
    return hashlib.sha1(name.encode()).digest()[0] % 50 == 0


def build_tokenizer(texts: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
    )
    return fast


def encode_all(tok, texts: list[str]) -> np.ndarray:
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    ids = []
    for enc in tok(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eos)
    return np.asarray(ids, dtype=np.int64)


def dense_experts_forward(experts, hidden_states, top_k_index, top_k_weights):
    """Qwen3MoeExperts' output computed densely over all experts, as two plain matmuls.

    transformers 5.17 computes the routed experts with torch's grouped matmul, casting the
    input to the weights' dtype: on the fp32 master weights it runs in fp32 under bf16
    autocast, and a step of the 30b-routing geometry took about a second. Here every token
    goes through every expert (at hidden 128 and width 64: 16x the routed FLOPs, but in two
    large GEMMs that autocast runs in bf16) and is weighted by a dense routing matrix that is
    zero for the experts not selected. Mathematically identical to transformers' forward:
    sum over the k selected e of w_te * down_e(act(gate_e x) * up_e x); check_dense_experts
    compares them. The router, top-k, normalisation and load-balancing loss stay transformers'
    own (Qwen3MoeTopKRouter, recorded for the aux loss as before); the parameters are the
    module's own gate_up_proj (E, 2I, H) and down_proj (E, H, I), so saving and conversion
    are unchanged.

    Measured on the H200 (30b-routing, one 32 x 512 batch, forward + backward): 292 ms dense;
    273 ms with transformers' grouped path on bf16-cast expert weights, which was tried and
    went NaN within 200 steps, so it is not offered (training with this dense form went NaN
    too, at rates down to 3.5e-5: the cause is elsewhere, see main's non-finite step skip). A
    whole step takes 0.31 s, against about 1 s before: the experts are no longer the whole cost.
    """
    t, h = hidden_states.shape
    e, i = experts.num_experts, experts.intermediate_dim
    # (T, E): top_k_weights at the selected experts, zero elsewhere (top-k indices are distinct).
    w = torch.zeros(t, e, dtype=top_k_weights.dtype, device=top_k_weights.device)
    w = w.scatter(1, top_k_index, top_k_weights)
    # All experts' gate and up rows at once: (T, H) x (H, E*2I); per expert [gate; up] as in
    # transformers' chunk(2, dim=-1).
    gu = torch.nn.functional.linear(hidden_states, experts.gate_up_proj.reshape(e * 2 * i, h))
    gate, up = gu.view(t, e, 2 * i).chunk(2, dim=-1)
    act = experts.act_fn(gate) * up * w.unsqueeze(-1).to(up.dtype)  # (T, E, I)
    # Down projections summed over experts in one GEMM: (T, E*I) x (E*I, H).
    down = experts.down_proj.permute(1, 0, 2).reshape(h, e * i)
    out = torch.nn.functional.linear(act.reshape(t, e * i), down)
    return out.to(hidden_states.dtype)


def use_dense_experts(model, on: bool = True) -> int:
    """Route every Qwen3MoeExperts of `model` through dense_experts_forward while the module
    is in training mode (eval, generation and the oracle keep transformers' own forward);
    on=False restores transformers' forward. Returns the number of modules."""
    impl = dense_experts_forward if on else None
    n = 0
    for m in model.modules():
        if type(m).__name__ != "Qwen3MoeExperts":
            continue
        n += 1
        if impl is None:
            m.__dict__.pop("forward", None)
            continue
        stock = type(m).forward.__get__(m)

        def fwd(hidden_states, top_k_index, top_k_weights, _m=m, _stock=stock, _impl=impl):
            if _m.training:
                return _impl(_m, hidden_states, top_k_index, top_k_weights)
            return _stock(hidden_states, top_k_index, top_k_weights)

        m.forward = fwd
    return n


def check_dense_experts():
    """CPU self-check, run at start: on a tiny random qwen3moe, dense_experts_forward must give
    transformers' own logits, load-balancing loss and gradients within float tolerance, so a
    wrong rewrite fails loudly before any device time is spent on training."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(1234)
    cfg = Qwen3MoeConfig(vocab_size=97, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         num_experts=8, num_experts_per_tok=3, norm_topk_prob=True,
                         max_position_embeddings=64, output_router_logits=True, router_aux_loss_coef=0.01)
    model = Qwen3MoeForCausalLM(cfg).float()
    with torch.no_grad():  # transformers initialises the router to zeros: make routing non-trivial
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.train()
    x = torch.randint(0, cfg.vocab_size, (2, 11))
    results = []
    # transformers' eager loop over experts, its default dispatch (grouped_mm), then dense.
    runs = (("eager", False), (model.config._experts_implementation, False), (None, True))
    for impl, dense in runs:
        if impl is not None:
            model.set_experts_implementation(impl)
        assert use_dense_experts(model, on=dense) == cfg.num_hidden_layers
        model.zero_grad(set_to_none=True)
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
        results.append((out.logits.detach(), out.aux_loss.detach(), out.loss.detach(), grads))
    use_dense_experts(model, on=False)
    for ref in results[:-1]:
        compare_runs(ref, results[-1])
    (l0, a0, t0, g0), (l1, a1, t1, g1) = results[0], results[-1]
    log(f"dense experts self-check: logits max diff {(l0 - l1).abs().max():.2e}, "
        f"aux {a0.item():.6f} = {a1.item():.6f}, {len(g0)} gradients match")


def compare_runs(r0, r1):
    (l0, a0, t0, g0), (l1, a1, t1, g1) = r0, r1
    assert torch.allclose(l0, l1, rtol=1e-4, atol=1e-5), f"dense experts: logits differ by {(l0 - l1).abs().max()}"
    assert torch.allclose(a0, a1, rtol=1e-5, atol=1e-6), f"dense experts: aux loss {a0} vs {a1}"
    assert torch.allclose(t0, t1, rtol=1e-5, atol=1e-6), f"dense experts: loss {t0} vs {t1}"
    assert g0.keys() == g1.keys(), "dense experts: different parameters got gradients"
    for k in g0:
        assert torch.allclose(g0[k], g1[k], rtol=1e-3, atol=1e-5), \
            f"dense experts: gradient of {k} differs by {(g0[k] - g1[k]).abs().max()}"


def strict_json(o):
    """`o` with NaN and infinities as None: the manifest stays JSON for every reader (a loss
    curve of a run that went NaN has them; Python would write the non-standard `NaN`)."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: strict_json(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [strict_json(v) for v in o]
    return o


@torch.no_grad()
def mean_nll(model, ids: np.ndarray, dev) -> float:
    model.eval()
    n = (len(ids) - 1) // SEQ
    tot, cnt = 0.0, 0
    for i in range(0, n, 16):
        rows = [ids[j * SEQ : j * SEQ + SEQ + 1] for j in range(i, min(n, i + 16))]
        x = torch.tensor(np.stack(rows), device=dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=x[:, :-1]).logits.float()
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum"
        )
        tot += nll.item()
        cnt += x[:, 1:].numel()
    model.train()
    return tot / cnt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--llama", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=6.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--geometry", choices=sorted(SHAPES), default="small",
                    help="small: the committed trained-moe; 30b-routing: 48 layers, 128 experts, top-8")
    ap.add_argument("--name", default="trained-moe", help="the GGUF is NAME-q8_0.gguf")
    ap.add_argument("--gguf-path", type=Path,
                    help="write the GGUF whole to this path instead of 15 MB parts in --out")
    ap.add_argument("--eval-every", type=int, default=100,
                    help="steps between held-out evaluations (the best one is kept)")
    ap.add_argument("--dense-experts", choices=["auto", "on", "off"], default="auto",
                    help="train with dense_experts_forward (auto: for the 30b-routing geometry)")
    ap.add_argument("--lr", type=float,
                    help="peak learning rate (default: PEAK_LR of the geometry: 2e-3 small, 1e-3 30b-routing)")
    ap.add_argument("--no-oracle", action="store_true",
                    help="skip the Q8_0-rounded reference logits (q8_0.dequant.logits.npy)")
    args = ap.parse_args()
    shape = SHAPES[args.geometry]
    dense = args.dense_experts == "on" or (args.dense_experts == "auto" and args.geometry == "30b-routing")
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    if dense:
        check_dense_experts()
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    dev = torch.device("cuda")

    files = read_files(args.data)
    train_f = [t for n, t in files if not held_out(n)]
    held_f = [t for n, t in files if held_out(n)]
    log(f"files: {len(train_f)} train, {len(held_f)} held out; "
        f"{sum(map(len, train_f))} / {sum(map(len, held_f))} characters")
    tok = build_tokenizer(train_f)
    train_ids = encode_all(tok, train_f)
    held_ids = encode_all(tok, held_f)
    log(f"tokens: {len(train_ids)} train, {len(held_ids)} held out ({time.time() - t_start:.0f} s)")

    # Unigram baseline (add-one smoothing, fitted on the train tokens).
    counts = np.bincount(train_ids, minlength=VOCAB).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    unigram_ppl = math.exp(-logp[held_ids[1:]].mean())

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = Qwen3MoeConfig(vocab_size=VOCAB, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, **shape)
    model = Qwen3MoeForCausalLM(cfg).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.1f} M parameters, experts implementation "
        f"{model.config._experts_implementation}" + (", dense while training" if dense else ""))
    train_t = torch.tensor(train_ids, device=dev)
    if dense:
        use_dense_experts(model)
    peak = args.lr or PEAK_LR[args.geometry]
    opt = torch.optim.AdamW(model.parameters(), lr=peak, betas=(0.9, 0.95), weight_decay=0.1)
    budget = args.minutes * 60
    warm = 100
    # The best evaluated checkpoint: weights and optimizer state (for a rollback), on the GPU.
    curve, best = [], dict(loss=float("inf"), state=None, opt=None, step=0)
    lr_scale, rollbacks, skipped = 1.0, [], []
    step, seen = 0, 0
    t0 = time.time()
    while True:
        elapsed = time.time() - t0
        if elapsed > budget:
            break
        frac = elapsed / budget
        lr = peak * lr_scale * min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.tensor(rng.integers(0, len(train_ids) - SEQ - 1, BATCH), device=dev)
        idx = starts[:, None] + torch.arange(SEQ + 1, device=dev)[None, :]
        x = train_t[idx]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=x[:, :-1])
            logits = out.logits.float()
        lm = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        aux = out.aux_loss if out.aux_loss is not None else torch.zeros((), device=dev)
        loss = lm + cfg.router_aux_loss_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        step += 1
        # One non-finite gradient poisons every weight through the clip and AdamW: the run of
        # 2026-12-03 (tools/train-moe/README.md) went NaN 4 times in 900 steps, at learning rates
        # down to 3.5e-5, so the cause is not the rate. Skip such a step (it costs a sync a step)
        # and say where it came from.
        if torch.isfinite(gnorm):
            opt.step()
            seen += BATCH * SEQ
        else:
            skipped.append(step)
            if len(skipped) <= 3:
                bad = [k for k, p in model.named_parameters()
                       if p.grad is not None and not torch.isfinite(p.grad).all()]
                bad_w = [k for k, p in model.named_parameters() if not torch.isfinite(p).all()]
                log(f"step {step}: gradient norm {gnorm.item()}, loss {lm.item():.4f}, aux {aux.item():.4f}; "
                    f"{len(bad)} parameters with non-finite gradients (first: {bad[:4]}), "
                    f"{len(bad_w)} with non-finite weights: step skipped")
        if step in (1, 10, 50):
            torch.cuda.synchronize()
            log(f"step {step}: {time.time() - t0:.1f} s, train loss {lm.item():.3f}")
        if step % args.eval_every == 0:
            held = mean_nll(model, held_ids[: 64 * SEQ + 1], dev)
            curve.append(dict(step=step, tokens=seen, seconds=round(time.time() - t0, 1),
                              train_loss=round(lm.item(), 4), aux=round(aux.item(), 4),
                              held_loss=round(held, 4), grad_norm=round(gnorm.item(), 3), lr=lr,
                              skipped=len(skipped)))
            log(json.dumps(curve[-1]))
            if held < best["loss"]:  # NaN compares false
                best = dict(loss=held, state={k: v.detach().clone() for k, v in model.state_dict().items()},
                            opt=copy.deepcopy(opt.state_dict()), step=step)
            elif not math.isfinite(held) or held > best["loss"] + DIVERGED:
                if best["state"] is None or len(rollbacks) == MAX_ROLLBACKS:
                    log(f"held-out loss {held:.4f} at step {step}: training diverged, stopping")
                    break
                # Back to the best checkpoint at half the rate. load_state_dict keeps the given
                # tensors as the optimizer's state, which opt.step() updates in place: load a copy.
                lr_scale /= 2
                model.load_state_dict(best["state"])
                opt.load_state_dict(copy.deepcopy(best["opt"]))
                rollbacks.append(dict(step=step, held_loss=held if math.isfinite(held) else str(held),
                                      back_to=best["step"], lr_scale=lr_scale))
                log(f"held-out loss {held:.4f} at step {step} (best {best['loss']:.4f} at step "
                    f"{best['step']}): diverged, back to step {best['step']}'s checkpoint, "
                    f"learning rate x{lr_scale}")
    # The last step too: a run of few steps would otherwise fall back to an early checkpoint.
    held = mean_nll(model, held_ids[: 64 * SEQ + 1], dev)
    log(f"last step {step}: held loss {held:.4f}")
    if held < best["loss"]:
        best = dict(loss=held, state=None, opt=None, step=step)
    if best["state"] is None and not math.isfinite(held):
        # NaN compares false: nothing was kept. Converting a NaN model only fails later (sluice
        # refuses its GGUF), so stop here.
        raise SystemExit(f"train.py: no finite held-out loss in {step} steps: the run diverged")
    if best["state"] is not None:
        model.load_state_dict(best["state"])
    best_step = best["step"]
    del best  # the GPU copies of weights and optimizer state
    held_nll = mean_nll(model, held_ids, dev)
    log(f"best step {best_step}: held-out ppl {math.exp(held_nll):.2f} (unigram {unigram_ppl:.2f})")

    # Greedy sample from the float32 model.
    model = model.float().eval()
    p_ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        gen = model.generate(torch.tensor([p_ids], device=dev), max_new_tokens=96, do_sample=False)
    sample_ids = gen[0].tolist()
    sample = tok.decode(sample_ids)
    log("sample:\n" + sample)

    # Save, then the Q8_0 oracle: every matrix llama.cpp stores as Q8_0 rounded the same way.
    hf = Path("/tmp/trained-moe-hf")
    model.save_pretrained(hf)
    tok.save_pretrained(hf)
    sys.path.insert(0, str(args.llama / "gguf-py"))
    import gguf.quants as gq
    from gguf import GGMLQuantizationType as Q

    ref_ids = held_ids[:128]
    if not args.no_oracle:
        with torch.no_grad():
            for name, p in model.named_parameters():
                keep_f32 = p.ndim < 2 or name.endswith("norm.weight") or ".mlp.gate." in name
                if not keep_f32 and p.shape[-1] % 32 == 0:
                    a = p.detach().cpu().numpy().astype(np.float32)
                    q = gq.dequantize(gq.quantize(a, Q.Q8_0), Q.Q8_0).reshape(a.shape)
                    p.copy_(torch.from_numpy(q))
            ref = model(input_ids=torch.tensor([ref_ids], device=dev)).logits[0].float().cpu().numpy()
        np.save(args.out / "q8_0.dequant.logits.npy", ref)
    (args.out / "tokens.json").write_text(json.dumps({"ids": ref_ids.tolist(), "source": "held-out files"}))

    # llama.cpp's converter, told the pre-tokenizer this tokenizer was trained with.
    sys.path.insert(0, str(args.llama))
    import conversion.base as base

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
    import convert_hf_to_gguf

    gguf_path = args.gguf_path or Path(f"/tmp/{args.name}-q8_0.gguf")
    sys.argv = ["convert_hf_to_gguf.py", str(hf), "--outtype", "q8_0", "--outfile", str(gguf_path)]
    convert_hf_to_gguf.main()
    data = gguf_path.read_bytes()
    piece = 15_000_000
    for i in range(0, len(data), piece) if args.gguf_path is None else []:
        (args.out / f"{args.name}-q8_0.gguf.part{i // piece:02d}").write_bytes(data[i : i + piece])
    manifest = dict(
        data=dict(source="Debian python3.11 3.11.2 standard library (/usr/lib/python3.11/**/*.py, "
                  "site-packages excluded)", license="Python Software Foundation License Version 2",
                  files_train=len(train_f), files_held_out=len(held_f),
                  tokens_train=int(len(train_ids)), tokens_held_out=int(len(held_ids))),
        tokenizer=dict(kind="byte-level BPE, Qwen2 pre-tokenizer regex", vocab=VOCAB, specials=SPECIALS),
        model=dict(arch="Qwen3MoeForCausalLM", parameters=n_params, **shape),
        training=dict(optimizer=f"AdamW lr {peak:g} (warm-up {warm} steps) cosine to {peak / 10:g}, "
                      "betas (0.9, 0.95), wd 0.1, clip 1.0",
                      rollbacks=rollbacks, skipped_steps=skipped,
                      geometry=args.geometry, batch=BATCH, seq=SEQ, steps=step, tokens_seen=seen, minutes=args.minutes,
                      best_step=best_step, precision="bf16 autocast, fp32 weights", seed=args.seed,
                      experts_in_training="dense (train.py dense_experts_forward)" if dense else "transformers'"),
        held_out=dict(ppl=math.exp(held_nll), unigram_ppl=unigram_ppl, tokens=int(len(held_ids))),
        loss_curve=curve,
        sample=dict(prompt=PROMPT, greedy_ids=sample_ids, text=sample),
        gguf=dict(bytes=len(data), sha256=hashlib.sha256(data).hexdigest(), outtype="q8_0",
                  converter="llama.cpp convert_hf_to_gguf.py (llama-cpp-python 0.3.36 vendor tree)"),
        versions=dict(torch=torch.__version__, transformers=__import__("transformers").__version__,
                      tokenizers=__import__("tokenizers").__version__),
        seconds_total=round(time.time() - t_start, 1),
    )
    (args.out / "manifest.json").write_text(json.dumps(strict_json(manifest), indent=1))
    log(f"done in {time.time() - t_start:.0f} s; gguf {len(data)} bytes")


if __name__ == "__main__":
    main()
