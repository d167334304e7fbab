"""Perplexity of a model on a token stream, in fixed windows with chunked prefill.

Windows are disjoint and each starts from an empty cache (the usual protocol for
a fixed-context model), so `window` must stay within the model's trained positions
to be fair; every token but the very first is scored once, each window's first
token being context only. Logits are reduced to NLL chunk by
chunk: the [tokens, vocab] matrix of a long window is never held whole.
"""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from attnlab.errors import AttnlabError


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits [B, T, V], targets [B, T] -> negative log-likelihood per token [B, T] (float32)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none").view(targets.shape)


@torch.inference_mode()
def perplexity(lm, ids: list[int] | torch.Tensor, window: int = 2048, chunk: int = 512, progress=None) -> dict:
    """-> {"ppl", "nll", "tokens", "seconds"} over ids (tokens = number scored = len(ids) - 1)."""
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    if ids.numel() < 2:
        raise AttnlabError(f"need at least 2 tokens to score, got {ids.numel()}")
    if window < 2 or chunk < 1:
        raise AttnlabError(f"window must be >= 2 and chunk >= 1, got window={window}, chunk={chunk}")
    total, count, start = 0.0, 0, time.perf_counter()
    for w0 in range(0, ids.numel() - 1, window):
        win = ids[w0:w0 + window + 1]  # +1: the last token is only a target
        if win.numel() < 2:
            break
        cache = lm.new_cache(capacity=win.numel())
        for c0 in range(0, win.numel() - 1, chunk):
            part = win[c0:min(c0 + chunk, win.numel() - 1)]
            logits = lm.forward(part[None], cache)
            nll = token_nll(logits, win[c0 + 1:c0 + 1 + part.numel()][None])
            total += float(nll.sum())
            count += part.numel()
            if progress is not None:
                progress(part.numel())
    mean = total / count
    return {"ppl": math.exp(mean), "nll": mean, "tokens": count, "seconds": time.perf_counter() - start}
