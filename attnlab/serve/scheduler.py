"""Continuous batching: many conversations advance together, one scheduler step at a time.

Why: a decode step reads every weight once whether it advances one conversation or eight
(`LM.step_batch`), so B conversations decoded together cost little more than one. A step is
at most one prefill chunk of one newcomer (round robin over the newcomers, so a long prompt
delays the others' next tokens by one chunk at most), then one batched decode step over every
conversation whose prompt is in: each advances by exactly one token per step. At most
`max_batch` requests hold a slot (prefilling or decoding); the others wait in arrival order
and take the slots that free, oldest first, so none starves (every request ends within its
max_tokens).

While decoding conversations outnumber the newcomers, a newcomer's chunk is also held to about two tokens
per decoding conversation (at least 8): on a CPU a step's cost grows with its rows (the kernels are compute-bound there, not memory-bound), so a
256-token chunk beside 4 decoding rows made their next token wait for the whole chunk (p99 inter-token latency
17x their own, measured through HTTP), while a chunk of about their rows' cost keeps it near 2-3x. A newcomer alone, or a burst of
newcomers at least as many as the decoding rows, is prefilled `chunk` tokens at a time (16 arrivals at once
otherwise went in 8 tokens a step behind the first ones: measured, time to first token 98 s against 5 s).

The scheduler is single-threaded and knows nothing of HTTP: `submit` a request (its Session,
the prompt ids to feed after what the session's cache holds, its own Sampler, max_tokens, stop
ids and stop strings), `cancel` it, and call `step()` for the events. Memory is not its
business: the caches it is handed were counted and allocated before (`sessions.py`). The
server runs it on its model thread (`worker.py`); tests drive it directly.

Each conversation keeps `Session`'s invariant: the last token of a reply is sampled but not
fed, and its session's `text`/`ids` hold what was fed once the request ends.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from attnlab.errors import AttnlabError
from attnlab.sampling import Sampler
from attnlab.serve.protocol import StopScanner
from attnlab.session import Session
from attnlab.textstream import TextStream


@dataclass(frozen=True)
class Event:
    """What a step did for one request.

    kind: "token" (token, and text: the new text it releases, cut at a stop string), "done" (reason "stop"
    or "length"; text: the held-back tail) or "error" (error: the exception; the request is gone)."""
    id: int
    kind: str
    token: int | None = None
    text: str = ""
    reason: str | None = None
    error: BaseException | None = None


@dataclass(eq=False)
class Request:
    id: int
    session: Session
    prompt: list[int]
    sampler: Sampler
    max_tokens: int
    stop_ids: frozenset
    scan: StopScanner
    text: TextStream | None
    fed: int = 0                  # prompt tokens fed so far
    prefilled: bool = False       # the whole prompt is in the cache (decoding)
    pending: int | None = None    # the last sampled token: fed by the next decode step
    reply: list[int] = field(default_factory=list)


@dataclass
class StepInfo:
    """What one step ran: the request whose prefill chunk it fed (and how many tokens), the decoded rows."""
    prefill: int | None = None
    prefill_tokens: int = 0
    batch: list[int] = field(default_factory=list)


class Scheduler:
    BUSY_PER_ROW, BUSY_FLOOR = 2, 8  # a newcomer's chunk beside decoding rows: tokens per row, at least

    def __init__(self, lm, max_batch: int = 8, chunk: int = 256):
        if max_batch < 1 or chunk < 1:
            raise AttnlabError(f"max_batch and chunk must be >= 1, got {max_batch} and {chunk}")
        self.lm, self.max_batch, self.chunk = lm, max_batch, chunk
        self.requests: dict[int, Request] = {}   # every live request
        self.queued: deque[Request] = deque()      # no slot yet, arrival order
        self.prefilling: deque[Request] = deque()  # a slot, prompt not all in (round robin)
        self.decoding: list[Request] = []          # a slot, decoding (oldest first)
        self.next_id = 0
        self.last = StepInfo()
        self.counters = {"steps": 0, "prefill_chunks": 0, "decode_steps": 0, "decode_rows": 0}

    @property
    def idle(self) -> bool:
        return not self.requests

    def submit(self, session: Session, prompt: list[int], sampler: Sampler, max_tokens: int, stop_ids=(),
               stops=()) -> int:
        """Queue a request; returns its id. prompt: the ids to feed after what `session`'s cache holds (empty:
        continue from the session's logits). Its events come from the next steps."""
        if max_tokens < 0:
            raise AttnlabError(f"max_tokens must be >= 0, got {max_tokens}")
        if any(r.session is session for r in self.requests.values()):
            raise AttnlabError("this session is already being served by another request")
        tok = self.lm.tokenizer
        if stops and tok is None:
            raise AttnlabError("stop strings need the model's tokenizer")
        r = Request(self.next_id, session, [int(t) for t in prompt], sampler, max_tokens, frozenset(stop_ids),
                    StopScanner(list(stops)), TextStream(tok) if tok is not None else None)
        self.next_id += 1
        self.requests[r.id] = r
        self.queued.append(r)
        return r.id

    def cancel(self, rid: int) -> Request | None:
        """Drop a request now (its row is not in the next step); returns it (`prefilled`: its session's cache
        and text are consistent), or None if it had already ended."""
        r = self.requests.pop(rid, None)
        if r is None:
            return None
        for waiting in (self.queued, self.prefilling):
            if r in waiting:
                waiting.remove(r)
        if r in self.decoding:
            self.decoding.remove(r)
            r.session.end_reply(r.reply)
        return r

    def step(self) -> list[Event]:
        """One prefill chunk of one newcomer (if any), then one decode step of every decoding request."""
        events: list[Event] = []
        while self.queued and len(self.prefilling) + len(self.decoding) < self.max_batch:
            self.prefilling.append(self.queued.popleft())  # oldest first
        batch = list(self.decoding)  # who joins during this step's prefill decodes from the next step on
        self.last = StepInfo(batch=[r.id for r in batch])
        if self.prefilling:
            self._prefill(self.prefilling[0], events)
        if batch:
            self._decode(batch, events)
        self.counters["steps"] += 1
        return events

    def chunk_now(self) -> int:
        """This step's prefill chunk: `chunk` while the newcomers are as many as the decoding rows (a burst of
        arrivals: their prompts first), else about the decoding rows' own cost (their next token first)."""
        if len(self.prefilling) + len(self.queued) >= len(self.decoding):
            return self.chunk
        return min(self.chunk, max(self.BUSY_FLOOR, self.BUSY_PER_ROW * len(self.decoding)))

    def _prefill(self, r: Request, events: list[Event]) -> None:
        part = r.prompt[r.fed:r.fed + self.chunk_now()]
        self.last.prefill, self.last.prefill_tokens = r.id, len(part)
        try:
            if part:
                r.session.feed(part)
                r.fed += len(part)
                self.counters["prefill_chunks"] += 1
            if r.fed < len(r.prompt):
                self.prefilling.rotate(-1)  # round robin: the next newcomer's chunk comes next
                return
            self.prefilling.popleft()
            r.prefilled = True
            self.decoding.append(r)
            if r.max_tokens == 0:
                return self._finish(r, "length", events)
            if r.session.logits is None:
                raise AttnlabError("nothing to continue from: the prompt is empty")
            self._emit(r, r.sampler(r.session.logits[None]), events)
        except Exception as e:
            self._fail(r, e, events)

    def _decode(self, batch: list[Request], events: list[Event]) -> None:
        try:
            logits = self.lm.step_batch(torch.tensor([r.pending for r in batch]), [r.session.cache for r in batch])
        except Exception as e:  # which row failed is unknown: the step's caches may be half-written
            for r in batch:
                self._fail(r, e, events)
            return
        self.counters["decode_steps"] += 1
        self.counters["decode_rows"] += len(batch)
        for b, r in enumerate(batch):
            r.session.record(r.pending)
            try:
                self._emit(r, r.sampler(logits[b:b + 1]), events)
            except Exception as e:
                self._fail(r, e, events)

    def _emit(self, r: Request, token: torch.Tensor, events: list[Event]) -> None:
        """A sampled token: its event, then the request's end if it is an end (EOS, a stop string, max_tokens)."""
        t = int(token.reshape(-1)[0])
        r.reply.append(t)
        r.pending = t
        text = r.scan.push(r.text.push(t)) if r.text is not None else ""
        events.append(Event(r.id, "token", token=t, text=text))
        if r.scan.stopped:
            self._finish(r, "stop", events, tail=False)
        elif t in r.stop_ids:
            self._finish(r, "stop", events)
        elif len(r.reply) >= r.max_tokens:
            self._finish(r, "length", events)

    def _finish(self, r: Request, reason: str, events: list[Event], tail: bool = True) -> None:
        text = r.scan.push(r.text.flush()) + r.scan.flush() if tail and r.text is not None else ""
        self._drop(r)
        events.append(Event(r.id, "done", text=text, reason=reason))

    def _fail(self, r: Request, e: Exception, events: list[Event]) -> None:
        self._drop(r)
        events.append(Event(r.id, "error", error=e))

    def _drop(self, r: Request) -> None:
        self.requests.pop(r.id, None)
        if r in self.prefilling:
            self.prefilling.remove(r)
        if r in self.decoding:
            self.decoding.remove(r)
            r.session.end_reply(r.reply)

    def summary(self) -> dict:
        """Counts for /health: requests queued, prefilling and decoding now; steps and decoded rows so far."""
        return {"queued": len(self.queued), "prefilling": len(self.prefilling), "decoding": len(self.decoding),
                **self.counters}
