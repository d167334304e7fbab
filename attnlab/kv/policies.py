"""KV-cache eviction policies: which cached tokens to keep when the budget is reached, while a stream decodes.

Why this module exists: attention is sparse (a few sink and heavy-hitter tokens
take most of the mass), so a cache of a fixed size can serve an unbounded
stream. A policy is a KV method (`attnlab.kv.scorers`: StreamingLLM, H2O, TOVA,
SnapKV, knorm, each written once and shared with the presses) plus when to
evict: the budget, the block of slack, the prefill chunk the cache must hold.
Everything else -- when to evict, forcing the method's sinks and recent window,
the top-k (`scorers.choose`), compacting the cache with `kv.keep(idx)` and
carrying per-slot evidence along -- lives once, in `Policy`.

Granularity: eviction is per layer and per KV head. Every KV head of every
layer keeps exactly `budget` slots (so all layers keep the same slot count),
but which tokens it keeps is its own choice; attention-based scores of the G
query heads of a grouped-query group are averaged into their KV head's score.

A policy is owned by its cache and never calls anything back: when it `needs_probs`, the cache
is an observer of the forward pass and hands it each layer's attention probabilities
(`observe(kv, probs)`, probs [B, Hq, T, n], see `attnlab.model.llama.attend`); once a step is
done the cache asks `due(kv)` for every layer and, when the layer holds budget + block slots
or more, compacts it to the slots `to_keep(kv)` names. The cache thus holds at most budget +
block - 1 + one chunk slots (`capacity`), and frees memory for real.

Positions (`positions`): "original" keeps every key rotated at its absolute
position; "cache" (StreamingLLM) stores keys before RoPE and rotates them at
their slot index, so positions never exceed the capacity.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import ClassVar

import torch

from attnlab.errors import AttnlabError
from attnlab.kv import scorers
from attnlab.kv.scorers import Observed, Scorer, choose, forced
from attnlab.kv.slots import POSITIONS


@dataclass
class Policy:
    """Base: keep `budget` slots per layer and KV head (int tokens, or a fraction in (0, 1]), ranked by `method`.

    A fractional budget is a share of the tokens the cache will see; turn it into tokens with
    `resolve(length)` before building a cache. `chunk` is the largest prefill chunk the cache
    must hold on top of the budget. `block` is block eviction: let the cache fill to
    budget + block - 1 slots and then evict down to budget in one go, so compaction happens
    once every `block` tokens instead of at every step; block 1 is the exact per-token policy
    (for sink and window the sinks move up a slot per step, `LayerKV.slide`). method: the KV
    method (`attnlab.kv.scorers`; default the class's `scorer` with its defaults).
    """
    budget: int | float = 256
    positions: str = "cache"
    chunk: int = 512
    block: int = 1
    method: Scorer | None = None
    scorer: ClassVar[type[Scorer] | None] = Scorer
    name: ClassVar[str] = "base"

    def __post_init__(self):
        if self.method is None and self.scorer is not None:
            self.method = self.scorer()
        if self.positions not in POSITIONS:
            raise AttnlabError(f"unknown positions {self.positions!r}; choose from {', '.join(POSITIONS)}")
        if isinstance(self.budget, bool) or not isinstance(self.budget, (int, float)):
            raise AttnlabError(f"budget must be a token count or a fraction, got {self.budget!r}")
        if isinstance(self.budget, float):
            if not 0 < self.budget <= 1:
                raise AttnlabError(f"a fractional budget must be in (0, 1], got {self.budget}")
        elif self.budget < 1:
            raise AttnlabError(f"budget must be >= 1 token, got {self.budget}")
        if self.chunk < 1:
            raise AttnlabError(f"chunk must be >= 1, got {self.chunk}")
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise AttnlabError(f"block must be an integer >= 1, got {self.block!r}")
        if isinstance(self.budget, int):
            self.check_budget(self.budget)

    # ---------------------------------------------------------------- the method's part

    @property
    def needs_probs(self) -> bool:
        """Whether the forward pass must hand this policy its attention probabilities."""
        return self.method is not None and (self.method.window > 0 or self.method.accumulates)

    def n_sink(self, budget: int) -> int:
        """Leading tokens (by position) that are never evicted."""
        return self.method.sinks(budget) if self.method else 0

    def n_recent(self, budget: int) -> int:
        """Trailing tokens (by position) that are never evicted."""
        return self.method.recent(budget) if self.method else 0

    def check_budget(self, budget: int) -> None:
        """Raise when budget cannot hold what the method always keeps."""
        if self.method is not None:
            self.method.check_budget(budget)

    def observe(self, kv, probs: torch.Tensor) -> None:
        """This step's attention probabilities [B, Hq, T, n] over layer kv's slots (when needs_probs)."""
        scorers.gather(kv, probs, self.method)

    def observed(self, kv) -> Observed:
        """The method's evidence on layer kv's slots, as a press would hand it over (quota: the budget)."""
        n, pos = kv.n, kv.pos[:, :, :kv.n]
        B = pos.shape[0]
        budget = self.tokens
        o = Observed(pos, torch.full((B,), budget), (pos[:, 0] >= 0).sum(-1), self.n_sink(budget),
                     self.n_recent(budget), **scorers.gathered(kv, n))
        if self.method.reads_keys:
            o.keys, o.values = scorers.stored(kv)
        return o

    def score(self, kv) -> torch.Tensor:
        """[B, H_kv, n] float: how much each slot deserves to stay (higher = keep)."""
        return self.method.score(self.observed(kv))

    # ---------------------------------------------------------------- shared mechanics

    @property
    def tokens(self) -> int:
        if isinstance(self.budget, float):
            raise AttnlabError(f"budget {self.budget} is a fraction; call resolve(length) first")
        return self.budget

    @property
    def capacity(self) -> int | None:
        """Slots a cache needs: the budget, the block's slack and one prefill chunk (None = unbounded)."""
        return self.tokens + self.block - 1 + self.chunk

    def resolve(self, length: int) -> "Policy":
        """A copy whose fractional budget is turned into tokens: ceil(fraction * length) (checked again)."""
        if isinstance(self.budget, int):
            return self
        return replace(self, budget=max(1, math.ceil(self.budget * length)))

    def due(self, kv) -> bool:
        """Whether layer kv must be compacted now: its block of slack is full."""
        return kv.n - kv.first > self.tokens + self.block - 1

    def to_keep(self, kv) -> torch.Tensor:
        """The `budget` best slots of every row and KV head: ascending idx [B, H_kv, budget]."""
        budget = self.tokens
        return select(kv.pos[:, :, :kv.n], self.score(kv), budget, self.n_sink(budget), self.n_recent(budget))

    def evict_span(self, kv) -> tuple[int, int] | None:
        """The slots [a, b) to evict when this policy keeps only sinks and recent tokens (no ranking) and the
        cache is unpadded, so its slots (from `kv.first`) hold the sinks and then a run of consecutive positions:
        evicting moves the sinks or the window in a block (`LayerKV.slide`, `drop`); None: rank and gather (`to_keep`)."""
        budget = self.tokens
        s, r = self.n_sink(budget), self.n_recent(budget)
        if s + r != budget or kv.padded:
            return None
        return kv.first + s, kv.n - r

    def describe(self) -> str:
        block = f", block={self.block}" if self.block > 1 else ""
        changed = "".join(f", {f.name}={getattr(self.method, f.name)}" for f in fields(self.method or Scorer())
                          if getattr(self.method, f.name) != f.default)  # the method's fields not at their default
        return f"{self.name}(budget={self.budget}, positions={self.positions}{block}{changed})"


def select(pos: torch.Tensor, score: torch.Tensor, budget: int, n_sink: int, n_recent: int) -> torch.Tensor:
    """Slots to keep: pos, score [B, H, n] -> ascending idx [B, H, budget] (`scorers.choose` with one budget for
    every row). Sinks (positions < n_sink) and the n_recent latest positions are always kept; empty or padding
    slots (position -1) go first; the rest by descending score."""
    return choose(pos, score, budget, forced(pos, n_sink, n_recent))[0]


# ---------------------------------------------------------------- the policies: a method each


@dataclass
class Full(Policy):
    """No eviction: the cache grows with the stream (the reference every policy is compared to)."""
    scorer: ClassVar = None
    name: ClassVar[str] = "full"

    @property
    def capacity(self) -> None:
        return None

    def due(self, kv) -> bool:
        return False


@dataclass
class Window(Policy):
    """The most recent `budget` tokens only (breaks once the first tokens slide out)."""
    scorer: ClassVar = scorers.Recent
    name: ClassVar[str] = "window"


@dataclass
class Sink(Policy):
    """StreamingLLM: the first `n_sink` tokens (attention sinks) plus the most recent ones."""
    scorer: ClassVar = scorers.StreamingLLM
    name: ClassVar[str] = "sink"


@dataclass
class H2O(Policy):
    """Heavy-Hitter Oracle: highest accumulated attention plus a recent window (default half and half)."""
    scorer: ClassVar = scorers.H2O
    name: ClassVar[str] = "h2o"


@dataclass
class SinkH2O(Policy):
    """Sinks + heavy hitters + recent: the first `n_sink` tokens, then the rest split as in H2O."""
    scorer: ClassVar = scorers.SinkH2O
    name: ClassVar[str] = "sink_h2o"


@dataclass
class TOVA(Policy):
    """TOVA: keep the slots the current query attends to most (averaged over all heads) and the newest token."""
    scorer: ClassVar = scorers.TOVA
    name: ClassVar[str] = "tova"


@dataclass
class SnapKV(Policy):
    """SnapKV: the pooled attention of an observation window of the last queries (a ring of their rows, so it
    also works token by token); the window's own tokens are kept (at most half the budget)."""
    scorer: ClassVar = scorers.SnapKV
    name: ClassVar[str] = "snapkv"


@dataclass
class Knorm(Policy):
    """Keep the keys of smallest L2 norm."""
    scorer: ClassVar = scorers.Knorm
    name: ClassVar[str] = "knorm"


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (Full, Window, Sink, H2O, SinkH2O, TOVA, SnapKV, Knorm)}


def parse_budget(text: str | int | float) -> int | float:
    """'256' -> 256 tokens; '0.2' or '20%' -> fraction 0.2 (must be in (0, 1])."""
    if isinstance(text, (int, float)):
        return text
    t = text.strip()
    try:
        if t.endswith("%"):
            value = float(t[:-1]) / 100
        elif any(c in t for c in ".eE"):
            value = float(t)
        else:
            return int(t)
    except ValueError:
        raise AttnlabError(f"budget must be a token count (256) or a fraction (0.2, 20%), got {text!r}") from None
    if not 0 < value <= 1:
        raise AttnlabError(f"a fractional budget must be in (0, 1], got {text}")
    return value


def make_policy(name: str, budget: int | float | str = 256, positions: str = "cache", n_sink: int = 4,
                chunk: int = 512, block: int = 1, length: int | None = None) -> Policy:
    """The one way to build a policy: by name ('full', 'window', 'sink', 'h2o', 'sink_h2o', 'tova', 'snapkv',
    'knorm') or by a spec NAME:field=value[:field=value...] setting the method's fields ("snapkv:window_size=32").
    n_sink: the sinks of a method that keeps some (sink, sink_h2o; a spec's n_sink wins). length: resolve a
    fractional budget against a stream of that many tokens (checked against the method again)."""
    cls, fields = scorers.parse_spec(name, POLICIES, "policy", set())
    if cls.scorer is None:
        method = None
    else:
        if getattr(cls.scorer, "n_sink", 0):
            fields = {"n_sink": n_sink, **fields}
        method = cls.scorer(**fields)
    p = cls(budget=parse_budget(budget), positions=positions, chunk=chunk, block=block, method=method)
    return p.resolve(length) if length else p
