"""Streaming perplexity: feed a long text token by token through a bounded KV cache.

Why this exists: the claims of StreamingLLM and H2O are about what a model
predicts when its cache keeps only some tokens, measured on the *same* tokens
as full attention. `stream_nll` scores every token of S parallel passages
([S, N] ids, one cache row each, every row keeping its own tokens) and returns
the per-token NLL, so any two policies can be compared token by token.

Runs are resumable: every `save_every` tokens the NLL so far and the whole cache
state (slots, positions, policy scores) are written atomically; a rerun with the
same checkpoint path continues where it stopped. `full` may instead be scored by
chunked prefill (`mode="prefill"`), which gives the same logits as token-by-token
decoding with full attention (tested) at a fraction of the time.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from attnlab.errors import AttnlabError
from attnlab.eval.perplexity import token_nll
from attnlab.io import save_figure, write_atomic
from attnlab.kv.cache import cache_state, load_cache_state
from attnlab.kv.policies import Full, Policy


@torch.inference_mode()
def stream_nll(lm, ids: torch.Tensor, policy: Policy, mode: str = "decode", chunk: int = 256, progress=None,
               checkpoint: str | Path | None = None, save_every: int = 1024) -> dict:
    """Score ids [S, N]: NLL of token t+1 given the stream up to t, for every t.

    policy must be resolved (token budget). mode "decode" feeds one token per step (what a
    bounded cache sees in deployment); "prefill" feeds `chunk` tokens per step (for `full`, the
    same logits); "chunk" streams an evicting policy `chunk` tokens at a time, evicting between
    chunks (an approximation of decode: a query may see up to budget + chunk tokens).
    Returns {"nll": [S, N-1] float32, "seconds", "kv_bytes" (allocated at the end),
    "peak_tokens" (most slots held after any step)}.
    """
    ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None]
    S, N = ids.shape
    if N < 2:
        raise AttnlabError(f"need at least 2 tokens per stream, got {N}")
    if mode not in ("decode", "prefill", "chunk"):
        raise AttnlabError(f"unknown mode {mode!r}; choose from decode, prefill, chunk")
    if mode == "prefill" and not isinstance(policy, Full):
        raise AttnlabError("prefill mode is exact only for the full cache; use mode='chunk' to stream an evicting "
                         "policy in chunks (eviction between chunks)")
    if mode == "chunk" and policy.capacity is not None and policy.chunk < chunk:
        raise AttnlabError(f"the policy reserves {policy.chunk} slots per chunk, chunk is {chunk}")
    step = 1 if mode == "decode" else chunk
    cache = lm.new_cache(S, capacity=min(N, 4096), policy=policy)
    nll = torch.zeros(S, N - 1)
    t, seconds, peak = 0, 0.0, 0
    ckpt = Path(checkpoint) if checkpoint else None
    if ckpt is not None and ckpt.exists():
        try:
            state = torch.load(ckpt, weights_only=True)  # plain tensors and numbers: no unpickling of code
            t, seconds, peak = int(state["t"]), float(state["seconds"]), int(state["peak_tokens"])
            if not 0 < t < N - 1:
                raise AttnlabError(f"position {t} outside this run's {N - 1} tokens")
            nll[:, :t] = state["nll"]
            load_cache_state(cache, state["cache"])
        except Exception as e:  # torch.load and the state raise many types on a damaged file
            raise AttnlabError(f"checkpoint {ckpt} is corrupt or from another run ({type(e).__name__}: "
                             f"{' '.join(str(e).split())[:200]}); delete it (stream --force) to start over") from None
        if progress is not None:
            progress(S * t)
    last_save, start = t, time.perf_counter() - seconds
    while t < N - 1:
        T = min(step, N - 1 - t)
        logits = lm.forward(ids[:, t:t + T], cache)
        nll[:, t:t + T] = token_nll(logits, ids[:, t + 1:t + 1 + T])
        t += T
        peak = max(peak, len(cache))
        if progress is not None:
            progress(S * T)
        if ckpt is not None and mode != "prefill" and t - last_save >= save_every and t < N - 1:
            state = {"t": t, "nll": nll[:, :t].clone(), "seconds": time.perf_counter() - start,
                     "peak_tokens": peak, "cache": cache_state(cache)}
            write_atomic(ckpt, lambda tmp: torch.save(state, tmp))
            last_save = t
    seconds = time.perf_counter() - start
    return {"nll": nll, "seconds": seconds, "kv_bytes": cache.nbytes(), "peak_tokens": peak}


def summarize(nll: torch.Tensor) -> dict:
    """Mean NLL and perplexity of a [S, T] NLL tensor."""
    mean = float(nll.double().mean())
    return {"nll": mean, "ppl": math.exp(mean)}


def bins(nll: torch.Tensor, size: int) -> list[dict]:
    """Perplexity of consecutive position bins of `size` tokens (averaged over streams)."""
    out = []
    for a in range(0, nll.shape[1], size):
        part = nll[:, a:a + size]
        out.append({"start": a + 1, "end": a + part.shape[1], **summarize(part)})
    return out


def paired(nll_a: torch.Tensor, nll_b: torch.Tensor, start: int = 0, end: int | None = None,
           block: int = 256) -> dict:
    """Paired comparison of two runs on the same tokens [start, end): mean NLL(a) - NLL(b) with a
    standard error from `block`-token blocks (neighbouring tokens are correlated)."""
    d = (nll_a[:, start:end] - nll_b[:, start:end]).double()
    blocks = torch.stack([d[:, i:i + block].mean() for i in range(0, d.shape[1] - block + 1, block)]) \
        if d.shape[1] >= 2 * block else d.mean(0)
    se = float(blocks.std() / math.sqrt(blocks.numel())) if blocks.numel() > 1 else float("nan")
    return {"tokens": d.numel(), "mean_diff": float(d.mean()), "se": se,
            "ppl_ratio": math.exp(float(d.mean()))}


def moving_average(x: torch.Tensor, width: int) -> torch.Tensor:
    """[T] -> [T - width + 1] trailing mean."""
    if x.numel() < width:
        return x.clone()
    c = torch.cat([torch.zeros(1, dtype=torch.float64), x.double().cumsum(0)])
    return ((c[width:] - c[:-width]) / width).float()


def plot_positions(runs: list[dict], path: str | Path, width: int = 256, trained: int | None = None,
                   title: str = "") -> None:
    """StreamingLLM's figure: NLL (moving average over `width` tokens) against stream position."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.2))
    for r in runs:
        y = moving_average(torch.as_tensor(r["nll_tokens"]).mean(0), width)
        x = torch.arange(y.numel()) + width
        ax.plot(x.numpy(), y.numpy(), lw=1.2, label=f"{r['policy']} ({r['budget']}, ppl {r['ppl']:.1f})")
    if trained:
        ax.axvline(trained, color="gray", ls=":", lw=1)
        ax.text(trained, ax.get_ylim()[1], " trained length", va="top", fontsize=8, color="gray")
    ax.set_xlabel("position in stream (tokens)")
    ax.set_ylabel(f"NLL (moving average, {width} tokens)")
    ax.set_title(title or "streaming NLL by position")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    save_figure(fig, path, dpi=130)


def plot_budgets(runs: list[dict], path: str | Path, title: str = "") -> None:
    """H2O's figure: perplexity against the KV budget (share of the stream) for every policy."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    by_policy: dict[str, list] = {}
    for r in runs:
        if r["policy"] == "full":
            ax.axhline(r["ppl"], color="black", ls="--", lw=1, label=f"full ({r['ppl']:.1f})")
        else:
            by_policy.setdefault(r["policy"], []).append((r["budget_fraction"], r["ppl"]))
    for name, pts in by_policy.items():
        pts.sort()
        ax.plot([100 * b for b, _ in pts], [p for _, p in pts], marker="o", label=name)
    ax.set_xlabel("KV budget (% of the stream)")
    ax.set_ylabel("perplexity")
    ax.set_yscale("log")
    ax.set_title(title or "perplexity against KV budget")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    save_figure(fig, path, dpi=130)
