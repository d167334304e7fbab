"""Soak test of `attnlab serve`: concurrent multi-turn conversations through the official `openai` client.

Starts the server as a subprocess for each policy, then C client threads each hold one
conversation for T turns (the full history is resent every turn, as OpenAI clients do).
Recorded per policy: per-turn latency (median of the first 10 vs the last 10 turns over all
clients), server RSS (after load, after the first 10 turns, at the end, peak), KV bytes held,
tokens seen per conversation, tokens fed per turn (the reuse of each conversation's cache), errors.
With --passage-words N every user message carries the next N words of the Shakespeare test plays
before its question, so a conversation outgrows the budget in fewer turns (prefill is ~30x
cheaper per token than decode on a CPU).

    python benchmarks/serve.py --clients 4 --turns 100 --policies sink,full --budget 512 --max-tokens 16
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from openai import OpenAI

QUESTIONS = ["Tell me about the sea.", "What lives in it?", "Why is it salty?", "Tell me about mountains.",
             "Which is the highest?", "What is snow?", "Name a famous river.", "What is a desert?",
             "Tell me about the moon.", "Why does it change shape?"]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def passages(words: int, count: int) -> list[str]:
    if not words:
        return [""] * count
    from attnlab.data import corpus
    text = corpus("shakespeare:test").split()
    return [" ".join(text[i * words:(i + 1) * words]) + "\n\n" for i in range(count)]


def start_server(serve_args: list[str], port: int, timeout: float) -> tuple[subprocess.Popen, str]:
    """`attnlab serve SERVE_ARGS --port PORT` in a subprocess, returned once /health answers (or an error)."""
    cmd = [sys.executable, "-m", "attnlab", "serve", *serve_args, "--port", str(port)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return server, wait_ready(server, f"http://127.0.0.1:{port}", timeout)


def wait_ready(server: subprocess.Popen, url: str, timeout: float, what: str = "server") -> str:
    """url once its /health answers 200, or the server's stderr tail as an error (it exited or took too long)."""
    deadline = time.time() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.time() > deadline:
            server.kill()
            raise RuntimeError(f"{what} did not start: {server.stderr.read()[-2000:]}")
        time.sleep(0.5)


def soak(args, policy: str) -> dict:
    port = free_port()
    cmd = [args.model, "--policy", policy, "--budget", str(args.budget), "--threads", str(args.threads),
           "--max-cache-mib", str(args.max_cache_mib), "--max-sessions", str(args.clients * 2), "--name", "m",
           "--block", str(args.block)] + (["--quant", args.quant] if args.quant else [])
    server, url = start_server(cmd, port, 300)
    try:
        rss = {"loaded": rss_mib(server.pid)}
        peak = [rss["loaded"]]
        stop = threading.Event()

        def watch():
            while not stop.wait(0.5):
                peak.append(rss_mib(server.pid))

        threading.Thread(target=watch, daemon=True).start()
        lat = [[None] * args.turns for _ in range(args.clients)]
        fed = [[None] * args.turns for _ in range(args.clients)]
        ends = [[None] * args.turns for _ in range(args.clients)]
        errors, sessions = [], [None] * args.clients
        done10 = threading.Barrier(args.clients + 1)
        texts = passages(args.passage_words, args.clients * args.turns)

        def client(i: int):
            api = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
            history = []
            for t in range(args.turns):
                history.append({"role": "user", "content": texts[i * args.turns + t]
                                + QUESTIONS[(t + 3 * i) % len(QUESTIONS)]})
                start = time.perf_counter()
                try:
                    r = api.chat.completions.create(model="m", messages=history, max_tokens=args.max_tokens,
                                                    temperature=0)
                    lat[i][t] = time.perf_counter() - start
                    ends[i][t] = time.perf_counter()
                    fed[i][t] = r.model_extra["attnlab"]["fed_tokens"]
                    sessions[i] = r.model_extra["attnlab"]["session"]
                    history.append({"role": "assistant", "content": r.choices[0].message.content})
                except Exception as e:  # counted, the conversation goes on without that turn
                    errors.append(f"client {i} turn {t}: {type(e).__name__}: {e}")
                    history.pop()
                if t == 9:
                    done10.wait()
                print(f"\r{policy}: client {i} turn {t + 1}/{args.turns}   ", end="", file=sys.stderr, flush=True)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        t0 = time.time()
        for th in threads:
            th.start()
        if args.turns >= 10:
            done10.wait()
            rss["after_10_turns"] = rss_mib(server.pid)
        for th in threads:
            th.join()
        rss["end"] = rss_mib(server.pid)
        stop.set()
        rss["peak"] = max(peak + [rss["end"]])
        held = {s["id"]: s for s in httpx.get(url + "/v1/sessions").json()["data"]}
        mine = [held.get(s) for s in sessions]
        first = [x for row in lat for x in row[:10] if x is not None]
        last = [x for row in lat for x in row[-10:] if x is not None]
        # clients drift apart: the last turns of the slower ones run with fewer neighbours, so also
        # compare turns that ended while every client was still talking
        cutoff = min(max(e for e in row if e is not None) for row in ends)
        busy = [[x for x, e in zip(lr, er) if x is not None and e <= cutoff] for lr, er in zip(lat, ends)]
        busy_last = [x for row in busy for x in row[-10:]]
        bins = {f"{b + 1}-{b + 10}": round(statistics.median(x for row in busy for x in row[b:b + 10]), 3)
                for b in range(0, min(len(r) for r in busy) - 9, 10)}
        return {"policy": policy, "budget": None if policy == "full" else args.budget, "clients": args.clients,
                "turns": args.turns, "max_tokens": args.max_tokens, "passage_words": args.passage_words, "seconds": round(time.time() - t0, 1),
                "errors": len(errors), "error_samples": errors[:5],
                "latency_first10_median_s": round(statistics.median(first), 3),
                "latency_last10_median_s": round(statistics.median(last), 3),
                "latency_last10_all_clients_median_s": round(statistics.median(busy_last), 3),
                "latency_median_by_10_turns_all_clients_s": bins,
                "fed_first_turn_median": statistics.median(row[0] for row in fed if row[0] is not None),
                "fed_last10_median": statistics.median(x for row in fed for x in row[-10:] if x is not None),
                "rss_mib": {k: round(v, 1) for k, v in rss.items()},
                "tokens_seen": [m["tokens_seen"] if m else None for m in mine],
                "slots_kept": [m["slots_kept"] if m else None for m in mine],
                "kv_mib_total": round(sum(m["bytes"] for m in mine if m) / 2**20, 1)}
    finally:
        server.terminate()
        server.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--turns", type=int, default=100)
    ap.add_argument("--policies", default="sink,full")
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--passage-words", type=int, default=0, help="words of text before each question")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--block", type=int, default=1, help="block eviction: evict every B tokens (1 = every token)")
    ap.add_argument("--quant", default=None, help="weight format of the server (e.g. int4:32)")
    ap.add_argument("--max-cache-mib", type=int, default=8192, help="high enough that no conversation is evicted")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    results = [soak(args, p.strip()) for p in args.policies.split(",") if p.strip()]
    print(file=sys.stderr)
    print(f"{args.clients} clients x {args.turns} turns, max_tokens {args.max_tokens}, passage words "
          f"{args.passage_words}, threads {args.threads}")
    print(f"{'policy':<12} {'lat first10':>11} {'lat last10':>10} {'RSS load':>9} {'RSS @10':>8} {'RSS end':>8} "
          f"{'KV MiB':>7} {'seen/conv':>9} {'fed/turn':>8} {'errors':>6}")
    for r in results:
        name = r["policy"] + (f" {r['budget']}" if r["budget"] else "")
        seen = max((s for s in r["tokens_seen"] if s), default=0)
        print(f"{name:<12} {r['latency_first10_median_s']:>10.2f}s {r['latency_last10_median_s']:>9.2f}s "
              f"{r['rss_mib']['loaded']:>9.0f} {r['rss_mib'].get('after_10_turns', 0):>8.0f} {r['rss_mib']['end']:>8.0f} "
              f"{r['kv_mib_total']:>7.1f} {seen:>9} {r['fed_last10_median']:>8} {r['errors']:>6}")
        print(f"  turn latency while every client is talking, median per 10 turns: "
              f"{r['latency_median_by_10_turns_all_clients_s']}")
    if args.json:
        from attnlab.io import finish_record, run_record, write_json
        record = run_record(None, None, "python " + " ".join(["benchmarks/serve.py", *sys.argv[1:]]))
        write_json(Path(args.json), {**finish_record(record), "runs": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
