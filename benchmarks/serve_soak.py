"""Soak of `attnlab serve` under hostile-but-legal load: memory against the count, /health latency, errors.

Starts `attnlab serve` (loopback, 3 API keys and an admin key, Quest with a channel-major key copy by
default) and runs --clients clients for --minutes: client i uses key i mod 3 and, by i mod 4, holds
multi-turn conversations (policies sink, h2o, tova, snapkv and full in turn), cancels streams after a few
chunks, reads its streams slowly (a pause between chunks), or sends short raw completions. Every second it
samples the server's RSS and the cache bytes the server counts (admin `GET /v1/sessions`); a separate
process asks `/health` every 20 ms on its own connection (so the client's own load does not delay it), the
server's port and its `--health-port` (a process of its own, `attnlab/serve/health.py`) in turn.

Pass criteria (issue 61): no error beyond the documented 4xx/503 answers (400 limits, 429 key queue,
503 busy); RSS <= counted cache + the RSS at startup (model and runtime) + 300 MiB at every sample;
/health p99.9 under 20 ms. Writes OUT.json / OUT.md (atomically) with the command, commit and seed.

    python benchmarks/serve_soak.py --minutes 30 --out docs/figures/serve/soak
"""
from __future__ import annotations

import argparse
import asyncio
import http.client
import io
import json
import multiprocessing
import random
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from serve import QUESTIONS, free_port, passages, rss_mib, start_server, wait_ready  # noqa: E402
from serve_load import pct  # noqa: E402

from attnlab.io import finish_record, run_record, write_json, write_text  # noqa: E402

KEYS = ["soak-key-0001", "soak-key-0002", "soak-key-0003"]
ADMIN = "soak-admin-0001"
POLICIES = ["sink", "h2o", "tova", "snapkv", "full"]
DOCUMENTED = {400, 413, 429, 503}  # limits, the key's queue, a busy server (docs/serve.md)


def probe_health(ports: list[int], seconds: float, every: float, out) -> None:
    """In its own process: GET /health on each port in turn every `every` s, one kept-alive connection each;
    per port its latencies and failures to `out`."""
    def connect(port):
        return http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conns, lat, bad = [connect(p) for p in ports], [[] for _ in ports], [0 for _ in ports]
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for i, port in enumerate(ports):
            t0 = time.perf_counter()
            try:
                conns[i].request("GET", "/health")
                r = conns[i].getresponse()
                r.read()
                lat[i].append(time.perf_counter() - t0)
                bad[i] += r.status != 200
            except (OSError, http.client.HTTPException):
                bad[i] += 1
                conns[i].close()
                conns[i] = connect(port)
            time.sleep(every)
    out.send((lat, bad))


class Tally:
    def __init__(self):
        self.status: dict[str, int] = {}
        self.errors: list[str] = []
        self.tokens = 0

    def count(self, what: str) -> None:
        self.status[what] = self.status.get(what, 0) + 1


async def stream(client, key: str, body: dict, tally: Tally, pause: float = 0.0, cut: int | None = None) -> str:
    """One streamed request; returns its text. pause: seconds between chunks read (a slow reader); cut: leave
    after that many chunks (a cancel)."""
    parts = []
    async with client.stream("POST", body.pop("path"), json=body, headers={"authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            await r.aread()
            tally.count(str(r.status_code))
            if r.status_code not in DOCUMENTED:
                tally.errors.append(f"HTTP {r.status_code}: {r.text[:200]}")
            return ""
        n = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                tally.errors.append(f"error event: {line[:200]}")
                break
            c = chunk["choices"][0] if chunk["choices"] else {}
            text = (c.get("delta") or {}).get("content") or c.get("text") or ""
            parts.append(text)
            n += 1
            tally.tokens += bool(text)
            if cut is not None and n >= cut:
                tally.count("cancelled")
                return "".join(parts)
            if pause:
                await asyncio.sleep(pause)
    tally.count("200")
    return "".join(parts)


async def client_loop(i: int, url: str, deadline: float, texts: list[str], args, tally: Tally) -> None:
    rng, key, kind = random.Random(args.seed + i), KEYS[i % len(KEYS)], i % 4
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        history: list[dict] = []
        policy = POLICIES[i % len(POLICIES)]
        while time.monotonic() < deadline:
            words = texts[rng.randrange(len(texts))].split()[:rng.randint(10, 80)]
            try:
                if kind == 3:  # raw completions: a one-off cache each
                    body = {"path": "/v1/completions", "model": "m", "prompt": " ".join(words), "stream": True,
                            "max_tokens": rng.randint(4, 24), "attnlab": {"policy": policy}}
                    await stream(client, key, body, tally)
                    continue
                history.append({"role": "user", "content": " ".join(words) + "\n\n" + rng.choice(QUESTIONS)})
                body = {"path": "/v1/chat/completions", "model": "m", "messages": history, "stream": True,
                        "max_tokens": args.max_tokens, "temperature": 0.7, "seed": rng.randrange(1 << 30),
                        "attnlab": {"policy": policy, "budget": args.budget}}
                text = await stream(client, key, body, tally, pause=0.25 if kind == 2 else 0.0,
                                    cut=rng.randint(1, 6) if kind == 1 else None)
                history.append({"role": "assistant", "content": text})
                if len(history) >= 2 * args.turns or kind == 1:
                    history, policy = [], POLICIES[rng.randrange(len(POLICIES))]
            except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
                tally.errors.append(f"{type(e).__name__}: {e}"[:200])
                history = []


async def run(url: str, pid: int, args, base_mib: float) -> dict:
    deadline = time.monotonic() + args.minutes * 60
    tally, samples, texts = Tally(), [], passages(100, 300)

    async def memory():
        # the count is read on the model thread between steps: on a starved machine that took over 30 s
        async with httpx.AsyncClient(base_url=url, timeout=600, headers={"authorization": f"Bearer {ADMIN}"}) as c:
            while time.monotonic() < deadline:
                counted = (await c.get("/v1/sessions")).json()["total_bytes"] / 2**20
                rss, heap = rss_mib(pid), (await c.get("/health")).json().get("memory", {})
                samples.append({"t": round(args.minutes * 60 - (deadline - time.monotonic()), 1), "rss_mib": rss,
                                "counted_mib": counted, "over_mib": rss - counted - base_mib,
                                "heap_used_mib": heap.get("used_mib"), "heap_free_mib": heap.get("free_mib"),
                                "trims": heap.get("trims"), "trim_ms_max": heap.get("trim_ms_max")})
                print(f"\r{samples[-1]['t']:.0f} s: RSS {rss:.0f} MiB, counted {counted:.0f} MiB, "
                      f"{sum(tally.status.values())} requests, {len(tally.errors)} errors   ",
                      end="", file=sys.stderr, flush=True)
                await asyncio.sleep(1.0)
    await asyncio.gather(memory(), *(client_loop(i, url, deadline, texts, args, tally) for i in range(args.clients)))
    print(file=sys.stderr)
    return {"status": tally.status, "errors": len(tally.errors), "error_samples": tally.errors[:10],
            "tokens": tally.tokens, "samples": samples}


class Attached:
    """A server started earlier, as `serve.wait_ready` polls one."""

    def __init__(self, pid: int):
        self.pid, self.stderr = pid, io.StringIO("(its stderr went to the script that started it)")

    def poll(self):
        return None if Path(f"/proc/{self.pid}").exists() else 1

    def kill(self):
        pass


def changed_files() -> list[str]:
    """The tracked files that differ from the commit when the run starts (the tree is shared: say which)."""
    out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                         cwd=Path(__file__).parent)
    return [line[3:] for line in out.stdout.splitlines()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--turns", type=int, default=6, help="turns of a conversation before a new one starts")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--attention", default="quest:128:16:0:8", help="the server's --attention ('' for none)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-cache-mib", type=int, default=512)
    p.add_argument("--serve-args", default="", help="more `attnlab serve` options")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    p.add_argument("--attach", default=None, metavar="PORT,HEALTH_PORT,PID",
                   help="soak a server this script started before (same options; left running): a busy machine may "
                        "take many minutes to start one")
    args = p.parse_args(argv)
    made = run_record(None, args.seed, "python " + " ".join(sys.argv))
    made["dirty_files"] = changed_files()
    port, side = free_port(), free_port()
    cmd = [args.model, "--health-port", str(side), "--policy", "sink", "--budget", str(args.budget), "--threads", str(args.threads),
           "--max-cache-mib", str(args.max_cache_mib), "--max-sessions", "24", "--name", "m", "--admin-key", ADMIN,
           "--max-prompt-tokens", "4096", *(f"--api-key={k}" for k in KEYS),
           *(["--attention", args.attention] if args.attention else []), *args.serve_args.split()]
    log: deque[str] = deque(maxlen=40)  # its stderr, read all along: a full pipe would block the server's logging
    if args.attach:
        port, side, pid = map(int, args.attach.split(","))
        server, url = None, wait_ready(Attached(pid), f"http://127.0.0.1:{port}", 3600)
        made["attached"] = {"serve_args": cmd[:2] + cmd[4:]}  # the health port and --port are the attached server's
    else:
        server, url = start_server(cmd, port, 900)
        pid = server.pid
        threading.Thread(target=log.extend, args=(server.stderr,), daemon=True).start()
    try:
        base = rss_mib(pid)
        there, here = multiprocessing.Pipe(duplex=False)
        prober = multiprocessing.Process(target=probe_health, args=([port, side], args.minutes * 60, 0.01, here))
        prober.start()
        out = asyncio.run(run(url, pid, args, base))
        (health, health_side), (health_bad, side_bad) = there.recv() if there.poll(60) else (([], []), (-1, -1))
        prober.join(10)
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
    worst = max(out["samples"], key=lambda s: s["over_mib"], default={"over_mib": None})
    row = {"minutes": args.minutes, "clients": args.clients, "requests": out["status"], "errors": out["errors"],
           "error_samples": out["error_samples"], "tokens": out["tokens"], "rss_start_mib": base,
           "rss_peak_mib": max((s["rss_mib"] for s in out["samples"]), default=None),
           "counted_peak_mib": max((s["counted_mib"] for s in out["samples"]), default=None),
           "worst_rss_over_count_mib": worst["over_mib"], "health_probes": len(health), "health_failed": health_bad,
           **{f"health_p{q}_ms": None if not health else 1000 * pct(health, q) for q in (50, 99, 99.9)},
           "health_max_ms": 1000 * max(health) if health else None,
           "health_port_probes": len(health_side), "health_port_failed": side_bad,
           **{f"health_port_p{q}_ms": None if not health_side else 1000 * pct(health_side, q) for q in (50, 99, 99.9)},
           "health_port_max_ms": 1000 * max(health_side) if health_side else None,
           "trim_ms_max": max((s["trim_ms_max"] or 0 for s in out["samples"]), default=None),
           "server_log_tail": "".join(log)[-2000:]}
    fine = row["errors"] == 0 and worst["over_mib"] is not None and worst["over_mib"] <= 300
    row["pass"] = bool(fine and row["health_p99.9_ms"] is not None and row["health_p99.9_ms"] < 20 and health_bad == 0)
    row["pass_with_health_port"] = bool(fine and row["health_port_p99.9_ms"] is not None
                                        and row["health_port_p99.9_ms"] < 20 and side_bad == 0)
    md = ("| minutes | clients | requests (by status) | errors | RSS start / peak (MiB) | counted peak (MiB) | "
          "worst RSS - counted - start (MiB) | /health p50 / p99 / p99.9 / max (ms) | --health-port's (ms) | "
          "pass (/health, --health-port) |\n|---:|---:|---|---:|---|---:|---:|---|---|---|\n"
          f"| {args.minutes:g} | {args.clients} | {json.dumps(row['requests'])} | {row['errors']} | "
          f"{base:.0f} / {row['rss_peak_mib']:.0f} | {row['counted_peak_mib']:.0f} | {worst['over_mib']:.0f} | "
          + " / ".join("-" if row[k] is None else f"{row[k]:.1f}" for k in
                       ("health_p50_ms", "health_p99_ms", "health_p99.9_ms", "health_max_ms")) + " | "
          + " / ".join("-" if row[k] is None else f"{row[k]:.1f}" for k in
                       ("health_port_p50_ms", "health_port_p99_ms", "health_port_p99.9_ms", "health_port_max_ms"))
          + f" | {'yes' if row['pass'] else 'no'}, {'yes' if row['pass_with_health_port'] else 'no'} |\n")
    print(md)
    if args.out:
        write_json(args.out + ".json", {**finish_record(made), "args": vars(args), "result": row,
                                        "samples": out["samples"]})
        write_text(args.out + ".md", md)
    return 0 if row["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
