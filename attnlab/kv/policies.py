"""KV-cache eviction policies: which cached tokens to keep when the budget is reached.

Why this module exists: attention is sparse (a few sink and heavy-hitter tokens
take most of the mass), so a cache of a fixed size can serve an unbounded
stream. Each policy is a small dataclass with one method, `score(kv)` ->
[B, H_kv, n] (higher = keep), plus how many leading sink tokens and trailing
recent tokens it always keeps. Everything else -- when to evict, the top-k,
forcing sinks and the recent window, compacting the cache with `kv.keep(idx)`
and carrying per-slot scores along -- lives once, in `Policy`.

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
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
import torch.nn.functional as F

from attnlab.errors import AttnlabError
from attnlab.kv.slots import POSITIONS


@dataclass
class Policy:
    """Base: keep `budget` slots per layer and KV head (int tokens, or a fraction in (0, 1]).

    A fractional budget is a share of the tokens the cache will see; turn it into tokens with
    `resolve(length)` before building a cache. `chunk` is the largest prefill chunk the cache
    must hold on top of the budget. `block` is block eviction: let the cache fill to
    budget + block - 1 slots and then evict down to budget in one go, so compaction happens
    once every `block` tokens instead of at every step; block 1 is the exact per-token policy
    (for sink and window the sinks move up a slot per step, `LayerKV.slide`).
    """
    budget: int | float = 256
    positions: str = "cache"
    chunk: int = 512
    block: int = 1
    needs_probs: ClassVar[bool] = False
    name: ClassVar[str] = "base"

    def __post_init__(self):
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

    # ---------------------------------------------------------------- what a subclass defines

    def n_sink(self, budget: int) -> int:
        """Leading tokens (by position) that are never evicted."""
        return 0

    def n_recent(self, budget: int) -> int:
        """Trailing tokens (by position) that are never evicted."""
        return 0

    def check_budget(self, budget: int) -> None:
        """Raise ValueError when budget cannot hold what the policy always keeps."""

    def accumulate(self, kv, probs: torch.Tensor | None) -> None:
        """Update kv.policy_state from this step's attention (probs [B, H_kv, T, n], group-averaged)."""

    def score(self, kv) -> torch.Tensor:
        """[B, H_kv, n] float: how much each slot deserves to stay (higher = keep)."""
        return torch.zeros(kv.pos.shape[0], kv.pos.shape[1], kv.n)

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
        """A copy whose fractional budget is turned into tokens: ceil(fraction * length)."""
        if isinstance(self.budget, int):
            return self
        return replace(self, budget=max(1, math.ceil(self.budget * length)))

    def observe(self, kv, probs: torch.Tensor) -> None:
        """This step's attention probabilities [B, Hq, T, n] over layer kv's slots (when needs_probs)."""
        B, Hq, T, n = probs.shape
        H = kv.pos.shape[1]
        probs = probs.view(B, H, Hq // H, T, n).mean(2)
        probs = probs * (kv.pos[:, :, n - T:n, None] >= 0)  # padding queries carry no evidence
        self.accumulate(kv, probs)

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
        return f"{self.name}(budget={self.budget}, positions={self.positions}{block})"


def select(pos: torch.Tensor, score: torch.Tensor, budget: int, n_sink: int, n_recent: int) -> torch.Tensor:
    """Slots to keep: pos, score [B, H, n] -> ascending idx [B, H, budget].

    Sinks (positions < n_sink) and the n_recent latest positions are always kept; empty or
    padding slots (position -1) go first; the rest by descending score.
    """
    valid = pos >= 0
    latest = pos.max(-1, keepdim=True).values
    forced = valid & ((pos < n_sink) | (pos > latest - n_recent))
    s = score.float().masked_fill(forced, float("inf")).masked_fill(~valid, float("-inf"))
    return s.topk(budget, dim=-1, sorted=False).indices.sort(-1).values


def _slot_state(kv, key: str, *lead: int) -> torch.Tensor:
    """A zero-initialised per-slot float tensor [B, H_kv, *lead, capacity] kept in kv.policy_state."""
    state = kv.policy_state.get(key)
    shape = (*kv.pos.shape[:2], *lead, kv.capacity)
    if state is None or state.shape != shape:
        state = torch.zeros(shape)
        kv.policy_state[key] = state
    return state


# ---------------------------------------------------------------- the policies


@dataclass
class Full(Policy):
    """No eviction: the cache grows with the stream (the reference every policy is compared to)."""
    name: ClassVar[str] = "full"

    @property
    def capacity(self) -> None:
        return None

    def due(self, kv) -> bool:
        return False


@dataclass
class Window(Policy):
    """The most recent `budget` tokens only (breaks once the first tokens slide out)."""
    name: ClassVar[str] = "window"

    def n_recent(self, budget):
        return budget


@dataclass
class Sink(Policy):
    """StreamingLLM: the first `sinks` tokens (attention sinks) plus the most recent ones."""
    sinks: int = 4
    name: ClassVar[str] = "sink"

    def check_budget(self, budget):
        if self.sinks < 0:
            raise AttnlabError(f"n_sink must be >= 0, got {self.sinks}")
        if budget <= self.sinks:
            raise AttnlabError(f"budget {budget} must exceed n_sink {self.sinks}")

    def n_sink(self, budget):
        return self.sinks

    def n_recent(self, budget):
        return budget - self.sinks


@dataclass
class H2O(Policy):
    """Heavy-Hitter Oracle: highest accumulated attention plus a recent window (default half and half).

    Score of a slot = attention it has received, summed over every query since it entered
    (averaged over the query heads of its KV group).
    """
    recent_ratio: float = 0.5
    needs_probs: ClassVar[bool] = True
    name: ClassVar[str] = "h2o"

    def check_budget(self, budget):
        if not 0 <= self.recent_ratio <= 1:
            raise AttnlabError(f"recent_ratio must be in [0, 1], got {self.recent_ratio}")
        if budget < 2:
            raise AttnlabError(f"{self.name} needs a budget of at least 2 tokens, got {budget}")

    def n_recent(self, budget):
        return max(1, budget - int(budget * (1 - self.recent_ratio)))

    def accumulate(self, kv, probs):
        acc = _slot_state(kv, "acc")
        acc[..., :probs.shape[-1]] += probs.sum(2)

    def score(self, kv):
        return kv.policy_state["acc"][..., :kv.n]


@dataclass
class SinkH2O(H2O):
    """Sinks + heavy hitters + recent: the first `sinks` tokens, then the rest split as in H2O."""
    sinks: int = 4
    name: ClassVar[str] = "sink_h2o"

    def check_budget(self, budget):
        super().check_budget(budget)
        if self.sinks < 0:
            raise AttnlabError(f"n_sink must be >= 0, got {self.sinks}")
        if budget <= self.sinks + 1:
            raise AttnlabError(f"budget {budget} must exceed n_sink {self.sinks} + 1")

    def n_sink(self, budget):
        return self.sinks

    def n_recent(self, budget):
        return super().n_recent(budget - self.sinks)


@dataclass
class TOVA(Policy):
    """TOVA (Oren et al. 2024): keep the slots the current query attends to most; no fixed window."""
    needs_probs: ClassVar[bool] = True
    name: ClassVar[str] = "tova"

    def accumulate(self, kv, probs):
        last = _slot_state(kv, "last")
        last.zero_()
        last[..., :probs.shape[-1]] = probs[:, :, -1]

    def score(self, kv):
        return kv.policy_state["last"][..., :kv.n]


@dataclass
class SnapKV(Policy):
    """SnapKV (Li et al. 2024): score by the attention of an observation window of recent queries.

    A slot's score is the attention it got from the last `window` queries (a ring buffer
    per KV head, so it also works token by token), max-pooled over `kernel` neighbouring
    slots to keep local context; the observation window itself is always kept (at most half
    the budget).
    """
    window: int = 32
    kernel: int = 7
    needs_probs: ClassVar[bool] = True
    name: ClassVar[str] = "snapkv"

    def check_budget(self, budget):
        if self.window < 1 or self.kernel < 1 or self.kernel % 2 == 0:
            raise AttnlabError(f"window must be >= 1 and kernel odd, got {self.window}, {self.kernel}")

    def n_recent(self, budget):
        return min(self.window, budget // 2)

    def accumulate(self, kv, probs):
        obs = _slot_state(kv, "obs", self.window)
        rows = probs[:, :, -self.window:]
        t, n = rows.shape[2], rows.shape[3]
        ptr = kv.policy_state.get("ptr", 0)
        at = (ptr + torch.arange(t)) % self.window
        obs[:, :, at] = 0.0
        obs[:, :, at, :n] = rows
        kv.policy_state["ptr"] = (ptr + t) % self.window

    def score(self, kv):
        s = kv.policy_state["obs"][..., :kv.n].sum(2)  # [B, H, n]
        B, H, n = s.shape
        return F.max_pool1d(s.view(B * H, 1, n), self.kernel, 1, self.kernel // 2).view(B, H, n)


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (Full, Window, Sink, H2O, SinkH2O, TOVA, SnapKV)}


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
                chunk: int = 512, block: int = 1) -> Policy:
    """A policy by name ('full', 'window', 'sink', 'h2o', 'sink_h2o', 'tova', 'snapkv')."""
    cls = POLICIES.get(name)
    if cls is None:
        raise AttnlabError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
    extra = {"sinks": n_sink} if cls in (Sink, SinkH2O) else {}
    return cls(budget=parse_budget(budget), positions=positions, chunk=chunk, block=block, **extra)
