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
    qg = q.float().reshape(B, Hkv, Hq // Hkv, D).transpose(-1, -2)  # [B, Hkv, D, G]
    # max(q_c min_c, q_c max_c) is q_c max_c where q_c >= 0 and q_c min_c where not: two matmuls
    per_head = page_max.float() @ qg.clamp(min=0) + page_min.float() @ qg.clamp(max=0)  # [B, Hkv, P, G]
    return per_head.amax(-1)


def channel_scores(q: torch.Tensor, keys_t: torch.Tensor, keys_s: torch.Tensor, channels: int, page: int) -> torch.Tensor:
    """q [B, Hq, 1, D]; keys_t [B, Hkv, D, n] (the keys channel-major, int8) and keys_s [B, Hkv, n] (each key's
    scale, `attnlab.kv.pages.channel_codes`) -> per KV head and page the largest approximate score of the page's
    keys [B, Hkv, P].

    Why: the bound adds up per-channel extremes that different keys reach, so on a small model whose keys
    wander (RoPE turns most channel pairs within a page) it ranks pages far from their true best key
    (docs/kv.md: 16.1 RULER points of full's 36.8 at 1/8, against 36.5 for pages ranked by their true best key).
    SparQ's step 1 (Ribar et al. 2024) approximates each key's q.k on the few channels that carry most of it.
    Here the query is the KV head's group summed (the keys are shared; one product per key instead of one per
    query head, and the scoring is bound by its arithmetic), the channels the R of largest |sum| (ties: the
    lower channel), a key's score its codes' dot product times its scale, a page's its best key's. Measured
    against the max over the group's heads: docs/kv.md."""
    B, Hq, _, D = q.shape
    Hkv, n = keys_t.shape[1], keys_t.shape[3]
    qg = q.float().reshape(B, Hkv, Hq // Hkv, D)
    summed = qg[:, :, 0]
    for g in range(1, Hq // Hkv):  # in head order, as the native step sums them
        summed = summed + qg[:, :, g]
    chosen = summed.abs().sort(dim=-1, descending=True, stable=True).indices[..., :channels]  # [B, Hkv, R]
    rows = keys_t.gather(2, chosen[..., None].expand(-1, -1, -1, n)).float()  # [B, Hkv, R, n]
    return page_best((summed.gather(-1, chosen)[:, :, None] @ rows)[:, :, 0] * keys_s, page)


def page_best(s: torch.Tensor, page: int) -> torch.Tensor:
    """Per-key scores s [B, Hkv, n] -> each page's largest [B, Hkv, ceil(n / page)] (the last page may be partial)."""
    n = s.shape[-1]
    P = -(-n // page)
    return torch.nn.functional.pad(s, (0, P * page - n), value=float("-inf")).view(*s.shape[:2], P, page).amax(-1)


def select_pages(bounds: torch.Tensor, budget: int, page: int) -> torch.Tensor | None:
    """bounds [B, Hkv, P] -> the pages to read [B, Hkv, budget // page], ascending: the first (sink) and the last
    (most recent) page, then the highest bounds; None when every page fits in the budget."""
    P = bounds.shape[-1]
    k = budget // page
    if P <= k:
        return None
    ranked = bounds.clone()
    ranked[..., 0] = ranked[..., -1] = float("inf")
    return ranked.topk(k, dim=-1).indices.sort(-1).values


def read_pages(q: torch.Tensor, kv, spec, k, v, mask):
    """One decode step's keys and values narrowed to Quest's pages (exact attention over them follows).

    q [B, Hq, 1, D]; kv: a cache layer with page summaries (`LayerKV.page`, `page_min`, `page_max`; `keys_t` under
    spec.channels) and `read`; spec: the `QuestSpec`; k, v, mask: what `kv.update` returned (K, V [B, Hkv, n, D]
    or int8 pairs; mask None or bool [B, Hkv, 1, n]).
    Returns (k, v, mask, slots): the chosen slots' rows, in cache order, and slots [B, Hkv, m] (None: all read).
    Every KV head reads the same number m of slots: the same number of pages, the last (partial) one included."""
    budget = spec.budget
    if -(-kv.paged // kv.page) <= budget // kv.page:  # every page fits: nothing to rank
        return k, v, mask, None
    if spec.channels:
        kv.keep_channel_keys()
        scores = channel_scores(q, kv.keys_t[..., :kv.paged], kv.keys_s[..., :kv.paged], spec.channels, kv.page)
    else:
        scores = page_bounds(q, kv.page_min, kv.page_max)
    return read_chosen(select_pages(scores, budget, kv.page), kv, k, v, mask)


def read_chosen(pages: torch.Tensor | None, kv, k, v, mask):
    """`read_pages`'s result for the chosen pages [B, Hkv, k] (None: every page)."""
    if pages is None:
        return k, v, mask, None
    n = (k[0] if isinstance(k, tuple) else k).shape[2]
    last = n - (kv.page_min.shape[2] - 1) * kv.page  # tokens in the most recent page
    m = (pages.shape[-1] - 1) * kv.page + last
    slots = (pages[..., None] * kv.page + torch.arange(kv.page)).flatten(-2)[..., :m]
    mask = None if mask is None else mask.gather(3, slots[:, :, None])
    return (*kv.read(slots), mask, slots)


def spread(probs: torch.Tensor, slots: torch.Tensor, n: int) -> torch.Tensor:
    """Attention probabilities over the read slots [B, Hq, 1, m] -> over the whole cache [B, Hq, 1, n] (zeros
    elsewhere), what an observer scoring by attention (H2O) expects."""
    G = probs.shape[1] // slots.shape[1]
    return probs.new_zeros(*probs.shape[:3], n).scatter_(-1, slots.repeat_interleave(G, 1)[:, :, None], probs)
