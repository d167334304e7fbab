"""Where the Q4_K_M perplexity gap to llama-perplexity comes from: the activations' rounding rule.

Both engines hold the same K-quant weights (our dequantisation equals the `gguf` package's), but they round
the activations differently before the integer dot products: ours per 32 values for every format (int8, one
float32 scale each); llama.cpp per 256 (its Q8_K: one scale per superblock) into K-quant tensors and per 32 with
a float16 scale (Q8_0) into the others. This script runs the file's dequantised weights in float32 on the
prefill path (no kernels) with each rule applied to every linear layer's input, and prints the perplexity on the
tokens `benchmarks/decode_kl.py` scores (test plays, chunks of n_ctx, second half of each scored), beside
llama-perplexity's number if given.

    python benchmarks/activation_rounding.py --model ~/.cache/attnlab/bench/smollm2-q4_k_m.gguf --llamacpp-ppl 32.677
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

RULES = ("float", "ours", "llamacpp")  # no rounding; per 32 everywhere; Q8_K into K-quant layers, Q8_0 elsewhere


def rounded(x, block: int, half_scale: bool):
    """x rounded to int8 with one scale per `block` values (amax / 127; float16 as Q8_0 stores it), dequantised."""
    import torch
    b = x.float().reshape(-1, block)
    amax = b.abs().amax(-1, keepdim=True)
    d = (amax / 127).half().float() if half_scale else amax / 127
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return ((b * inv).round().clamp(-127, 127) * d).view(x.shape)


def source_types(path: Path, n_layers: int) -> dict[str, str]:
    """Each linear layer's GGUF block type (a fused layer: its first part's, q or gate)."""
    import gguf
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    out = {"lm_head": types.get("output.weight", types["token_embd.weight"])}
    for i in range(n_layers):
        out |= {f"layers.{i}.attn.wqkv": types[f"blk.{i}.attn_q.weight"], f"layers.{i}.attn.wo": types[f"blk.{i}.attn_output.weight"],
                f"layers.{i}.mlp.w13": types[f"blk.{i}.ffn_gate.weight"], f"layers.{i}.mlp.w2": types[f"blk.{i}.ffn_down.weight"]}
    return out


def perplexity(path: Path, rule: str, n_ctx: int, chunks: int) -> float:
    import torch
    import torch.nn.functional as F
    import attnlab
    from attnlab.data import corpus
    from attnlab.eval import decode_kl
    from attnlab.model.files import resolve
    from attnlab.model.tokenizer import load_tokenizer
    from attnlab.quant.linear import QuantLinear
    lm = attnlab.LM.load(path, tokenizer=False)
    types = source_types(path, len(lm.model.layers))
    for name, mod in lm.model.named_modules():
        if not isinstance(mod, QuantLinear):
            continue
        w = mod.dequantize()
        kquant = types[name].endswith("_K")

        def forward(x, mod=mod, w=w, kquant=kquant):
            x2 = x.reshape(-1, mod.in_features).float()
            if rule == "ours":
                x2 = rounded(x2, 32, False)
            elif rule == "llamacpp":
                x2 = rounded(x2, 256, False) if kquant else rounded(x2, 32, True)
            return F.linear(x2, w, mod.bias).view(*x.shape[:-1], mod.out_features)
        mod.forward = forward
    ids = load_tokenizer(resolve("smollm2-135m")).encode(corpus("shakespeare:test"), add_special_tokens=False)
    nll, count = 0.0, 0
    for chunk in decode_kl.chunks_of(ids, n_ctx, chunks):
        lp = decode_kl.scored_logprobs(lm, chunk, "prefill")
        targets = chunk[n_ctx // 2 + 1:]
        nll -= lp[torch.arange(lp.shape[0]), targets].sum().item()
        count += targets.numel()
    return math.exp(nll / count)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True, help="a GGUF file (its K-quant layers get llama.cpp's Q8_K rule)")
    p.add_argument("--rules", default=",".join(RULES))
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument("--chunks", type=int, default=1)
    p.add_argument("--llamacpp-ppl", type=float, default=None, help="llama-perplexity's number on the same file and tokens")
    args = p.parse_args(argv)
    os.environ["ATTNLAB_NO_KERNELS"] = "1"  # float32 matmuls on the dequantised weights: only the rounding differs
    import torch
    torch.set_num_threads(1)
    print(f"{args.model.name}: prefill path, float32 weights as dequantised, n_ctx {args.n_ctx}, {args.chunks} chunk(s)")
    print("| activations rounded | PPL | vs llama-perplexity |\n|---|---|---|")
    for rule in args.rules.split(","):
        ppl = perplexity(args.model, rule, args.n_ctx, args.chunks)
        rel = f"{100 * (ppl / args.llamacpp_ppl - 1):+.2f}%" if args.llamacpp_ppl else "-"
        print(f"| {rule} | {ppl:.4f} | {rel} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
