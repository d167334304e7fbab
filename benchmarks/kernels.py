"""Per-call time of the fused batch-1 kernels (q4_mm, q8_mm, lut4_mm) on SmolLM2-135M shapes, 1 thread,
against the same kernels built from another git revision (`--baseline REV`), interleaved.

The baseline's kernels.cpp is taken from git, its op namespace renamed to `attnlab_base`, and built
beside ours, so both run in one process on the same weights: the ratio is what changed, not the
machine's load. Weights of `--layers` distinct copies are cycled so they come from memory as in a
decode step. `--clock cpu` times this thread's CPU time (steadier on a shared machine).
`python benchmarks/kernels.py --baseline 4c0e5a3 --clock cpu --repeats 9`
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import time
import warnings
from pathlib import Path

import torch

from attnlab.quant import kernels
from rows_kernels import D, H, linear  # benchmarks/ is on sys.path when this script runs

# (name, out N, in K, format): SmolLM2-135M's batch-1 matvecs; the head is the tied int8 embedding
SHAPES = [("w13", 2 * H, D, "int4:32"), ("w2", D, H, "int4:32"), ("wqkv", 960, D, "int4:32"),
          ("wo", D, D, "int4:32"), ("head", 49152, D, "int8"), ("head:32", 49152, D, "int8:32"),
          ("w13", 2 * H, D, "int8:32"), ("w13", 2 * H, D, "kmeans:4")]
# the row-sparse matvec (Deja Vu's gate/up rows) at --rows of the rows, sorted random selection
ROWS = [("w13 rows", 2 * H, D, "int4:32"), ("w13 rows", 2 * H, D, "int8:32")]


def build_baseline(rev: str) -> bool:
    """Build kernels.cpp as of `rev` with its ops under torch.ops.attnlab_base; False if it has no such file."""
    root = Path(__file__).resolve().parents[1]
    try:
        src = subprocess.run(["git", "show", f"{rev}:attnlab/quant/kernels.cpp"], cwd=root, check=True,
                             capture_output=True, text=True).stdout
    except subprocess.CalledProcessError:
        return False
    src = src.replace("TORCH_LIBRARY(attnlab,", "TORCH_LIBRARY(attnlab_base,").replace(
        "TORCH_LIBRARY_IMPL(attnlab,", "TORCH_LIBRARY_IMPL(attnlab_base,")
    build = kernels.CACHE / f"base-{rev}"
    build.mkdir(parents=True, exist_ok=True)
    (build / "base.cpp").write_text(src)
    header = subprocess.run(["git", "show", f"{rev}:attnlab/quant/kernels_simd.h"], cwd=root, capture_output=True,
                            text=True)
    if header.returncode == 0:  # its own SIMD header, if it had one
        (build / "kernels_simd.h").write_text(header.stdout)
    from torch.utils.cpp_extension import load
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load(name=f"attnlab_base_{rev}", sources=[str(build / "base.cpp")], build_directory=str(build),
             extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c"], verbose=False, is_python_module=False)
    return True


def call(ops, layer, x, idx=None):
    """The op QuantLinear's batch-1 forward calls (or with idx, the rows op), from the namespace `ops`."""
    if idx is not None and layer.kind == "int8":
        return lambda: ops.q8_rows_mv(x[0], layer.q, layer.scale, layer.group, idx)
    if idx is not None:
        return lambda: ops.q4_rows_mv(x[0], layer.qs, layer.scale, layer.min, layer.group, idx)
    if layer.kind == "int8":
        return lambda: ops.q8_mm(x, layer.q, layer.scale, layer.group)
    if layer.kind == "int4":
        return lambda: ops.q4_mm(x, layer.qs, layer.scale, layer.min, layer.group)
    return lambda: ops.lut4_mm(x, layer.qs, layer.lut, layer.lut_scale, layer.group)


def main() -> None:
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--baseline", default="", help="git revision whose kernels to time alongside ours")
    p.add_argument("--only", default="", help="comma-separated shape names (default all)")
    p.add_argument("--rows", type=float, default=0.3, help="fraction of rows for the rows ops (0: skip them)")
    p.add_argument("--layers", type=int, default=30, help="distinct weight copies cycled (the head: 2)")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--clock", choices=("wall", "cpu"), default="cpu")
    args = p.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    torch.set_num_threads(1)
    if not kernels.available():
        raise SystemExit("fused kernels unavailable (no compiler or no AVX2)")
    impls = {"new": torch.ops.attnlab}
    if args.baseline and build_baseline(args.baseline):
        impls = {"base": torch.ops.attnlab_base, **impls}
    print(f"threads 1, clock {args.clock}, repeats {args.repeats}, baseline {args.baseline or '-'}")
    print(f"{'shape':9} {'format':9} {'N x K':>12} " + " ".join(f"{k + ' us':>9}" for k in impls)
          + ("   speedup  max|diff|" if len(impls) > 1 else ""))
    g = torch.Generator().manual_seed(0)
    only = set(args.only.split(",")) - {""}
    for name, N, K, fmt in SHAPES + (ROWS if args.rows else []):
        if only and name not in only:
            continue
        n = 2 if N > 10000 else args.layers
        layers = [linear(torch.randn(N, K, generator=g) * 0.05, fmt) for _ in range(n)]
        xs = [torch.randn(1, K, generator=g) for _ in range(n)]
        idx = [torch.randperm(N, generator=g)[:round(args.rows * N)].sort().values if "rows" in name else None
               for _ in range(n)]
        calls = {k: [call(ops, *a) for a in zip(layers, xs, idx)] for k, ops in impls.items()}
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
