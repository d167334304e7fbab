"""Per-layer, per-head statistics of attention over a real text.

Attention probabilities come from the engine's own forward pass: a `Recorder` is an
observer of the pass (see `attnlab.model.llama.Pass`) that asks for the
probabilities, so `Attention.forward` hands it every layer's [B, Hq, T, L] map.
Statistics are reduced layer by layer as the maps arrive, so a 30-layer model over
1-2K tokens never holds all maps at once.

Definitions (query t sees keys 0..t; a[t, j] its attention on key j):
- sink mass k:      mean over queries t >= k of sum_{j<k} a[t, j]
- entropy:          mean over queries of -sum_j a log(a + 1e-8)  (nats); also divided
                    by log(t + 1), the entropy of uniform causal attention (0..1)
- top-p share:      mean over queries t >= min_query of the mass of the ceil(p (t+1))
                    largest a[t, :]   (p = 5%, 20%)
- first-in-top:     fraction of those queries whose top-5% keys include key 0
- received:         per key j, mean over queries t >= j of a[t, j] (H2O's accumulated
                    score, normalised by how many queries can see j)
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from attnlab.errors import AttnlabError
from attnlab.model.llama import Pass
from attnlab.stats import entropy
from attnlab.stats import spearman as rank_correlation

EPS = 1e-8
TOP_FRACTIONS = (0.05, 0.20)


@dataclass
class Recorder:
    """An observer of the forward pass that receives every layer's attention probabilities.

    on_probs(layer, probs) is called with probs [B, Hq, T, L] (float32) per layer.
    """
    on_probs: Callable[[int, torch.Tensor], None]
    needs_probs: bool = True

    def record(self, i: int, name: str, t: torch.Tensor) -> None:
        if name == "probs":
            self.on_probs(i, t)


def run_with_probs(model, ids: torch.Tensor, on_probs) -> torch.Tensor:
    """One causal forward of ids [B, T] from position 0 whose recorder gets each layer's
    probs [B, Hq, T, T]. Returns logits [B, T, vocab]."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None]
    with torch.no_grad():
        return model(ids, Pass.full(model.rope, ids, observers=[Recorder(on_probs)]))


def attention_maps(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """All layers' attention probabilities: list (per layer) of [B, Hq, T, T]. Small inputs only."""
    maps: dict[int, torch.Tensor] = {}
    run_with_probs(model, ids, lambda i, p: maps.__setitem__(i, p.detach().clone()))
    return [maps[i] for i in range(len(maps))]


def row_entropy(probs: torch.Tensor) -> torch.Tensor:
    """probs [..., T, L] -> entropy of each query row [..., T] in nats (log(a + 1e-8), as JoMA)."""
    return entropy(probs, -1, EPS)


def head_stats(probs: torch.Tensor, sinks: tuple[int, ...] = (1, 4), min_query: int = 16) -> dict:
    """Statistics of one layer. probs [B, H, T, T] (causal) -> dict of per-head tensors [H]
    (plus "received" [H, T]); every number is averaged over the batch."""
    B, H, T, L = probs.shape
    if T != L:
        raise AttnlabError(f"expected square causal maps, got T={T}, L={L}")
    t = torch.arange(T)
    out: dict[str, torch.Tensor] = {}
    for k in sinks:
        rows = t >= k
        out[f"sink_mass_{k}"] = probs[:, :, rows, :k].sum(-1).mean((0, 2)) if rows.any() else torch.full((H,), float("nan"))
    ent = row_entropy(probs)                                   # [B, H, T]
    out["entropy"] = ent.mean((0, 2))
    uniform = torch.log(t[1:].float() + 1)                    # query 0 has one key: skip it
    out["entropy_normalised"] = (ent[:, :, 1:] / uniform).mean((0, 2))
    rows = t >= min(min_query, T - 1)
    sorted_p = probs[:, :, rows].sort(-1, descending=True).values   # [B, H, R, T]
    cum = sorted_p.cumsum(-1)
    visible = t[rows] + 1                                      # keys each selected query sees
    for frac in TOP_FRACTIONS:
        n_top = torch.ceil(frac * visible.float()).long().clamp_min(1)   # [R]
        share = cum.gather(-1, (n_top - 1).view(1, 1, -1, 1).expand(B, H, -1, 1)).squeeze(-1)
        out[f"top{round(frac * 100)}_share"] = share.mean((0, 2))
    n5 = torch.ceil(TOP_FRACTIONS[0] * visible.float()).long().clamp_min(1)
    kth = sorted_p.gather(-1, (n5 - 1).view(1, 1, -1, 1).expand(B, H, -1, 1)).squeeze(-1)
    out["first_in_top5"] = (probs[:, :, rows, 0] >= kth).float().mean((0, 2))
    seen_by = (T - t).float()                                  # queries that can attend to key j
    out["received"] = probs.sum(2).mean(0) / seen_by           # [H, T]
    return out


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Rank correlation of two 1-D tensors, as a float (attnlab.stats.spearman)."""
    return float(rank_correlation(x, y))


@dataclass
class Anatomy:
    """Result of `analyze`: per-layer x per-head arrays plus the chosen attention map."""
    stats: dict[str, torch.Tensor] = field(default_factory=dict)   # name -> [layers, heads]
    received: torch.Tensor | None = None                              # [layers, T] mean over heads
    attention_map: torch.Tensor | None = None                         # [T, T] of (map_layer, map_head)


def analyze_ids(model, ids: torch.Tensor, sinks: tuple[int, ...] = (1, 4), map_layer: int = -1,
                map_head: int = 0, min_query: int = 16, progress=None) -> Anatomy:
    """Run ids [T] (or [B, T]) through model and reduce each layer's attention as it arrives."""
    n_layers = model.cfg.n_layers
    layer = map_layer % n_layers
    per_layer: dict[int, dict] = {}
    res = Anatomy()

    def on_probs(i, probs):
        s = head_stats(probs, sinks, min_query)
        per_layer[i] = s
        if i == layer:
            res.attention_map = probs[0, map_head].clone()
        if progress is not None:
            progress(1)

    run_with_probs(model, ids, on_probs)
    keys = [k for k in per_layer[0] if k != "received"]
    res.stats = {k: torch.stack([per_layer[i][k] for i in range(n_layers)]) for k in keys}
    res.received = torch.stack([per_layer[i]["received"].mean(0) for i in range(n_layers)])
    return res


def frequency_relation(received: torch.Tensor, ids: torch.Tensor, text_ids: list[int],
                       skip: int = 4, window: int = 32) -> dict:
    """How the attention a key receives relates to its token's statistics (H2O's observation).

    received [layers, T] (mean attention received per key); ids [T] the analysed tokens;
    text_ids the whole text's tokens (frequencies are counted there). The first `skip`
    keys (sinks) and the last `window` keys (seen by few queries) are left out.
    Returns per-layer Spearman correlations with log-frequency and with co-occurrence,
    and both for the mean over layers. Co-occurrence of position j: how many of the token
    types in the `window` tokens after j also followed another occurrence of the same token
    within `window` tokens (pairs seen at least twice in the analysed text).
    """
    ids = torch.as_tensor(ids).flatten()
    T = ids.numel()
    counts = torch.bincount(torch.as_tensor(text_ids), minlength=int(ids.max()) + 1).float()
    freq = counts[ids].log1p()
    pair: dict[tuple[int, int], int] = {}
    flat = ids.tolist()
    for j in range(T):
        for x in set(flat[j + 1:j + 1 + window]):
            pair[(flat[j], x)] = pair.get((flat[j], x), 0) + 1
    cooc = torch.tensor([sum(1 for x in set(flat[j + 1:j + 1 + window]) if pair[(flat[j], x)] >= 2)
                         for j in range(T)], dtype=torch.float)
    sel = slice(skip, max(skip + 2, T - window))
    per_freq = [spearman(r[sel], freq[sel]) for r in received]
    per_cooc = [spearman(r[sel], cooc[sel]) for r in received]
    mean_r = received.mean(0)
    return {"spearman_frequency_per_layer": per_freq, "spearman_cooccurrence_per_layer": per_cooc,
            "spearman_frequency_all_layers": spearman(mean_r[sel], freq[sel]),
            "spearman_cooccurrence_all_layers": spearman(mean_r[sel], cooc[sel]),
            "keys_used": len(range(T)[sel]), "cooccurrence_window": window}


def summarise(res: Anatomy) -> dict:
    """Layer means (over heads) of every statistic, and the whole-model means."""
    out = {}
    for k, v in res.stats.items():
        out[k] = {"per_layer": v.mean(1).tolist(), "model_mean": float(v.mean()),
                  "per_layer_head": v.tolist()}
    return out
