"""The few statistics the theory lab and the real-model analysis share, defined once.

Entropy of attention rows and rank correlation are computed the same way whether the
probabilities come from a synthetic Scan and Snap run or from SmolLM2, so the numbers in
docs/theory.md and docs/analysis.md are comparable.
"""
from __future__ import annotations

import torch

from attnlab.errors import AttnlabError


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


def paired_difference(x: list[float], y: list[float], resamples: int = 10000, seed: int = 0) -> dict:
    """Paired comparison of two methods scored on the same samples: x[i] - y[i].

    Returns the mean difference, its 95% percentile-bootstrap interval (samples resampled with
    replacement, `seed`ed), wins/losses/ties, and the exact two-sided sign-test p (ties dropped):
    the way to say "A beats B by d points" when each sample's score is noisy but shared by both.
    """
    import math
    import random
    if len(x) != len(y) or not x:
        raise AttnlabError(f"paired_difference needs two equally long, non-empty lists, got {len(x)} and {len(y)}")
    d = [a - b for a, b in zip(x, y)]
    n = len(d)
    rng = random.Random(seed)
    means = sorted(sum(d[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    wins, losses = sum(v > 0 for v in d), sum(v < 0 for v in d)
    m = wins + losses
    tail = sum(math.comb(m, k) for k in range(min(wins, losses) + 1)) / 2 ** m if m else 1.0
    return {"n": n, "mean": sum(d) / n, "lo": means[int(0.025 * resamples)], "hi": means[int(0.975 * resamples) - 1],
            "wins": wins, "losses": losses, "ties": n - m, "sign_p": min(1.0, 2 * tail)}
