"""Speculative decoding through the server: `attnlab serve` plain against `attnlab serve --speculative SPEC`, in one
run, on a workload that repeats its prompt (a passage of the test plays, then "repeat it word for word").

Both servers run at once (each --threads T, idle while the other is measured); for each concurrency N, R rounds, the
two alternating round by round, N streamed chat conversations at once through the official `openai` client
(temperature 0, `ignore_eos`, the same prompts). Recorded per round: aggregate generated tokens per second (every
stream's content chunks over the round's wall time), whether every reply's text is the plain server's, and the
speculative replies' drafted / accepted / verification steps (the `attnlab.speculative` of each stream's last chunk).
Writes a JSON record (atomically).

    python benchmarks/serve_speculative.py --concurrency 1,8 --threads 1 --rounds 3 --max-tokens 128 \\
        --out docs/figures/speculative/serve-ngram
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from serve import free_port, passages, start_server  # noqa: E402
from serve_batch import round_prompts  # noqa: E402

from attnlab.io import run_record, write_json  # noqa: E402

ASK = "\n\nRepeat the passage above word for word."
KEY = "spec-bench-key-0001"


async def stream(client, prompt: str, max_tokens: int) -> dict:
    t0, text, counts = time.perf_counter(), [], None
    out = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}],
                                               max_tokens=max_tokens, temperature=0.0, stream=True,
                                               extra_body={"ignore_eos": True})
    tokens = 0
    async for chunk in out:
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
            tokens += 1
        ext = (chunk.model_extra or {}).get("attnlab") or {}
        counts = ext.get("speculative", counts)
    return {"text": "".join(text), "seconds": time.perf_counter() - t0, "chunks": tokens, "speculative": counts}


async def round_(url: str, prompts: list[str], max_tokens: int) -> dict:
    from openai import AsyncOpenAI
    async with AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=1800) as client:
        t0 = time.perf_counter()
        got = await asyncio.gather(*(stream(client, p, max_tokens) for p in prompts))
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "tok_s": len(prompts) * max_tokens / wall, "texts": [g["text"] for g in got],
            "speculative": [g["speculative"] for g in got]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--spec", default="ngram", help="the speculative server's --speculative")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-words", type=int, default=100, help="words of the passage to repeat")
    p.add_argument("--out", type=Path, default=Path("runs/serve-speculative"))
    args = p.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",")]
    prompts = [t.strip() + ASK for t in passages(args.prompt_words, max(levels))]
    record = {**run_record(None, 0, "python " + shlex.join(["benchmarks/serve_speculative.py", *(argv or sys.argv[1:])])),
              "cpu_count": os.cpu_count(), "threads": args.threads, "spec": args.spec, "model": args.model,
              "max_tokens": args.max_tokens, "prompt_words": args.prompt_words, "cells": []}
    common = [args.model, "--threads", str(args.threads), "--name", "m", "--api-key", KEY, "--max-tokens-cap",
              str(args.max_tokens), "--policy", "full"]
    servers = {name: start_server(common + extra, free_port(), 600)
               for name, extra in (("plain", []), ("speculative", ["--speculative", args.spec]))}
    try:
        for n in levels:
            cell = {"n": n, "rounds": {"plain": [], "speculative": []}}
            for r in range(args.rounds):
                batch = round_prompts(prompts, n, r)
                for name in ("plain", "speculative") if r % 2 == 0 else ("speculative", "plain"):
                    cell["rounds"][name].append(asyncio.run(round_(servers[name][1], batch, args.max_tokens)))
                a, b = cell["rounds"]["plain"][-1], cell["rounds"]["speculative"][-1]
                print(f"N={n} round {r + 1}: plain {a['tok_s']:.1f} tok/s, speculative {b['tok_s']:.1f} "
                      f"({b['tok_s'] / a['tok_s']:.2f}x), same text: {a['texts'] == b['texts']}", flush=True)
            plain, spec = (statistics.median(x["tok_s"] for x in cell["rounds"][k]) for k in ("plain", "speculative"))
            counts = [c for x in cell["rounds"]["speculative"] for c in x["speculative"] if c]
            cell.update(plain_tok_s=plain, speculative_tok_s=spec, speedup=spec / plain,
                        identical=all(a["texts"] == b["texts"] for a, b in zip(cell["rounds"]["plain"],
                                                                                 cell["rounds"]["speculative"])),
                        acceptance=sum(c["accepted"] for c in counts) / max(1, sum(c["drafted"] for c in counts)),
                        tokens_per_step=statistics.median(c["tokens_per_step"] for c in counts) if counts else None)
            print(f"N={n}: plain {plain:.1f} tok/s, speculative {spec:.1f} tok/s: {spec / plain:.2f}x (medians of "
                  f"{args.rounds}), identical text: {cell['identical']}, acceptance {cell['acceptance']:.2f}", flush=True)
            record["cells"].append(cell)
    finally:
        for server, _ in servers.values():
            server.terminate()
    write_json(args.out.with_suffix(".json"), record)


if __name__ == "__main__":
    main()
