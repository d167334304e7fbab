"""Generation slots shared fairly between API keys.

Why not one semaphore: with a server-wide count, eight long streams of one key held every slot and
another key's four-token request waited the full queue timeout (issue 61). Here each key has its own
queue, slots are handed round robin over the keys that wait, and a key is held to its share while
others want slots:

- A key below its fair share (the slots divided between the configured keys) takes any free slot. Beyond
  it, a key takes one only if that leaves a slot free for each other key that holds none (at most a
  quarter of the slots kept so), so a key that arrives later starts at once instead of waiting for a
  long generation to end. Alone on a server with one key (or none) a key may use every slot; with
  several keys, every slot but that reserve.
- Freed slots go round robin over the waiting keys, those below their share of the slots between the
  keys that want them now first.
- key_active caps one key's generations outright; key_queued caps its waiting requests (beyond: 429).

A slot is held from admission until its generation ends (the scheduler's last event), not until the
client has read the reply, so a slow reader holds buffers (bounded by max_tokens and the socket), never
a slot. Runs on the server's event loop only (no locks).
"""
from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict, deque

from attnlab.serve.protocol import APIError


class Slot:
    """One granted slot; `release` (idempotent) hands it back."""

    def __init__(self, admission: Admission, owner: str):
        self.admission, self.owner, self.held = admission, owner, True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.admission.release(self.owner)


class Admission:
    def __init__(self, slots: int, owners: int = 1, key_active: int | None = None, key_queued: int | None = None,
                 timeout: float = 60.0):
        self.slots, self.owners, self.timeout = slots, owners, timeout
        self.key_active, self.key_queued = key_active or slots, key_queued or 4 * slots
        self.active: Counter = Counter()
        self.waiting: OrderedDict[str, deque[asyncio.Future]] = OrderedDict()  # round-robin order of keys

    @property
    def busy(self) -> int:
        return sum(self.active.values())

    def share(self) -> int:
        contenders = {k for k, n in self.active.items() if n} | set(self.waiting)
        return max(1, self.slots // max(1, len(contenders)))

    def reserve(self, owner: str) -> int:
        """Free slots a key above its share must leave: one per other key that holds none (capped)."""
        if self.owners <= 1:
            return 0
        holding = sum(1 for k, n in self.active.items() if n and k != owner)
        return min(max(0, self.owners - 1 - holding), max(1, self.slots // 4))

    def may_take(self, owner: str) -> bool:
        free, mine = self.slots - self.busy, self.active[owner]
        if free <= 0 or mine >= self.key_active:
            return False
        return mine < max(1, self.slots // self.owners) or free - 1 >= self.reserve(owner)

    async def acquire(self, owner: str) -> Slot:
        """A slot for `owner`: at once if its turn, else after the keys ahead of it; 503 after `timeout` s,
        429 when the key already has key_queued requests waiting."""
        if owner not in self.waiting and self.may_take(owner):
            return self.grant(owner)
        queue = self.waiting.setdefault(owner, deque())
        if len(queue) >= self.key_queued:
            if not queue:
                del self.waiting[owner]
            raise APIError(429, f"too many requests waiting for this key ({self.key_queued}); retry later",
                           type="rate_limit_error", code="rate_limit_exceeded")
        future = asyncio.get_running_loop().create_future()
        queue.append(future)
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.timeout)
        except BaseException as e:  # timed out, or the client left while waiting
            if future.done() and not future.cancelled():
                future.result().release()  # granted just as it gave up
            else:
                future.cancel()
            self.forget(owner, future)
            if isinstance(e, TimeoutError):
                raise APIError(503, f"server busy: no generation slot freed within {self.timeout:g} s",
                               type="server_error", code="queue_timeout") from None
            raise

    def grant(self, owner: str) -> Slot:
        self.active[owner] += 1
        return Slot(self, owner)

    def forget(self, owner: str, future: asyncio.Future) -> None:
        queue = self.waiting.get(owner)
        if queue is not None and future in queue:
            queue.remove(future)
        if queue is not None and not queue:
            del self.waiting[owner]
        self.pump()

    def release(self, owner: str) -> None:
        self.active[owner] -= 1
        if self.active[owner] <= 0:
            del self.active[owner]
        self.pump()

    def pump(self) -> None:
        """Hand free slots to waiting keys, round robin (a grant moves its key to the back), keys below their
        share of the slots between the keys that want them first."""
        while self.busy < self.slots:
            for owner in [k for k, q in self.waiting.items() if not any(not f.done() for f in q)]:
                del self.waiting[owner]  # only timed-out or cancelled waiters left
            ready = [k for k in self.waiting if self.may_take(k)]
            if not ready:
                return
            share = self.share()
            owner = next((k for k in ready if self.active[k] < share), ready[0])
            queue = self.waiting[owner]
            while queue[0].done():
                queue.popleft()
            queue.popleft().set_result(self.grant(owner))
            if queue:
                self.waiting.move_to_end(owner)
            else:
                del self.waiting[owner]

    def summary(self) -> dict:
        return {"slots": self.slots, "active": self.busy, "keys_active": len(self.active),
                "waiting": sum(len(q) for q in self.waiting.values())}
