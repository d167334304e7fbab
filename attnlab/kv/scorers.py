"""KV methods, each written once as a scorer: which cached pairs deserve to stay (higher = keep).

Why: SnapKV, TOVA, H2O, StreamingLLM, knorm and expected attention are each used two ways, as a policy
that evicts while a stream decodes (`attnlab.kv.policies`: a scorer plus when to evict) and as a press that
compresses a prefilled cache once (`attnlab.kv.press`: a scorer plus a ratio). Written twice, the copies
drifted; here each is one dataclass (kvpress's shape): its parameters are fields checked in __post_init__,
`score(o)` -> [B, H_kv, n], and `sinks(keep)` / `recent(keep)`, how many leading and trailing positions it
always keeps out of a quota of `keep` pairs. Policy and press hand it the same evidence (`Observed`) and keep
slots with the same `choose` (top-k after forcing the kept-always slots; whole pages on request).

Evidence a scorer may read (it says which): the attention of the last `window` queries, the attention summed
over every query (`accumulates`), the keys and values (`reads_keys`), the pre-RoPE query statistics
(`needs_stats`). A policy gathers attention from its forward passes as the stream comes in (`gather`: per KV
head, the mean of its group's query heads); a press recomputes the window's attention from the recorded queries.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import cached_property
from typing import ClassVar

import torch
import torch.nn.functional as F

from attnlab.errors import AttnlabError
from attnlab.kernels.reference import dequantize_int8_blocks

INF = float("inf")


@dataclass
class Observed:
    """What a scorer reads for one layer. pos [B, H_kv, n] (-1 = padding); keep, n_real [B] (each row's quota and
    real length); n_sink, n_recent [B]: what the method keeps of each row whatever the score (`forced`, computed
    when read: [B, H_kv, n]); keys, values [B, H_kv, n, D] (float, rotated, pairs (2i, 2i+1)); window
    [B, H_kv, G, W, n]: attention of the last W queries, oldest first (G query heads per KV head, or G = 1: their
    mean); acc [B, H_kv, n]: attention summed over every query (group mean); q_mean [B, Hq, D], q_cov
    [B, Hq, D, D]: pre-RoPE query statistics; tables: positions -> RoPE rotations."""
    pos: torch.Tensor
    keep: torch.Tensor
    n_real: torch.Tensor
    n_sink: object
    n_recent: object
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None
    window: torch.Tensor | None = None
    acc: torch.Tensor | None = None
    q_mean: torch.Tensor | None = None
    q_cov: torch.Tensor | None = None
    tables: object = None

    @cached_property
    def forced(self) -> torch.Tensor:
        return forced(self.pos, self.n_sink, self.n_recent)


@dataclass
class Scorer:
    """Base: no preference (every slot scores 0), nothing always kept."""
    name: ClassVar[str] = "scorer"
    accumulates: ClassVar[bool] = False  # reads `acc`
    reads_keys: ClassVar[bool] = False   # reads `keys` and `values`
    needs_stats: ClassVar[bool] = False  # reads `q_mean`, `q_cov`, `tables`

    def __post_init__(self):
        for f in fields(self):  # a field's kind is its default's: bool (0 and 1 taken), int or float, never < 0
            value, default = getattr(self, f.name), f.default
            if isinstance(default, bool):
                if isinstance(value, float) or value not in (0, 1):
                    raise AttnlabError(f"{self.name}: {f.name} is a flag (0 or 1), got {value!r}")
                setattr(self, f.name, bool(value))
                continue
            kind = int if isinstance(default, int) else (int, float)
            if isinstance(value, bool) or not isinstance(value, kind):
                raise AttnlabError(f"{self.name}: {f.name} must be {'an integer' if kind is int else 'a number'}, "
                                   f"got {value!r}")
            if value < 0:
                raise AttnlabError(f"{self.name}: {f.name} must be >= 0, got {value}")

    @property
    def window(self) -> int:
        """How many of the last queries' attention the scorer reads (0 = none)."""
        return 0

    @property
    def stats_skip(self) -> int:
        """Leading positions left out of the query statistics."""
        return 0

    def sinks(self, keep: int) -> int:
        """Leading positions always kept out of a quota of `keep`."""
        return 0

    def recent(self, keep: int) -> int:
        """Trailing positions always kept out of a quota of `keep`."""
        return 0

    def check_budget(self, budget: int) -> None:
        """Raise when a policy's budget cannot hold what the method always keeps."""

    def score(self, o: Observed) -> torch.Tensor:
        """[B, H_kv, n] float: how much each slot deserves to stay (higher = keep)."""
        return torch.zeros(o.pos.shape)


@dataclass
class StreamingLLM(Scorer):
    """StreamingLLM (Xiao et al. 2024): the first `n_sink` positions (attention sinks) and the most recent ones."""
    n_sink: int = 4
    name: ClassVar[str] = "streaming_llm"

    def sinks(self, keep):
        return self.n_sink

    def recent(self, keep):
        return keep - self.n_sink

    def check_budget(self, budget):
        if budget <= self.n_sink:
            raise AttnlabError(f"budget {budget} must exceed n_sink {self.n_sink}")


@dataclass
class Recent(StreamingLLM):
    """The most recent positions only (StreamingLLM without sinks: breaks once the first tokens slide out)."""
    n_sink: int = 0
    name: ClassVar[str] = "window"


@dataclass
class Knorm(Scorer):
    """The keys of smallest L2 norm (Devoto et al. 2024: low-norm keys draw the most attention)."""
    name: ClassVar[str] = "knorm"
    reads_keys: ClassVar[bool] = True

    def score(self, o):
        return -o.keys.float().norm(dim=-1)


@dataclass
class H2O(Scorer):
    """Heavy-Hitter Oracle (Zhang et al. 2023): the attention a slot received, summed over every query since it
    entered (group mean), plus a recent window of `recent_ratio` of the quota; `n_sink` leading positions kept."""
    recent_ratio: float = 0.5
    n_sink: int = 0
    name: ClassVar[str] = "h2o"
    accumulates: ClassVar[bool] = True

    def __post_init__(self):
        super().__post_init__()
        if self.recent_ratio > 1:
            raise AttnlabError(f"recent_ratio must be in [0, 1], got {self.recent_ratio}")

    def sinks(self, keep):
        return self.n_sink

    def recent(self, keep):
        rest = keep - self.n_sink
        return max(1, rest - int(rest * (1 - self.recent_ratio)))

    def check_budget(self, budget):
        if budget <= self.n_sink + 1:
            raise AttnlabError(f"budget {budget} must exceed n_sink {self.n_sink} + 1 (a heavy hitter and a recent "
                               "token)")

    def score(self, o):
        return o.acc


@dataclass
class SinkH2O(H2O):
    """H2O with the first `n_sink` positions always kept."""
    n_sink: int = 4
    name: ClassVar[str] = "sink_h2o"


@dataclass
class TOVA(Scorer):
    """TOVA (Oren et al. 2024): the current (last) query's attention averaged over all query heads, one choice for
    every KV head (the paper's and kvpress's); the last token is kept."""
    name: ClassVar[str] = "tova"

    @property
    def window(self):
        return 1

    def recent(self, keep):
        return 1

    def score(self, o):
        p = o.window[:, :, :, -1]  # [B, H, G, n]
        return p.mean((1, 2), keepdim=True)[:, :, 0].expand(-1, p.shape[1], -1)


@dataclass
class SnapKV(Scorer):
    """SnapKV (Li et al. 2024): the mean attention of the last `window_size` queries, average-pooled over
    `kernel_size` neighbouring slots (per query head, then averaged over the KV group), kvpress's defaults. The
    window's own keys are kept (at most half the quota, so that the score chooses the rest) and left out of the
    pooling, as kvpress pools only the slots before its window."""
    window_size: int = 64
    kernel_size: int = 5
    name: ClassVar[str] = "snapkv"

    def __post_init__(self):
        super().__post_init__()
        if self.window_size < 1 or self.kernel_size % 2 == 0:
            raise AttnlabError(f"snapkv: window_size must be >= 1 and kernel_size odd, got {self.window_size}, "
                               f"{self.kernel_size}")

    @property
    def window(self):
        return self.window_size

    def recent(self, keep):
        return min(self.window_size, keep // 2)

    def score(self, o):
        s = o.window.mean(3).masked_fill(o.forced[:, :, None], 0.0)  # [B, H, G, n]
        B, H, G, n = s.shape
        s = F.avg_pool1d(s.reshape(B * H * G, 1, n), self.kernel_size, 1, self.kernel_size // 2)
        return s.view(B, H, G, n).mean(2)


@dataclass
class ExpectedAttention(Scorer):
    """Expected Attention (Devoto et al. 2025): the softmax a future query would give each key, the queries
    modelled as a Gaussian (the prompt's query mean and covariance, sinks left out) rotated by the mean RoPE
    rotation of the next `n_future` positions: exp(mu.k / sqrt(d) + k^T S k / 2d), times |v|; sinks kept."""
    n_future: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    name: ClassVar[str] = "expected_attention"
    reads_keys: ClassVar[bool] = True
    needs_stats: ClassVar[bool] = True

    @property
    def stats_skip(self):
        return self.n_sink

    def sinks(self, keep):
        return self.n_sink

    def score(self, o):
        k = o.keys.float()
        B, H, n, D = k.shape
        G = o.q_mean.shape[1] // H
        # mean rotation of the next n_future positions after each row's prompt: [B, D/2] complex
        c = o.tables(o.n_real[:, None] + torch.arange(self.n_future)[None]).mean(1)
        rot = torch.zeros(B, D, D)  # block-diagonal 2x2 per pair (2i, 2i+1)
        i = torch.arange(D // 2)
        rot[:, 2 * i, 2 * i], rot[:, 2 * i, 2 * i + 1] = c.real, -c.imag
        rot[:, 2 * i + 1, 2 * i], rot[:, 2 * i + 1, 2 * i + 1] = c.imag, c.real
        mu = torch.einsum("bij,bhj->bhi", rot, o.q_mean.float())
        logits = (mu.view(B, H, G, 1, D) @ k[:, :, None].transpose(-1, -2))[..., 0, :] / math.sqrt(D)
        if self.use_covariance:
            cov = rot[:, None] @ o.q_cov.float() @ rot[:, None].transpose(-1, -2)
            kc = torch.einsum("bhnd,bhgde->bhgne", k, cov.view(B, H, G, D, D))
            logits = logits + (kc * k[:, :, None]).sum(-1) / D / 2
        sink = (o.pos < self.n_sink) | (o.pos < 0)
        s = logits.masked_fill(sink[:, :, None], -INF).softmax(-1).mean(2)
        return (s + self.epsilon) * o.values.float().norm(dim=-1) if self.use_vnorm else s


METHODS: dict[str, type[Scorer]] = {m.name: m for m in (StreamingLLM, Recent, Knorm, H2O, SinkH2O, TOVA, SnapKV,
                                                        ExpectedAttention)}


def parse_spec(spec: str, kinds: dict, what: str, known: set) -> tuple[type, dict]:
    """'NAME[:field=value...]' -> (kinds[NAME], {field: value}), values numbers (0 / 1 for a flag), as the CLI and
    the anchor scripts take them. known: the fields the caller itself takes (ratio, page, ...), besides the method's."""
    name, *pairs = spec.split(":")
    cls = kinds.get(name)
    if cls is None:
        raise AttnlabError(f"unknown {what} {name!r}; choose from {', '.join(kinds)}")
    method = getattr(cls, "scorer", cls)
    out = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not (key and eq):
            raise AttnlabError(f"{what} spec: expected field=number after {name!r}, got {pair!r}")
        if key not in known and key not in getattr(method, "__dataclass_fields__", {}):
            raise AttnlabError(f"{what} {name} has no field {key!r}")
        try:
            out[key] = int(value) if value.lstrip("-").isdigit() else float(value)
        except ValueError:
            raise AttnlabError(f"{what} spec: expected field=number after {name!r}, got {pair!r}") from None
    return cls, out


def forced(pos: torch.Tensor, n_sink, n_recent) -> torch.Tensor:
    """The slots kept whatever their score: pos [B, H, n]; n_sink, n_recent: ints or [B] -> [B, H, n] bool, True
    for positions < n_sink and for the n_recent latest positions of the row and head (never padding)."""
    n_sink, n_recent = (torch.as_tensor(x).reshape(-1, 1, 1) for x in (n_sink, n_recent))
    latest = pos.max(-1, keepdim=True).values
    return (pos >= 0) & ((pos < n_sink) | (pos > latest - n_recent))


def kept_always(method: Scorer, keep: torch.Tensor) -> tuple[list[int], list[int]]:
    """Each row's sinks and recent window out of its quota keep [B], clipped to fit it: (n_sink, n_recent)."""
    sinks = [min(method.sinks(k), k) for k in keep.tolist()]
    return sinks, [max(0, min(method.recent(k), k - s)) for k, s in zip(keep.tolist(), sinks)]


def choose(pos: torch.Tensor, score: torch.Tensor, keep, force: torch.Tensor | None = None,
           page: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The slots to keep, the one selection of policies and presses: pos, score [B, H, n]; keep: pairs per row
    (an int, or [B]); force [B, H, n]: slots kept first (+inf); padding (position -1) last; page > 1: whole pages
    (`whole_pages`). Returns ascending idx [B, H, m] (m = max keep) and alive [B, H, m]: False for a row's surplus
    slots (to be masked), when rows keep different counts (None for an int keep: every slot is alive)."""
    s = score.float()
    if force is not None:
        s = s.masked_fill(force, INF)
    s = s.masked_fill(pos < 0, -INF)
    if page > 1:
        s = whole_pages(s, pos, page)
    if isinstance(keep, int):
        return s.topk(keep, dim=-1, sorted=False).indices.sort(-1).values, None
    m = int(keep.max())
    top = s.topk(m, dim=-1).indices  # descending score: a row's first keep[b] are its own
    alive = (torch.arange(m)[None, None] < keep[:, None, None]).expand_as(top)
    idx, order = top.sort(-1)
    return idx, torch.gather(alive, -1, order)


def whole_pages(score: torch.Tensor, pos: torch.Tensor, page: int) -> torch.Tensor:
    """Scores [B, H, n] -> scores that rank whole pages (positions p // page): a page by its best pair, ties to the
    lower page, and inside a page by position, so a top-k takes pages whole, the last one cut short. Slots at
    position -1 (padding) stay -inf; a page holding a kept-always pair (+inf) ranks first."""
    s = score.float().masked_fill(pos < 0, -INF)
    page_of = pos.clamp_min(0) // page
    best = torch.full((*s.shape[:2], int(page_of.max()) + 1), -INF).scatter_reduce(-1, page_of, s, "amax")
    order = best.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1]).expand_as(order))
    ranked = -(rank.gather(-1, page_of) * page + pos.clamp_min(0) % page).float()
    return ranked.masked_fill(pos < 0, -INF)


def _slot_state(kv, key: str, *lead: int) -> torch.Tensor:
    """A zero-initialised per-slot float tensor [B, H_kv, *lead, capacity] kept in kv.policy_state (it follows its
    tokens when the cache is compacted)."""
    state = kv.policy_state.get(key)
    shape = (*kv.pos.shape[:2], *lead, kv.capacity)
    if state is None or state.shape != shape:
        state = torch.zeros(shape)
        kv.policy_state[key] = state
    return state


def gather(kv, probs: torch.Tensor, method: Scorer) -> None:
    """Fold one pass's attention probs [B, Hq, T, n] over layer kv's slots into kv.policy_state, per KV head (the
    mean of its group's query heads; padding queries carry none): "acc" summed over every query (`accumulates`),
    "obs" the last `window` queries' rows (a ring, "ptr" the next row, "rows" how many are filled)."""
    B, Hq, T, n = probs.shape
    H = kv.pos.shape[1]
    probs = probs.view(B, H, Hq // H, T, n).mean(2) * (kv.pos[:, :, n - T:n, None] >= 0)
    if method.accumulates:
        _slot_state(kv, "acc")[..., :n] += probs.sum(2)
    W = method.window
    if W:
        obs, rows = _slot_state(kv, "obs", W), probs[:, :, -W:]
        ptr, t = kv.policy_state.get("ptr", 0), rows.shape[2]
        at = (ptr + torch.arange(t)) % W
        obs[:, :, at] = 0.0
        obs[:, :, at, :n] = rows
        kv.policy_state["ptr"] = (ptr + t) % W
        kv.policy_state["rows"] = min(W, kv.policy_state.get("rows", 0) + t)


def stored(kv) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer kv's keys and values [B, H, n, D] as stored (rotated), in float (an int8 cache dequantised)."""
    n = kv.n
    k, v = kv.k[:, :, :n], kv.v[:, :, :n]
    if kv.k_scale is not None:
        k, v = dequantize_int8_blocks(k, kv.k_scale[:, :, :n]), dequantize_int8_blocks(v, kv.v_scale[:, :, :n])
    return k, v


def gathered(kv, n: int) -> dict:
    """What `gather` kept, for `Observed`: window [B, H, 1, W', n] (the filled rows, oldest first) and acc [B, H, n]."""
    state, out = kv.policy_state, {}
    if "acc" in state:
        out["acc"] = state["acc"][..., :n]
    if "obs" in state:
        obs, W, rows, ptr = state["obs"][..., :n], state["obs"].shape[2], state["rows"], state["ptr"]
        out["window"] = (obs if rows == W and ptr == 0 else obs[:, :, (ptr - rows + torch.arange(rows)) % W])[:, :, None]
    return out
