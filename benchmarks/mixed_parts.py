"""Fused layers whose parts keep their own formats (a Q4_K_M file's Q4_K q/k beside a Q6_K v) against the
same layers promoted to one format: weight bytes, and native decode speed in one process.

Each file loads in its own formats (the default load). Bytes: every linear layer's `nbytes`, and what the
layers of parts would hold promoted (`QuantLinear(layer.packed)`, the single format they all fit, as every
load made them before). Decode: the native step with a float16 cache, the mixed layers swapped between
their parts and their promoted twins in alternating rounds (the same weights, cache and tokens).
`python benchmarks/mixed_parts.py ~/.cache/attnlab/bench/llama1b-q4_k_m.gguf --threads 1 --rounds 5`
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch


def layer_bytes(model) -> tuple[int, int, collections.Counter]:
    """(bytes of the linear layers as held, as they would be promoted, count of each layer's formats)."""
    from attnlab.quant import QuantLinear
    from attnlab.quant.linear import linear_names
    now = promoted = 0
    kinds: collections.Counter = collections.Counter()
    for name in linear_names(model):
        m = model.get_submodule(name)
        if not isinstance(m, QuantLinear):
            continue
        now += m.nbytes
        promoted += QuantLinear(m.packed).nbytes if m.parts is not None else m.nbytes
        fmt = " + ".join(f"{p.packed.format} x{p.out_features}" for p in m.parts) if m.parts is not None else m.packed.format
        kinds[(name.rsplit(".", 1)[-1], fmt)] += 1
    return now, promoted, kinds


def decode_ab(lm, rounds: int, steps: int) -> dict[str, list[float]]:
    """tok/s of the native step per round, the layers of parts and their promoted twins alternating."""
    from attnlab.quant import QuantLinear
    owners = [(b.attn, "wqkv") for b in lm.model.layers] + [(b.mlp, "w13") for b in lm.model.layers]
    owners = [(o, n) for o, n in owners if getattr(o, n).parts is not None]
    variants = {"parts": [getattr(o, n) for o, n in owners],
                "promoted": [QuantLinear(getattr(o, n).packed, getattr(o, n).bias) for o, n in owners]}
    ids = torch.randint(0, lm.model.cfg.vocab_size, (1, 32 + steps + 1), generator=torch.Generator().manual_seed(0))
    out: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, layers in variants.items():
            for (owner, attr), layer in zip(owners, layers):
                setattr(owner, attr, layer)
            lm.compile_decode()
            cache = lm.new_cache(capacity=64 + steps)
            lm.prefill(ids[:, :32], cache)
            lm.forward(ids[:, 32:33], cache)  # the first step binds the cache
            t = time.perf_counter()
            for i in range(33, 33 + steps):
                lm.forward(ids[:, i:i + 1], cache)
            out[name].append(steps / (time.perf_counter() - t))
            assert lm.compiled is not None and lm.compiled.calls["eager"] == 0
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="GGUF files")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds of decode (0: bytes only)")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per round")
    args = p.parse_args(argv)
    from attnlab.engine import LM
    torch.set_num_threads(args.threads)
    for f in args.files:
        lm = LM.load(f, tokenizer=False)
        lm.kv_dtype = torch.float16
        now, promoted, kinds = layer_bytes(lm.model)
        print(f"{f}: linear layers {now / 2**20:.1f} MiB, promoted {promoted / 2**20:.1f} MiB "
              f"({(promoted - now) / promoted:.1%} saved); model.quant {lm.model.quant!r}")
        for (leaf, fmt), n in sorted(kinds.items()):
            print(f"  {n:3d} x {leaf}: {fmt}")
        if args.rounds and now != promoted:
            with torch.inference_mode():
                res = decode_ab(lm, args.rounds, args.steps)
            print(f"  decode tok/s, {args.threads} thread(s), medians of {args.rounds} rounds: " + ", ".join(
                f"{k} {statistics.median(v):.2f} ({' '.join(f'{x:.1f}' for x in v)})" for k, v in res.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
