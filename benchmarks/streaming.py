"""Speed and memory of streaming with a bounded KV cache (StreamingLLM's efficiency claims).

For each policy the stream is advanced with chunked prefill (eviction between chunks) to each
measurement position, then `--decode` tokens are decoded one at a time: per-token latency
(median) and the process RSS are recorded there. Measured in one run, so ratios are comparable:

- sink (budget B): latency and RSS should stay flat from the first to the last position;
- full: grows with the stream; stops when advancing would exceed --full-limit tokens or the time cap;
- sliding window with recomputation (re-encode the last W tokens for every new token);
- h2o and sink_h2o relative to sink at the first position;
- llama.cpp with its full cache at --llamacpp-depth (when llama-cpp-python is installed).

With --quant/--compile/--block the engine runs quantized weights, the compiled decode step and
block eviction (evict once every BLOCK tokens), the configuration meant for long streams.

    python benchmarks/streaming.py --threads 2                      # the issue's sizes (long)
    python benchmarks/streaming.py --positions 1000,4000,8000 --json out.json
    python benchmarks/streaming.py --quant int4:32 --block 64 --compile --llamacpp-depth 16384 --threads 1
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time

import torch


def rss_mib() -> float:
    """Current resident set size of this process in MiB (Linux /proc)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


@torch.inference_mode()
def decode_latency(lm, cache, tokens: torch.Tensor) -> tuple[float, float]:
    """(median, best) seconds per decoded token, feeding tokens [1, n] one by one. The best of n is
    the robust statistic on a shared machine (other processes only ever add time)."""
    times = []
    for i in range(tokens.shape[1]):
        t = time.perf_counter()
        lm.forward(tokens[:, i:i + 1], cache)
        times.append(time.perf_counter() - t)
    times = times[1:] if len(times) > 1 else times
    return statistics.median(times), min(times)


def text_ids(lm, n: int) -> torch.Tensor:
    from attnlab.data import corpus
    ids = lm.encode(corpus("shakespeare:test"))
    reps = n // len(ids) + 1
    return torch.tensor((ids * reps)[:n])[None]


def run_stream(lm, policy, ids, positions, decode, chunk, time_cap, max_tokens=None):
    """Advance to every position (chunked prefill), decode there; rows of measurements."""
    cache = lm.new_cache(policy=policy, capacity=256)  # full grows from here
    rows, fed, start = [], 0, time.perf_counter()
    for p in positions:
        if max_tokens is not None and p > max_tokens:
            rows.append({"position": p, "stopped": f"beyond --full-limit {max_tokens}"})
            break
        if time.perf_counter() - start > time_cap:
            rows.append({"position": p, "stopped": f"time cap {time_cap}s reached"})
            break
        if p > fed:
            lm.prefill(ids[:, fed:p], cache, chunk=chunk)
            fed = p
        med, best = decode_latency(lm, cache, ids[:, fed:fed + decode])
        fed += decode
        rows.append({"position": p, "ms_per_token": 1000 * best, "ms_median": 1000 * med, "rss_mib": rss_mib(),
                     "kv_mib": cache.nbytes() / 2**20, "cache_tokens": len(cache)})
        print(json.dumps({"policy": getattr(policy, "name", "full"), **rows[-1]}), file=sys.stderr, flush=True)
    return rows


@torch.inference_mode()
def recompute_latency(lm, ids, window: int, n: int) -> float:
    """Sliding window with recomputation: every new token re-encodes the last `window` tokens."""
    times = []
    for i in range(n):
        ctx = ids[:, i:i + window]
        t = time.perf_counter()
        lm.model(ctx, keep=slice(-1, None))
        times.append(time.perf_counter() - t)
    return min(times)


def llamacpp_latency(path, ids, depth: int, n: int, threads: int, flash_modes=(False, True)) -> dict:
    """llama.cpp decoding with its full (f16) cache after `depth` tokens of the same text; best ms per token
    over n tokens, with flash attention off and on (the faster is reported)."""
    from llama_cpp import Llama

    best = None
    for flash in flash_modes:
        llm = Llama(model_path=str(path), n_ctx=depth + n + 8, n_threads=threads, n_threads_batch=threads,
                    n_batch=512, flash_attn=flash, verbose=False)
        llm.eval(ids[0, :depth].tolist())
        times = []
        for i in range(n):
            t = time.perf_counter()
            llm.eval([int(ids[0, depth + i])])
            times.append(time.perf_counter() - t)
        row = {"depth": depth, "ms_per_token": 1000 * min(times), "ms_median": 1000 * statistics.median(times),
               "flash_attn": flash}
        print(json.dumps({"policy": "llama.cpp", **row}), file=sys.stderr, flush=True)
        best = row if best is None or row["ms_per_token"] < best["ms_per_token"] else best
        del llm
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--positions", default="1000,10000,50000,100000")
    p.add_argument("--decode", type=int, default=32, help="tokens decoded at every position (best of them kept)")
    p.add_argument("--cost-position", type=int, default=None,
                   help="where h2o and sink_h2o are compared with sink (default 2 x budget: evicting every step)")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk used to advance the stream")
    p.add_argument("--window", type=int, default=1024, help="W of the recomputation baseline")
    p.add_argument("--full-limit", type=int, default=20000, help="do not advance full past this many tokens")
    p.add_argument("--time-cap", type=float, default=900.0, help="seconds per policy before stopping")
    p.add_argument("--quant", default=None, help="weight format, e.g. int4:32 (default float32)")
    p.add_argument("--compile", action="store_true", help="compiled decode step")
    p.add_argument("--kv-dtype", default=None, help="float16: the KV cache in half the bytes (llama.cpp's default)")
    p.add_argument("--block", type=int, default=1, help="block eviction: evict once every BLOCK tokens")
    p.add_argument("--llamacpp-depth", type=int, default=0, help="also time llama.cpp's full cache at this depth")
    p.add_argument("--llamacpp-flash", choices=("off", "on", "both"), default="both",
                   help="llama.cpp's flash attention (each setting prefills the whole depth again)")
    p.add_argument("--json", default=None, help="write all measurements here")
    args = p.parse_args(argv)

    import attnlab
    from attnlab.kv import make_policy as _make_policy

    def make_policy(name, budget, chunk):
        return _make_policy(name, budget, chunk=chunk, block=args.block)

    lm = attnlab.load("smollm2-135m", threads=args.threads, quant=args.quant, compile=args.compile,
                      kv_dtype=args.kv_dtype)
    positions = [int(x) for x in args.positions.split(",")]
    ids = text_ids(lm, max(positions) + args.decode * len(positions) + args.window + 64)
    out = {"budget": args.budget, "threads": args.threads, "decode": args.decode, "quant": args.quant,
           "compile": args.compile, "block": args.block, "kv_dtype": args.kv_dtype}
    out["sink"] = run_stream(lm, make_policy("sink", args.budget, chunk=args.chunk), ids, positions, args.decode,
                             args.chunk, args.time_cap)
    at = [args.cost_position or 2 * args.budget]
    for name in ("sink", "h2o", "sink_h2o"):
        out[f"{name}_cost"] = run_stream(lm, make_policy(name, args.budget, chunk=args.chunk), ids, at, args.decode,
                                         args.chunk, args.time_cap)
    out["recompute_ms_per_token"] = 1000 * recompute_latency(lm, ids, args.window, 4)
    out["full"] = run_stream(lm, None, ids, positions, args.decode, args.chunk, args.time_cap, args.full_limit)

    sink = [r for r in out["sink"] if "ms_per_token" in r]
    base = sink[0]["ms_per_token"]
    print(f"\nsink, budget {args.budget}, {args.threads} threads")
    print(f"{'position':>9} {'ms/token':>9} {'vs first':>9} {'RSS MiB':>9} {'KV MiB':>8}   (best of --decode tokens)")
    for r in sink:
        print(f"{r['position']:>9} {r['ms_per_token']:>9.1f} {r['ms_per_token'] / base:>8.2f}x "
              f"{r['rss_mib']:>9.0f} {r['kv_mib']:>8.1f}")
    print("\nfull")
    for r in out["full"]:
        if "stopped" in r:
            print(f"{r['position']:>9} stopped: {r['stopped']}")
        else:
            print(f"{r['position']:>9} {r['ms_per_token']:>9.1f} {r['ms_per_token'] / base:>8.2f}x "
                  f"{r['rss_mib']:>9.0f} {r['kv_mib']:>8.1f}")
    rec = out["recompute_ms_per_token"]
    print(f"\nsliding window with recomputation (W={args.window}): {rec:.1f} ms/token = "
          f"{rec / base:.1f}x sink at position {positions[0]}")
    cost = out["sink_cost"][0]["ms_per_token"]
    print(f"at position {at[0]} (every step evicts): sink {cost:.1f} ms/token")
    for name in ("h2o", "sink_h2o"):
        r = out[f"{name}_cost"][0]
        print(f"{name}: {r['ms_per_token']:.1f} ms/token = {r['ms_per_token'] / cost:.2f}x sink")
    if args.llamacpp_depth:
        flash = {"off": (False,), "on": (True,), "both": (False, True)}[args.llamacpp_flash]
        out["llamacpp"] = llamacpp_latency(lm.source, ids, args.llamacpp_depth, args.decode, args.threads, flash)
        r = out["llamacpp"]
        print(f"llama.cpp full cache at depth {r['depth']}: {r['ms_per_token']:.1f} ms/token = "
              f"{r['ms_per_token'] / base:.1f}x sink at position {positions[0]} "
              f"(best of {args.decode}; flash attention {'on' if r['flash_attn'] else 'off'}"
              + (", the faster)" if args.llamacpp_flash == "both" else ")"))
    if args.json:
        from attnlab.io import write_json
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
