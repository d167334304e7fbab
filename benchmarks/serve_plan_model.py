"""The scheduler's plans under a cost model: how near the engine's bound a prompt-token budget puts a workload, and
at what inter-token latency, without timing anything (a shared machine's timings move by tens of percent).

The real `Scheduler` plans and runs over stub sessions; each step costs one native decode call for its decode rows
(A + B x rows ms) plus one eager pass per prompt chunk (F + G x tokens ms), the costs measured with the engine on
SmolLM2 at 1 thread (defaults: the Intel Xeon, loaded; only their ratios matter). The bound is the engine's as
`serve_batch.py` computes it: every prompt in `chunk`-token passes, then max_tokens steps of all rows together.
Requests arrive one per step (as the server's model thread admits them). Printed and recorded per budget:
fraction of the bound for 8 long-prompt conversations (three arrival orders) and 8 decode-heavy ones, the decoding
rows' p99 inter-token latency in decode steps of 8 rows, and a 4,000-token newcomer beside 4 streams: their worst
latency over their own, and its time to first token.

    python benchmarks/serve_plan_model.py --out docs/figures/serve/issue55/plan_model.json
"""
from __future__ import annotations

import argparse
import random
import shlex
import sys

import torch

from attnlab.io import run_record, write_json
from attnlab.sampling import Sampler
from attnlab.serve.scheduler import Scheduler

LONG = [191, 313, 451, 634, 745, 852, 991, 1147]  # serve_batch.py --prompt-words 75,750, chat-rendered (SmolLM2)
SHORT = [61, 67, 66, 70, 71, 78, 85, 78]           # --prompt-words 5,20


class Stub:
    """A session and its cache, as the scheduler's runner uses them."""
    batch, max_chunk, observers, logits = 1, None, (), None

    def __init__(self):
        self.cache = self

    def took(self, ids, logits):
        self.logits = logits if logits is not None else self.logits

    def end_reply(self, reply):
        pass


class CostLM:
    tokenizer = None

    def __init__(self, a, b, f, g):
        self.a, self.b, self.f, self.g, self.t = a, b, f, g, 0.0

    def step(self, batch):
        decode = sum(not r.prompt for r in batch.rows)
        self.t += (self.a + self.b * decode if decode else 0) + sum(self.f + self.g * r.tokens for r in batch.rows
                                                                    if r.prompt)
        return [torch.zeros(1, 1, 2) for _ in batch.rows]


class Budget(Scheduler):
    """The scheduler with a token budget beside decoding rows (step_tokens; 0: the scheduler's own rule)."""

    def __init__(self, lm, chunk: int, step_tokens: int):
        super().__init__(lm, max_batch=8, chunk=chunk)
        self.step_tokens = step_tokens

    def chunk_now(self) -> int:
        if not self.step_tokens:
            return super().chunk_now()
        return min(self.chunk, self.step_tokens) if self.decoding else self.chunk


def workload(costs, lens, max_tokens, chunk, step_tokens) -> dict:
    lm = CostLM(*costs)
    s = Budget(lm, chunk, step_tokens)
    todo, last, gaps = list(lens), {}, []
    while todo or not s.idle:
        if todo:
            s.submit(Stub(), [1] * todo.pop(0), Sampler(0.0), max_tokens)
        for e in s.step():
            if e.kind == "token":
                gaps += [lm.t - last[e.id]] if e.id in last else []
                last[e.id] = lm.t
    a, b, f, g = costs
    bound = sum(f + g * min(chunk, n - i) for n in lens for i in range(0, n, chunk)) + max_tokens * (a + b * len(lens))
    gaps.sort()
    return {"of_bound": bound / lm.t, "itl_p99_steps": gaps[int(0.99 * (len(gaps) - 1))] / (a + 8 * b)}


def newcomer(costs, chunk, step_tokens) -> dict:
    lm = CostLM(*costs)
    s = Budget(lm, chunk, step_tokens)
    for _ in range(4):
        s.submit(Stub(), [1] * 70, Sampler(0.0), 10_000)
    while len(s.decoding) < 4:
        s.step()
    s.step()
    alone = lm.t
    s.step()
    alone, worst = lm.t - alone, 0.0
    new, t0, first = s.submit(Stub(), [1] * 4000, Sampler(0.0), 8), lm.t, None
    while first is None:
        before = lm.t
        events = s.step()
        worst = max(worst, lm.t - before)
        first = next((lm.t - t0 for e in events if e.id == new), None)
    return {"itl_over_alone": worst / alone, "newcomer_ttft_steps": first / (costs[0] + 8 * costs[1])}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--costs", default="54,12.4,160,5.7",
                   help="A,B,F,G ms: decode A + B x rows, prompt pass F + G x tokens")
    p.add_argument("--budgets", default="0,32,64,96,128,192,256", help="0: the scheduler's own rule")
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    costs = tuple(float(x) for x in args.costs.split(","))
    record = {**run_record(None, 1, "python " + shlex.join(["benchmarks/serve_plan_model.py", *sys.argv[1:]])),
              "costs_ms": dict(zip("ABFG", costs)), "chunk": args.chunk, "rows": []}
    orders = {"ascending": LONG, "descending": LONG[::-1], "shuffled": random.Random(1).sample(LONG, 8)}
    print("| step_tokens | long prompts: of bound (asc / desc / shuffled) | ITL p99, decode steps | decode-heavy: of "
          "bound | 4,000-token newcomer: 4 streams' worst latency / alone | its TTFT, decode steps |")
    print("|---|---|---|---|---|---|")
    for budget in [int(b) for b in args.budgets.split(",")]:
        long = {k: workload(costs, v, 64, args.chunk, budget) for k, v in orders.items()}
        short, fair = workload(costs, SHORT, 256, args.chunk, budget), newcomer(costs, args.chunk, budget)
        record["rows"].append({"step_tokens": budget, "long": long, "short": short, "newcomer": fair})
        fractions = " / ".join(f"{v['of_bound']:.2f}" for v in long.values())
        print(f"| {budget} | {fractions} | "
              f"{max(v['itl_p99_steps'] for v in long.values()):.1f} | {short['of_bound']:.2f} | "
              f"{fair['itl_over_alone']:.1f}x | {fair['newcomer_ttft_steps']:.0f} |")
    if args.out:
        write_json(args.out, record)


if __name__ == "__main__":
    main()
