"""Batch-1 decode speed of dense and sparse plans on one model, measured side by side.

All variants share the loaded weights and one prefilled cache (rolled back before every
run); runs are interleaved (the order rotates each repeat) and repeated, medians reported.
The bytes a step reads in the MLPs (predictor included) come from `Plan.bytes_per_token`.
"""
from __future__ import annotations

import statistics
import time

import torch

from attnlab.errors import AttnlabError


@torch.inference_mode()
def decode_speed(lm, plans: dict, ids: torch.Tensor, depth: int = 128, steps: int = 32, repeats: int = 5,
                 clock: str = "wall", progress=None) -> list[dict]:
    """plans: {name: Plan or None (dense)}; ids: 1-D tokens (depth + steps of them; fed for real so a
    predictor sees real inputs); clock: "wall" or "cpu" (this thread's CPU time: on a loaded machine
    it leaves out the time other processes held the core). Returns rows {"variant", "tok_s", "runs",
    "mlp_mib_per_token", "proj_mib_per_token" (all seven projections), "speedup"}."""
    if clock not in ("wall", "cpu"):
        raise AttnlabError(f"clock must be wall or cpu, got {clock!r}")
    now = time.perf_counter if clock == "wall" else time.thread_time
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    if ids.numel() < depth + steps:
        raise AttnlabError(f"need {depth + steps} tokens, got {ids.numel()}")
    model = lm.model
    lm = lm.with_sparsity(None)
    cache = lm.new_cache(capacity=depth + steps + 1)
    lm.prefill(ids[None, :depth], cache)
    bound = {name: (p.bind(model) if p is not None else None) for name, p in plans.items()}
    engines = {name: lm.with_sparsity(p) for name, p in bound.items()}
    names = list(plans)
    times = {n: [] for n in names}
    for r in range(repeats + 1):  # the first round warms up (allocations, first kernel calls)
        for name in names[r % len(names):] + names[:r % len(names)]:
            cache.truncate(depth)
            t = now()
            for j in range(steps):
                engines[name].forward(ids[None, depth + j:depth + j + 1], cache)
            if r:
                times[name].append(steps / (now() - t))
            if progress is not None:
                progress(1)
    dense_row = None
    rows = []
    for name in names:
        p = bound[name]
        b = p.bytes_per_token(model) if p is not None else None
        attn = _dense_attn(model)
        row = {"variant": name, "tok_s": statistics.median(times[name]), "runs": [round(x, 2) for x in times[name]],
               "mlp_mib_per_token": (b["sparse_mlp"] if b else _dense_mlp(model)) / 2**20,
               "proj_mib_per_token": (b.get("sparse_proj", attn + b["sparse_mlp"]) if b else attn + _dense_mlp(model))
               / 2**20}
        dense_row = dense_row or (row if p is None else None)
        rows.append(row)
    if dense_row is not None:
        for row in rows:
            row["speedup"] = row["tok_s"] / dense_row["tok_s"]
    return rows


def _dense_attn(model) -> int:
    from attnlab.sparsity.plan import _nbytes
    return sum(_nbytes(layer.attn.wqkv) + _nbytes(layer.attn.wo) for layer in model.layers)


def _dense_mlp(model) -> int:
    from attnlab.sparsity.plan import _nbytes
    return sum(_nbytes(layer.mlp.w13) + _nbytes(layer.mlp.w2) for layer in model.layers)
