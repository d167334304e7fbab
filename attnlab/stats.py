"""The few statistics the theory lab and the real-model analysis share, defined once.

Entropy of attention rows and rank correlation are computed the same way whether the
probabilities come from a synthetic Scan and Snap run or from SmolLM2, so the numbers in
docs/theory.md and docs/analysis.md are comparable.
"""
from __future__ import annotations

import torch


def entropy(p: torch.Tensor, dim: int = -1, eps: float = 1e-12) -> torch.Tensor:
    """Shannon entropy (nats) of probability vectors along `dim`: p (..., n, ...) -> (...) without `dim`.

    Computed as -sum p log(p + eps), so zero entries contribute 0 (JoMA uses eps = 1e-8).
    """
    return -(p * (p + eps).log()).sum(dim)


def centred_cosine(a: torch.Tensor, b: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Normalised correlation NC(a, b): cosine after removing each vector's mean. a, b: (..., n) -> (...)."""
    a = a - a.mean(dim, keepdim=True)
    b = b - b.mean(dim, keepdim=True)
    return (a * b).sum(dim) / (a.norm(dim=dim) * b.norm(dim=dim)).clamp_min(1e-12)


def spearman(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Rank correlation along the last axis: x, y (..., n) -> (...). Ties broken by order (no average ranks)."""
    rx = x.argsort(-1).argsort(-1).to(torch.float64)
    ry = y.argsort(-1).argsort(-1).to(torch.float64)
    return centred_cosine(rx, ry)
