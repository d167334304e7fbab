"""Data-parallel training under `torchrun` (torch.distributed, gloo: CPU, any number of hosts).

`torchrun --nproc-per-node N -m attnlab train ...` sets RANK/WORLD_SIZE/MASTER_ADDR; `init()`
joins the process group. The `Trainer` then splits each global minibatch (the same one a
single process draws, a function of (seed, step)) into N equal slices, DistributedDataParallel
averages the gradients, so N processes follow the single-process run up to float rounding;
only rank 0 evaluates and writes logs and checkpoints. Without torchrun nothing changes.
"""
from __future__ import annotations

import os

import torch.distributed as dist

from attnlab.errors import AttnlabError


def init(backend: str = "gloo") -> int:
    """Join the torchrun process group if there is one; -> world size (1 without torchrun)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        if not dist.is_available():
            raise AttnlabError("this torch build has no torch.distributed")
        dist.init_process_group(backend)
    return world_size()


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main() -> bool:
    return rank() == 0


def shard(x, world: int, r: int):
    """Rank r's equal slice of a global batch (rows)."""
    if x.shape[0] % world:
        raise AttnlabError(f"batch {x.shape[0]} does not split over {world} processes; use a multiple of {world}")
    n = x.shape[0] // world
    return x[r * n:(r + 1) * n]


def mean_across(value: float) -> float:
    """The mean of a per-rank number over all ranks (the global batch's loss from the slices')."""
    if world_size() == 1:
        return value
    import torch
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / world_size()


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
