"""Speculative decoding against plain decoding, tokens/s of the whole generation (prefill included), same run.

Workloads that repeat their prompt (where n-gram lookup drafts well): renaming a variable in a function of this
repository, and quoting a passage of a play from `attnlab.data`. Each round runs plain and every spec in turn
(interleaved, so a load change on a shared machine hits all alike); the medians over rounds are reported, with
acceptance, tokens per verification step and whether the tokens equal plain decoding's.

    python benchmarks/speculative.py --rounds 3 --new 128 --specs ngram ngram:4:8 self:sink:64
"""
from __future__ import annotations

import argparse
import inspect
import shlex
import statistics
import sys
import time

import torch


def workloads(lm) -> dict[str, list[int]]:
    from attnlab import data
    from attnlab.stop import StopScanner
    code = inspect.getsource(StopScanner)
    play = data.play_text(data.plays()[0])
    passage = play[len(play) // 3:][:700]
    texts = {"rename": f"Rename the variable `stops` to `patterns` in the following class and print the whole class "
                       f"again:\n\n```python\n{code}```",
             "quote": f"Quote the following passage exactly, word for word:\n\n{passage}"}
    if getattr(lm.tokenizer, "chat_template", None):
        return {k: lm.chat_ids([{"role": "user", "content": t}]) for k, t in texts.items()}
    return {k: lm.encode(t + "\n\n") for k, t in texts.items()}


def run_once(lm, ids, new, spec):
    from attnlab.sampling import Sampler
    from attnlab.speculative import SpecStats
    stats = SpecStats()
    cache = lm.new_cache(capacity=len(ids) + new + 64)
    start = time.perf_counter()
    out = list(lm.stream(ids, cache, Sampler(0), new, stop_at_eos=False, speculative=spec, stats=stats))
    return out, time.perf_counter() - start, stats


def row_costs(lm, ids, lengths=(1, 2, 3, 5, 9), reps=15) -> dict:
    """Median seconds of one verification step (`Row.verify`, T tokens) after the prompt ids, per T, interleaved."""
    from attnlab.batch import Batch
    cache = lm.new_cache(capacity=len(ids) + 64)
    lm.prefill(torch.tensor([ids]), cache)
    seen, times = cache.seen, {t: [] for t in lengths}
    for _ in range(reps):
        for t in lengths:
            start = time.perf_counter()
            lm.step(Batch.one([[5] * t], cache, "all", verify=True))
            times[t].append(time.perf_counter() - start)
            cache.truncate(seen)
    return {t: round(statistics.median(ts), 5) for t, ts in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default=None, help="float32: weights expanded (exact tokens); default: the file's format")
    p.add_argument("--specs", nargs="+", default=["ngram", "ngram:4:8"])
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--row-cost", action="store_true", help="only time verification rows of 1-9 tokens")
    p.add_argument("--out", default="runs/speculative/bench.json")
    args = p.parse_args(argv)
    import attnlab
    from attnlab.io import finish_record, run_record, write_json
    from attnlab.kernels import isa
    record = run_record(None, None, "python benchmarks/speculative.py " + shlex.join(argv or sys.argv[1:]))
    torch.set_num_threads(args.threads)
    lm = attnlab.load(args.model, dtype=args.dtype, threads=args.threads)
    print(f"threads {args.threads}; CPU {isa.describe()}; model {args.model} dtype {args.dtype or 'file'}; "
          f"native step {'on' if lm.compiled is not None else 'off'}")
    rows = []
    if args.row_cost:
        ids = workloads(lm)["quote"]
        costs = row_costs(lm, ids)
        print(f"verification step after {len(ids)} prompt tokens, median s by row length: {costs}")
        write_json(args.out, {**finish_record(record), "threads": args.threads, "cpu": isa.describe(),
                              "model": args.model, "dtype": args.dtype, "prompt_tokens": len(ids), "row_seconds": costs})
        return 0
    for name, ids in workloads(lm).items():
        times = {s: [] for s in [None, *args.specs]}
        last = {}
        run_once(lm, ids, 8, None)  # warm-up
        for _ in range(args.rounds):
            for spec in times:
                out, took, stats = run_once(lm, ids, args.new, spec)
                times[spec].append(took)
                last[spec] = (out, stats)
        plain = statistics.median(times[None])
        for spec, ts in times.items():
            out, stats = last[spec]
            med = statistics.median(ts)
            row = {"workload": name, "prompt_tokens": len(ids), "spec": spec or "plain", "new": args.new,
                   "median_s": round(med, 4), "tokens_per_s": round(args.new / med, 2),
                   "speedup": round(plain / med, 3), "same_tokens": out == last[None][0],
                   **({"stats": stats.as_dict()} if spec else {})}
            rows.append(row)
            print(f"{name:7s} {row['spec']:12s} {row['tokens_per_s']:7.1f} tok/s  x{row['speedup']:.2f}  "
                  f"same={row['same_tokens']}" + (f"  accept {stats.acceptance:.2f}, "
                                                  f"{stats.tokens_per_step:.2f} tok/step" if spec else ""))
    write_json(args.out, {**finish_record(record), "threads": args.threads, "cpu": isa.describe(),
                          "model": args.model, "dtype": args.dtype, "rounds": args.rounds, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
