"""Exactness of speculative decoding: greedy tokens identical to plain decoding for every drafter kind, per path
(native step, eager), target policy (full, sink) and KV dtype (float16, int8), on a set of prompts.

Plain decoding runs each prompt once per setting through `LM.step` (as `LM.decode` does) and keeps every step's
top-2 logit gap; each drafter then decodes the same prompt speculatively (adaptive K, so rows of every length).
A difference where plain decoding's gap is below --near-tie is a near tie and reported as such; any other
difference is a failure. Also reported: per case, how many of plain decoding's steps sat on a near tie at all.

    python benchmarks/spec_exact.py --prompts 20 --new 128 --out runs/speculative/exact_smollm2.json
"""
from __future__ import annotations

import argparse
import inspect
import shlex
import sys
import time

import torch

KINDS = ["ngram", "self:sink:32", "self:quest:64", "draft"]


def prompts(count: int) -> list[str]:
    """count prompts, half source code of this repository, half passages of a play (deterministic)."""
    import attnlab.engine as engine
    import attnlab.kv.cache as cache
    import attnlab.speculative as spec
    from attnlab import data
    sources = [inspect.getsource(o) for m in (spec, engine, cache) for _, o in inspect.getmembers(m, inspect.isfunction)
               if o.__module__ == m.__name__]
    play = data.play_text(data.plays()[0])
    out = []
    for i in range(count):
        if i % 2:
            out.append(sources[(i // 2) % len(sources)][:360])
        else:
            at = len(play) * (i // 2 + 1) // (count // 2 + 2)
            out.append(play[at:at + 360])
    return out


def plain(lm, ids, new, policy, near):
    """Greedy tokens of plain decoding and each step's top-2 logit gap."""
    from attnlab.batch import Batch
    cache = lm.new_cache(capacity=len(ids) + new + 16, policy=policy)
    logits = lm.prefill(torch.tensor([ids]), cache)
    out, gaps = [], []
    for i in range(new):
        top = logits[0].topk(2)
        gaps.append(float(top.values[0] - top.values[1]))
        out.append(int(top.indices[0]))
        if i < new - 1:
            logits = lm.step(Batch.one([[out[-1]]], cache))[0][:, -1]
    return out, gaps


def speculative(lm, ids, new, spec, drafter, policy):
    from attnlab.sampling import Sampler
    from attnlab.speculative import SpecStats, decode
    cache = lm.new_cache(capacity=len(ids) + new + 16, policy=policy)
    logits = lm.prefill(torch.tensor([ids]), cache)
    stats = SpecStats()
    return list(decode(lm, cache, ids, logits, Sampler(0), new, (), spec, drafter, stats)), stats


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--draft-quant", default="int4:32", help="the draft kind's model: the target's file requantized")
    p.add_argument("--kinds", nargs="+", default=KINDS)
    p.add_argument("--paths", nargs="+", default=["native", "eager"])
    p.add_argument("--policies", nargs="+", default=["full", "sink"])
    p.add_argument("--kv", nargs="+", default=["float16", "int8"])
    p.add_argument("--sink-budget", type=int, default=96)
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--near-tie", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="runs/speculative/exact.json")
    args = p.parse_args(argv)
    import attnlab
    from attnlab.io import finish_record, run_record, write_json
    from attnlab.kernels import isa
    from attnlab.kv import make_policy
    from attnlab.speculative import ModelDrafter, SpeculativeSpec, make_drafter
    record = run_record(None, None, "python benchmarks/spec_exact.py " + shlex.join(argv or sys.argv[1:]))
    torch.set_num_threads(args.threads)
    texts = prompts(args.prompts)
    draft = None
    if "draft" in args.kinds:
        draft = attnlab.load(args.model, quant=args.draft_quant, threads=args.threads, tokenizer=False)
    cases, failures = [], 0
    for path in args.paths:
        for kv in args.kv:
            lm = attnlab.load(args.model, kv_dtype=kv, compile=path == "native", threads=args.threads)
            if path == "native" and lm.compiled is None:
                raise SystemExit("no native step here")
            for pol in args.policies:
                def policy():
                    return make_policy("sink", args.sink_budget, n_sink=4, block=8, chunk=64) if pol == "sink" else None
                encoded = [lm.encode(text) for text in texts]
                start = time.perf_counter()
                plains = [plain(lm, ids, args.new, policy(), args.near_tie) for ids in encoded]
                plain_s = round(time.perf_counter() - start, 1)
                ties = sum(any(g < args.near_tie for g in gaps) for _, gaps in plains)
                for kind in args.kinds:
                    case = {"path": path, "kv": kv, "policy": pol, "kind": kind, "identical": 0, "near_tie_diffs": [],
                            "failures": [], "prompts_with_near_ties": ties, "accepted": 0, "drafted": 0, "steps": 0,
                            "plain_seconds": plain_s}
                    start = time.perf_counter()
                    for j, (ids, (want, gaps)) in enumerate(zip(encoded, plains)):
                        spec = SpeculativeSpec.parse("draft:-" if kind == "draft" else kind)
                        drafter = ModelDrafter(draft) if kind == "draft" else make_drafter(lm, spec)
                        got, stats = speculative(lm, ids, args.new, spec, drafter, policy())
                        for key in ("accepted", "drafted", "steps"):
                            case[key] += getattr(stats, key)
                        if got == want:
                            case["identical"] += 1
                            continue
                        i = next(t for t, (a, b) in enumerate(zip(got, want)) if a != b)
                        where = {"prompt": j, "token": i, "gap": round(gaps[i], 6)}
                        (case["near_tie_diffs"] if gaps[i] < args.near_tie else case["failures"]).append(where)
                    case["seconds"] = round(time.perf_counter() - start, 1)
                    failures += len(case["failures"])
                    cases.append(case)
                    print(f"{path:6s} kv {kv:7s} {pol:4s} {kind:14s} identical {case['identical']}/{len(texts)}  "
                          f"near-tie diffs {len(case['near_tie_diffs'])}  FAIL {len(case['failures'])}  "
                          f"accept {case['accepted']}/{case['drafted']}  {case['seconds']} s", flush=True)
                    write_json(args.out, {  # after every case: a run cut short keeps what it did
                        **finish_record(record), "threads": args.threads, "cpu": isa.describe(), "model": args.model,
                        "prompts": len(texts), "new": args.new, "near_tie": args.near_tie,
                        "sink": {"budget": args.sink_budget, "n_sink": 4, "block": 8},
                        "draft": f"{args.model} requantized {args.draft_quant}", "failures": failures, "cases": cases})
    print(f"{failures} failures; written {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
