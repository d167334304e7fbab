"""Perplexity of a model on a token stream, in fixed windows with chunked prefill.

Windows are disjoint and each starts from an empty cache (the usual protocol for
a fixed-context model), so `window` must stay within the model's trained positions
to be fair; every token but the very first is scored once, each window's first
token being context only. Logits are reduced to NLL chunk by
chunk: the [tokens, vocab] matrix of a long window is never held whole.

`llamacpp_perplexity` scores instead as llama.cpp's `llama-perplexity` does (only the second half of each
n_ctx chunk, BOS in front of each), so its number and llama.cpp's are the same quantity on the same tokens.
"""
from __future__ import annotations

import math
import time
from types import SimpleNamespace

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


def adds_bos(tokenizer) -> int | None:
    """The BOS id when the tokenizer prepends one to encoded text (llama.cpp's add_bos), else None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    ids = tokenizer.encode("a", add_special_tokens=True)
    return bos if len(ids) > len(tokenizer.encode("a", add_special_tokens=False)) and ids[0] == bos else None


@torch.inference_mode()
def llamacpp_perplexity(lm, ids: list[int] | torch.Tensor, n_ctx: int = 512, chunks: int | None = None,
                        path: str = "prefill", bos: int | None = None, progress=None) -> dict:
    """Perplexity scored as `llama-perplexity -c n_ctx [--chunks N]` scores it, so the two are comparable.

    ids: the text tokenized as llama.cpp does (with the BOS where the vocabulary adds one). It is cut into
    disjoint n_ctx-token chunks (the remainder dropped); each chunk is evaluated from an empty cache with its
    first token replaced by `bos` (llama.cpp does so when the vocabulary adds a BOS); only the second half
    is scored (logits at positions n_ctx/2 .. n_ctx-2), and the result is exp of the mean NLL over all
    scored tokens. path "prefill": each chunk as one batch (as llama.cpp runs it); "decode": the first half
    prefilled, the rest one token per step. Like llama-perplexity, fewer than 2 * n_ctx tokens is an error.
    -> {"ppl", "nll", "tokens", "chunks", "n_ctx", "seconds"}"""
    from attnlab.eval.decode_kl import chunks_of, scored_logprobs

    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    if ids.numel() < 2 * n_ctx:
        raise AttnlabError(f"llama-perplexity scoring needs at least 2 * n_ctx = {2 * n_ctx} tokens, "
                           f"the text has {ids.numel()}")
    parts = chunks_of(ids, n_ctx, chunks)
    first, total, count, start = n_ctx // 2, 0.0, 0, time.perf_counter()
    bar = SimpleNamespace(update=progress) if progress is not None else None
    for chunk in parts:
        if bos is not None:
            chunk = chunk.clone()
            chunk[0] = bos
        logprobs = scored_logprobs(lm, chunk, path, bar)
        total -= float(logprobs.gather(1, chunk[first + 1:, None]).sum())
        count += n_ctx - 1 - first
    mean = total / count
    return {"ppl": math.exp(mean), "nll": mean, "tokens": count, "chunks": len(parts), "n_ctx": n_ctx,
            "seconds": time.perf_counter() - start}
