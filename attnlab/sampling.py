"""Next-token sampling: greedy, temperature, top-k, top-p (nucleus), seeded.

One rule for values too small to sample with (they would divide logits into infinities, or a
top_p that rounds to 0 in float32 would drop every token, and the probabilities become NaN):
a temperature below TEMPERATURE_FLOOR or a top_p below TOP_P_FLOOR means greedy (the top token).
Should the probabilities still not be finite, the row takes its top token as well.
"""
from __future__ import annotations

import math

import torch

from attnlab.errors import AttnlabError

TEMPERATURE_FLOOR = 1e-3  # below: greedy (at 1e-3 a logit gap of 0.01 is already a factor e^10)
TOP_P_FLOOR = 1e-6        # below: greedy (the smallest prefix reaching top_p is the top token then)


def top_token(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dimension, as `Tensor.argmax` (the first of equal maxima; a NaN counts as the
    largest), by numpy where the logits are float32 on the CPU: a decode step's [8, 49152] logits in 24 us
    against torch's 570 (one thread), and greedy decoding takes one per token."""
    if logits.dtype == torch.float32 and logits.device.type == "cpu" and not logits.requires_grad:
        return torch.as_tensor(logits.numpy().argmax(-1))
    return logits.argmax(-1)


class Sampler:
    """Turns logits [B, V] into token ids [B]. temperature 0 means greedy (argmax)."""

    def __init__(self, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None):
        if not (math.isfinite(temperature) and temperature >= 0):
            raise AttnlabError(f"temperature must be a finite number >= 0, got {temperature}")
        if top_k < 0:
            raise AttnlabError(f"top_k must be >= 0, got {top_k}")
        if not 0.0 < top_p <= 1.0:  # NaN fails too
            raise AttnlabError(f"top_p must be in (0, 1], got {top_p}")
        if temperature < TEMPERATURE_FLOOR or top_p < TOP_P_FLOOR:
            temperature = 0.0
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()  # fresh entropy for this sampler only; torch.seed() would reseed the global RNG
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.temperature == 0:
            return top_token(logits)
        return torch.multinomial(self.probs(logits), 1, generator=self.generator).squeeze(-1)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution [..., V] this sampler draws from (temperature > 0): what speculative sampling's
        acceptance test compares the target's and the draft's choices by."""
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
        probs = logits.softmax(-1)
        bad = ~torch.isfinite(probs).all(-1)
        if bool(bad.any()):  # e.g. logits that are themselves inf or NaN: the top token, never a crash
            probs[bad] = torch.nn.functional.one_hot(logits[bad].nan_to_num(-float("inf")).argmax(-1),
                                                     probs.shape[-1]).to(probs.dtype)
        return probs
