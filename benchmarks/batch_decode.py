"""The engine alone: B conversations advanced together by `LM.step`, aggregate tokens per second by B.

What the server's scheduler can get at most from one step for B conversations (no HTTP, no sampling): each
conversation's cache is prefilled with its own prompt (lengths spread evenly over --prompt-tokens), then every
batch size B in turn runs --steps steps over its first B conversations, the sizes interleaved round by round
(medians of --repeats rounds). Prints the CPU model and ISA flags, writes JSON + Markdown (atomically).

    python benchmarks/batch_decode.py --batches 1,2,4,8,16 --threads 1,2 --repeats 3 --out docs/figures/serve/engine-batch
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import llamacpp  # noqa: E402

import attnlab  # noqa: E402
from attnlab.batch import Batch  # noqa: E402
from attnlab.data import corpus  # noqa: E402
from attnlab.io import provenance, write_json, write_text  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batches", default="1,2,4,8,16")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--prompt-tokens", default="100,1000")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--load", default="", help="extra attnlab.load fields, e.g. kv_dtype=int8")
    p.add_argument("--out", type=Path, default=Path("docs/figures/serve/engine-batch"))
    args = p.parse_args(argv)
    print(llamacpp.header(), flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    lo, hi = (int(t) for t in args.prompt_tokens.split(","))
    fields = dict(kv.split("=", 1) for kv in args.load.split()) if args.load else {}
    lm = attnlab.load(args.model, **fields)
    text = lm.encode(corpus("shakespeare:test"))
    top = max(batches)
    record = {**provenance(None), "command": "python " + shlex.join(["benchmarks/batch_decode.py", *sys.argv[1:]]),
              "seed": 0, "cpu": llamacpp.header(), "model": args.model, "quant": lm.quant, "kv": str(lm.kv_dtype),
              "cells": []}
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        lm = lm.with_threads(threads)  # the native step's team is the engine's, built for this count
        caches = []
        for i in range(top):
            n = lo + (hi - lo) * i // max(1, top - 1)
            cache = lm.new_cache(capacity=n + args.steps * (args.repeats + 1) + 8)
            lm.prefill(torch.tensor([text[i * hi:i * hi + n]]), cache)
            caches.append(cache)
        times = {b: [] for b in batches}
        for r in range(args.repeats):
            for b in (batches if r % 2 == 0 else batches[::-1]):
                rows = caches[:b]
                tokens = torch.full((b,), 42)
                lm.step(Batch.decode(tokens, rows))  # binds the rows
                t = time.perf_counter()
                for _ in range(args.steps):
                    tokens = torch.cat([lg[:, -1] for lg in lm.step(Batch.decode(tokens, rows))]).argmax(-1)
                times[b].append(time.perf_counter() - t)
                for c in rows:  # back to the prompt, so every round decodes at the same depths
                    c.truncate(len(c) - args.steps - 1)
        one = statistics.median(times[1]) if 1 in times else None
        for b in batches:
            step = statistics.median(times[b]) / args.steps
            cell = {"threads": threads, "batch": b, "ms_per_step": step * 1e3, "tok_s": b / step,
                    "all_s": times[b], "x_one": (b / step) / (args.steps / one) if one else None}
            record["cells"].append(cell)
            print(f"threads {threads} B {b:>2}: {step * 1e3:7.1f} ms/step  {b / step:7.1f} tok/s"
                  + (f"  x{cell['x_one']:.2f} of B=1" if one else ""), flush=True)
        write_json(args.out / "batch_decode.json", record)
    rows = ["| threads | B | ms / step | tok/s | x B=1 |", "|---|---|---|---|---|"]
    rows += [f"| {c['threads']} | {c['batch']} | {c['ms_per_step']:.1f} | {c['tok_s']:.1f} | "
             f"{c['x_one']:.2f} |" for c in record["cells"]]
    write_text(args.out / "batch_decode.md", "\n".join([f"`{record['command']}` at {record['commit'][:10]}", "",
                                                        record["cpu"], "", *rows]) + "\n")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
