"""Conversations the server holds: one `Session` (KV cache) each, found again by rendered prefix.

Why: the OpenAI API resends the whole history every turn. A request whose rendered prompt
starts with the text a held cache already contains continues that cache and feeds only the
rest, so turn N costs what turn 1 costs. Idle sessions are evicted least recently used when
there are more than `max_sessions` or their KV buffers exceed `max_bytes`; a session serving
a request is never evicted nor handed to a second request (that one starts a fresh cache).

Memory is counted as allocated (every tensor the cache holds, `alloc_bytes`, at the capacity
the cache will have) and checked *before* every allocation: a new cache, a `full` cache growing
for a continued conversation (grown exactly to what the request needs, never by doubling) and
the one-off cache of a raw completion. Room is made by evicting idle sessions; a cache that
cannot fit is refused (400 if it never could, 503 while busy conversations hold the memory).

Sessions carry an `owner` (a hash of the caller's API key): prefix reuse, listings, lookups and
eviction only ever touch the caller's own. Each owner has its own quota of conversations and
bytes (`key_sessions`, `key_bytes`; by default the global limits split evenly between the keys),
so one key's new conversations evict only its own, or are refused.
"""
from __future__ import annotations

import math
import threading
import time
import uuid
from collections import Counter, OrderedDict
from dataclasses import dataclass, field, replace

import torch

from attnlab.kv.slots import held_tensors, storage_bytes
from attnlab.options import PolicySpec
from attnlab.serve.protocol import APIError
from attnlab.session import Session


def alloc_bytes(cache) -> int:
    """Every byte a cache holds: each layer's tensors (`LayerKV.tensors`: keys, values, scales, positions,
    Quest's page summaries and channel-major copy, the sinks' float32 copy, the policy's state) and the
    cache's own (its padding), each storage once. Read from where they are allocated, not from a list of
    names, so a new buffer is counted the day it is added."""
    return storage_bytes([*(t for layer in cache.layers for t in layer.tensors()), *held_tensors(vars(cache))])


def own_bytes(cache) -> int:
    """The bytes of a cache that do not grow with its slots (its padding row)."""
    return storage_bytes(held_tensors(vars(cache)))


@dataclass
class Held:
    """A stored conversation: its Session plus bookkeeping for the store and /v1/sessions."""
    id: str
    spec: PolicySpec          # how its cache is built; sessions are only reused under the same spec
    policy: object            # Policy or None (full)
    session: Session
    busy: bool = False
    turns: int = 0
    owner: str = ""
    stored: bool = True       # False: a raw completion's one-off cache (counted while it lives, never reused)
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)
    freed: int | None = None  # the bytes it held when `free` gave them back

    def nbytes(self) -> int:
        return alloc_bytes(self.session.cache) if self.freed is None else self.freed

    def free(self) -> None:
        """Give a dropped conversation's cache memory back now: every storage its cache holds resized to 0 bytes.

        Why not leave it to the garbage collector: something else may still reference the tensors (the native
        step keeps the buffers of the last cache bound to each of its rows until that row is bound to another:
        up to max_batch dropped caches, measured 300 MiB held beyond the count under load). A dropped cache is
        never stepped again (a row whose cache is another is bound anew), so its buffers may go."""
        if self.freed is None:
            self.freed = self.nbytes()
            cache = self.session.cache
            for t in [*(t for layer in cache.layers for t in layer.tensors()), *held_tensors(vars(cache))]:
                t.untyped_storage().resize_(0)

    def summary(self) -> dict:
        cache = self.session.cache
        return {"id": self.id, **self.spec.describe(), "turns": self.turns, "tokens_seen": cache.seen,
                "slots_kept": len(cache), "bytes": self.nbytes(), "busy": self.busy,
                "created": int(self.created), "last_used": int(self.last_used)}

    def cache_view(self) -> dict:
        """Which absolute positions each layer holds (union over KV heads, `heads`: how many hold each one)
        and how the policy classes them.

        sinks: positions < n_sink; recent: the trailing n_recent positions of the layer; anything
        else kept is a heavy hitter (kept for its score). For `full` every position is recent.
        """
        cache = self.session.cache
        n = len(cache)
        layers, heads = [], []
        for layer in cache.layers:
            pos, count = layer.pos[:, :, :layer.n].flatten().unique(return_counts=True)
            keep = pos >= 0
            layers.append(pos[keep].tolist())
            heads.append(count[keep].tolist())
        if self.policy is None:
            n_sink, n_recent = 0, cache.seen
        else:
            budget = self.policy.tokens
            n_sink, n_recent = self.policy.n_sink(budget), self.policy.n_recent(budget)
        return {"id": self.id, **self.spec.describe(), "tokens_seen": cache.seen, "slots_kept": n,
                "kv_heads": cache.layers[0].pos.shape[1], "n_sink": n_sink, "n_recent": n_recent,
                "layers": layers, "heads": heads}


class SessionStore:
    """Thread-safe LRU store of conversations, bounded by count and by allocated bytes, per owner and in total."""

    def __init__(self, lm, max_sessions: int = 16, max_bytes: int = 1 << 30, chunk: int = 512,
                 key_sessions: int | None = None, key_bytes: int | None = None):
        self.lm, self.max_sessions, self.max_bytes, self.chunk = lm, max_sessions, max_bytes, chunk
        self.key_sessions, self.key_bytes = key_sessions or max_sessions, key_bytes or max_bytes
        self.sessions: OrderedDict[str, Held] = OrderedDict()  # least recently used first
        self.loose: dict[str, Held] = {}                        # one-off caches being served
        self.lock = threading.RLock()
        self.evicted: Counter = Counter()                       # per owner
        self.per_slot: dict[tuple, float] = {}                  # allocated bytes per slot, by policy kind
        self.own = 0                                            # a cache's bytes that do not grow with its slots

    def policy(self, spec: PolicySpec):
        """The Policy object of a spec (None for full), with this store's prefill chunk."""
        return replace(spec, chunk=self.chunk).build()

    def slot_bytes(self, spec: PolicySpec) -> float:
        """Bytes one slot of a cache of this policy allocates, measured once on a small cache (model thread).

        Why measured: a policy's per-slot state (attention scores, an observation window) is allocated
        on the first step and differs by policy; the budget and n_sink do not change it per slot. A bounded
        probe is fed past its budget, so what its first eviction allocates (the sinks' float32 copy) is in."""
        kind = (spec.name, spec.positions, spec.block)
        if kind not in self.per_slot:
            if spec.name == "full":
                probe = self.lm.new_cache(capacity=16, max_capacity=16)
            else:
                probe = self.lm.new_cache(policy=replace(spec, budget=32, n_sink=min(spec.n_sink, 4), chunk=8).build())
            fed = 16 if spec.name == "full" else 48
            self.lm.prefill(torch.zeros(1, fed, dtype=torch.long), probe, 8)  # allocates the policy's state
            self.own = own_bytes(probe)
            self.per_slot[kind] = (alloc_bytes(probe) - self.own) / probe.layers[0].capacity
        return self.per_slot[kind]

    def slots(self, spec: PolicySpec, tokens: int) -> int:
        """Slots a new cache has: a bounded policy's capacity, else (full) the request's tokens."""
        policy = self.policy(spec)
        return policy.capacity if policy is not None else max(1, min(tokens, self.lm.cfg.context_length))

    def cache_bytes(self, spec: PolicySpec, tokens: int = 0) -> int:
        """Bytes a new cache of this spec allocates for a request of `tokens` (prompt + max_tokens)."""
        return math.ceil(self.slots(spec, tokens) * self.slot_bytes(spec)) + self.own

    def new_cache(self, spec: PolicySpec, tokens: int):
        policy = self.policy(spec)
        if policy is None:  # sized for this request exactly; grown exactly by `grow`
            return self.lm.new_cache(capacity=self.slots(spec, tokens), max_capacity=self.lm.cfg.context_length)
        return self.lm.new_cache(policy=policy)

    def acquire(self, text: str, spec: PolicySpec, owner: str = "", tokens: int = 0) -> tuple[Held, bool]:
        """The owner's idle session of this spec whose text is the longest prefix of `text`, or a new one.

        tokens: prompt + max_tokens, the slots a new `full` cache is given (checked against the limits first).
        Returns (held, reused); the session is marked busy until `release`.
        """
        with self.lock:
            best = None
            for held in self.sessions.values():
                if (not held.busy and held.owner == owner and held.spec == spec and held.session.matches(text)
                        and (best is None or len(held.session.text) > len(best.session.text))):
                    best = held
            if best is not None:
                best.busy = True
                self.sessions.move_to_end(best.id)
                return best, True
            need = self.cache_bytes(spec, tokens)
            self.make_room(owner, need, need, new=True)
            held = Held(uuid.uuid4().hex[:12], spec, self.policy(spec), Session(self.lm, self.new_cache(spec, tokens),
                        self.chunk), busy=True, owner=owner)
            self.sessions[held.id] = held
            return held, False

    def one_off(self, spec: PolicySpec, owner: str, tokens: int) -> Held:
        """A counted cache that is never stored nor reused (raw completions); `release` frees it."""
        with self.lock:
            need = self.cache_bytes(spec, tokens)
            self.make_room(owner, need, need)
            held = Held(uuid.uuid4().hex[:12], spec, self.policy(spec), Session(self.lm, self.new_cache(spec, tokens),
                        self.chunk), busy=True, owner=owner, stored=False)
            self.loose[held.id] = held
            return held

    def grow(self, held: Held, tokens: int) -> None:
        """Give a `full` cache room for `tokens` in all, exactly, after checking the limits (before any work)."""
        cache = held.session.cache
        have = cache.layers[0].capacity
        if held.policy is not None or tokens <= have:
            return
        with self.lock:
            extra = math.ceil((tokens - have) * self.slot_bytes(held.spec))
            self.make_room(held.owner, extra, held.nbytes() + extra, keep=held)
            cache.reserve(tokens)

    def make_room(self, owner: str, need: int, whole: int, new: bool = False, keep: Held | None = None) -> None:
        """Evict the owner's idle sessions (LRU) until `need` more bytes fit its quota and the total; else APIError.

        whole: what the cache in question will hold in all (400 when that alone is over a limit).
        new: a session is being added (the count quotas apply). Other owners' sessions are never evicted.
        """
        mib, cap = 1 << 20, min(self.max_bytes, self.key_bytes)
        if whole > cap:
            raise APIError(400, f"this conversation's cache needs {whole / mib:.0f} MiB; this server holds at most "
                                f"{cap / mib:.0f} MiB of cache per key (lower attnlab.budget or max_tokens, or start "
                                f"a new conversation)", param="attnlab", code="cache_limit_exceeded")
        with self.lock:
            def bytes_fit() -> bool:
                mine = sum(h.nbytes() for h in self.held() if h.owner == owner)
                return mine + need <= self.key_bytes and self.total_bytes() + need <= self.max_bytes

            def count_fits() -> bool:
                mine = sum(1 for h in self.sessions.values() if h.owner == owner)
                return not new or (mine < self.key_sessions and len(self.sessions) < self.max_sessions)
            for sid in list(self.sessions):
                if bytes_fit() and count_fits():
                    break
                h = self.sessions[sid]
                if h.owner == owner and not h.busy and h is not keep:
                    self.drop(sid)
            if not bytes_fit():  # (a count over the quota while all the owner's are busy is trimmed at release)
                raise APIError(503, "server busy: the conversations being served hold the cache memory this one "
                                    "needs; retry later", type="server_error", code="cache_full")

    def held(self):
        return [*self.sessions.values(), *self.loose.values()]

    def total_bytes(self) -> int:
        return sum(h.nbytes() for h in self.held())

    def drop(self, sid: str) -> None:
        held = self.sessions.pop(sid)
        self.evicted[held.owner] += 1
        held.free()

    def release(self, held: Held, keep: bool = True) -> None:
        """Hand a session back (keep=False drops it, e.g. after a failed request), then trim the owner's LRU."""
        with self.lock:
            held.busy, held.last_used = False, time.time()
            if not held.stored:
                self.loose.pop(held.id, None)
                held.free()
                return
            if not keep:
                self.sessions.pop(held.id, None)
                held.free()
            elif held.id in self.sessions:
                self.sessions.move_to_end(held.id)
            self._evict(held.owner)

    def _evict(self, owner: str) -> None:
        """Drop the owner's idle sessions, LRU first, while it holds more than its quotas or the total is over."""
        def over() -> bool:
            mine = [h for h in self.sessions.values() if h.owner == owner]
            return (len(mine) > self.key_sessions or sum(h.nbytes() for h in mine) > self.key_bytes
                    or len(self.sessions) > self.max_sessions or self.total_bytes() > self.max_bytes)
        for sid in list(self.sessions):
            if not over():
                break
            if self.sessions[sid].owner == owner and not self.sessions[sid].busy:
                self.drop(sid)

    def get(self, sid: str, owner: str | None = None) -> Held | None:
        """The session `sid` if it exists and belongs to `owner` (None: any owner, the admin view)."""
        with self.lock:
            held = self.sessions.get(sid)
        return held if held is not None and (owner is None or held.owner == owner) else None

    def summary(self, owner: str | None = None) -> dict:
        """The owner's conversations (None: everyone's), most recent first, with its quotas and counters."""
        with self.lock:
            items = [h.summary() for h in reversed(self.sessions.values()) if owner is None or h.owner == owner]
            mine = [h for h in self.held() if owner is None or h.owner == owner]
            evicted = sum(self.evicted.values()) if owner is None else self.evicted[owner]
        return {"object": "list", "data": items,
                "max_sessions": self.max_sessions if owner is None else self.key_sessions,
                "max_bytes": self.max_bytes if owner is None else self.key_bytes,
                "total_bytes": sum(h.nbytes() for h in mine), "evicted": evicted}
