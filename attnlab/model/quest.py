"""Quest's page selection for one decode step (Tang et al., ICML 2024): which cache pages a query reads.

Why a bound: q.k = sum_c q_c k_c, and for k_c in [min_c, max_c] each term is at most
max(q_c min_c, q_c max_c). Summed over channels that bounds every key of a page from the page's
per-channel key min and max alone (kept by the cache, `attnlab.kv.pages`), so a step can rank pages
without reading their keys, then attend exactly over the best ones. Under grouped-query attention the
heads of a group read one KV head, so they must agree on its pages: a page's score is the largest bound
over the group's heads (a page is read if any head of the group could attend to it strongly).
"""
from __future__ import annotations

import torch


def page_bounds(q: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, 1, D]; page_min, page_max [B, Hkv, P, D] -> the upper bound of q.k per KV head and page [B, Hkv, P]
    (the largest over the query heads of the KV head's group)."""
    B, Hq, _, D = q.shape
    Hkv = page_min.shape[1]
    qg = q.float().reshape(B, Hkv, Hq // Hkv, 1, D)
    per_head = torch.maximum(qg * page_min[:, :, None], qg * page_max[:, :, None]).sum(-1)  # [B, Hkv, G, P]
    return per_head.amax(2)


def select_pages(bounds: torch.Tensor, budget: int, page: int) -> torch.Tensor | None:
    """bounds [B, Hkv, P] -> chosen pages [B, Hkv, P] bool: the first (sink) and the last (most recent) page,
    then the highest bounds, budget // page pages in all; None when every page fits in the budget."""
    P = bounds.shape[-1]
    k = budget // page
    if P <= k:
        return None
    ranked = bounds.clone()
    ranked[..., 0] = ranked[..., -1] = float("inf")
    top = ranked.topk(k, dim=-1).indices
    return torch.zeros_like(bounds, dtype=torch.bool).scatter_(-1, top, True)


def quest_mask(q: torch.Tensor, kv, budget: int, n: int, mask):
    """The key mask of one decode step over a cache layer `kv` with page summaries (`LayerKV.page_min/page_max`):
    the cache's own mask (None or bool [B, Hkv, 1, n]) narrowed to the chosen pages' slots."""
    chosen = select_pages(page_bounds(q, kv.page_min, kv.page_max), budget, kv.page)
    if chosen is None:
        return mask
    slots = chosen.repeat_interleave(kv.page, dim=-1)[..., :n][:, :, None]  # [B, Hkv, 1, n]
    return slots if mask is None else mask & slots
