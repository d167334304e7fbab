"""One request's reply: the decode loop on the model thread, cut at stop strings, as JSON or SSE events."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field

from attnlab.serve.protocol import StopScanner
from attnlab.serve.sessions import alloc_bytes
from attnlab.textstream import TextStream


@dataclass
class Turn:
    """One request's generation: what it was fed, what it sampled, why it ended."""
    prompt_tokens: int
    fed: int
    reply: list[int] = field(default_factory=list)
    finish: str = "length"
    owner: str = ""


class Reply:
    """Drives `gen` (the session's token generator) one worker step per token; `done` releases everything."""

    def __init__(self, server, held, session, turn: Turn, gen, stops: list[str], chat: bool, done):
        self.server, self.held, self.session, self.turn, self.gen = server, held, session, turn, gen
        self.stops, self.chat, self.done = stops, chat, done
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created, self.kind = int(time.time()), "chat.completion" if chat else "text_completion"

    async def deltas(self, request=None):
        """Decode one token per worker step; yields text deltas (cut at stop strings)."""
        server, turn = self.server, self.turn
        lm = server.lm
        text, scan, eos = TextStream(lm.tokenizer), StopScanner(self.stops), lm.eos_ids
        while True:
            token = await server.on_worker(next, self.gen, None)
            if token is None:
                break
            turn.reply.append(token)
            server.stats["tokens_generated"] += 1
            server.by_owner[turn.owner]["tokens_generated"] += 1
            if token in eos:
                turn.finish = "stop"
            delta = scan.push(text.push(token))
            if delta:
                yield delta
            if scan.stopped:
                turn.finish = "stop"
                return
            if request is not None and len(turn.reply) % 16 == 0 and await request.is_disconnected():
                return
        tail = scan.push(text.flush()) + scan.flush()
        if tail:
            yield tail

    def usage(self) -> dict:
        t = self.turn
        return {"prompt_tokens": t.prompt_tokens, "completion_tokens": len(t.reply),
                "total_tokens": t.prompt_tokens + len(t.reply),
                "prompt_tokens_details": {"cached_tokens": max(0, t.prompt_tokens - t.fed)}}

    def extension(self) -> dict:
        cache = self.session.cache
        return {"session": self.held.id if self.held and self.held.stored else None, "fed_tokens": self.turn.fed,
                "tokens_seen": cache.seen, "slots_kept": len(cache), "cache_bytes": alloc_bytes(cache)}

    async def whole(self, request) -> dict:
        """The non-streamed answer."""
        parts = []
        try:
            async for delta in self.deltas(request):  # the same text, cut the same way, as the stream
                parts.append(delta)
        finally:
            self.done()
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
        """The streamed answer as server-sent events."""
        try:
            if self.chat:
                yield self.chunk(None, first=True)
            async for delta in self.deltas():
                yield self.chunk(delta)
            yield self.chunk(None, self.turn.finish)
            if include_usage:
                body = {"id": self.id, "object": self.kind + ".chunk", "created": self.created,
                        "model": self.server.model_name, "choices": [], "usage": self.usage()}
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.done()
