"""Speculative decoding against plain decoding, tokens/s of the whole generation (prefill included), same run.

Workloads that repeat their prompt (where n-gram lookup drafts well): renaming a variable in a function of this
repository, and quoting a passage of a play from `attnlab.data`. Each round runs plain and every spec in turn
(interleaved, so a load change on a shared machine hits all alike); the medians over rounds are reported, with
acceptance, tokens per verification step and whether the tokens equal plain decoding's.

    python benchmarks/speculative.py --rounds 3 --new 128 --specs ngram ngram:4:8 self:sink:64
    python benchmarks/speculative.py --long 16384 --rounds 2 --specs self:quest:1024 self:sink:1024
"""
from __future__ import annotations

import argparse
import inspect
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp  # noqa: E402  (the peer's builds and llama-bench)


def long_context(lm, tokens: int) -> list[int]:
    """`tokens` of the plays (the first play onwards) then a request to continue: a depth where attention, not the
    weights, is most of a decode step, so a drafter that reads a few pages of the cache (self:quest) pays."""
    from attnlab import data
    text = "".join(data.play_text(p) for p in data.plays())
    ids = lm.encode(text[:tokens * 8])[:tokens]
    return ids + lm.encode("\n\nContinue the scene:\n")


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


def llama_lookup(build: dict, model: str, text: str, new: int, draft: int, threads: int) -> dict:
    """llama.cpp's n-gram speculation (`llama-lookup`: the prompt's n-gram cache drafts up to `draft` tokens) on the
    same prompt text, greedy: its prompt and generation seconds, tokens/s of the whole (prefill included, as ours)
    and its acceptance."""
    cmd = [str(Path(build["bin"]) / "llama-lookup"), "-m", model, "-p", text, "-n", str(new), "-t", str(threads),
           "--temp", "0", "--spec-draft-n-max", str(max(draft, 1)), "-c", "8192"]
    if build.get("ub1"):
        cmd += ["-ub", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    log = out.stdout + out.stderr
    enc = re.search(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
    dec = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
    if out.returncode != 0 or not (enc and dec):
        raise RuntimeError(f"llama-lookup failed ({out.returncode}): {log.strip().splitlines()[-3:]}")
    acc = re.search(r"accept\s+=\s+([\d.]+)%", log)
    seconds = float(enc.group(2)) + float(dec.group(2))
    return {"prompt_tokens": int(enc.group(1)), "new": int(dec.group(1)), "seconds": round(seconds, 4),
            "tokens_per_s": round(int(dec.group(1)) / seconds, 2), "acceptance": float(acc.group(1)) / 100 if acc else None}


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
    p.add_argument("--long", type=int, default=0, metavar="TOKENS",
                   help="only a long-context workload: TOKENS of the plays, then 'Continue the scene' (e.g. 16384)")
    p.add_argument("--llamacpp", action="store_true",
                   help="also llama.cpp's llama-lookup (n-gram drafts, --draft-max 8) and its plain decoding on the same "
                        "prompt text (`make bench-llamacpp` with the llama-lookup target)")
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
    loads = {f"long{args.long}": long_context(lm, args.long)} if args.long else workloads(lm)
    for name, ids in loads.items():
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
            print(f"{name:9s} {row['spec']:16s} {row['tokens_per_s']:7.1f} tok/s  x{row['speedup']:.2f}  "
                  f"same={row['same_tokens']}" + (f"  accept {stats.acceptance:.2f}, "
                                                  f"{stats.tokens_per_step:.2f} tok/step" if spec else ""))
        if args.llamacpp:
            rows += peer_rows(args, lm, name, ids, plain)
    write_json(args.out, {**finish_record(record), "threads": args.threads, "cpu": isa.describe(),
                          "model": args.model, "dtype": args.dtype, "rounds": args.rounds, "rows": rows})
    return 0


def peer_rows(args, lm, name: str, ids: list[int], ours_plain_s: float) -> list[dict]:
    """llama.cpp on the workload's prompt text: plain and n-gram lookup, medians over rounds, each against our plain
    decoding of the same workload (whole generation, prefill included)."""
    from attnlab.model.files import resolve
    builds = llamacpp.find_builds()
    if not builds:
        raise SystemExit("--llamacpp: no llama.cpp build (make bench-llamacpp)")
    build = builds.get("native") or next(iter(builds.values()))
    text = lm.tokenizer.decode(ids)
    out = []
    model = str(resolve(args.model))
    for kind in ("llama.cpp plain", "llama.cpp lookup:8"):
        if kind.endswith("plain"):  # llama-bench: the prompt's length at depth 0, then `new` tokens at its depth
            runs = []
            for _ in range(args.rounds):
                pp = llamacpp.run_bench(build, model, ["-p", str(len(ids)), "-n", "0", "-t", str(args.threads), "-r", "1"])
                tg = llamacpp.run_bench(build, model, ["-p", "0", "-n", str(args.new), "-d", str(len(ids)),
                                                       "-t", str(args.threads), "-r", "1"])
                runs.append({"prompt_tokens": len(ids), "new": args.new, "acceptance": None,
                             "seconds": len(ids) / pp[0]["tps"] + args.new / tg[0]["tps"]})
        else:
            runs = [llama_lookup(build, model, text, args.new, 8, args.threads) for _ in range(args.rounds)]
        med = statistics.median(r["seconds"] for r in runs)
        row = {"workload": name, "spec": kind, "prompt_tokens": runs[0]["prompt_tokens"], "new": runs[0]["new"],
               "median_s": med, "tokens_per_s": round(runs[0]["new"] / med, 2),
               "speedup": round(ours_plain_s / med * runs[0]["new"] / args.new, 3), "acceptance": runs[-1]["acceptance"]}
        if kind.endswith("plain"):
            row["how"] = "llama-bench: -p PROMPT -n 0, then -p 0 -n NEW -d PROMPT (random tokens, same lengths)"
        out.append(row)
        print(f"{name:9s} {kind:16s} {row['tokens_per_s']:7.1f} tok/s  x{row['speedup']:.2f} of our plain"
              + (f"  accept {row['acceptance']:.2f}" if row["acceptance"] is not None else ""))
    return out


if __name__ == "__main__":
    sys.exit(main())
