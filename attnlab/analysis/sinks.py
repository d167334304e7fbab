"""StreamingLLM's sink experiment: does the *position* of the first tokens matter, or their content?

A streaming cache that keeps `sinks` initial tokens plus the last `window` tokens is
exactly a banded attention mask applied in every layer: query t sees keys
{0..sinks-1} and {t-window+1..t}, and the keys it sees were themselves computed under
the same rule (as they would have been when decoded). So the whole stream is scored
in one forward with that mask, independently of any cache policy:

- full:     plain causal attention (reference);
- keep:     first `sinks` tokens + window (StreamingLLM);
- drop:     window only (the initial tokens evicted);
- replace:  the first `sinks` tokens replaced by another token (a newline) + window.

Positions are the original ones; RoPE only sees query-key distances, all within the
model's trained context here. Only queries t >= window + sinks are scored, i.e. once
the window has slid past the initial tokens.
"""
from __future__ import annotations

import math

import torch

from attnlab.errors import AttnlabError
from attnlab.eval.perplexity import token_nll
from attnlab.model.llama import Pass

CASES = ("full", "keep", "drop", "replace")


def band_mask(T: int, window: int, sinks: int) -> torch.Tensor:
    """[T, T] bool: query t attends to key j iff j <= t and (t - j < window or j < sinks)."""
    t = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    return (j <= t) & ((t - j < window) | (j < sinks))


@torch.no_grad()
def forward_masked(model, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The network's own forward under an arbitrary key mask. ids [B, T]; mask [T, T] bool
    (True = attend) or None for causal. Returns logits [B, T, vocab]."""
    return model(ids, Pass.full(model.rope, ids, mask))


def sink_experiment(model, ids, sinks: int = 4, window: int = 256, replace_id: int = 198,
                    progress=None) -> dict:
    """Perplexity of ids[window + sinks + 1:] under the four CASES. ids: 1-D token ids.

    Returns {"cases": {case: {"ppl", "nll", "tokens"}}, "nll_curve": {case: [per-position nll]},
    "window", "sinks", "scored_from", "replace_id"}.
    """
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    T = ids.numel()
    start = window + sinks
    if sinks < 1 or window < 1:
        raise AttnlabError(f"sinks and window must be >= 1, got sinks={sinks}, window={window}")
    if T < start + 2:
        raise AttnlabError(f"need more than window + sinks + 1 = {start + 1} tokens, got {T}")
    replaced = ids.clone()
    replaced[:sinks] = replace_id
    setups = {"full": (ids, None), "keep": (ids, band_mask(T, window, sinks)),
              "drop": (ids, band_mask(T, window, 0)), "replace": (replaced, band_mask(T, window, sinks))}
    cases, curves = {}, {}
    for name in CASES:
        seq, mask = setups[name]
        logits = forward_masked(model, seq[None], mask)
        nll = token_nll(logits[:, start:-1], seq[None, start + 1:])[0]
        mean = float(nll.mean())
        cases[name] = {"ppl": math.exp(mean), "nll": mean, "tokens": nll.numel()}
        curves[name] = nll.tolist()
        if progress is not None:
            progress(1)
    return {"cases": cases, "nll_curve": curves, "window": window, "sinks": sinks,
            "scored_from": start + 1, "replace_id": replace_id, "tokens": T}
