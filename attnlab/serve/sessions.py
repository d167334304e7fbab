"""Conversations the server holds: one `Session` (KV cache) each, found again by rendered prefix.

Why: the OpenAI API resends the whole history every turn. A request whose rendered prompt
starts with the text a held cache already contains continues that cache and feeds only the
rest, so turn N costs what turn 1 costs. Idle sessions are evicted least recently used when
there are more than `max_sessions` or their KV buffers exceed `max_bytes`; a session serving
a request is never evicted nor handed to a second request (that one starts a fresh cache).

A new cache is checked against `max_bytes` before it is allocated: idle sessions are evicted
to make room, and a cache that cannot fit is refused (400 if it never could, 503 while busy
conversations hold the memory). Sessions carry an `owner` (a hash of the caller's API key):
prefix reuse, listings and lookups only ever see the caller's own.
"""
from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field, replace

from attnlab.options import PolicySpec
from attnlab.serve.protocol import APIError
from attnlab.session import Session


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
    created: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)

    def nbytes(self) -> int:
        return self.session.cache.nbytes()

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
            pos, count = layer.pos[:, :, :n].flatten().unique(return_counts=True)
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
    """Thread-safe LRU store of conversations, bounded by count and by KV bytes."""

    def __init__(self, lm, max_sessions: int = 16, max_bytes: int = 1 << 30, chunk: int = 128):
        self.lm, self.max_sessions, self.max_bytes, self.chunk = lm, max_sessions, max_bytes, chunk
        self.sessions: OrderedDict[str, Held] = OrderedDict()  # least recently used first
        self.lock = threading.Lock()
        self.evicted = 0
        probe = lm.new_cache(capacity=8, max_capacity=8)
        self.slot_bytes = probe.nbytes() / 8  # KV bytes per cache slot (all layers), for checks before allocating
        del probe

    def policy(self, spec: PolicySpec):
        """The Policy object of a spec (None for full), with this store's prefill chunk."""
        return replace(spec, chunk=self.chunk).build()

    def acquire(self, text: str, spec: PolicySpec, owner: str = "", tokens: int = 0) -> tuple[Held, bool]:
        """The owner's idle session of this spec whose text is the longest prefix of `text`, or a new one.

        tokens: how many slots a new `full` cache will need (prompt + max_tokens), for the byte check.
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
        policy = self.policy(spec)
        self.make_room(self.cache_bytes(policy, tokens))
        if policy is None:  # grows on demand, never past what the model was trained on
            cache = self.lm.new_cache(capacity=256, max_capacity=self.lm.cfg.context_length)
        else:
            cache = self.lm.new_cache(policy=policy)
        held = Held(uuid.uuid4().hex[:12], spec, policy, Session(self.lm, cache, self.chunk), busy=True, owner=owner)
        with self.lock:
            self.sessions[held.id] = held
        return held, False

    def cache_bytes(self, policy, tokens: int = 0) -> int:
        """KV bytes a new cache of this policy will hold (full: `tokens` slots, at least its first 256)."""
        slots = policy.capacity if policy is not None and getattr(policy, "capacity", None) else max(tokens, 256)
        return int(slots * self.slot_bytes)

    def make_room(self, need: int) -> None:
        """Evict idle sessions until `need` more bytes fit under max_bytes; APIError if they cannot."""
        mib = 1 << 20
        if need > self.max_bytes:
            raise APIError(400, f"this conversation's cache needs {need / mib:.0f} MiB; this server holds at most "
                                f"{self.max_bytes / mib:.0f} MiB of cache (lower attnlab.budget)", param="attnlab",
                           code="cache_limit_exceeded")
        with self.lock:
            for sid in list(self.sessions):
                if self.total_bytes() + need <= self.max_bytes and len(self.sessions) < self.max_sessions:
                    break
                if not self.sessions[sid].busy:
                    del self.sessions[sid]
                    self.evicted += 1
            if self.total_bytes() + need > self.max_bytes:
                raise APIError(503, "server busy: the conversations being served hold the cache memory this one "
                                    "needs; retry later", type="server_error", code="cache_full")

    def total_bytes(self) -> int:
        return sum(h.nbytes() for h in self.sessions.values())

    def release(self, held: Held, keep: bool = True) -> None:
        """Hand a session back (keep=False drops it, e.g. after a failed request), then evict LRU."""
        with self.lock:
            held.busy, held.last_used = False, time.time()
            if not keep:
                self.sessions.pop(held.id, None)
            elif held.id in self.sessions:
                self.sessions.move_to_end(held.id)
            self._evict()

    def _evict(self) -> None:
        def over() -> bool:
            return (len(self.sessions) > self.max_sessions
                    or sum(h.nbytes() for h in self.sessions.values()) > self.max_bytes)
        for sid in list(self.sessions):
            if not over():
                break
            if not self.sessions[sid].busy:
                del self.sessions[sid]
                self.evicted += 1

    def get(self, sid: str, owner: str | None = None) -> Held | None:
        """The session `sid` if it exists and belongs to `owner` (None: any owner, the admin view)."""
        with self.lock:
            held = self.sessions.get(sid)
        return held if held is not None and (owner is None or held.owner == owner) else None

    def summary(self, owner: str | None = None) -> dict:
        """The owner's conversations (None: everyone's), most recent first, with the store's totals."""
        with self.lock:
            items = [h.summary() for h in reversed(self.sessions.values()) if owner is None or h.owner == owner]
        return {"object": "list", "data": items, "max_sessions": self.max_sessions, "max_bytes": self.max_bytes,
                "total_bytes": sum(i["bytes"] for i in items), "evicted": self.evicted}
