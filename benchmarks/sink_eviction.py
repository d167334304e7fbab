"""Decode tok/s of StreamingLLM caches that evict one token per step (block 1, the exact policy) and in blocks,
against full attention over a cache of the same size, all in the native step, one process, one model.

A sink cache of budget B holds B slots whatever the depth, so its step attends to as many keys as full attention
at depth B; what it adds is eviction. Every step of a block-1 cache moves its sinks up one slot in every layer
and turns their keys (`LayerKV.slide`; keys sit at slot + `KVCache.shift`), and once per chunk or so compacts the
slots left behind (`KVCache.begin`); the time spent evicting (`KVCache.advance`) is printed per step. Runs interleave, the order rotating every repeat; medians with the CPU
model, its ISA flags, the thread count and the load average.

    python benchmarks/sink_eviction.py --budgets 512,2048 --blocks 1,64 --threads 1
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # this checkout's attnlab
from native_step import cpu  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kv", default="float16")
    p.add_argument("--budgets", default="512,2048")
    p.add_argument("--blocks", default="1,64")
    p.add_argument("--threads", default="1")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    import attnlab
    from attnlab.kv import make_policy

    lm = attnlab.load(args.model, kv_dtype=args.kv, tokenizer=False)
    print(f"cpu: {cpu()}\nmodel: {args.model} ({lm.quant}), {args.kv} cache, load average at start "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    tok = torch.tensor([[7]])
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        lm = lm.with_threads(threads)  # the native step's team is the engine's, built for this count
        print(f"\n### {threads} thread{'s' if threads > 1 else ''}: decode tok/s, median of {args.repeats} x "
              f"{args.steps} steps (x full attention over as many keys; min-max); eviction ms per step\n")
        print("| budget | cache | tok/s | eviction ms/step |\n|---|---|---|---|")
        for budget in [int(b) for b in args.budgets.split(",")]:
            ids = torch.randint(0, lm.cfg.vocab_size, (1, budget + 64), generator=torch.Generator().manual_seed(0))
            caches = {"full": lm.new_cache(capacity=budget + args.steps + 2)}
            lm.prefill(ids[:, :budget], caches["full"])
            for block in [int(b) for b in args.blocks.split(",")]:
                c = caches[f"sink, block {block}"] = lm.new_cache(
                    policy=make_policy("sink", budget, chunk=64, block=block))
                lm.prefill(ids, c, chunk=64)
            times = {name: [] for name in caches}
            evict = {name: [] for name in caches}
            order = list(caches)
            for _ in range(args.repeats):
                order = order[1:] + order[:1]
                for name in order:
                    c = caches[name]
                    if name == "full":
                        c.truncate(budget)
                    lm.forward(tok, c)  # warm-up step
                    spent = [0.0]
                    advance = c.advance

                    def timed(T, advance=advance, spent=spent):
                        t0 = time.perf_counter()
                        advance(T)
                        spent[0] += time.perf_counter() - t0
                    c.advance = timed
                    t = time.perf_counter()
                    for _ in range(args.steps):
                        lm.forward(tok, c)
                    times[name].append(args.steps / (time.perf_counter() - t))
                    del c.advance
                    evict[name].append(spent[0] / args.steps)
            assert lm.compiled is not None and lm.compiled.calls["eager"] == 0, "a step left the native path"
            full = statistics.median(times["full"])
            for name in caches:
                m = statistics.median(times[name])
                print(f"| {budget} | {name} | {m:.1f} ({m / full:.2f}x; {min(times[name]):.1f}-{max(times[name]):.1f}) "
                      f"| {statistics.median(evict[name]) * 1e3:.2f} |", flush=True)
        print(f"\nload average at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
