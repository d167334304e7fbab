"""Next-token sampling: greedy, temperature, top-k, top-p (nucleus), seeded."""
from __future__ import annotations

import math

import torch

from attnlab.errors import AttnlabError


class Sampler:
    """Turns logits [B, V] into token ids [B]. temperature 0 means greedy (argmax)."""

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None):
        if not (math.isfinite(temperature) and temperature >= 0):
            raise AttnlabError(f"temperature must be a finite number >= 0, got {temperature}")
        if top_k < 0:
            raise AttnlabError(f"top_k must be >= 0, got {top_k}")
        if not 0.0 < top_p <= 1.0:  # NaN fails too
            raise AttnlabError(f"top_p must be in (0, 1], got {top_p}")
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()  # fresh entropy for this sampler only; torch.seed() would reseed the global RNG
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.temperature == 0:
            return logits.argmax(-1)
        logits = logits.float() / self.temperature
        if self.top_k:
            kth = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, order = logits.sort(-1, descending=True)
            cum = sorted_logits.softmax(-1).cumsum(-1)
            drop = cum - sorted_logits.softmax(-1) >= self.top_p  # keep the smallest prefix reaching top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
        return torch.multinomial(logits.softmax(-1), 1, generator=self.generator).squeeze(-1)
