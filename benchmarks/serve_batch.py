"""Many conversations at once: `attnlab serve` against `llama-server -np N` on the same GGUF, in one run.

For each thread count and each concurrency N, both servers get the same N streamed chat conversations at once
through the official `openai` client (the same prompts of --prompt-words words of the Shakespeare test plays
plus a question, the same max_tokens, temperature 0), R rounds each, the two servers alternating round by round.
Recorded per round: aggregate generated tokens per second (every stream's content chunks over the round's wall
time), time to first token and inter-token latency (p50 / p99 over every stream), errors, and each server's peak
RSS. llama-server's slots are fixed at start (`-np N`, context N x --ctx), so it is restarted per N; attnlab
serves every N from one process (`--max-batch`). Beside each attnlab aggregate, the engine's own figure for the
same requests, measured in this process (`engine_figure`): for N = 1 its one-conversation generation of the same prompt and
token count; for N > 1 the bound its measured prefill and batched step times give (every prompt prefilled, then
the longest reply's steps of all N rows together), and the served aggregate over the engine's single stream.
Writes a JSON record and a Markdown table (atomically).

The issue-55 targets, e.g. (attnlab only, 1 and 2 threads):
    python benchmarks/serve_batch.py --servers attnlab --concurrency 1,8 --prompt-words 5,20 --max-tokens 256
    python benchmarks/serve_batch.py --servers attnlab --concurrency 1,8 --prompt-words 75,750 --max-tokens 64

    python benchmarks/serve_batch.py --concurrency 1,2,4,8,16 --threads 1,2 --rounds 3 --out docs/figures/serve/vs-llama-server
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import llamacpp  # noqa: E402
from serve import free_port, passages, rss_mib, start_server, wait_ready  # noqa: E402

from attnlab.io import run_record, write_json, write_text  # noqa: E402

QUESTION = "\n\nRetell this passage in your own words, in detail."


def start_llama_server(binary: Path, model: str, threads: int, slots: int, ctx: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [str(binary), "-m", model, "-t", str(threads), "-tb", str(threads), "-np", str(slots),
           "-c", str(ctx * slots), "--port", str(port), "--host", "127.0.0.1", "-cb", "--no-webui"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return server, wait_ready(server, f"http://127.0.0.1:{port}", 300, "llama-server")


async def one_stream(client, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed chat request: its chunk arrival times (relative to the request) or its error."""
    t0 = time.perf_counter()
    times = []
    try:
        stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                      max_tokens=max_tokens, temperature=0.0, stream=True,
                                                      extra_body={"ignore_eos": True})  # every reply max_tokens long
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                times.append(time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - an error is a result here
        return {"error": f"{type(e).__name__}: {e}"[:300], "times": times}
    return {"times": times}


async def round_(url: str, model: str, prompts: list[str], max_tokens: int, key: str) -> dict:
    from openai import AsyncOpenAI
    async with AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=1800) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, model, p, max_tokens) for p in prompts))
        wall = time.perf_counter() - t0
    tokens = sum(len(r["times"]) for r in results)
    per = [len(r["times"]) for r in results]
    ttft = [r["times"][0] for r in results if r["times"]]
    gaps = [b - a for r in results for a, b in zip(r["times"], r["times"][1:])]
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "errors": [r["error"] for r in results
                                                                                 if "error" in r],
            "ttft": ttft, "itl": gaps, "per_stream": per}


def engine_figure(lm, prompts: list[str], tokens: list[int], steps: int = 8) -> dict:
    """The engine's own aggregate tokens per second for the same requests (chat-rendered, greedy; tokens: each
    stream's count as served). N = 1: one conversation's generation (`Session.generate`, past the end-of-turn
    token as the served replies go, `ignore_eos`), the whole request timed (prefill included). N > 1:
    the bound its measured times give, sum(tokens) / (every prompt's prefill + max(tokens) batched steps of all
    N rows), a step's time the median of `steps` steps over the N prefilled caches."""
    import torch

    from attnlab.batch import Batch
    from attnlab.sampling import Sampler
    from attnlab.session import Session
    ids = [lm.chat_ids([{"role": "user", "content": p}]) for p in prompts]
    if len(ids) == 1:
        t = time.perf_counter()
        session = Session(lm)
        session.feed(ids[0])
        n = sum(1 for _ in session.generate(Sampler(0.0), max(1, tokens[0]), stop_at_eos=False))
        return {"engine": "generate", "engine_tok_s": n / (time.perf_counter() - t)}
    caches = [lm.new_cache(capacity=len(p) + max(tokens) + steps + 2) for p in ids]
    t = time.perf_counter()
    for p, c in zip(ids, caches):
        lm.prefill(torch.tensor([p]), c, chunk=256)
    prefill = time.perf_counter() - t
    tok, times = torch.full((len(ids),), 42), []
    lm.step(Batch.decode(tok, caches))  # binds the rows
    for _ in range(steps):
        t = time.perf_counter()
        lm.step(Batch.decode(tok, caches))
        times.append(time.perf_counter() - t)
    step = statistics.median(times)
    return {"engine": "bound", "engine_tok_s": sum(tokens) / (prefill + max(tokens) * step),
            "engine_prefill_s": prefill, "engine_step_ms": step * 1e3}


async def fairness(url: str, model: str, prompts: list[str], long_prompt: str, max_tokens: int, key: str,
                   delay: float) -> dict:
    """4 streams alone, then the same 4 with a long prompt arriving `delay` s in: their inter-token latencies."""
    from openai import AsyncOpenAI
    async with AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=1800) as client:
        solo = await asyncio.gather(*(one_stream(client, model, p, max_tokens) for p in prompts))

        async def late():
            await asyncio.sleep(delay)
            return await one_stream(client, model, long_prompt, 8)
        *mixed, newcomer = await asyncio.gather(*(one_stream(client, model, p + " Again.", max_tokens)
                                                  for p in prompts), late())
    gaps = [[b - a for r in rs for a, b in zip(r["times"], r["times"][1:])] for rs in (solo, mixed)]
    return {"itl_p99_solo": pct(gaps[0], 0.99), "itl_p99_with_long_prompt": pct(gaps[1], 0.99),
            "itl_max_with_long_prompt": max(gaps[1], default=float("nan")),
            "newcomer_ttft": newcomer["times"][0] if newcomer["times"] else None,
            "errors": [r["error"] for r in (*solo, *mixed, newcomer) if "error" in r]}


def overhead(url: str, model: str, lm, prompt: str, max_tokens: int, key: str, repeats: int) -> dict:
    """One conversation (prompt + max_tokens, greedy) through HTTP against the same request in this process
    (`Session` over the same engine settings), interleaved: generated tokens per second of the whole request."""
    from attnlab.sampling import Sampler
    from attnlab.session import Session
    http, engine = [], []
    for r in range(repeats):
        text = f"{prompt} (take {r})"
        got = asyncio.run(round_(url, model, [text], max_tokens, key))
        http.append(got["tokens"] / got["wall_s"])
        t = time.perf_counter()
        session = Session(lm, chunk=128)
        session.feed(lm.chat_ids([{"role": "user", "content": text}]))
        n = sum(1 for _ in session.generate(Sampler(0.0), got["tokens"], stop_at_eos=False))
        engine.append(n / (time.perf_counter() - t))
    return {"http_tok_s": statistics.median(http), "engine_tok_s": statistics.median(engine),
            "ratio": statistics.median(http) / statistics.median(engine), "http_all": http, "engine_all": engine}


def round_prompts(prompts: list[str], n: int, r: int) -> list[str]:
    """Round r's N prompts: spread evenly over the lengths (so every N sees the same mean prompt), the same for
    both servers. Each opens with its round and reader, so no server finds a cached prefix: with the tag at the
    end, llama-server's slots reused the whole passage a reader had been given in an earlier round (its prompt
    cache), and its time to first token at N = 16 measured that cache, not its prefill."""
    top = len(prompts)
    picks = [top // 2] if n == 1 else [round(i * (top - 1) / (n - 1)) for i in range(n)]
    return [f"(Round {r}, reader {i}.) " + prompts[(j + r) % top] for i, j in enumerate(picks)]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


class Peak:
    """A server process's peak RSS, sampled every 0.5 s while the rounds run."""

    def __init__(self, pid: int):
        self.pid, self.peak, self.stop = pid, rss_mib(pid), threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self):
        while not self.stop.wait(0.5):
            try:
                self.peak = max(self.peak, rss_mib(self.pid))
            except OSError:
                return


def summarize(rounds: list[dict]) -> dict:
    ttft = [t for r in rounds for t in r["ttft"]]
    itl = [t for r in rounds for t in r["itl"]]
    return {"tok_s": statistics.median(r["tok_s"] for r in rounds), "tok_s_all": [r["tok_s"] for r in rounds],
            "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99), "itl_p50": pct(itl, 0.5),
            "itl_p99": pct(itl, 0.99), "errors": sum(len(r["errors"]) for r in rounds),
            "error_examples": [e for r in rounds for e in r["errors"]][:3],
            "tokens": sum(r["tokens"] for r in rounds), "per_stream": rounds[0]["per_stream"]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--concurrency", default="1,2,4,8,16")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-words", default="75,750", help="prompt lengths: words drawn evenly in [lo, hi]")
    p.add_argument("--ctx", type=int, default=2048, help="llama-server context per slot")
    p.add_argument("--servers", default="attnlab,llama-server")
    p.add_argument("--attnlab-args", default="", help="extra `attnlab serve` arguments")
    p.add_argument("--fairness", type=int, default=0, metavar="TOKENS",
                   help="instead: 4 streams, then the same with a prompt of about TOKENS tokens arriving (attnlab only)")
    p.add_argument("--overhead", action="store_true",
                   help="instead: one conversation through HTTP against the same request in-process (attnlab only)")
    p.add_argument("--out", type=Path, default=Path("docs/figures/serve/vs-llama-server"))
    args = p.parse_args(argv)
    from attnlab.model.files import resolve
    model = str(resolve(args.model or "smollm2-135m"))
    levels = [int(n) for n in args.concurrency.split(",")]
    servers = args.servers.split(",")
    lo, hi = (int(w) for w in args.prompt_words.split(","))
    header = llamacpp.header()
    print(header, flush=True)
    builds = llamacpp.find_builds()
    binary = Path(builds["native"]["bin"]) / "llama-server" if "native" in builds else None
    if "llama-server" in servers and (binary is None or not binary.exists()):
        raise SystemExit("no llama-server build: run `make bench-llamacpp` first")
    top = max(levels)
    texts = passages(hi, top)
    prompts = [" ".join(t.split()[:lo + (hi - lo) * i // max(1, top - 1)]) + QUESTION for i, t in enumerate(texts)]
    key = "batch-bench-key-0001"
    record = {**run_record(None, 0, "python " + shlex.join(["benchmarks/serve_batch.py", *sys.argv[1:]])),
              "load_average_start": list(os.getloadavg()), "cpu": header, "model": model, "max_tokens": args.max_tokens,
              "prompt_words": [lo, hi], "rounds": args.rounds, "cells": []}
    if args.overhead or args.fairness:  # one attnlab server per thread count, one measurement each
        if args.overhead:
            import attnlab
            import torch
        long_prompt = " ".join(passages(args.fairness, 1)[0].split()[:int(args.fairness * 0.75)]) + QUESTION
        for threads in (int(t) for t in args.threads.split(",")):
            extra = ["--max-prompt-tokens", str(2 * args.fairness)] if args.fairness else []
            ours, url = start_server([model, "--threads", str(threads), "--name", "m", "--api-key", key, *extra,
                                      *args.attnlab_args.split()], free_port(), 600)
            try:
                if args.overhead:
                    torch.set_num_threads(threads)
                    got = overhead(url, "m", attnlab.load(model), prompts[top // 2], args.max_tokens, key, args.rounds)
                else:
                    got = asyncio.run(fairness(url, "m", prompts[:4], long_prompt, args.max_tokens, key, 2.0))
            finally:
                ours.terminate()
                ours.wait(30)
            record["cells"].append({"threads": threads, **got})
            print(record["cells"][-1], flush=True)
        write_json(args.out / ("overhead.json" if args.overhead else "fairness.json"), record)
        return
    for threads in (int(t) for t in args.threads.split(",")):
        ours = ours_url = lm = None
        single = None  # the engine's single stream at this thread count (its N = 1 figure)
        if "attnlab" in servers:
            import attnlab
            import torch
            torch.set_num_threads(threads)  # this script is a command line's edge
            lm = attnlab.load(model, threads=threads)
            ours, ours_url = start_server([model, "--threads", str(threads), "--name", "m", "--api-key", key,
                                           "--max-batch", str(top), "--max-sessions", str(4 * top),
                                           "--max-active", str(top), *args.attnlab_args.split()],
                                          free_port(), 600)
            asyncio.run(round_(ours_url, "m", ["Hello."], 8, key))  # warm-up: a first request's one-time costs
            engine_figure(lm, ["Hello."], [8])
        try:
            for n in levels:
                peer = peer_url = None
                if "llama-server" in servers:
                    peer, peer_url = start_llama_server(binary, model, threads, n, args.ctx)
                runs = {s: [] for s in servers}
                peaks = {"attnlab": Peak(ours.pid) if ours else None, "llama-server": Peak(peer.pid) if peer else None}
                try:
                    for r in range(args.rounds):
                        order = servers if r % 2 == 0 else servers[::-1]
                        for s in order:
                            url = ours_url if s == "attnlab" else peer_url
                            chosen = round_prompts(prompts, n, r)
                            runs[s].append(asyncio.run(round_(url, "m", chosen, args.max_tokens, key)))
                finally:
                    for pk in peaks.values():
                        if pk:
                            pk.stop.set()
                    if peer:
                        peer.terminate()
                        peer.wait(30)
                for s in servers:
                    cell = {"server": s, "threads": threads, "n": n, **summarize(runs[s]),
                            "peak_rss_mib": peaks[s].peak if peaks[s] else None,
                            "load_average": list(os.getloadavg())}  # a shared machine: how busy it was
                    if s == "attnlab":  # the engine's own figure for round 0's requests
                        cell.update(engine_figure(lm, round_prompts(prompts, n, 0), cell["per_stream"]))
                        single = cell["engine_tok_s"] if n == 1 else single
                        cell["of_engine"] = cell["tok_s"] / cell["engine_tok_s"]
                        cell["x_engine_single"] = cell["tok_s"] / single if single else None
                    record["cells"].append(cell)
                    print(f"threads {threads} N {n:>2} {s:<12} {cell['tok_s']:7.1f} tok/s  ttft p50 "
                          f"{cell['ttft_p50']:.2f} s  itl p50/p99 {cell['itl_p50'] * 1e3:.0f}/{cell['itl_p99'] * 1e3:.0f} "
                          f"ms  errors {cell['errors']}  rss {cell['peak_rss_mib'] or 0:.0f} MiB", flush=True)
                    if s == "attnlab":
                        print(f"{'':>18}engine ({cell['engine']}) {cell['engine_tok_s']:7.1f} tok/s  served / engine "
                              f"{cell['of_engine']:.2f}" + (f"  served / engine's single stream "
                                                            f"{cell['x_engine_single']:.2f}x" if single else ""),
                              flush=True)
                write_json(args.out / "serve_batch.json", record)
        finally:
            if ours:
                ours.terminate()
                ours.wait(30)
    write_text(args.out / "serve_batch.md", table(record))
    print(table(record))


def table(record: dict) -> str:
    rows = ["| threads | N | server | tok/s (median) | x N=1 | TTFT p50 / p99 s | ITL p50 / p99 ms | errors | peak RSS MiB "
            "| engine tok/s (N=1: generate, N>1: bound) | served / engine | x engine's single stream |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {(c["server"], c["threads"]): c["tok_s"] for c in record["cells"] if c["n"] == 1}
    for c in record["cells"]:
        one = base.get((c["server"], c["threads"]))
        rows.append(f"| {c['threads']} | {c['n']} | {c['server']} | {c['tok_s']:.1f} | "
                    f"{c['tok_s'] / one:.2f} |" if one else f"| {c['threads']} | {c['n']} | {c['server']} | "
                    f"{c['tok_s']:.1f} | - |")
        rows[-1] += (f" {c['ttft_p50']:.2f} / {c['ttft_p99']:.2f} | {c['itl_p50'] * 1e3:.0f} / "
                     f"{c['itl_p99'] * 1e3:.0f} | {c['errors']} | {c['peak_rss_mib'] or 0:.0f} |")
        rows[-1] += (f" {c['engine_tok_s']:.1f} | {c['of_engine']:.2f} | " + (
            f"{c['x_engine_single']:.2f} |" if c.get("x_engine_single") else "- |") if "engine_tok_s" in c else " - | - | - |")
    return "\n".join([f"`{record['command']}` at {record['commit'][:10]}", "", record["cpu"], "", *rows]) + "\n"


if __name__ == "__main__":
    main()
