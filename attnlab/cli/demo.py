"""`make demo`: the main job on the embedded defaults (SmolLM2-135M, Shakespeare's test plays).

Streams test-play tokens through a bounded KV cache with each policy (full, window,
StreamingLLM sinks, H2O heavy hitters, sinks + heavy hitters), all scoring the same
tokens, prints perplexity / KV memory / speed and writes the NLL-by-position plot.
A short chat answer generated with a sink cache comes first.
"""
from __future__ import annotations

import argparse
import sys
import time

from attnlab.cli.common import positive_int
from attnlab.io import progress

POLICIES = ["full", "window", "sink", "h2o", "sink_h2o"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m attnlab.cli.demo")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads (1: see the README's measurement)")
    p.add_argument("--tokens", type=positive_int, default=256, help="tokens per stream")
    p.add_argument("--streams", type=positive_int, default=8, help="parallel passages of the test plays")
    p.add_argument("--budget", type=positive_int, default=64, help="KV budget (tokens per layer and KV head)")
    p.add_argument("--plot", default="runs/demo/nll_by_position.png", help="NLL-by-position figure")
    args = p.parse_args(argv)

    import torch

    from attnlab.data import corpus
    from attnlab.engine import load
    from attnlab.eval.streaming import plot_positions, stream_nll, summarize
    from attnlab.kv import make_policy

    t0 = time.perf_counter()
    lm = load("smollm2-135m", threads=args.threads)
    print(f"loaded {lm.source.name} ({lm.cfg.n_params / 1e6:.0f}M parameters) in {time.perf_counter() - t0:.1f}s")
    question = "In one sentence, why do language models put attention on the first token?"
    print(f"\nuser> {question}\nbot> ", end="", flush=True)
    print(lm.generate(question, max_new_tokens=48, chat=True, policy=make_policy("sink", 64, chunk=512)))
    print("(generated with a StreamingLLM cache of 64 tokens: 4 sinks + 60 recent)")

    ids = lm.encode(corpus("shakespeare:test"))[:args.tokens * args.streams]
    ids = torch.tensor(ids).view(args.streams, args.tokens)
    print(f"\nstreaming {args.streams} passages x {args.tokens} tokens of the test plays token by token, "
          f"KV budget {args.budget} tokens ({100 * args.budget / args.tokens:.0f}%), cache positions")
    runs = []
    for name in POLICIES:
        policy = make_policy(name, args.budget, positions="cache", chunk=1)
        with progress(ids.numel() - args.streams, name) as bar:
            r = stream_nll(lm, ids, policy, mode="decode", progress=bar.update)
        runs.append({"policy": name, "budget": args.budget if name != "full" else args.tokens,
                     "kv_bytes": r["kv_bytes"], "tok_s": r["nll"].numel() / r["seconds"],
                     "nll_tokens": r["nll"].tolist(), **summarize(r["nll"])})
    full = runs[0]["ppl"]
    print("\nperplexity of the same tokens under each cache (lower is better); vs full: ppl / full's ppl "
          "(1.000x = nothing lost); KV MiB: cache memory; tok/s: scoring speed")
    print(f"{'policy':<10} {'budget':>7} {'ppl':>8} {'vs full':>8} {'KV MiB':>8} {'tok/s':>7}")
    for r in runs:
        print(f"{r['policy']:<10} {r['budget']:>7} {r['ppl']:>8.2f} {r['ppl'] / full:>7.3f}x "
              f"{r['kv_bytes'] / 2**20:>8.2f} {r['tok_s']:>7.1f}")
    plot_positions(runs, args.plot, width=64, title=f"SmolLM2-135M, {args.streams} x {args.tokens} test-play tokens, "
                                                    f"budget {args.budget}")
    print(f"\nwrote {args.plot}  (total {time.perf_counter() - t0:.0f}s, {args.threads} threads)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
