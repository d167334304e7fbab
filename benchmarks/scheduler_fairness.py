"""Fairness of the server's scheduler without HTTP: a long prompt arriving while 4 conversations stream.

Each scheduler step is one prefill chunk of the newcomer plus one batched decode step of the 4, so
the 4 streams' inter-token latency while the prompt goes in is a decode step plus a chunk's prefill.
This times every step (the 4 streams' inter-token gap) against one conversation decoding alone, per
prefill chunk size, and how long the newcomer waits for its first token. Writes JSON atomically.

    python benchmarks/scheduler_fairness.py --prompt 4000 --chunks 128,32,8 --out /tmp/fairness.json
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from attnlab.io import provenance, write_json
from attnlab.options import PolicySpec
from attnlab.sampling import Sampler
from attnlab.serve.scheduler import Scheduler
from attnlab.session import Session


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def session(lm, spec: PolicySpec) -> Session:
    return Session(lm, lm.new_cache(policy=spec.build()), spec.chunk)


def timed(sched: Scheduler, until) -> list[float]:
    gaps = []
    while not until():
        t = time.perf_counter()
        sched.step()
        gaps.append(time.perf_counter() - t)
    return gaps


def run(lm, chunk: int, args) -> dict:
    spec = PolicySpec("sink", args.budget, 4, "cache", chunk=chunk)
    g = torch.Generator().manual_seed(0)
    prompt = lambda n: torch.randint(100, 20000, (n,), generator=g).tolist()  # noqa: E731
    sched = Scheduler(lm, max_batch=8, chunk=chunk)
    sched.submit(session(lm, spec), prompt(100), Sampler(0.0), 10_000)
    timed(sched, lambda: len(sched.decoding) == 1)
    solo = timed(sched, lambda: sched.counters["decode_steps"] >= args.steps)
    for _ in range(3):
        sched.submit(session(lm, spec), prompt(100), Sampler(0.0), 10_000)
    timed(sched, lambda: len(sched.decoding) == 4)
    before = sched.counters["decode_steps"]
    four = timed(sched, lambda: sched.counters["decode_steps"] >= before + args.steps)
    sched.submit(session(lm, spec), prompt(args.prompt), Sampler(0.0), 1)
    start = time.perf_counter()
    during = timed(sched, lambda: len(sched.prefilling) == 0 and not sched.queued)
    first = time.perf_counter() - start
    s50 = pct(solo, 50)
    return {"chunk": chunk, "solo_itl_p50_ms": 1000 * s50, "four_itl_p50_ms": 1000 * pct(four, 50),
            "during_itl_p50_ms": 1000 * pct(during, 50), "during_itl_p99_ms": 1000 * pct(during, 99),
            "during_p99_over_solo": pct(during, 99) / s50, "newcomer_first_token_s": first, "steps": len(during)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompt", type=int, default=4000, help="the newcomer's prompt tokens")
    p.add_argument("--chunks", default="128,32,8", help="prefill chunk sizes to try")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--steps", type=int, default=40, help="decode steps timed solo and with 4")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    made = {**provenance(None), "command": "python " + " ".join(sys.argv)}
    import attnlab
    lm = attnlab.load(args.model, threads=args.threads)
    rows = [run(lm, int(c), args) for c in args.chunks.split(",")]
    print("| chunk | solo ITL p50 (ms) | 4 streams ITL p50 (ms) | while the prompt goes in: ITL p50 / p99 (ms) | "
          "p99 / solo | newcomer's first token (s) |\n|---:|---:|---:|---|---:|---:|")
    for r in rows:
        print(f"| {r['chunk']} | {r['solo_itl_p50_ms']:.1f} | {r['four_itl_p50_ms']:.1f} | {r['during_itl_p50_ms']:.1f} / "
              f"{r['during_itl_p99_ms']:.1f} | {r['during_p99_over_solo']:.1f} | {r['newcomer_first_token_s']:.2f} |")
    if args.out:
        write_json(args.out, {**made, "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
