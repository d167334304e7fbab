"""Presses: compress a prefilled KV cache once, to a ratio, after the whole prompt has been read.

Why a second mechanism beside `policies`: a policy evicts while the prompt streams in, before the
question has been read; a press (kvpress's protocol, and the field's RULER leaderboard) reads the
whole context first, then drops a share `ratio` of each layer's and KV head's pairs in one go,
with a scorer that may look at the last prompt tokens' queries (SnapKV's observation window, TOVA)
or at the queries it expects (Expected Attention). What is kept is then never evicted again.

Each press is a small dataclass with one `score(o)` -> [B, H_kv, n] (higher = keep, +inf = always
kept), as each policy is; everything else lives once here: what the forward pass must hand over
(`PressRecorder`, an observer like the cache itself), the per-row quota and top-k (`choose`),
and compacting the cache (`LayerKV.keep`). A row keeps int(n_real * (1 - ratio)) pairs, n_real its
own prompt length (kvpress's count); in a left-padded batch the shorter rows' surplus slots are
kept as masked (position -1) slots, so every row gets exactly its own quota.

`page`, a field of every press: keep whole pages of that many positions (Quest's pages), each ranked by
its best-scored pair, per layer and KV head. Why: a needle is a run of tokens (a 7-digit number is 7 of
Qwen's), and a scorer that ranks pairs one by one keeps the digits the question attends to and drops the
ones between, so the answer is copied with digits missing; a page is kept or dropped whole.

Use: `lm.prefill(ids, cache, press=make_press("snapkv", 0.5))` (or a spec such as
"snapkv:window_size=32:page=16"); the cache must have no policy and `original` positions (keys keep
their absolute rotation, as in kvpress).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F

from attnlab.errors import AttnlabError
from attnlab.kernels.reference import dequantize_int8_blocks
from attnlab.kv.policies import H2O, SinkH2O

INF = float("inf")


@dataclass
class Observed:
    """What a scorer may read for one layer. keys/values [B, H_kv, n, D] (keys rotated, pairs (2i, 2i+1));
    pos [B, H_kv, n] (-1 = padding); keep, n_real [B]; queries [B, Hq, W, D] rotated queries of the last W
    prompt tokens at q_pos [B, W]; q_mean [B, Hq, D], q_cov [B, Hq, D, D] pre-RoPE query statistics;
    tables: positions -> complex RoPE rotations [..., D/2]; layer: the cache layer (policy state)."""
    keys: torch.Tensor
    values: torch.Tensor
    pos: torch.Tensor
    keep: torch.Tensor
    n_real: torch.Tensor
    queries: torch.Tensor | None = None
    q_pos: torch.Tensor | None = None
    q_mean: torch.Tensor | None = None
    q_cov: torch.Tensor | None = None
    tables: object = None
    layer: object = None


@dataclass
class Press:
    """Base: drop a share `ratio` in [0, 1) of every row's prompt pairs, per layer and KV head (in whole pages
    of `page` positions when page > 1)."""
    ratio: float = 0.5
    page: int = 1
    needs_probs: ClassVar[bool] = False   # the prompt's attention probabilities (accumulated, H2O)
    needs_stats: ClassVar[bool] = False   # mean and covariance of the prompt's queries
    stats_skip: ClassVar[int] = 0         # leading positions left out of the statistics
    name: ClassVar[str] = "press"

    def __post_init__(self):
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0 <= self.ratio < 1:
            raise AttnlabError(f"a press ratio must be in [0, 1), got {self.ratio!r}")
        if isinstance(self.page, bool) or not isinstance(self.page, int) or self.page < 1:
            raise AttnlabError(f"a press page must be a positive number of positions, got {self.page!r}")

    @property
    def window(self) -> int:
        """How many of the prompt's last queries the scorer reads (0 = none)."""
        return 0

    def score(self, o: Observed) -> torch.Tensor:
        raise NotImplementedError

    def policy_for(self, budget: int):
        """The policy whose state the forward pass feeds (needs_probs presses only)."""
        return None

    def describe(self) -> str:
        return f"{self.name}(ratio={self.ratio:g}" + (f", page={self.page})" if self.page > 1 else ")")


def _window_probs(o: Observed) -> torch.Tensor:
    """Attention of the window queries over every slot, causal by position: [B, H_kv, G, W, n] (float32)."""
    q, k = o.queries.float(), o.keys.float()
    B, Hq, W, D = q.shape
    H, n = k.shape[1], k.shape[2]
    G = Hq // H
    s = (q.reshape(B, H, G * W, D) @ k.transpose(-1, -2)).view(B, H, G, W, n) / math.sqrt(D)
    seen = (o.pos[:, :, None, None, :] <= o.q_pos[:, None, None, :, None]) & (o.pos[:, :, None, None, :] >= 0)
    return s.masked_fill(~seen, -INF).softmax(-1)


@dataclass
class KnormPress(Press):
    """Keep the keys of smallest L2 norm (Devoto et al. 2024: low-norm keys draw the most attention)."""
    name: ClassVar[str] = "knorm"

    def score(self, o):
        return -o.keys.float().norm(dim=-1)


@dataclass
class StreamingLLMPress(Press):
    """StreamingLLM as a press: the first n_sink positions and the most recent ones."""
    n_sink: int = 4
    name: ClassVar[str] = "streaming_llm"

    def score(self, o):
        pruned = (o.n_real - o.keep)[:, None, None]
        return (~((o.pos >= self.n_sink) & (o.pos < self.n_sink + pruned))).float()


@dataclass
class SnapKVPress(Press):
    """SnapKV: attention of the last `window_size` prompt queries (their mean), average-pooled over
    `kernel_size` neighbours and over the query heads of a KV group; the window itself is kept."""
    window_size: int = 64
    kernel_size: int = 5
    name: ClassVar[str] = "snapkv"

    @property
    def window(self):
        return self.window_size

    def score(self, o):
        W, n = self.window_size, o.keys.shape[2]
        if n <= W:
            raise AttnlabError(f"snapkv needs a prompt longer than its window ({W} tokens), got {n}")
        p = _window_probs(o).mean(3)[..., :n - W]  # [B, H, G, n - W]
        B, H, G, m = p.shape
        p = F.avg_pool1d(p.reshape(B * H * G, 1, m), self.kernel_size, 1, self.kernel_size // 2).view(B, H, G, m)
        return F.pad(p.mean(2), (0, W), value=INF)


@dataclass
class TOVAPress(Press):
    """TOVA as a press: the last prompt query's attention, averaged over all query heads (kvpress's
    definition, one choice for every KV head); the last token is kept."""
    name: ClassVar[str] = "tova"

    @property
    def window(self):
        return 1

    def score(self, o):
        p = _window_probs(o)[:, :, :, 0, :-1]  # [B, H, G, n - 1]
        B, H = p.shape[:2]
        s = p.mean((1, 2), keepdim=True).expand(B, H, 1, -1)[:, :, 0]
        return F.pad(s, (0, 1), value=INF)


@dataclass
class ExpectedAttentionPress(Press):
    """Expected Attention (Devoto et al. 2025): the softmax a future query would give each key, the queries
    modelled as a Gaussian (the prompt's query mean and covariance, sinks left out) rotated by the mean
    RoPE rotation of the next `n_future` positions: exp(mu.k / sqrt(d) + k^T S k / 2d), times |v|."""
    n_future: int = 512
    n_sink: int = 4
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    needs_stats: ClassVar[bool] = True
    name: ClassVar[str] = "expected_attention"

    @property
    def stats_skip(self):
        return self.n_sink

    def score(self, o):
        k = o.keys.float()
        B, H, n, D = k.shape
        Hq = o.q_mean.shape[1]
        G = Hq // H
        # mean rotation of the next n_future positions after each row's prompt: [B, D/2] complex
        future = o.n_real[:, None] + torch.arange(self.n_future)[None]
        c = o.tables(future).mean(1)
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
        if self.use_vnorm:
            s = (s + self.epsilon) * o.values.float().norm(dim=-1)
        return s.masked_fill((o.pos < self.n_sink) & (o.pos >= 0), INF)


@dataclass
class H2OPress(Press):
    """Our H2O score as a press: attention summed over every prompt query (group-averaged), plus H2O's
    recent window (recent_ratio of the kept pairs)."""
    recent_ratio: float = 0.5
    needs_probs: ClassVar[bool] = True
    name: ClassVar[str] = "h2o"

    def policy_for(self, budget):
        return H2O(budget=max(2, budget), positions="original", recent_ratio=self.recent_ratio)

    def score(self, o):
        s = o.layer.policy_state["acc"][..., :o.pos.shape[-1]].clone()
        latest = o.pos.max(-1, keepdim=True).values
        for b, keep in enumerate(o.keep.tolist()):
            p = self.policy_for(keep)
            n_sink, n_recent = p.n_sink(p.tokens), p.n_recent(p.tokens)
            forced = (o.pos[b] >= 0) & ((o.pos[b] < n_sink) | (o.pos[b] > latest[b] - n_recent))
            s[b] = s[b].masked_fill(forced, INF)
        return s


@dataclass
class SinkH2OPress(H2OPress):
    """Our sink_h2o score as a press: H2O's, with the first n_sink positions always kept."""
    n_sink: int = 4
    name: ClassVar[str] = "sink_h2o"

    def policy_for(self, budget):
        return SinkH2O(budget=max(self.n_sink + 2, budget), positions="original", recent_ratio=self.recent_ratio,
                       sinks=self.n_sink)


PRESSES: dict[str, type[Press]] = {p.name: p for p in (KnormPress, StreamingLLMPress, SnapKVPress, TOVAPress,
                                                       ExpectedAttentionPress, H2OPress, SinkH2OPress)}


def make_press(name: str, ratio: float = 0.5, **fields) -> Press:
    """A press by name (knorm, streaming_llm, snapkv, tova, expected_attention, h2o, sink_h2o), or by a spec
    NAME:field=value[:field=value...] (numbers only: "snapkv:window_size=32:page=16"), as the CLI takes it."""
    name, *pairs = name.split(":")
    for pair in pairs:
        key, eq, value = pair.partition("=")
        try:
            if not (key and eq):
                raise ValueError
            fields[key] = int(value) if value.lstrip("-").isdigit() else float(value)
        except ValueError:
            raise AttnlabError(f"press spec: expected field=number after {name!r}, got {pair!r}") from None
    cls = PRESSES.get(name)
    if cls is None:
        raise AttnlabError(f"unknown press {name!r}; choose from {', '.join(PRESSES)}")
    try:
        return cls(ratio=ratio, **fields)
    except TypeError as e:
        raise AttnlabError(f"press {name}: {e}") from None


@dataclass
class PressRecorder:
    """An observer of the prefill: keeps, per layer, what the press's scorer will read (and nothing more).
    Records "q" (pre-RoPE queries [B, Hq, T, D]) and, for needs_probs presses, "probs"."""
    press: Press
    layers: list
    tails: dict = field(default_factory=dict)
    stats: dict = field(default_factory=dict)

    @property
    def needs_probs(self) -> bool:
        return self.press.needs_probs

    def record(self, i: int, name: str, t: torch.Tensor) -> None:
        kv = self.layers[i]
        if name == "probs" and self.press.needs_probs:
            self.press.policy_for(2).observe(kv, t)  # accumulates into kv.policy_state, as the policy would
        if name != "q":
            return
        T = t.shape[2]
        pos = kv.pos[:, 0, kv.n:kv.n + T]  # the chunk's slots are written before its attention
        if self.press.window:
            q = kv.rope.rotate(t.float(), pos)
            old = self.tails.get(i)
            if old is not None:
                q, pos = torch.cat([old[0], q], 2), torch.cat([old[1], pos], 1)
            self.tails[i] = (q[:, :, -self.press.window:].clone(), pos[:, -self.press.window:].clone())
        if self.press.needs_stats:
            m = ((pos >= self.press.stats_skip) & (pos >= 0)).float()[:, None, :, None]
            q = t.float() * m
            s = self.stats.setdefault(i, [0.0, 0.0, 0.0])
            s[0] = s[0] + q.sum(2)
            s[1] = s[1] + q.transpose(-1, -2) @ q
            s[2] = s[2] + m.sum(2)


def choose(pos: torch.Tensor, score: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots to keep: pos, score [B, H, n]; keep [B] pairs per row. Returns ascending idx [B, H, m]
    (m = max keep) and alive [B, H, m]: False for a row's surplus slots (to be masked)."""
    m = int(keep.max())
    s = score.float().masked_fill(pos < 0, -INF)
    top = s.topk(m, dim=-1).indices  # descending score: a row's first keep[b] are its own
    alive = (torch.arange(m)[None, None] < keep[:, None, None]).expand_as(top)
    idx, order = top.sort(-1)
    return idx, torch.gather(alive, -1, order)


def whole_pages(score: torch.Tensor, pos: torch.Tensor, page: int) -> torch.Tensor:
    """Scores [B, H, n] -> scores that rank whole pages (positions p // page): a page by its best pair, ties
    to the lower page, and inside a page by position, so a top-k takes pages whole, the last one cut short.
    Slots at position -1 (padding) stay -inf; a page holding a kept-always pair (+inf) ranks first."""
    s = score.float().masked_fill(pos < 0, -INF)
    page_of = pos.clamp_min(0) // page
    best = torch.full((*s.shape[:2], int(page_of.max()) + 1), -INF).scatter_reduce(-1, page_of, s, "amax")
    order = best.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(order.shape[-1]).expand_as(order))
    ranked = -(rank.gather(-1, page_of) * page + pos.clamp_min(0) % page).float()
    return ranked.masked_fill(pos < 0, -INF)


def observed(press: Press, kv, recorder: PressRecorder, i: int, hf_layout: bool = False) -> Observed:
    """One layer's scorer inputs (keys and values read from the cache; hf_layout: keys stored with
    transformers' half-split rotation, turned into adjacent pairs for scoring)."""
    n = kv.n
    k, v = kv.k[:, :, :n], kv.v[:, :, :n]
    if kv.k_scale is not None:
        k, v = dequantize_int8_blocks(k, kv.k_scale[:, :, :n]), dequantize_int8_blocks(v, kv.v_scale[:, :, :n])
    if hf_layout:
        k = k.unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)
    pos = kv.pos[:, :, :n]
    n_real = (pos[:, 0] >= 0).sum(-1)
    keep = torch.tensor([max(1, int(x * (1 - press.ratio))) for x in n_real.tolist()])
    o = Observed(k, v, pos, keep, n_real, tables=kv.rope.tables, layer=kv)
    if press.window:
        o.queries, o.q_pos = recorder.tails[i]
    if press.needs_stats:
        total, outer, count = recorder.stats[i]
        count = count.clamp_min(1)
        o.q_mean = total / count
        o.q_cov = outer / count[..., None] - o.q_mean[..., :, None] * o.q_mean[..., None, :]
    return o


def compress_layer(press: Press, kv, o: Observed) -> None:
    """Score, choose and compact one layer; a row's surplus slots become masked padding."""
    score = press.score(o)
    if press.page > 1:
        score = whole_pages(score, o.pos, press.page)
    idx, alive = choose(o.pos, score, o.keep)
    kv.policy_state = {}
    kv.keep(idx)
    if not bool(alive.all()):
        kv.pos[:, :, :idx.shape[-1]].masked_fill_(~alive, -1)
        kv.padded = True


def compress(cache, press: Press, recorder: PressRecorder) -> None:
    """Press every layer of a prefilled cache (see the module docstring)."""
    check_cache(cache)
    cache.pressed = True
    if press.ratio == 0:
        return
    for i, kv in enumerate(cache.layers):
        compress_layer(press, kv, observed(press, kv, recorder, i))


def check_cache(cache) -> None:
    """A press reads a cache that holds the whole prompt: no policy, original positions, not pressed yet."""
    if cache.policy is not None or cache.positions != "original":
        raise AttnlabError("a press needs a cache without an eviction policy and with original positions")
    if getattr(cache, "pressed", False):
        raise AttnlabError("this cache was already pressed: a press compresses a freshly prefilled cache once")
