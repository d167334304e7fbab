"""One request's reply: the scheduler's events for it, as JSON or SSE events."""
from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
import weakref
from collections import deque
from dataclasses import dataclass, field

from attnlab.serve.scheduler import Event

GONE = Event(-1, "done", reason="gone")  # the client closed the connection (put by the server's watcher)


@dataclass
class Turn:
    """One request's generation: what it was fed, what it sampled, why it ended."""
    prompt_tokens: int
    fed: int
    reply: list[int] = field(default_factory=list)
    finish: str = "length"
    owner: str = ""
    speculative: bool = False  # decoded speculatively: the reply's extension reports its drafts


class Mailbox:
    """The model thread's hand-off to one event loop: a step's events for every request in one wake-up of the loop.

    Why: one `call_soon_threadsafe` per request and step woke the loop up to 8 times a step (8 streams), each time
    asking the model thread for the GIL in the middle of its next step's Python; the first event of a step schedules
    one `drain`, and the others of that step ride with it."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.lock, self.waiting = loop, threading.Lock(), []

    def post(self, inbox: "Inbox", events: list[Event]) -> None:
        with self.lock:
            self.waiting.append((inbox, events))
            if len(self.waiting) > 1:  # a drain is already scheduled
                return
        try:
            self.loop.call_soon_threadsafe(self.drain)
        except RuntimeError:  # the loop has closed: nothing will drain, and the next post must try again
            with self.lock:
                self.waiting.clear()
            raise

    def drain(self) -> None:
        with self.lock:
            waiting, self.waiting = self.waiting, []
        for inbox, events in waiting:
            inbox.put(events)


_MAILBOXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its Mailbox


class Inbox:
    """A request's events, handed from the model thread (`deliver`) to the event loop (`peek`, `next`).

    on_end runs as soon as the generation's last event arrives, however far behind the reader is: the
    slot goes back then. What waits here for a slow reader is at most the request's max_tokens events."""

    def __init__(self, on_end=lambda: None):
        self.loop, self.events, self.ready = asyncio.get_running_loop(), deque(), asyncio.Event()
        self.on_end = on_end
        self.mailbox = _MAILBOXES.get(self.loop) or _MAILBOXES.setdefault(self.loop, Mailbox(self.loop))

    def deliver(self, events: list[Event]) -> None:
        self.mailbox.post(self, events)

    def put(self, events: list[Event]) -> None:
        self.events.extend(events)
        self.ready.set()
        if events and events[-1].kind in ("done", "error"):
            self.on_end()

    async def peek(self) -> Event:
        while not self.events:
            self.ready.clear()
            await self.ready.wait()
        return self.events[0]

    async def next(self) -> Event:
        event = await self.peek()
        self.events.popleft()
        return event


class Reply:
    """The events of one scheduled request (id `rid`) as text deltas; `close` cancels it and frees its slot.

    on_end: frees the request's generation slot (idempotent); called when the generation ends or at close."""

    def __init__(self, server, held, turn: Turn, chat: bool, on_end):
        self.server, self.held, self.session, self.turn = server, held, held.session, turn
        self.chat, self.on_end = chat, on_end
        self.inbox, self.rid, self.watcher, self.closed = Inbox(on_end), None, None, False
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created, self.kind = int(time.time()), "chat.completion" if chat else "text_completion"

    def close(self) -> None:
        """Stop watching the client, drop the request from the scheduler if it still runs, free the slot."""
        if self.closed:
            return
        self.closed = True
        if self.watcher is not None:
            self.watcher.cancel()
        if self.rid is not None:
            self.server.worker.cancel(self.rid)
        self.on_end()

    async def watch(self, request) -> None:
        """Wait for the client to leave (in prefill, in a stream, before a whole answer), then cancel the request."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.inbox.put([GONE])
        self.close()

    async def deltas(self):
        """Text deltas (already cut at stop strings by the scheduler; "" where an event released none) until the
        request ends."""
        server, turn = self.server, self.turn
        while True:
            event = await self.inbox.next()
            if event.kind == "error":
                raise event.error
            if event.kind == "token":
                turn.reply.append(event.token)
                server.stats["tokens_generated"] += 1
                server.by_owner[turn.owner]["tokens_generated"] += 1
            elif event.reason != "gone":
                turn.finish = event.reason
            yield event.text
            if event.kind == "done":
                return

    def usage(self) -> dict:
        t = self.turn
        return {"prompt_tokens": t.prompt_tokens, "completion_tokens": len(t.reply),
                "total_tokens": t.prompt_tokens + len(t.reply),
                "prompt_tokens_details": {"cached_tokens": max(0, t.prompt_tokens - t.fed)}}

    def extension(self) -> dict:
        cache = self.session.cache
        out = {"session": self.held.id if self.held and self.held.stored else None, "fed_tokens": self.turn.fed,
               "tokens_seen": cache.seen, "slots_kept": len(cache), "cache_bytes": self.held.nbytes()}
        if self.turn.speculative and self.session.stats is not None:  # drafted, accepted, steps of this reply
            out["speculative"] = self.session.stats.as_dict()
        return out

    async def whole(self) -> dict:
        """The non-streamed answer."""
        parts = []
        try:
            async for delta in self.deltas():  # the same text, cut the same way, as the stream
                parts.append(delta)
        finally:
            self.close()
        out = "".join(parts)
        choice = {"index": 0, "message": {"role": "assistant", "content": out}} if self.chat else {"index": 0, "text": out}
        choice.update(finish_reason=self.turn.finish, logprobs=None)
        return {"id": self.id, "object": self.kind, "created": self.created, "model": self.server.model_name,
                "choices": [choice], "usage": self.usage(), "attnlab": self.extension()}

    def chunk(self, delta: str | None, reason: str | None = None, first: bool = False) -> str:
        if self.chat:
            d = {"role": "assistant", "content": ""} if first else {"content": delta} if delta else {}
            choice = {"index": 0, "delta": d, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": reason, "logprobs": None}
        body = {"id": self.id, "object": self.kind + (".chunk" if self.chat else ""), "created": self.created,
                "model": self.server.model_name, "choices": [choice]}
        if reason is not None or first:  # the page learns its session id from the first chunk
            body["attnlab"] = self.extension()
        return f"data: {json.dumps(body)}\n\n"

    async def events(self, include_usage: bool):
        """The streamed answer as server-sent events; deltas that are already waiting (a reader behind the steps)
        go out in one write, each still its own event."""
        try:
            if self.chat:
                yield self.chunk(None, first=True)
            out = []
            async for delta in self.deltas():
                if delta:
                    out.append(self.chunk(delta))
                if out and not self.inbox.events:
                    yield "".join(out)
                    out = []
            yield "".join(out) + self.chunk(None, self.turn.finish)
            if include_usage:
                body = {"id": self.id, "object": self.kind + ".chunk", "created": self.created,
                        "model": self.server.model_name, "choices": [], "usage": self.usage()}
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.close()
