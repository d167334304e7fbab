"""Decode tok/s at long depths: full attention against Quest's page selection (`--attention quest:BUDGET`),
all in the native step, one process, one model.

Per depth the prompt is prefilled once (with the most threads asked for) into a cache that keeps page summaries;
every variant decodes from it (rolled back to the depth before each timed run, `KVCache.truncate`), at each thread
count, runs interleaved with the order rotating
every repeat, medians printed with the CPU model, its ISA flags, the thread count and the load average. Also
printed: what keeping the summaries in Python after each step (`LayerKV._summarize` of the new slot, every
layer) would cost, against the step keeping them itself in C++ (measured inside the native step's time), and the
cache's bytes per token. `--sink` adds a StreamingLLM cache of each budget (it holds BUDGET slots whatever the
depth: prefilled with BUDGET + 64 tokens, its steps evict as they decode), with block eviction (`--sink-block`,
default 64; block 1 moves every layer's window one slot per step: `benchmarks/sink_eviction.py` measures it).

    python benchmarks/quest_speed.py --depths 4096 --budgets 512,1024,2048 --threads 1
    python benchmarks/quest_speed.py --depths 16384 --rope yarn:4 --budgets 512,1024,2048 --threads 1,2 --sink
    python benchmarks/quest_speed.py --depths 16384 --rope yarn:4 --budgets 512,1024 --channels 0,16
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
    p.add_argument("--rope", default=None, help="e.g. yarn:4 past SmolLM2's 8,192 trained positions")
    p.add_argument("--depths", default="4096")
    p.add_argument("--budgets", default="512,1024,2048")
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--dense", type=int, default=None, help="layers that read every key (default: QuestSpec's)")
    p.add_argument("--threads", default="1")
    p.add_argument("--channels", default="0", help="Quest's CHANNELS per budget: 0 = the bound, R = pages ranked by "
                   "their best key's q.k on R channels (e.g. 0,16: both)")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sink", action="store_true", help="a sink cache of each budget too")
    p.add_argument("--sink-block", type=int, default=64, help="the sink caches' block eviction (1: every step)")
    p.add_argument("--keep", type=Path, default=None, help="a folder keeping each depth's prefilled cache: read "
                   "from there when present (same model, --kv, --rope, --page and --steps), written there when not")
    p.add_argument("--phases", action="store_true", help="also each variant's attention and the rest of the step, "
                   "ms per step (`DecodeStep.profile`, median of the repeats; quest:2*PAGE is the page scoring alone)")
    args = p.parse_args(argv)
    import attnlab
    from attnlab.kv import make_policy
    from attnlab.kv.pages import QuestSpec

    dense = {} if args.dense is None else {"dense": args.dense}
    channels = [int(c) for c in args.channels.split(",")]
    specs = {"full": None}
    for b in args.budgets.split(","):
        for c in channels:
            spec = QuestSpec(int(b), args.page, dense.get("dense", 0), c)
            specs[f"quest:{b}" if not c else str(spec)] = spec
    # the cache keeps page summaries (and keys_t where a variant reads it): every variant decodes from it
    lm = attnlab.load(args.model, kv_dtype=args.kv, rope=args.rope, tokenizer=False,
                      attention=QuestSpec(2 * args.page, args.page, 0, max(channels)))
    print(f"cpu: {cpu()}\nmodel: {args.model} ({lm.quant}), {args.kv} cache, rope {args.rope}, "
          f"load average at start {os.getloadavg()[0]:.1f}", flush=True)
    tok = torch.tensor([[7]])
    thread_counts = [int(t) for t in args.threads.split(",")]
    teams = {t: lm.with_threads(t) for t in thread_counts}  # the native step's team is the engine's, set per view
    prefilled = {}  # depth -> (cache, sink caches): prefilled once, with the most threads asked for
    for threads in thread_counts:
        rows = {}
        for n in [int(d) for d in args.depths.split(",")]:
            if n not in prefilled:
                torch.set_num_threads(max(thread_counts))
                ids = torch.randint(0, lm.cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
                name = f"{Path(args.model).name}-{args.kv}-{args.rope}-page{args.page}-{n}-{args.steps}.pt"
                kept = args.keep / name if args.keep else None
                if kept and kept.exists():
                    cache = torch.load(kept, weights_only=False)
                    print(f"depth {n}: prefilled cache read from {kept}", flush=True)
                else:
                    cache = lm.new_cache(capacity=n + args.steps + 1)  # page summaries kept: every variant reads it
                    t = time.perf_counter()
                    lm.prefill(ids, cache)
                    print(f"depth {n}: prefill {time.perf_counter() - t:.1f} s at {max(thread_counts)} thread(s)",
                          flush=True)
                    if kept:
                        kept.parent.mkdir(parents=True, exist_ok=True)
                        torch.save(cache, kept.with_suffix(".tmp"))
                        kept.with_suffix(".tmp").replace(kept)
                print(f"depth {n}: {cache.nbytes() / n:.0f} bytes per token (keys, values, page summaries and what "
                      "CHANNELS reads, all layers)", flush=True)
                sinks = {}
                for b in (args.budgets.split(",") if args.sink else []):
                    sinks[f"sink:{b}"] = c = lm.with_attention(None).new_cache(
                        policy=make_policy("sink", int(b), chunk=64, block=args.sink_block))
                    lm.with_attention(None).prefill(ids[:, :int(b) + 64], c)
                prefilled[n] = cache, sinks
            cache, sinks = prefilled[n]
            torch.set_num_threads(threads)  # the eager path's ops (a command line's edge)
            team = teams[threads]
            views = {name: team.with_attention(spec) for name, spec in specs.items()}
            times = {name: [] for name in [*views, *sinks]}
            phases = {name: [] for name in times}
            order = list(times)
            for _ in range(args.repeats):
                order = order[1:] + order[:1]
                for name in order:
                    view = views.get(name, views["full"])
                    c = sinks.get(name, cache)
                    if name not in sinks:
                        c.truncate(n)
                    view.forward(tok, c)  # warm-up step (builds the step for this thread count)
                    if args.phases:
                        team.compiled.step.profile(True)
                    t = time.perf_counter()
                    for _ in range(args.steps):
                        view.forward(tok, c)
                    times[name].append(args.steps / (time.perf_counter() - t))
                    if args.phases:
                        ms = {k: v[0] * 1e3 for k, v in team.compiled.step.profile(False).items()}
                        phases[name].append((ms["attention"], sum(ms.values()) - ms["attention"]))
            assert team.compiled is not None and team.compiled.calls["eager"] == 0, "a step left the native path"
            cache.truncate(n)
            py = python_summaries(cache, n)
            rows[n] = times, py
            if args.phases:
                print(f"\ndepth {n}, {threads} thread(s): ms per step, attention / the rest (wall, thread 0's "
                      "barrier to barrier), medians")
                for name, got in phases.items():
                    print(f"  {name}: {statistics.median(a for a, _ in got):.2f} / "
                          f"{statistics.median(r for _, r in got):.2f}", flush=True)
        load = os.getloadavg()[0]
        print(f"\n### {threads} thread{'s' if threads > 1 else ''}: decode tok/s, median of {args.repeats} x "
              f"{args.steps} steps (x full; min-max), load average {load:.1f} at the end\n")
        print("| attention | " + " | ".join(f"depth {n}" for n in rows) + " |")
        print("|---|" + "---|" * len(rows))
        for name in times:
            cells = []
            for n, (times, _) in rows.items():
                m, f = statistics.median(times[name]), statistics.median(times["full"])
                cells.append(f"{m:.1f} ({m / f:.2f}x; {min(times[name]):.1f}-{max(times[name]):.1f})")
            print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
        for n, (_, py) in rows.items():
            print(f"\ndepth {n}: page summaries of one new slot kept in Python (every layer's `_summarize`): "
                  f"{py * 1e3:.2f} ms per step", flush=True)
    return 0


def python_summaries(cache, n: int, repeats: int = 20) -> float:
    """Seconds per step that keeping the page summaries in Python after a step would cost (all layers)."""
    t = time.perf_counter()
    for _ in range(repeats):
        for layer in cache.layers:
            layer._summarize(n - 1, n)
    return (time.perf_counter() - t) / repeats


if __name__ == "__main__":
    sys.exit(main())
