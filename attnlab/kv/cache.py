"""The KV cache: every layer's slots (`attnlab.kv.slots`), the positions of the next tokens, the eviction
policy, and saving a stream to resume it.

The cache owns its eviction policy. The engine's step calls `begin` (positions, growth) before
the network and `advance` (counting, eviction) after it, so a layer's `update` is tensor work
only and a decode step can be compiled. A policy that scores by attention gets the
probabilities because the cache observes the pass (`observers`, `record`), the same way the
analysis recorders do. How keys are stored and moved (the position conventions, the shift,
int8 codes) is told in `attnlab.kv.slots`.
"""
from __future__ import annotations

import torch

from attnlab.errors import AttnlabError
from attnlab.kv.slots import POSITIONS, LayerKV, Step
from attnlab.rope import Rope

KEY_FORMAT = "rotated-at-slot"  # what cache_state() stores; older states held pre-RoPE `cache` keys


class KVCache:
    """All layers' slots, the eviction policy, and the bookkeeping that turns token counts into positions.

    A policy with a budget fixes the cache's size (`policy.capacity`) and position convention; without
    one the cache grows (amortised doubling) up to max_capacity. pad: the left padding of each row of
    a batch of prompts of unequal length (its slots hold position -1 and are never attended). page: keep
    Quest's page summaries of this size in every layer (None: none); channel_keys: and a channel-major copy of
    the keys (Quest with CHANNELS > 0).
    """

    def __init__(self, n_layers: int, batch: int, heads: int, head_dim: int, rope: Rope,
                 dtype: torch.dtype = torch.float32, capacity: int = 256, positions: str = "original",
                 max_capacity: int | None = None, policy=None, window: int | None = None,
                 pad: list[int] | None = None, page: int | None = None, channel_keys: bool = False):
        if getattr(policy, "capacity", None):
            capacity = max_capacity = policy.capacity
            positions = policy.positions
        if positions not in POSITIONS:
            raise AttnlabError(f"unknown positions {positions!r}; choose from {', '.join(POSITIONS)}")
        self.layers = [LayerKV(batch, heads, head_dim, capacity, dtype, rope, positions, max_capacity, window, page,
                               channel_keys) for _ in range(n_layers)]
        self.batch, self.policy, self.positions = batch, policy, positions
        self.seen = 0                                   # tokens fed per row, padding included
        self.kept_from = 0  # `seen` after the last eviction: the tokens fed since hold the last slots, one each
        self.shift = 0  # `cache` positions: keys and queries are rotated at slot + shift (see LayerKV.keep)
        self.pad = torch.zeros(batch, dtype=torch.long) if pad is None else torch.as_tensor(pad, dtype=torch.long)
        # the cache observes the forward pass only for a policy that scores by attention
        self.observers = (self,) if policy is not None and policy.needs_probs else ()
        self.needs_probs = bool(self.observers)

    @property
    def max_chunk(self) -> int | None:
        """The most tokens one step may add: a bounded cache has room for one policy chunk (None = any)."""
        return self.policy.chunk if getattr(self.policy, "capacity", None) else None

    def record(self, i: int, name: str, t: torch.Tensor) -> None:
        """Observer hook of the forward pass: layer i's attention probabilities go to the policy."""
        if name == "probs":
            self.policy.observe(self.layers[i], t)

    def begin(self, T: int, rope: Rope, real: bool = False) -> "Step":
        """Positions and rotation tables of the next T tokens, computed once for all layers; makes room."""
        start, first = self.layers[0].n, self.layers[0].first
        if first and start + T > self.layers[0].capacity:  # the slots evicted by `slide` are needed now
            new = self._shift_after(first)
            for layer in self.layers:
                layer.drop(0, first, self.shift, new)
            self.shift, start = new, self.layers[0].n
        for layer in self.layers:
            layer._reserve(start + T)
        pos = self.seen + torch.arange(T)[None, :] - self.pad[:, None]
        padded = bool(self.seen < int(self.pad.max()))
        pos = torch.where(pos >= 0, pos, -1) if padded else pos
        if self.positions == "cache":  # queries and new keys sit at their slots
            q_pos = torch.arange(start, start + T).expand(self.batch, T) + self.shift
        else:
            q_pos = pos
        return Step(pos, q_pos, rope.rotation(q_pos, real=real), padded, start)

    def reserve(self, slots: int) -> None:
        """Grow every layer to hold `slots` tokens now, exactly (no doubling): for a caller that sized the
        memory beforehand (the server's cache limit) and must not see it grow past that."""
        for layer in self.layers:
            layer._reserve(slots, exact=True)

    def advance(self, T: int) -> None:
        """After a step: count its tokens and evict what the policy drops (every layer's attention is done)."""
        shift = new = self.shift
        for i, layer in enumerate(self.layers):
            layer.n += T
            layer.paged = layer.n  # the native step summarised its key in place (eager: `update` did)
            if self.policy is not None and self.policy.due(layer):
                self.kept_from = self.seen + T
                span = self.policy.evict_span(layer)
                if span and layer.page is None and layer.window is None:  # no copy of the window at all
                    layer.slide(*span, shift)
                    continue
                idx = None if span else self.policy.to_keep(layer)
                if i == 0:  # every layer evicts alike: one new shift for all
                    new = self._shift_after(span[1] - span[0] if span else layer.n - idx.shape[-1])
                if span:
                    layer.drop(*span, shift, new)
                else:
                    layer.keep(idx, shift, new)
        self.shift = new
        self.seen += T

    def _shift_after(self, evicted: int) -> int:
        """The shift after evicting `evicted` tokens: grown by them (keys behind the evicted keep their rotation),
        or 0 (every key turned) once it would pass the capacity, so rotation angles stay below twice the
        capacity; always 0 under dynamic RoPE, whose frequencies follow the largest position."""
        layer = self.layers[0]
        new = self.shift + evicted
        return 0 if self.positions != "cache" or layer.rope.dynamic or new > layer.capacity else new

    @torch.inference_mode()
    def truncate(self, length: int) -> None:
        """Cut the cache back to what it held after its first `length` tokens (`seen`, padding included): reuse
        one prefill for several continuations, or drop a speculative step's rejected draft tokens. The tokens fed
        since hold the last slots, one each, so they go: positions, the policy's per-slot state, Quest's page
        holding the cut (and int8 codes and scales, never read past `n`). Refused where the policy evicted after
        `length` tokens (the cache no longer holds what it held then) or scores by attention (its scores have
        counted the later tokens' queries)."""
        if not 0 <= length <= self.seen:
            raise AttnlabError(f"cannot truncate a cache of {self.seen} tokens to {length}")
        if length < self.kept_from:
            raise AttnlabError(f"cannot truncate this cache to {length} tokens: its policy evicted after "
                               f"{self.kept_from} tokens (rewind only to {self.kept_from} or later)")
        if length < self.seen and self.needs_probs:
            raise AttnlabError(f"cannot truncate this cache: its policy ({type(self.policy).__name__}) scores by "
                               "attention, and its scores have counted the tokens past the cut")
        drop = self.seen - length
        for layer in self.layers:
            n = layer.n - drop
            layer._clear(n, layer.n)
            layer.n = n
            if layer.page:  # the page holding the cut loses the keys past it
                layer._summarize(n, n)
        self.seen = length

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    def __len__(self) -> int:
        """Tokens held (slots `slide` left unread before `first` do not count)."""
        return self.layers[0].n - self.layers[0].first


def cache_state(cache: KVCache) -> dict:
    """Everything needed to resume a stream later: slots, positions and policy state of every layer."""
    layers = [{**{name: getattr(l, name)[:, :, :l.n].clone() for name in l.buffers()},
               "pos": l.pos[:, :, :l.n].clone(), "n": l.n, "natural": l.natural, "padded": l.padded, "capacity": l.capacity,
               "home": l._home, "first": l.first,
               "policy_state": {key: (val.clone() if isinstance(val, torch.Tensor) else val)
                                for key, val in l.policy_state.items()}} for l in cache.layers]
    return {"layers": layers, "seen": cache.seen, "pad": cache.pad.clone(), "keys": KEY_FORMAT, "shift": cache.shift}


def load_cache_state(cache: KVCache, state: dict) -> None:
    """Restore cache_state() output into a cache built the same way (same model, batch and policy)."""
    if state.get("keys") != KEY_FORMAT:
        raise AttnlabError("the saved cache was written by an older attnlab (keys stored differently); rerun with --force")
    for layer, s in zip(cache.layers, state["layers"], strict=True):
        layer._reserve(s["capacity"])
        n = s["n"]
        if set(layer.buffers()) != set(s) & {"k", "v", "k_scale", "v_scale"}:
            raise AttnlabError("the saved cache was stored in another KV dtype than this one (int8 vs float)")
        for name in (*layer.buffers(), "pos"):
            getattr(layer, name)[:, :, :n] = s[name]
        layer.pos[:, :, n:] = -1
        layer.n, layer.natural, layer.padded = n, s["natural"], s["padded"]
        layer.policy_state = dict(s["policy_state"])
        layer._home, layer.first = s.get("home"), s.get("first", 0)
        if layer.page and n:
            layer._summarize(0, n)
    cache.seen, cache.pad, cache.shift = state["seen"], state["pad"].clone(), state.get("shift", 0)
    cache.kept_from = cache.seen if cache.policy is not None else 0  # when it last evicted is not saved
