"""Per-call time of the fused batch-1 kernels (q4_mm, q8_mm, lut4_mm, decode_attention) on SmolLM2-135M
shapes, against the same kernels built from another git revision (`--baseline REV`), interleaved.

The baseline's sources (kernels.cpp, attend.cpp when it has one) are taken from git, their op namespace
renamed to `attnlab_base`, and built beside ours with the same flags, so both run in one process on the
same weights and caches: the ratio is what changed, not the machine's load. Weights (and KV caches) of
`--layers` distinct copies are cycled so they come from memory as in a decode step. Decode attention
runs over SmolLM2's 3 KV heads x 3 query heads, D 64, at `--depths`, with a float16 and an int8 cache.
`--clock cpu` times this thread's CPU time (steadier on a shared machine; use wall with --threads > 1).
`python benchmarks/kernel_ops.py --baseline 4c0e5a3 --clock cpu --repeats 9`
`python benchmarks/kernel_ops.py --baseline 17a9ce0 --only attention --threads 2 --clock wall`

`--variants avx2,avx512vnni --threads 1,2` instead times the ISA variants against each other: one worker
process per variant (`ATTNLAB_ISA`; one extension per process), each holding the same weights in the
layout its variant uses (`QuantLinear.kernel()`: repacked 16-row blocks on avx512vnni), driven in
turn by this process so every (variant, threads) cell is timed once per repeat, wall clock. Printed:
microseconds per call, the speedup over the first variant, 2-thread over 1-thread, and GB/s of weights.
`--clock cpu` times 1-thread cells in CPU time (steady on a shared machine); more threads need wall time.
`python benchmarks/kernel_ops.py --variants avx2,avx512vnni --threads 1,2 --repeats 9 --depths ''`

`--layouts` times the repacked kernels (q4x_mm, q8x_mm) on the same GGUF blocks (Q4_0, Q4_1, Q8_0 made by
the `gguf` package from random weights) stored two ways, interleaved: scales (and mins) as float32, the
layout before fp16 scales, and as the layout the values allow (`repack.q4_layout`: float16, Q4_0 with no
min). Shapes: SmolLM2-135M's and Llama-3.2-1B's. Printed: us per call, bytes per weight, GB/s, speedup.
Q4_K and Q6_K (random blocks) run their superblock layout (`repack.KQ`, flag "kq") against the float32 one.
`python benchmarks/kernel_ops.py --layouts --threads 1 --repeats 9`
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from attnlab.kernels import build as kernels
from attnlab.kernels import isa
import llamacpp  # noqa: E402 - benchmarks/ is on sys.path when this script runs
from rows_kernels import D, H, linear

# (name, out N, in K, format): SmolLM2-135M's batch-1 matvecs; the head is the tied int8 embedding
SHAPES = [("w13", 2 * H, D, "int4:32"), ("w2", D, H, "int4:32"), ("wqkv", 960, D, "int4:32"),
          ("wo", D, D, "int4:32"), ("head", 49152, D, "int8"), ("head:32", 49152, D, "int8:32"),
          ("w13", 2 * H, D, "int8:32"), ("w13", 2 * H, D, "kmeans:4")]
# the row-sparse matvec (Deja Vu's gate/up rows) at --rows of the rows, sorted random selection
ROWS = [("w13 rows", 2 * H, D, "int4:32"), ("w13 rows", 2 * H, D, "int8:32")]


def build_baseline(rev: str) -> bool:
    """Build the kernels as of `rev` with their ops under torch.ops.attnlab_base; False if it has none."""
    root = Path(__file__).resolve().parents[1]
    build = kernels.CACHE / f"base-{rev}"
    build.mkdir(parents=True, exist_ok=True)
    sources = []
    for name in kernels.SOURCES + ("kernels_simd.h",):
        for folder in ("attnlab/kernels", "attnlab/quant"):  # the sources lived in quant/ before 22's move
            got = subprocess.run(["git", "show", f"{rev}:{folder}/{name}"], cwd=root, capture_output=True, text=True)
            if got.returncode == 0:
                break
        if got.returncode != 0:  # a revision before that file
            continue
        src = got.stdout
        for macro in ("TORCH_LIBRARY", "TORCH_LIBRARY_IMPL", "TORCH_LIBRARY_FRAGMENT"):
            src = src.replace(f"{macro}(attnlab,", f"{macro}(attnlab_base,")
        (build / name).write_text(src)
        if name.endswith(".cpp"):
            sources.append(str(build / name))
    if not sources:
        return False
    from torch.utils.cpp_extension import load
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load(name=f"attnlab_base_{rev}", sources=sources, build_directory=str(build),
             extra_cflags=list(kernels.FLAGS) + list(isa.LEVELS["avx2"][1]) + ["-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False,
             is_python_module=False)
    return True


def attention_calls(ops, depth: int, kv: str, layers: int, g: torch.Generator):
    """decode_attention over `layers` distinct caches of `depth` rows (slices of larger buffers, as the cache's)."""
    from attnlab.kernels.reference import int8_blocks
    out = []
    for _ in range(layers):
        q = torch.randn(1, 9, 1, 64, generator=g)
        k, v = (torch.randn(1, 3, depth + 64, 64, generator=g) for _ in range(2))
        if kv == "int8":
            (kq, ks), (vq, vs) = int8_blocks(k), int8_blocks(v)
            args = (kq[:, :, :depth], vq[:, :, :depth], 0.125, ks[:, :, :depth], vs[:, :, :depth])
        else:
            args = (k.half()[:, :, :depth], v.half()[:, :, :depth], 0.125)
        out.append(lambda q=q, args=args: ops.decode_attention(q, *args))
    return out


def call(ops, layer, x, idx=None):
    """The op QuantLinear's batch-1 forward calls (`kernel()`; with idx, the rows op), from the namespace `ops`."""
    if idx is not None:
        f, operands = getattr(ops, layer.fmt.sparse.rows_mv), layer.row_operands()
        return lambda: f(x[0], *operands, idx)
    name, operands = layer.kernel()
    if ops is not torch.ops.attnlab:  # a baseline build: the row-layout ops of its time
        name, operands = {"int8": ("q8_mm", lambda p: (p.q, p.scale, p.group)),
                          "int4": ("q4_mm", lambda p: (p.qs, p.scale, p.min, p.group))}.get(
            layer.kind, (name, lambda p: operands))
        operands = operands(layer.packed) if callable(operands) else operands
    f = getattr(ops, name)
    return lambda: f(x, *operands)


def matrix_cases(args, g: torch.Generator) -> list:
    """(label, layer bytes, [calls]) for each matrix shape, weights from g (the same in every process)."""
    out, only = [], set(args.only.split(",")) - {""}
    for name, N, K, fmt in SHAPES:
        if only and name not in only:
            continue
        n = 2 if N > 10000 else args.layers
        layers = [linear(torch.randn(N, K, generator=g) * 0.05, fmt) for _ in range(n)]
        xs = [torch.randn(1, K, generator=g) for _ in range(n)]
        out.append((f"{name:9} {fmt:9} {N:>6}x{K:<5}", layers[0].nbytes,
                    [call(torch.ops.attnlab, layer, x) for layer, x in zip(layers, xs)]))
    return out


def worker(args) -> None:
    """One variant's process: reads 'CASE THREADS' lines, times one pass over that case's layers, prints us."""
    if not kernels.load():
        raise SystemExit("fused kernels unavailable")
    cases = matrix_cases(args, torch.Generator().manual_seed(0))
    print(f"ready {kernels.variant()} repacked={kernels.repacks()} {len(cases)}", flush=True)
    print(json.dumps([(label, nbytes) for label, nbytes, _ in cases]), flush=True)
    for line in sys.stdin:
        i, threads = map(int, line.split())
        torch.set_num_threads(threads)
        calls = cases[i][2]
        calls[0]()  # the thread pool at this size, awake
        clock = time.thread_time if args.clock == "cpu" and threads == 1 else time.perf_counter
        start = clock()
        for c in calls:
            c()
        print((clock() - start) / len(calls) * 1e6, flush=True)


def compare_variants(args) -> None:
    """Drive one worker per variant, interleaved per repeat; print the table."""
    variants, threads = args.variants.split(","), [int(t) for t in args.threads.split(",")]
    print(f"# {isa.describe()}")
    print("# " + llamacpp.bandwidth_line({t: llamacpp.read_bandwidth(t) for t in threads}))
    clock = "this thread's CPU time at 1 thread, wall clock above" if args.clock == "cpu" else "wall clock"
    print(f"# variants {variants} (one process each), threads {threads}, repeats {args.repeats}, {clock}, "
          f"medians; load average {os.getloadavg()[0]:.2f} at start")
    procs, names = {}, []
    for v in variants:
        env = {**os.environ, "ATTNLAB_ISA": v}
        cmd = [sys.executable, __file__, "--worker", "--only", args.only, "--layers", str(args.layers),
               "--clock", args.clock]
        procs[v] = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = procs[v].stdout.readline().split()
        if not ready or ready[0] != "ready":
            raise SystemExit(f"worker for {v} failed to start")
        labels = json.loads(procs[v].stdout.readline())  # the same cases in every worker
        print(f"# {v}: {' '.join(ready[1:3])}")
    cells = [(v, t) for v in variants for t in threads]
    head = " ".join(f"{f'{v}@{t}t':>14}" for v, t in cells)
    extra = [f"x{v}/{variants[0]}@{t}" for v in variants[1:] for t in threads] + [f"2t/1t {v}" for v in variants
                                                                                  if len(threads) > 1]
    print(f"{'shape':9} {'format':9} {'N x K':>12} {head} " + " ".join(f"{e:>16}" for e in extra)
          + "  GB/s(best@1t)")
    for i, (label, nbytes) in enumerate(labels):
        times = {c: [] for c in cells}
        for _ in range(args.repeats):
            for v, t in cells:
                procs[v].stdin.write(f"{i} {t}\n")
                procs[v].stdin.flush()
                times[(v, t)].append(float(procs[v].stdout.readline()))
        med = {c: statistics.median(x) for c, x in times.items()}
        ratios = [med[(variants[0], t)] / med[(v, t)] for v in variants[1:] for t in threads]
        if len(threads) > 1:
            ratios += [med[(v, threads[0])] / med[(v, threads[1])] for v in variants]
        best = min(med[(v, threads[0])] for v in variants)
        print(f"{label} " + " ".join(f"{med[c]:14.1f}" for c in cells) + " "
              + " ".join(f"{r:16.2f}" for r in ratios) + f"  {nbytes / best / 1e3:8.1f}", flush=True)
    for p in procs.values():
        p.stdin.close()
        p.wait()
    print(f"# load average {os.getloadavg()[0]:.2f} at end")


# (name, N, K, GGUF type): SmolLM2-135M's and Llama-3.2-1B's matvecs (the 1B head: SmolLM's 49152 tokens, Q8_0)
LAYOUT_SHAPES = [("w13", 2 * H, D, "Q4_1"), ("w2", D, H, "Q4_1"), ("w13", 2 * H, D, "Q4_0"),
                 ("1B wqkv", 3072, 2048, "Q4_0"), ("1B wo", 2048, 2048, "Q4_0"), ("1B w13", 16384, 2048, "Q4_0"),
                 ("1B w2", 2048, 8192, "Q4_0"), ("1B w13", 16384, 2048, "Q4_1"), ("1B head", 49152, 2048, "Q8_0"),
                 ("1B w2", 2048, 8192, "Q4_K"), ("1B w13/2", 8192, 2048, "Q4_K"), ("1B w2", 2048, 8192, "Q6_K"),
                 ("1B w13/2", 8192, 2048, "Q6_K")]
_K_HALVES = {"Q4_K": (0, 2), "Q6_K": (208,)}  # where K-quant blocks keep their float16 d (and dmin)


def random_k_blocks(kind: str, N: int, K: int, seed: int):
    """Random Q4_K / Q6_K blocks (`gguf.quants` cannot quantize to them): any code and scale bytes, small
    float16 d: the kernels' time does not depend on the values."""
    import numpy as np

    from attnlab.quant.formats import _BLOCK_BYTES
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(N * K // 256, _BLOCK_BYTES[kind][1]), dtype=np.uint8)
    for at in _K_HALVES[kind]:
        raw[:, at:at + 2] = rng.normal(0, 0.003, size=raw.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw


def layout_calls(N: int, K: int, kind: str, copies: int, g: torch.Generator) -> dict:
    """{layout flags: [calls]} over `copies` distinct GGUF-quantized weights, each packed float32 and as its values allow."""
    import gguf

    from attnlab.kernels import repack
    from attnlab.quant.formats import from_gguf
    out = {}
    for _ in range(copies):
        if kind in _K_HALVES:
            p = from_gguf(random_k_blocks(kind, N, K, int(torch.randint(1 << 30, (1,), generator=g))), kind, (N, K))
        else:
            w = (torch.randn(N, K, generator=g) * 0.05).numpy()
            p = from_gguf(gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind]), kind, (N, K))
        x = torch.randn(1, K, generator=g)
        for fmt in (0, None):
            if p.kind == "int4":
                wp, f = repack.pack_q4(p.qs, p.scale, p.min, p.group, fmt, kscale=p.kscale)
                op, args = torch.ops.attnlab.q4x_mm, (wp, N, p.group, f)
            else:
                wp, f = repack.pack_q8(p.q, p.scale, p.group, None, fmt, kscale=p.kscale)
                op, args = torch.ops.attnlab.q8x_mm, (wp, N, p.group, False, f)
            out.setdefault(f, []).append((lambda op=op, x=x, args=args: op(x, *args), wp.numel() * N / (wp.shape[0] * 16)))
    return out


def compare_layouts(args) -> None:
    from attnlab.kernels import repack
    t = int(args.threads)
    torch.set_num_threads(t)
    if not kernels.load():
        raise SystemExit("fused kernels unavailable")
    clock = time.thread_time if args.clock == "cpu" and t == 1 else time.perf_counter
    print(f"# {isa.describe()}; variant {kernels.variant()}")
    print(f"# read bandwidth (float32 sum over 1 GiB): {llamacpp.read_bandwidth(t):.1f} GB/s at {t} thread(s)")
    torch.set_num_threads(t)
    print(f"# threads {t}, repeats {args.repeats} interleaved, medians, clock {'cpu' if clock is time.thread_time else 'wall'}; "
          f"load average {os.getloadavg()[0]:.2f} at start")
    print(f"{'shape':9} {'type':5} {'N x K':>12} {'f32 us':>9} {'new us':>9} {'layout':>7} {'B/w f32':>8} {'B/w new':>8} "
          f"{'GB/s f32':>9} {'GB/s new':>9} {'speedup':>8} {'bytes ratio':>11}")
    g = torch.Generator().manual_seed(0)
    only = set(args.only.split(",")) - {""}
    for name, N, K, kind in LAYOUT_SHAPES:
        if only and name not in only:
            continue
        copies = max(2, min(args.layers, int(64e6 // (N * K))))  # >= 32 MB of weights per pass: from memory
        calls = layout_calls(N, K, kind, copies, g)
        fmts = list(calls)
        times = {f: [] for f in fmts}
        for _ in range(args.repeats):
            for f in fmts:
                calls[f][0][0]()
                start = clock()
                for c, _ in calls[f]:
                    c()
                times[f].append((clock() - start) / len(calls[f]))
        med = {f: statistics.median(v) for f, v in times.items()}
        nb = {f: calls[f][0][1] for f in fmts}
        new = fmts[-1]
        flags = ("h" if new & repack.HALF else "") + ("s" if new & repack.SYM else "") + (
            "kq" if new & repack.KQ else "") or "-"
        print(f"{name:9} {kind:5} {N:>6}x{K:<5} {med[0] * 1e6:9.1f} {med[new] * 1e6:9.1f} {flags:>7} "
              f"{nb[0] / (N * K):8.4f} {nb[new] / (N * K):8.4f} {nb[0] / med[0] / 1e9:9.1f} {nb[new] / med[new] / 1e9:9.1f} "
              f"{med[0] / med[new]:8.2f} {nb[0] / nb[new]:11.2f}", flush=True)
    print(f"# load average {os.getloadavg()[0]:.2f} at end")


def main() -> None:
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--baseline", default="", help="git revision whose kernels to time alongside ours")
    p.add_argument("--only", default="", help="comma-separated shape names (default all)")
    p.add_argument("--rows", type=float, default=0.3, help="fraction of rows for the rows ops (0: skip them)")
    p.add_argument("--layers", type=int, default=30, help="distinct weight copies cycled (the head: 2)")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--clock", choices=("wall", "cpu"), default="cpu")
    p.add_argument("--threads", default="1", help="thread count (with --variants: a list, e.g. 1,2)")
    p.add_argument("--variants", default="", help="ISA variants to compare, one process each (e.g. avx2,avx512vnni)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layouts", action="store_true", help="repacked blocks with float32 against float16 scales")
    p.add_argument("--depths", default="1024,4096", help="cache depths of the attention cases ('' to skip them)")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.variants:
        return compare_variants(args)
    if args.layouts:
        return compare_layouts(args)
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    torch.set_num_threads(int(args.threads))
    if not kernels.load():
        raise SystemExit("fused kernels unavailable (no compiler or no AVX2)")
    impls = {"new": torch.ops.attnlab}
    if args.baseline and build_baseline(args.baseline):
        impls = {"base": torch.ops.attnlab_base, **impls}
    print(f"# {isa.describe()}; variant {kernels.variant()}")
    print(f"threads {args.threads}, clock {args.clock}, repeats {args.repeats}, baseline {args.baseline or '-'}")
    print(f"{'shape':9} {'format':9} {'N x K':>12} " + " ".join(f"{k + ' us':>9}" for k in impls)
          + ("   speedup  max|diff|" if len(impls) > 1 else ""))
    g = torch.Generator().manual_seed(0)
    only = set(args.only.split(",")) - {""}
    attention = [("attention", depth, 64, kv) for depth in map(int, filter(None, args.depths.split(",")))
                 for kv in ("float16", "int8")]
    for name, N, K, fmt in SHAPES + (ROWS if args.rows else []) + attention:
        if only and name not in only:
            continue
        if name == "attention":  # N: the depth, fmt: the cache's dtype; one seed so both read the same caches
            calls = {k: attention_calls(ops, N, fmt, args.layers, torch.Generator().manual_seed(N))
                     for k, ops in impls.items()}
        else:
            n = 2 if N > 10000 else args.layers
            layers = [linear(torch.randn(N, K, generator=g) * 0.05, fmt) for _ in range(n)]
            xs = [torch.randn(1, K, generator=g) for _ in range(n)]
            idx = [torch.randperm(N, generator=g)[:round(args.rows * N)].sort().values if "rows" in name else None
                   for _ in range(n)]
            calls = {k: [call(ops, *a) for a in zip(layers, xs, idx)] for k, ops in impls.items()}
        n = len(calls["new"])
        times = {k: [] for k in impls}
        for _ in range(args.repeats):
            for k, cs in calls.items():  # interleaved: each implementation once per repeat
                start = clock()
                for c in cs:
                    c()
                times[k].append((clock() - start) / len(cs) * 1e6)
        med = {k: statistics.median(v) for k, v in times.items()}
        line = f"{name:9} {fmt:9} {N:>6}x{K:<5} " + " ".join(f"{med[k]:9.1f}" for k in impls)
        if len(impls) > 1:
            diff = max((calls["new"][i]() - calls["base"][i]()).abs().max().item() for i in range(min(n, 3)))
            line += f"   {med['base'] / med['new']:6.2f}x  {diff:.2e}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
