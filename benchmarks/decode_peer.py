"""Decode tok/s on the files people run, ours against llama.cpp side by side, with the bandwidth bound (issue 56).

Per file and thread count: ours is `attnlab.load(FILE, threads=N)` (the native step, no other option), its cache
filled once per depth with random ids and truncated back before every timed run of `--steps` tokens; llama.cpp is
`llama-bench -p 0 -n STEPS -d DEPTHS -fa 0,1 -r 1` of each build (`make bench-llamacpp`), one call per round
(each call maps the file and fills each depth before timing the generation; its `-d` pads attention to 256
cells). Rounds alternate which engine goes first; medians over rounds; the faster of llama.cpp's builds and
flash attention settings per cell is the peer. The run starts with the CPU, its ISA flags, the load averages and
the read bandwidth (a float32 sum over 1 GiB at 1 and 2 threads), and every tok/s is also given as a fraction of
the bandwidth limit: bandwidth / (bytes a token reads: the file's tensors, one row of an untied token table,
plus the f16 KV cache at that depth; the same count for both engines).

    python benchmarks/decode_peer.py --files qwen2.5-coder-0.5b,~/.cache/attnlab/bench/qwen15b-q4_k_m.gguf \\
        --threads 1,2 --depths 128,1024 --rounds 5 --json docs/benchmarks/results/decode_peer_xeon_amx.json
    python benchmarks/decode_peer.py --files smollm2-135m --threads 1 --no-llamacpp   # ours only
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp  # noqa: E402
import decode_speed  # noqa: E402


class Ours(decode_speed.Ours):
    """`attnlab.load(path, threads=t)`, no other option; decode_speed's caches (one per depth, prefilled once,
    truncated back before each timed run) and timing."""

    def __init__(self, path: Path, threads: int, depths: list[int], steps: int, seed: int = 0):
        import attnlab
        t = time.perf_counter()
        self.lm = attnlab.load(str(path), threads=threads, tokenizer=False)
        self.name, self.load_s, self.caches = "ours", time.perf_counter() - t, {}
        gen = torch.Generator().manual_seed(seed)
        for d in depths:
            self.prepare(torch.randint(0, self.lm.cfg.vocab_size, (1, d), generator=gen), steps)


def peer_round(builds: dict, path: Path, threads: int, depths: list[int], steps: int, fas: str) -> dict:
    """{(build, fa): {depth: tok/s}} of one llama-bench call per build."""
    out = {}
    for name, meta in builds.items():
        rows = llamacpp.run_bench(meta, path, ["-t", str(threads), "-p", "0", "-n", str(steps), "-r", "1",
                                               "-d", ",".join(map(str, depths)), "-fa", fas])
        for r in rows:
            out.setdefault(f"{name} fa={'on' if r['flash'] else 'off'}", {})[r["depth"]] = r["tps"]
    return out


def measure(path: Path, threads: int, args, builds: dict) -> dict:
    """Interleaved rounds of ours and llama.cpp on one file at one thread count: medians and every sample."""
    torch.set_num_threads(threads)
    ours = Ours(path, threads, args.depths, args.steps, args.seed)
    samples: dict[str, dict[int, list[float]]] = {"ours": {d: [] for d in args.depths}}
    for r in range(args.rounds):
        def run_ours():
            for d in args.depths:
                samples["ours"][d].append(ours.decode(d, args.steps))

        def run_peer():
            for k, v in (peer_round(builds, path, threads, args.depths, args.steps, args.fa) if builds else {}).items():
                for d, x in v.items():
                    samples.setdefault(f"llama.cpp {k}", {}).setdefault(d, []).append(x)
        for fn in ((run_ours, run_peer) if r % 2 == 0 else (run_peer, run_ours)):
            fn()
        print(f"  round {r + 1}/{args.rounds}: load average {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
    med = {k: {d: statistics.median(x) for d, x in v.items()} for k, v in samples.items()}
    del ours
    return {"median": med, "samples": samples}


def table(path: Path, threads: int, res: dict, bw: float, weight_bytes: int, kv_bytes: float,
          depths: list[int]) -> dict:
    """Print one markdown table (ours, the peer per cell, the ratio, % of the bound) and return its cells."""
    med = res["median"]
    peers = [k for k in med if k != "ours"]
    print(f"\n### {path.name}, {threads} thread{'s' if threads > 1 else ''}: tok/s (% of the bandwidth limit at "
          f"{bw:.1f} GB/s, {weight_bytes / 2**20:.0f} MiB of weights a token)\n")
    print("| engine | " + " | ".join(f"depth {d}" for d in depths) + " |")
    print("|---|" + "---|" * len(depths))
    cells = {}
    for d in depths:
        limit = bw * 1e9 / (weight_bytes + kv_bytes * d)
        best = max(peers, key=lambda k: med[k][d]) if peers else None
        cells[d] = {"ours": med["ours"][d], "ours_bound": med["ours"][d] / limit, "limit_tok_s": limit,
                    "peer": best, "peer_tok_s": med[best][d] if best else None,
                    "peer_bound": med[best][d] / limit if best else None,
                    "ratio": med["ours"][d] / med[best][d] if best else None}
    for k in ["ours", *peers]:
        print(f"| {k} | " + " | ".join(f"{med[k][d]:.1f} ({100 * med[k][d] / cells[d]['limit_tok_s']:.0f}%)"
                                       for d in depths) + " |")
    if peers:
        print("| ours / best llama.cpp | " + " | ".join(f"{cells[d]['ratio']:.2f}x (vs {cells[d]['peer'][10:]})"
                                                      for d in depths) + " |")
    return cells


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", default="qwen2.5-coder-0.5b", help="comma list of GGUF files or model names")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--depths", default="128,1024")
    p.add_argument("--steps", type=int, default=32, help="decode steps per timed run (llama-bench -n)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--fa", default="0,1", help="llama.cpp flash attention settings (llama-bench -fa)")
    p.add_argument("--builds", default="native,generic", help="llama.cpp's builds to time")
    p.add_argument("--no-llamacpp", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bandwidth-gib", type=float, default=1.0, help="GiB the read-bandwidth sum reads")
    p.add_argument("--json", default=None, help="write the run record here (atomically)")
    args = p.parse_args(argv)
    args.depths = [int(d) for d in args.depths.split(",")]
    from attnlab.io import finish_record, run_record, write_json
    from attnlab.model.files import resolve
    record = run_record(None, args.seed, command="python " + shlex.join(["benchmarks/decode_peer.py", *sys.argv[1:]]))
    head = llamacpp.header()
    bw = llamacpp.bandwidths(gib=args.bandwidth_gib)
    load = os.getloadavg()
    print(f"{head}\n{llamacpp.bandwidth_line(bw, args.bandwidth_gib)}\n"
          f"load averages {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start (a shared machine)")
    wanted = args.builds.split(",")
    builds = {} if args.no_llamacpp else {k: v for k, v in llamacpp.find_builds().items() if k in wanted}
    for name, meta in builds.items():
        print(f"llama.cpp {name}: {meta['bin']} ({meta.get('version', '?')}; {meta.get('note', '')})")
    if not builds and not args.no_llamacpp:
        print("llama.cpp is not built (make bench-llamacpp): ours only", file=sys.stderr)
    record.update(cpu=head, bandwidth_gbs=bw, load_avg_start=load, steps=args.steps, rounds=args.rounds, runs=[])
    for spec in args.files.split(","):
        path = resolve(os.path.expanduser(spec))
        weight_bytes, kv_bytes = llamacpp.token_bytes(path), decode_speed.kv_slot_elems(path) * 2
        for t in [int(x) for x in args.threads.split(",")]:
            res = measure(path, t, args, builds)
            gbs = bw.get(t) or llamacpp.read_bandwidth(t, args.bandwidth_gib)
            cells = table(path, t, res, gbs, weight_bytes, kv_bytes, args.depths)
            record["runs"].append({"file": str(path), "file_mib": path.stat().st_size / 2**20, "threads": t,
                                   "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_bytes, "cells": cells,
                                   **res, "load_avg": os.getloadavg()})
            if args.json:  # after every table: a run cut short keeps what it measured
                write_json(args.json, finish_record(record))
    load = os.getloadavg()
    print(f"\nload averages {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end (shared machine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
