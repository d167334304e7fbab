"""Presses: compress a prefilled KV cache once, to a ratio, after the whole prompt has been read.

Why a second mechanism beside `policies`: a policy evicts while the prompt streams in, before the
question has been read; a press (kvpress's protocol, and the field's RULER leaderboard) reads the
whole context first, then drops a share `ratio` of each layer's and KV head's pairs in one go,
with a scorer that may look at the last prompt tokens' queries (SnapKV's observation window, TOVA)
or at the queries it expects (Expected Attention). What is kept is then never evicted again.

A press is a KV method (`attnlab.kv.scorers`, each written once and shared with the policies) plus a
ratio; everything else lives once: what the forward pass must hand over (`PressRecorder`, an observer like
the cache itself), the evidence the scorer reads (`observed`), the per-row quota and top-k
(`scorers.choose`), and compacting the cache (`LayerKV.keep`). A row keeps int(n_real * (1 - ratio)) pairs,
n_real its own prompt length (kvpress's count); in a left-padded batch the shorter rows' surplus slots are
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

import torch

from attnlab.errors import AttnlabError
from attnlab.kv import scorers
from attnlab.kv.scorers import INF, Observed, Scorer, choose, whole_pages  # noqa: F401 (choose, whole_pages: public here)

PRESSES: dict[str, type[Scorer]] = {name: m for name, m in scorers.METHODS.items() if name != "window"}


@dataclass
class Press:
    """A KV method applied once: drop a share `ratio` in [0, 1) of every row's prompt pairs, per layer and KV
    head (in whole pages of `page` positions when page > 1)."""
    method: Scorer
    ratio: float = 0.5
    page: int = 1

    def __post_init__(self):
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or not 0 <= self.ratio < 1:
            raise AttnlabError(f"a press ratio must be in [0, 1), got {self.ratio!r}")
        if isinstance(self.page, bool) or not isinstance(self.page, int) or self.page < 1:
            raise AttnlabError(f"a press page must be a positive number of positions, got {self.page!r}")

    @property
    def name(self) -> str:
        return self.method.name

    @property
    def needs_probs(self) -> bool:
        """Whether the forward pass must hand over its attention probabilities (a method that sums them)."""
        return self.method.accumulates

    @property
    def window(self) -> int:
        """How many of the prompt's last queries the scorer reads (0 = none)."""
        return self.method.window

    @property
    def needs_stats(self) -> bool:
        return self.method.needs_stats

    @property
    def stats_skip(self) -> int:
        return self.method.stats_skip

    def describe(self) -> str:
        return f"{self.name}(ratio={self.ratio:g}" + (f", page={self.page})" if self.page > 1 else ")")


def make_press(name: str, ratio: float = 0.5, **fields) -> Press:
    """A press by name (knorm, streaming_llm, snapkv, tova, expected_attention, h2o, sink_h2o), or by a spec
    NAME:field=value[:field=value...] (numbers only: "snapkv:window_size=32:page=16"), as the CLI takes it;
    page is the press's field, the others the method's."""
    method, spec = scorers.parse_spec(name, PRESSES, "press", {"page"})
    fields = {**fields, **spec}
    page = fields.pop("page", 1)
    try:
        return Press(method(**fields), ratio, page)
    except TypeError as e:
        raise AttnlabError(f"press {method.name}: {e}") from None


def _window_probs(o: Observed, queries: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """Attention of the window queries [B, Hq, W, D] at q_pos [B, W] over every slot, causal by position:
    [B, H_kv, G, W, n] (float32)."""
    q, k = queries.float(), o.keys.float()
    B, Hq, W, D = q.shape
    H, n = k.shape[1], k.shape[2]
    G = Hq // H
    s = (q.reshape(B, H, G * W, D) @ k.transpose(-1, -2)).view(B, H, G, W, n) / math.sqrt(D)
    seen = (o.pos[:, :, None, None, :] <= q_pos[:, None, None, :, None]) & (o.pos[:, :, None, None, :] >= 0)
    return s.masked_fill(~seen, -INF).softmax(-1)


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
            scorers.gather(kv, t, self.press.method)  # into kv.policy_state, as a policy gathers it
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


def observed(press: Press, kv, recorder: PressRecorder, i: int, hf_layout: bool = False) -> Observed:
    """One layer's scorer inputs (keys and values read from the cache; hf_layout: keys stored with
    transformers' half-split rotation, turned into adjacent pairs for scoring)."""
    k, v = scorers.stored(kv)
    if hf_layout:
        k = k.unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)
    pos = kv.pos[:, :, :kv.n]
    n_real = (pos[:, 0] >= 0).sum(-1)
    keep = torch.tensor([max(1, int(x * (1 - press.ratio))) for x in n_real.tolist()])
    o = Observed(pos, keep, n_real, *scorers.kept_always(press.method, keep), k, v, tables=kv.rope.tables)
    if press.window:
        o.window = _window_probs(o, *recorder.tails[i])
    if press.needs_probs:
        o.acc = kv.policy_state["acc"][..., :kv.n]
    if press.needs_stats:
        total, outer, count = recorder.stats[i]
        count = count.clamp_min(1)
        o.q_mean = total / count
        o.q_cov = outer / count[..., None] - o.q_mean[..., :, None] * o.q_mean[..., None, :]
    return o


def compress_layer(press: Press, kv, o: Observed) -> None:
    """Score, choose and compact one layer; a row's surplus slots become masked padding."""
    idx, alive = choose(o.pos, press.method.score(o), o.keep, o.forced, press.page)
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
