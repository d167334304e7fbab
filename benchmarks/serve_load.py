"""Load test of `attnlab serve`: N concurrent streamed conversations for M minutes, per turn p50/p95/p99.

Starts `attnlab serve` as a subprocess (with an API key, as a shared deployment would run it),
then for each concurrency level N keeps N conversations going with asyncio + httpx for
--minutes: every turn sends the whole history plus a user message of realistic length (a
passage of 10-60 words from the Shakespeare test plays and a question), streams the reply
(max_tokens --max-tokens) and records time to first token, the gaps between content chunks
(inter-token latency), the tokens generated (`usage`) and the whole turn. A
conversation ends after --turns turns and a new one starts. Every second the server's RSS is
sampled beside the cache bytes it counts (admin `GET /v1/sessions`), and the table reports the
largest RSS - counted - RSS at start (what the count misses: model and runtime are in the start).
Writes a JSON record and a Markdown table (atomically).

    python benchmarks/serve_load.py --concurrency 4,8 --minutes 3 --out docs/figures/serve/load
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from serve import QUESTIONS, free_port, passages, rss_mib, start_server  # noqa: E402

from attnlab.io import provenance, write_json, write_text  # noqa: E402

KEY = "load-test-key-0001"
ADMIN = "load-test-admin-0001"


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


async def conversation(client, i: int, texts: list[str], args, deadline: float, rec: dict) -> None:
    rng = random.Random(i)
    while time.monotonic() < deadline:
        history = []
        for t in range(args.turns):
            if time.monotonic() >= deadline:
                return
            words = texts[rng.randrange(len(texts))].split()[:rng.randint(10, 60)]
            history.append({"role": "user", "content": " ".join(words) + "\n\n" + rng.choice(QUESTIONS)})
            body = {"model": "m", "messages": history, "max_tokens": args.max_tokens, "temperature": args.temperature,
                    "seed": rng.randrange(1 << 30), "stream": True, "stream_options": {"include_usage": True}}
            start, first, parts, last = time.perf_counter(), None, [], None
            try:
                async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                    async for line in r.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if chunk.get("usage"):
                            rec["tokens"] += chunk["usage"]["completion_tokens"]
                        delta = chunk["choices"][0].get("delta", {}).get("content") if chunk["choices"] else None
                        if delta:
                            now = time.perf_counter()
                            first = first or now
                            if last is not None:
                                rec["itl"].append(now - last)
                            last = now
                            parts.append(delta)
                end = time.perf_counter()
                rec["turn"].append(end - start)
                rec["ttft"].append((first or end) - start)
                history.append({"role": "assistant", "content": "".join(parts)})
            except Exception as e:  # counted; the conversation starts over
                rec["errors"].append(f"{type(e).__name__}: {e}"[:200])
                break


async def level(url: str, n: int, args, pid: int, texts: list[str], base: float) -> dict:
    rec = {"turn": [], "ttft": [], "itl": [], "tokens": 0, "errors": [], "rss": [rss_mib(pid)], "over": []}
    began = time.monotonic()
    deadline = time.monotonic() + args.minutes * 60
    limits = httpx.Limits(max_connections=n + 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits,
                                 headers={"authorization": f"Bearer {KEY}"}) as client:
        async def watch():
            admin = {"authorization": f"Bearer {ADMIN}"}
            while time.monotonic() < deadline:
                await asyncio.sleep(1)
                counted = (await client.get("/v1/sessions", headers=admin)).json()["total_bytes"] / 2**20
                rec["rss"].append(rss_mib(pid))
                rec["over"].append((rec["rss"][-1] - counted - base, counted))
                left = deadline - time.monotonic()
                print(f"\r{n} conversations: {len(rec['turn'])} turns, {len(rec['errors'])} errors, "
                      f"{max(0, left):.0f} s left   ", end="", file=sys.stderr, flush=True)
        await asyncio.gather(watch(), *(conversation(client, i, texts, args, deadline, rec) for i in range(n)))
    rec["rss"].append(rss_mib(pid))
    elapsed = time.monotonic() - began
    print(file=sys.stderr)
    return {"concurrency": n, "minutes": args.minutes, "turns": len(rec["turn"]), "errors": len(rec["errors"]),
            "error_samples": rec["errors"][:5],
            **{f"turn_p{q}": pct(rec["turn"], q) for q in (50, 95, 99)},
            **{f"ttft_p{q}": pct(rec["ttft"], q) for q in (50, 95, 99)},
            "tokens": rec["tokens"], "tok_per_s": rec["tokens"] / elapsed,
            **{f"itl_p{q}": pct(rec["itl"], q) for q in (50, 99)},
            "rss_start_mib": rec["rss"][0], "rss_end_mib": rec["rss"][-1], "rss_peak_mib": max(rec["rss"]),
            "counted_peak_mib": max((c for _, c in rec["over"]), default=None),
            "rss_over_count_mib": max((o for o, _ in rec["over"]), default=None)}


def table(rows: list[dict]) -> str:
    def s(x):
        return "-" if x is None else f"{x:.2f}"
    out = ["| conversations | turns | errors | generated tok/s | ITL p50 / p99 (ms) | turn p50 / p95 / p99 (s) | "
           "TTFT p50 / p95 / p99 (s) | RSS start / end / peak (MiB) | counted peak (MiB) | RSS - counted - server start, "
           "worst (MiB) |", "|---:|---:|---:|---:|---|---|---|---|---:|---:|"]
    for r in rows:
        itl = " / ".join("-" if r[k] is None else f"{1000 * r[k]:.0f}" for k in ("itl_p50", "itl_p99"))
        out.append(f"| {r['concurrency']} | {r['turns']} | {r['errors']} | {r['tok_per_s']:.1f} | {itl} | "
                   f"{s(r['turn_p50'])} / {s(r['turn_p95'])} / {s(r['turn_p99'])} | {s(r['ttft_p50'])} / "
                   f"{s(r['ttft_p95'])} / {s(r['ttft_p99'])} | {r['rss_start_mib']:.0f} / {r['rss_end_mib']:.0f} / "
                   f"{r['rss_peak_mib']:.0f} | {s(r['counted_peak_mib'])} | {s(r['rss_over_count_mib'])} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--concurrency", default="4,8", help="comma-separated numbers of concurrent conversations")
    p.add_argument("--minutes", type=float, default=3.0, help="duration of each level")
    p.add_argument("--turns", type=int, default=6, help="turns per conversation before a new one starts")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--serve-args", default="", help="more `attnlab serve` options, e.g. '--max-batch 1 --eager'")
    p.add_argument("--policy", default="sink")
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-cache-mib", type=int, default=256)
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = p.parse_args(argv)
    levels = [int(x) for x in args.concurrency.split(",")]
    made = {**provenance(None), "command": "python " + " ".join(sys.argv)}
    port = free_port()
    cmd = [args.model, "--policy", args.policy, "--budget", str(args.budget), "--threads", str(args.threads),
           "--max-cache-mib", str(args.max_cache_mib), "--max-sessions", str(2 * max(levels)),
           "--max-active", str(max(levels)), "--name", "m", "--api-key", KEY, "--admin-key", ADMIN, "--max-prompt-tokens", "4096",
           *args.serve_args.split()]
    server, url = start_server(cmd, port, 900)
    try:
        texts, base = passages(60, 200), rss_mib(server.pid)
        rows = [asyncio.run(level(url, n, args, server.pid, texts, base)) for n in levels]
    finally:
        server.terminate()
        server.wait(30)
    md = table(rows)
    print(md)
    if args.out:
        meta = {**made, "args": vars(args), "rows": rows}
        write_json(args.out + ".json", meta)
        write_text(args.out + ".md", md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
