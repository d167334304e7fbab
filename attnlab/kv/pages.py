"""Quest's page summaries: per page of PAGE cache slots and per KV head, the per-channel min and max of the keys.

Why: Quest (Tang et al., ICML 2024) keeps every key but reads, per decode step, only the pages whose
upper bound on q.k could be large. The bound needs, per page, the smallest and largest value of each key
channel; the cache keeps them (over the keys as stored: rotated, float16 or int8-dequantised) and the
network's decode step picks the pages (`attnlab.model.quest`). The spec lives here because the cache
must know the page size when it is built.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from attnlab.errors import AttnlabError


@dataclass(frozen=True)
class QuestSpec:
    """budget: keys read per decode step, in tokens (whole pages: budget // page of them);
    page: slots per page (16, Quest's default); dense: the first layers, which read every key (Quest leaves
    its first two layers dense, where attention is not sparse); channels: 0 ranks pages by Quest's bound
    from the page's key min/max; R > 0 by the largest q.k of the page's keys, q the KV head's group of queries
    summed, on the R channels where its |q| is largest (SparQ's approximate scores, Ribar et al. 2024), read from
    a channel-major int8 copy of the keys the cache then keeps (`LayerKV.keys_t`, `channel_codes`)."""
    budget: int
    page: int = 16
    dense: int = 0
    channels: int = 0

    def __post_init__(self):
        for name in ("budget", "page"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise AttnlabError(f"quest {name} must be a positive integer, got {value!r}")
        for name in ("dense", "channels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise AttnlabError(f"quest {name} must be an integer >= 0, got {value!r}")
        if self.budget < 2 * self.page:
            raise AttnlabError(f"quest budget {self.budget} must hold at least two pages of {self.page} "
                               "(the first and the most recent page are always read)")

    @classmethod
    def parse(cls, text: "str | QuestSpec | None") -> "QuestSpec | None":
        """'quest:1024', 'quest:1024:16', 'quest:1024:16:2' (BUDGET:PAGE:DENSE), 'quest:1024:16:0:8'
        (BUDGET:PAGE:DENSE:CHANNELS), 'full' or None (= full attention) -> a spec."""
        if text is None or isinstance(text, QuestSpec):
            return text
        parts = str(text).strip().split(":")
        if parts == ["full"]:
            return None
        if parts[0] != "quest" or not 2 <= len(parts) <= 5:
            raise AttnlabError(f"unknown attention {text!r}; use quest:BUDGET[:PAGE[:DENSE[:CHANNELS]]] "
                               "(e.g. quest:1024) or full")
        try:
            numbers = [int(p) for p in parts[1:]]
        except ValueError:
            raise AttnlabError(f"attention {text!r}: BUDGET, PAGE, DENSE and CHANNELS must be integers") from None
        return cls(*numbers)

    def __str__(self) -> str:
        return f"quest:{self.budget}:{self.page}" + (f":{self.dense}" if self.dense or self.channels else "") + \
            (f":{self.channels}" if self.channels else "")


def summarize(keys: torch.Tensor, valid: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [B, H, n, D] (float32), valid [B, H, n] bool -> per-page channel min and max [B, H, ceil(n/page), D],
    float16 rounded outward (`outward`).

    Invalid slots (left padding) are left out; a page with no valid slot gets zeros (its slots are masked anyway)."""
    B, H, n, D = keys.shape
    pad = -n % page
    keys = torch.nn.functional.pad(keys, (0, 0, 0, pad)).view(B, H, -1, page, D)
    ok = torch.nn.functional.pad(valid, (0, pad)).view(B, H, -1, page, 1)
    lo = keys.masked_fill(~ok, float("inf")).amin(3)
    hi = keys.masked_fill(~ok, float("-inf")).amax(3)
    some = ok.any(3)
    return outward(torch.where(some, lo, 0.0), up=False), outward(torch.where(some, hi, 0.0), up=True)


def outward(x: torch.Tensor, up: bool) -> torch.Tensor:
    """float32 -> float16 rounded toward +inf (up: page maxima) or -inf (minima), so that bounds from the stored
    summaries stay upper bounds; the native step rounds its own the same way (F16C's directed rounding). Half
    the bytes of float32 summaries: at depth 16K the bounds read every page's summaries on every step."""
    h = x.half()
    wrong = h.float() < x if up else h.float() > x
    return torch.where(wrong, torch.nextafter(h, torch.full_like(h, float("inf") if up else float("-inf"))), h)


def channel_codes(keys: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [B, H, n, D] (float32), valid [B, H, n] -> keys_t [B, H, D, n] int8 and its scales [B, H, n] float32:
    each key divided by its own largest |channel| / 127 and rounded to nearest (even), zeros at invalid slots.

    Why int8: the copy is what CHANNELS costs in memory (SmolLM2: 6,120 bytes per token, against 11,520 in
    float16 and 23,040 for the float16 keys and values), and its scores only rank pages: with one scale per key
    RULER at 1/8 matched the float16 copy's (docs/kv.md). The native step rounds the same way (`add_key`),
    dividing in float32 as here."""
    keys = keys.masked_fill(~valid[..., None], 0.0)
    scale = keys.abs().amax(-1) / 127
    codes = torch.where(scale[..., None] > 0, keys / scale[..., None], 0.0).round().clamp(-127, 127)
    return codes.to(torch.int8).transpose(-1, -2), scale
