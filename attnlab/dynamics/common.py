"""Small shared helpers for the theory lab: entropies, normalised correlation,
seeding and atomic output files.

Every experiment in ``attnlab.dynamics`` reports entropies and correlations the
same way, and writes its numbers so that a crash never leaves half a JSON file;
keeping those few functions here avoids five slightly different copies.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from attnlab.io import write_json
from attnlab.stats import centred_cosine, entropy, spearman  # noqa: F401  (re-exported)


def normalised_entropy_of_weights(w: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Entropy of ``w / w.sum(dim)``: w: (..., n) non-negative -> (...)."""
    return entropy(w / w.sum(dim, keepdim=True), dim)


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
    """``data`` (tensors and non-finite floats made plain) as JSON, written atomically, mode 0644."""
    return write_json(path, to_jsonable(data))
