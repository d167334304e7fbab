"""Small shared helpers for the theory lab: entropies, normalised correlation,
seeding and atomic output files.

Every experiment in ``attnlab.dynamics`` reports entropies and correlations the
same way, and writes its numbers so that a crash never leaves half a JSON file;
keeping those few functions here avoids five slightly different copies.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import torch


def entropy(p: torch.Tensor, dim: int = -1, eps: float = 1e-12) -> torch.Tensor:
    """Shannon entropy (nats) of probability vectors along ``dim``.

    p: (..., n, ...) non-negative, summing to 1 along ``dim`` -> (...) with ``dim`` removed.
    """
    return -(p * (p + eps).log()).sum(dim)


def normalised_entropy_of_weights(w: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Entropy of ``w / w.sum(dim)``: w: (..., n) non-negative -> (...)."""
    return entropy(w / w.sum(dim, keepdim=True), dim)


def centred_cosine(a: torch.Tensor, b: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Normalised correlation NC(a, b): cosine after removing each vector's mean.

    a, b: (..., n) -> (...). A global additive constant in either vector does not matter,
    which is why the JoMA invariant is checked with it.
    """
    a = a - a.mean(dim, keepdim=True)
    b = b - b.mean(dim, keepdim=True)
    return (a * b).sum(dim) / (a.norm(dim=dim) * b.norm(dim=dim)).clamp_min(1e-12)


def spearman(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Rank correlation along the last axis: x, y: (..., n) -> (...). Ties broken by order."""
    rx = x.argsort(-1).argsort(-1).to(torch.float64)
    ry = y.argsort(-1).argsort(-1).to(torch.float64)
    return centred_cosine(rx, ry)


def make_generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (experiments never touch the global RNG)."""
    g = torch.Generator()
    g.manual_seed(int(seed))
    return g


def to_jsonable(obj: Any) -> Any:
    """Convert tensors / tuples / non-finite floats into plain JSON values."""
    if isinstance(obj, torch.Tensor):
        return to_jsonable(obj.detach().cpu().tolist())
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
        return to_jsonable(obj.item())
    return obj


def write_json_atomic(path: str | os.PathLike, data: Any) -> Path:
    """Write ``data`` as JSON to ``path`` via a temporary file and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(to_jsonable(data), fh, indent=2)
            fh.write("\n")
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; results are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
