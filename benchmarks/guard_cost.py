"""The perplexity guard's cost beside a 64-token reply, on many prompts, in the server's way (the reply's own
prefill scores the user's tokens) and standalone (one more prefill); and the filter's detection of the attacks'
suffixes at its threshold.

Prompts: a random sample of the ordinary prompts (`pairs.ordinary_prompts`: play lines, chat questions, RULER
prompts in their natural mix) and the attacked ones (prompt + suffix, the final suffixes and every fifth step's of
`attnlab attack` results; nanogcg's final suffixes from `benchmarks/nanogcg_anchor.py`'s JSON). Per prompt, in
turn (`timings`): the greedy chat reply (64 tokens, EOS ignored) through the server's
scheduler, the same reply with the guard's `Screen` in its prefill, and the standalone check, so a shared machine's
load moves all of them alike; --rounds passes over the prompts, each prompt's fastest kept. The guard's cost is the
screened reply less the plain one: the median over prompts of cost / reply, and the ratio of the sums (ordinary,
attacked).

    .venv/bin/python benchmarks/guard_cost.py --prompts 60 --attacks runs/robust/gcg/attack.json \\
        --nanogcg runs/h60/success/nanogcg.json --out runs/h60/guard-cost.json
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path


def attacked(attack_jsons: list[str], nanogcg_jsons: list[str], decode) -> list[dict]:
    from attnlab.robust import evaluate as ev
    from attnlab.robust.pairs import PAIRS
    rows = []
    for path in attack_jsons:
        rows += [{**p, "kind": "final"} for p in ev.attacked_prompts(json.loads(Path(path).read_text())["results"])]
        rows += [{**p, "kind": f"step {p['step']}"} for p in ev.step_prompts(path, decode)]
    for path in nanogcg_jsons:
        for r in json.loads(Path(path).read_text())["results"]:
            rows.append({"pair": r["pair"], "text": PAIRS[r["pair"]][0] + r["suffix"], "success": r["success"],
                         "variant": "nanogcg", "kind": "final"})
    return rows


def reply_seconds(lm, ids: list[int], reply_tokens: int = 64, screen=None) -> float:
    """Seconds of a greedy `reply_tokens`-token reply to ids (EOS ignored) through the server's scheduler, with a
    guard's Screen in its prefill or without."""
    from attnlab.sampling import Sampler
    from attnlab.serve.config import ServeConfig
    from attnlab.serve.scheduler import Scheduler
    from attnlab.session import Session
    t = time.perf_counter()
    sched = Scheduler(lm, max_batch=1, chunk=ServeConfig.chunk)
    sched.submit(Session(lm, lm.new_cache(1, capacity=len(ids) + reply_tokens)), ids, Sampler(0.0), reply_tokens,
                 screen=screen)
    while not sched.idle:
        sched.step()
    return time.perf_counter() - t


def timings(lm, filt, text: str, reply_tokens: int = 64) -> dict:
    """One round of a prompt's timings, in turn: the reply, the reply whose prefill also scores the user's tokens
    (as `serve --guard` does; never rejecting, so both decode alike), and the filter's standalone check."""
    from attnlab.robust.defenses import Screen
    ids, spans = filt.tokens(text)
    return {"reply_s": reply_seconds(lm, ids, reply_tokens),
            "screened_s": reply_seconds(lm, ids, reply_tokens, Screen(filt, spans, lambda v: None)),
            "check_s": _seconds(filt.check, text)}


def _seconds(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--guard", default="ppl", help="the guard spec as `serve --guard` takes (chat messages)")
    ap.add_argument("--prompts", type=int, default=60, help="ordinary prompts timed (a random sample)")
    ap.add_argument("--attacks", nargs="*", default=[], help="`attnlab attack` attack.json files")
    ap.add_argument("--nanogcg", nargs="*", default=[], help="nanogcg_anchor.py peer JSONs (nanogcg.json)")
    ap.add_argument("--timed-attacks", type=int, default=12, help="attacked prompts timed (of the final suffixes)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reply-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/guard-cost.json")
    ap.add_argument("--checkout", default=None, metavar="COMMIT:NOTE", help="run from an exported tree (no git): "
                    "the commit it was exported from and what differs from it (recorded as dirty, with the note)")
    args = ap.parse_args(argv)

    import torch

    import attnlab
    from attnlab.io import finish_record, run_record, write_json
    sys.path.insert(0, str(Path(__file__).parent))
    import llamacpp
    print(llamacpp.header(), flush=True)
    from attnlab.robust.defenses import Guard
    from attnlab.robust.pairs import ordinary_prompts
    record = run_record(None, args.seed, " ".join(["benchmarks/guard_cost.py", *(argv or sys.argv[1:])]))
    if args.checkout:
        commit, _, note = args.checkout.partition(":")
        record.update(commit=commit, dirty=True, dirty_note=note)
    torch.set_num_threads(args.threads)
    lm = attnlab.load(args.model, threads=args.threads)
    f = Guard.parse(args.guard).build(lm, "chat")
    found = attacked(args.attacks, args.nanogcg, lm.tokenizer.decode)
    rng = random.Random(args.seed)
    timed = [{**r, "group": "ordinary"} for r in rng.sample(ordinary_prompts(lm.encode, seed=args.seed), args.prompts)]
    finals = [r for r in found if r["kind"] == "final"]
    timed += [{**r, "group": "attacked"} for r in rng.sample(finals, min(args.timed_attacks, len(finals)))]

    for i in range(args.rounds):
        for r in timed:
            for k, v in timings(lm, f, r["text"], args.reply_tokens).items():
                r[k] = min(r.get(k, v), v)
        print(f"round {i + 1} of {args.rounds} done", file=sys.stderr, flush=True)

    result = {**record, "cpu": llamacpp.header(), "model": args.model, "reply_tokens": args.reply_tokens,
              "threads": args.threads,
              "guard": args.guard, "threshold": f.threshold, "context": f.context,
              "timed": {"ordinary": args.prompts, "attacked": len(timed) - args.prompts}, "cost": {}, "detection": {}}
    for group in ("ordinary", "attacked", "all"):
        part = [r for r in timed if group in ("all", r["group"])]
        if part:
            reply = sum(r["reply_s"] for r in part)
            result["cost"][group] = {
                "median_ratio": statistics.median((r["screened_s"] - r["reply_s"]) / r["reply_s"] for r in part),
                "sum_ratio": (sum(r["screened_s"] for r in part) - reply) / reply,
                "standalone_median_ratio": statistics.median(r["check_s"] / r["reply_s"] for r in part),
                "standalone_sum_ratio": sum(r["check_s"] for r in part) / reply,
                "median_reply_s": statistics.median(r["reply_s"] for r in part), "prompts": len(part),
                "median_prompt_tokens": statistics.median(len(f.tokens(r["text"])[0]) for r in part)}
    for kind in sorted({(r["variant"], r["kind"] == "final") for r in found}):
        part = [r for r in found if (r["variant"], r["kind"] == "final") == kind]
        scores = [f.score(r["text"]) for r in part]
        result["detection"][f"{kind[0]} {'final' if kind[1] else 'every 5th step'}"] = {
            "prompts": len(part), "flagged": sum(s > f.threshold for s in scores), "min_score": min(scores)}
    print(f"{args.guard} (threshold {f.threshold:g}, {f.context}): " + ", ".join(
        f"{g}: in the prefill median {v['median_ratio']:.1%} sum {v['sum_ratio']:.1%}, standalone median "
        f"{v['standalone_median_ratio']:.1%} sum {v['standalone_sum_ratio']:.1%} ({v['prompts']})"
        for g, v in result["cost"].items()))
    for k, d in result["detection"].items():
        print(f"  {k}: {d['flagged']} of {d['prompts']} flagged (lowest {d['min_score']:.1f})")
    write_json(args.out, finish_record(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
