"""Row-sparse MLP ops against the dense matvec and against gather-then-multiply, SmolLM2 shapes, 1 thread.

Deja Vu's sparse MLP pays only if it reads fewer bytes: gate/up rows from w13 [3072, 576] (neuron i
is rows i and 1536 + i) and the down projection transposed, w2T [1536, 576], one neuron per row.
Weights of `--layers` distinct layers are cycled so they come from memory as in a real decode step,
not from cache. Methods interleave within each repeat; the median per call is reported.
`python benchmarks/rows_kernels.py --repeats 7`.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from attnlab.kernels import ops
from attnlab.quant import Packed, QuantLinear, QuantSpec
from attnlab.sparsity.rows import rows_combine, rows_matvec

D, H = 576, 1536  # SmolLM2-135M model and MLP widths


def linear(w: torch.Tensor, fmt: str) -> nn.Module:
    if fmt == "fp32":
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False).requires_grad_(False)
        lin.weight.data = w.contiguous()
        return lin
    return QuantLinear(QuantSpec.parse(fmt).quantize(w))


def gathered(layer: nn.Module, idx: torch.Tensor):
    """The rows idx copied out (the index_select that gather-then-multiply pays every call):
    a float [k, K] matrix, or a Packed one with k rows."""
    if isinstance(layer, nn.Linear):
        return layer.weight.index_select(0, idx)
    p = layer.packed
    return replace(p, shape=(idx.numel(), p.shape[1]), **{k: v.index_select(0, idx) for k, v in p.tensors().items()})


def dense_mv(p: Packed, x: torch.Tensor) -> torch.Tensor:
    """The fused dense kernel on a packed matrix, as QuantLinear's batch-1 forward calls it."""
    if p.kind == "int8":
        return ops.q8_mm(x[None], p.q, p.scale, p.group)[0]
    return ops.q4_mm(x[None], p.qs, p.scale, p.min, p.group)[0]


def row_bytes(layer: nn.Module) -> float:
    n = layer.weight.numel() * 4 if isinstance(layer, nn.Linear) else layer.nbytes
    return n / layer.out_features


def methods(layer13, layer2, layer2T, sel, a, x, h):
    """{(op, method): call}: one op of one layer; sel the active neurons. The quantized down
    projection has no fused a @ rows kernel to gather into, so its gather dequantises the rows."""
    idx13 = torch.cat([sel, sel + H])
    fp32 = isinstance(layer13, nn.Linear)
    mv = (lambda w, v: F.linear(v, w)) if fp32 else dense_mv
    w13, w2 = (layer13.weight, layer2.weight) if fp32 else (layer13.packed, layer2.packed)
    return {
        ("w13 mv", "dense"): lambda: mv(w13, x),
        ("w13 mv", "rows"): lambda: rows_matvec(layer13, x, idx13),
        ("w13 mv", "gather+mm"): lambda: mv(gathered(layer13, idx13), x),
        ("w2 combine", "dense"): lambda: mv(w2, h),
        ("w2 combine", "rows"): lambda: rows_combine(layer2T, a, sel),
        ("w2 combine", "gather+mm"): lambda: a @ (gathered(layer2T, sel) if fp32 else gathered(layer2T, sel).dequantize()),
    }


def main() -> None:
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--formats", default="fp32,int4:32")
    p.add_argument("--fractions", default="1.0,0.5,0.3,0.1", help="active neuron fractions")
    p.add_argument("--layers", type=int, default=30, help="distinct weight copies cycled (SmolLM2 has 30)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: this thread's CPU time, steadier on a machine shared with other jobs")
    args = p.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    torch.set_num_threads(1)
    print(f"kernels: {ops.load()}, threads 1, layers cycled {args.layers}, clock {args.clock}")
    g = torch.Generator().manual_seed(0)
    rows = []
    for fmt in args.formats.split(","):
        layers = []
        for _ in range(args.layers):
            w13, w2 = torch.randn(2 * H, D, generator=g) * 0.05, torch.randn(D, H, generator=g) * 0.05
            layers.append((linear(w13, fmt), linear(w2, fmt), linear(w2.t().contiguous(), fmt)))
        for frac in (float(f) for f in args.fractions.split(",")):
            k = round(frac * H)
            calls = []
            for l13, l2, l2T in layers:
                sel = torch.randperm(H, generator=g)[:k].sort().values
                calls.append(methods(l13, l2, l2T, sel, torch.randn(k), torch.randn(D), torch.randn(H)))
            times = {key: [] for key in calls[0]}
            for _ in range(args.repeats):
                for key in times:  # interleaved: every method once per repeat, over all layers
                    start = clock()
                    for c in calls:
                        c[key]()
                    times[key].append((clock() - start) / len(calls))
            l13, l2, l2T = layers[0]
            for op, full, rb in (("w13 mv", 2 * H, row_bytes(l13)), ("w2 combine", H, row_bytes(l2T))):
                n = 2 * k if op == "w13 mv" else k
                med = {m: statistics.median(times[(op, m)]) * 1e6 for m in ("dense", "rows", "gather+mm")}
                rows.append((fmt, frac, op, med, full * rb, n * rb, 2 * n * rb))
    print(f"{'format':8} {'active':>6} {'op':11} {'dense us':>9} {'rows us':>8} {'gather us':>9} "
          f"{'rows/dense':>10} {'MB dense':>8} {'MB rows':>8} {'MB gather':>9}")
    for fmt, frac, op, med, bd, br, bg in rows:
        print(f"{fmt:8} {frac:6.2f} {op:11} {med['dense']:9.1f} {med['rows']:8.1f} {med['gather+mm']:9.1f} "
              f"{med['dense'] / med['rows']:9.2f}x {bd / 1e6:8.3f} {br / 1e6:8.3f} {bg / 1e6:9.3f}")
    print("MB = bytes read per call (gather: the rows read twice, plus a write of the copy not counted)")


if __name__ == "__main__":
    main()
