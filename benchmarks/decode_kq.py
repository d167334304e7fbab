"""The K-quant matvecs of one decode step at Qwen2.5-1.5B's shapes, alone: GB/s against the read bandwidth.

A Q4_K_M file's decode is its matvecs reading the weights once per token; this times exactly those (the repacked
superblock kernels `q4x_mm` / `q8x_mm` with `repack.KQ`, M = 1) over a whole model's worth of random blocks (28
layers of q/k/v, o, gate+up, down and the tied Q6_K head, 1.0 GB: more than the caches hold), with the formats
llama-quantize gives Q4_K_M (Q6_K for v and down in half the layers). No attention, no glue: the ceiling the
native step's weight phases approach. Prints tokens/s of the matvecs, GB/s, and the fraction of the read bandwidth
(a float32 sum over 1 GiB) at each thread count; medians of `--repeats`. To compare two kernel builds, run this
from each tree (`PYTHONPATH=TREE`) alternately.

    python benchmarks/decode_kq.py --threads 1,2 --repeats 7
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

D, FF, KV, LAYERS, VOCAB = 1536, 8960, 256, 28, 151936
KQ = 4  # repack.KQ
Q4K, Q6K = 2368, 3360  # bytes per (16-row block, 256-input superblock)


def blocks(n: int, k: int, q6: bool, gen: torch.Generator) -> torch.Tensor:
    """Random superblocks [ceil(n / 16), k / 256, stride] with every float16 factor 2^-7 (finite, no denormals)."""
    stride = Q6K if q6 else Q4K
    w = torch.randint(0, 256, ((n + 15) // 16, k // 256, stride), dtype=torch.uint8, generator=gen)
    half = torch.full((16 if q6 else 32,), 0x2000, dtype=torch.int16).view(torch.uint8)
    w[:, :, 3328 if q6 else 2304:] = half
    return w


def matvecs(gen: torch.Generator) -> list[tuple]:
    """(op, weight, n, group) of one step, layer by layer (v and down Q6_K in every other layer), then the head."""
    out = []
    for i in range(LAYERS):
        q6 = i % 2 == 0
        for n, k, six in ((D + KV, D, False), (KV, D, q6), (D, D, False), (2 * FF, D, False), (D, FF, q6)):
            out.append(("q8x_mm" if six else "q4x_mm", blocks(n, k, six, gen), n, 16 if six else 32))
    out.append(("q8x_mm", blocks(VOCAB, D, True, gen), VOCAB, 16))
    return out


def step(ops: list[tuple], xs: dict) -> None:
    for name, w, n, group in ops:
        x = xs[w.shape[1] * 256]
        if name == "q4x_mm":
            torch.ops.attnlab.q4x_mm(x, w, n, group, KQ)
        else:
            torch.ops.attnlab.q8x_mm(x, w, n, group, False, KQ)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    p.add_argument("--json", default=None, help="write the run record here (atomically)")
    args = p.parse_args(argv)
    from attnlab.io import finish_record, run_record, write_json
    record = run_record(None, 0, command="python " + shlex.join(["benchmarks/decode_kq.py", *sys.argv[1:]]))
    from attnlab.kernels import build
    if not build.load():
        raise SystemExit(f"no kernels: {build.why()}")
    print(llamacpp.header())
    bw = llamacpp.bandwidths()
    print(llamacpp.bandwidth_line(bw))
    if args.clock == "cpu":
        bw[1] = llamacpp.read_bandwidth(1, clock=time.thread_time)
        print(f"read bandwidth at 1 thread in CPU time: {bw[1]:.1f} GB/s")
    gen = torch.Generator().manual_seed(0)
    ops = matvecs(gen)
    total = sum(w.numel() for _, w, _, _ in ops)
    xs = {k: torch.randn(1, k, generator=gen) for k in (D, FF)}
    print(f"weights {total / 2**20:.0f} MiB a step, {len(ops)} matvecs; kernels {build.library().name}; "
          f"load averages {' '.join(f'{x:.2f}' for x in os.getloadavg())} (a shared machine)")
    record.update(cpu=llamacpp.header(), bandwidth_gbs=bw, clock=args.clock, weight_bytes=total,
                  kernels=build.library().name, load_avg_start=os.getloadavg(), threads={})
    for t in [int(x) for x in args.threads.split(",")]:
        torch.set_num_threads(t)
        clock = time.thread_time if args.clock == "cpu" and t == 1 else time.perf_counter
        step(ops, xs)
        times = []
        for _ in range(args.repeats):
            start = clock()
            step(ops, xs)
            times.append(clock() - start)
        s = statistics.median(times)
        gbs = total / s / 1e9
        frac = gbs / (bw.get(t) or llamacpp.read_bandwidth(t))
        print(f"{t} thread{'s' if t > 1 else ''}: {1 / s:.2f} steps/s, {gbs:.1f} GB/s, {100 * frac:.0f}% of the read "
              f"bandwidth (min {1 / max(times):.2f}, max {1 / min(times):.2f} steps/s)")
        record["threads"][t] = {"steps_s": 1 / s, "gbs": gbs, "bound_fraction": frac, "times_s": times}
    if args.json:
        write_json(args.json, finish_record({**record, "load_avg_end": os.getloadavg()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
