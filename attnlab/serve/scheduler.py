"""Continuous batching: many conversations advance together, one step at a time, as a plan and its run.

Why: the engine's step reads every weight once whether it advances one conversation or eight (`LM.step`), so
B conversations decoded together cost little more than one. `Scheduler.schedule()` decides a step and returns it
as data (a `Plan`: which conversations decode one token, which prompt chunk goes in); `Runner.run(plan)` executes
it with one engine call (one `Batch`: the decode rows and the chunk's row) and turns the logits into events,
each reply ended by the one stop check (`attnlab.stop.Stop`). `Scheduler.step()` is the two in turn.

A plan is one chunk of the first newcomer's prompt (round robin over the newcomers, so a long prompt delays the
others' next tokens by one chunk at most), with the whole prompts of the next newcomers that fit in the same
chunk's tokens (a burst of short prompts goes in in one step), beside every conversation whose prompt is in: each
advances by exactly one token per step. At most `max_batch` requests hold a slot (prefilling or decoding); the others wait and take
the slots that free, oldest first, so none starves (every request ends within its max_tokens). Requests carry a
`key` (the caller's identity): while several keys wait, slots go to them in turn (round robin over keys, each
key's oldest first), and `schedule(caps=...)` holds a key at its cap of slots.

While decoding conversations outnumber the newcomers, a newcomer's chunk is also held to about two tokens
per decoding conversation (at least 8): on a CPU a step's cost grows with its rows (the kernels are compute-bound
there, not memory-bound), so a 256-token chunk beside 4 decoding rows made their next token wait for the whole
chunk (p99 inter-token latency 17x their own, measured through HTTP), while a chunk of about their rows' cost
keeps it near 2-3x. A newcomer alone, or a burst of newcomers at least as many as the decoding rows, is
prefilled `chunk` tokens at a time (16 arrivals at once otherwise went in 8 tokens a step behind the first
ones: measured, time to first token 98 s against 5 s). So is a newcomer's prompt that would not be in, at that rate,
while the decoding rows have at least the newcomer's reply left to decode (their replies' max_tokens): beside rows
about to end, small chunks only left the newcomers to decode alone afterwards (8 conversations of 100-1,000-token
prompts and 64 new tokens: 0.75 of the engine's bound in process, 0.92 with this rule). A chunk longer than a
bounded cache's policy chunk
goes in that cache's parts inside the engine's step, as `LM.prefill` feeds it.

A request may decode speculatively (`speculative`, e.g. ngram): the plan gives it K drafts (fewer where its reply or
its cache's policy has less room; adaptive K by its acceptance), the runner drafts them and its row is a
verification row of K + 1 tokens in the same step as everyone else's (scored as K + 1 decode steps of its cache, so
the kept tokens are the ones plain decoding gives), then cuts its cache back to what it kept. Each weight is read
once for all the step's rows and drafts.

The scheduler is single-threaded and knows nothing of HTTP: `submit` a request (its Session, the prompt ids to
feed after what the session's cache holds, its own Sampler, max_tokens, stop ids and stop strings, its key),
`cancel` it, and call `step()` for the events. Memory is not its business: the caches it is handed were counted
and allocated before (`sessions.py`). The server runs it on its model thread (`worker.py`); tests drive it
directly. Each conversation keeps `Session`'s invariant: the last token of a reply is sampled but not fed, and
its session's `text`/`ids` hold what was fed once the request ends.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field

import torch

from attnlab.batch import Batch, Row
from attnlab.errors import AttnlabError
from attnlab.sampling import Sampler, top_token
from attnlab.session import Session
from attnlab.speculative import AdaptiveK, SpecStats, SpeculativeSpec, check_cache, make_drafter, room, verify
from attnlab.stop import Stop

_NOBODY = object()  # no key may take a slot now


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
    stop: Stop
    key: object = None            # the caller's identity: slots go round robin over keys
    fed: int = 0                  # prompt tokens fed so far
    prefilled: bool = False       # the whole prompt is in the cache (decoding)
    pending: int | None = None    # the last sampled token: fed by the next decode step
    reply: list[int] = field(default_factory=list)
    spec: SpeculativeSpec | None = None  # decode speculatively: its drafter's kind and K
    drafter: object = None
    adaptive: AdaptiveK | None = None
    stats: SpecStats | None = None
    screen: object = None          # a guard's check of the prompt's user tokens in its own prefill (robust.Screen)


@dataclass
class Plan:
    """One step as data: the requests that decode (their pending tokens, and for a speculative one the number of
    drafts to verify beside it), and the prompt chunks that go in (request id, first prompt token, end), each
    chunk its own row of the step."""
    decode: list[int] = field(default_factory=list)
    chunks: list[tuple[int, int, int]] = field(default_factory=list)
    drafts: dict[int, int] = field(default_factory=dict)  # request id -> K drafts (speculative requests only)

    @property
    def batch(self) -> list[int]:
        return self.decode

    @property
    def prefill(self) -> int | None:
        return self.chunks[0][0] if self.chunks else None

    @property
    def prefill_tokens(self) -> int:
        return sum(b - a for _, a, b in self.chunks)


class Scheduler:
    BUSY_PER_ROW, BUSY_FLOOR = 2, 8  # a newcomer's chunk beside decoding rows: tokens per row, at least

    # speculative requests draft only while at most this many conversations decode: the batched step is compute-bound
    # on a CPU, so drafts cost nearly full price beside other rows (SmolLM2, 1 thread, n-gram drafts through HTTP:
    # 1.47x plain at 1 conversation, 1.10x at 2, 0.83x at 4, 0.79x at 8; docs/speculative.md)
    SPECULATE_ROWS = 2

    def __init__(self, lm, max_batch: int = 8, chunk: int = 256, speculate_rows: int = SPECULATE_ROWS):
        if max_batch < 1 or chunk < 1:
            raise AttnlabError(f"max_batch and chunk must be >= 1, got {max_batch} and {chunk}")
        self.lm, self.max_batch, self.chunk, self.speculate_rows = lm, max_batch, chunk, speculate_rows
        self.requests: dict[int, Request] = {}   # every live request
        self.queued: deque[Request] = deque()      # no slot yet, arrival order
        self.prefilling: deque[Request] = deque()  # a slot, prompt not all in (round robin)
        self.decoding: list[Request] = []          # a slot, decoding (oldest first)
        self.turns: deque = deque()                # keys with queued requests, in the order their turns come
        self.runner = Runner(self)
        self.next_id = 0
        self.last = Plan()
        self.counters = {"steps": 0, "prefill_chunks": 0, "decode_steps": 0, "decode_rows": 0}

    @property
    def idle(self) -> bool:
        return not self.requests

    def submit(self, session: Session, prompt: list[int], sampler: Sampler, max_tokens: int, stop_ids=(),
               stops=(), key=None, speculative=None, screen=None) -> int:
        """Queue a request; returns its id. prompt: the ids to feed after what `session`'s cache holds (empty:
        continue from the session's logits). key: the caller (slots go round robin over keys). speculative: a
        SpeculativeSpec (or its text) to decode with, a drafter of its own; its counts go to `session.stats`.
        screen: a guard's `robust.defenses.Screen` of the prompt: the request fails with its error, before its first
        token, if the prompt's own prefill flags it. Its events come from the next steps."""
        if max_tokens < 0:
            raise AttnlabError(f"max_tokens must be >= 0, got {max_tokens}")
        if any(r.session is session for r in self.requests.values()):
            raise AttnlabError("this session is already being served by another request")
        tok = self.lm.tokenizer
        if stops and tok is None:
            raise AttnlabError("stop strings need the model's tokenizer")
        r = Request(self.next_id, session, [int(t) for t in prompt], sampler, Stop(max_tokens, stop_ids, stops, tok),
                    key, spec=SpeculativeSpec.parse(speculative), screen=screen)
        if r.spec is not None:
            check_cache(session.cache)
            r.drafter, r.adaptive = make_drafter(self.lm, r.spec), AdaptiveK(r.spec.k) if r.spec.adaptive else None
            r.stats = session.stats = SpecStats()  # the reply's counts, for its usage
        self.next_id += 1
        self.requests[r.id] = r
        self.queued.append(r)
        if key not in self.turns:
            self.turns.append(key)
        return r.id

    def cancel(self, rid: int) -> Request | None:
        """Drop a request now (its row is not in the next step); returns it (`prefilled`: its session's cache
        and text are consistent), or None if it had already ended."""
        r = self.requests.get(rid)
        if r is not None:
            self.drop(r)
        return r

    def step(self) -> list[Event]:
        """One step: the plan, then its run."""
        return self.runner.run(self.schedule())

    def schedule(self, caps: dict | None = None) -> Plan:
        """Admit waiting requests to free slots (round robin over keys; caps: key -> most slots it may hold), then
        plan one step: every decoding request's next token, and one chunk of one newcomer's prompt."""
        self._admit(caps or {})
        plan = Plan(decode=[r.id for r in self.decoding])
        for r in self.decoding if len(self.decoding) <= self.speculate_rows else ():
            if r.spec is not None and (k := self._drafts(r)) > 0:
                plan.drafts[r.id] = k
        budget = self.chunk_now() if self.prefilling else 0
        for r in self.prefilling:  # the first newcomer's next chunk; then whole prompts that fit beside it
            rest = len(r.prompt) - r.fed
            n = min(rest, budget) if not plan.chunks else rest if rest <= budget else -1
            if n >= 0:
                plan.chunks.append((r.id, r.fed, r.fed + n))
                budget -= n
            if budget <= 0:
                break
        self.last = plan
        return plan

    @staticmethod
    def _drafts(r: Request) -> int:
        """K for this step: none past the reply's max_tokens, none that would make the cache's policy evict (a
        verification row must be cut back), then adaptive K's choice."""
        k = min(r.spec.k, r.stop.max_tokens - len(r.reply) - 1)
        left = room(r.session.cache)
        if left is not None:
            k = min(k, left - 1)
        return r.adaptive.choose(k) if r.adaptive and k > 0 else k

    def _admit(self, caps: dict) -> None:
        held = Counter(r.key for r in (*self.prefilling, *self.decoding))
        while self.queued and len(self.prefilling) + len(self.decoding) < self.max_batch:
            key = next((k for k in self.turns if held[k] < caps.get(k, self.max_batch)), _NOBODY)
            if key is _NOBODY:
                return
            self.turns.remove(key)
            r = next(q for q in self.queued if q.key == key)  # this key's oldest
            self.queued.remove(r)
            self.prefilling.append(r)
            held[key] += 1
            if any(q.key == key for q in self.queued):
                self.turns.append(key)  # its next turn comes after every other waiting key's

    def chunk_now(self) -> int:
        """This step's prefill chunk: `chunk` while the newcomers are as many as the decoding rows (a burst of
        arrivals: their prompts first) or, at the small rate, their prompts would be in too late to decode beside
        the decoding rows (fewer of the rows' tokens left than a newcomer's reply: it would finish alone), else
        about the decoding rows' own cost (their next token first)."""
        if len(self.prefilling) + len(self.queued) >= len(self.decoding):
            return self.chunk
        busy = min(self.chunk, max(self.BUSY_FLOOR, self.BUSY_PER_ROW * len(self.decoding)))
        rest = sum(len(r.prompt) - r.fed for r in self.prefilling)
        left = max(r.stop.max_tokens - len(r.reply) for r in self.decoding)
        reply = max(r.stop.max_tokens for r in self.prefilling)
        # 8 conversations of 100-1,000-token prompts and 64 new tokens, in process: 0.75 -> 0.92 of the engine's
        # bound (the last prompt went in 14 tokens a step, then decoded alone: 119 steps, now 75)
        return self.chunk if rest > busy * max(0, left - reply) else busy

    def drop(self, r: Request) -> None:
        """A request leaves: its slot frees (a decoding one's reply ends in its session)."""
        self.requests.pop(r.id, None)
        for waiting in (self.queued, self.prefilling):
            if r in waiting:
                waiting.remove(r)
        if r.key in self.turns and not any(q.key == r.key for q in self.queued):
            self.turns.remove(r.key)
        if r in self.decoding:
            self.decoding.remove(r)
            r.session.end_reply(r.reply)

    def summary(self) -> dict:
        """Counts for /health: requests queued, prefilling and decoding now; steps and decoded rows so far."""
        return {"queued": len(self.queued), "prefilling": len(self.prefilling), "decoding": len(self.decoding),
                **self.counters}


class Runner:
    """Executes a plan: one `LM.step` over its rows, then each row's sampling, stop check and events."""

    def __init__(self, scheduler: Scheduler):
        self.s = scheduler

    def run(self, plan: Plan) -> list[Event]:
        s, events = self.s, []
        decode = [s.requests[i] for i in plan.decode if i in s.requests]
        chunks = [(s.requests[i], a, b) for i, a, b in plan.chunks if i in s.requests]
        try:
            drafts = {r.id: self._draft(r, plan.drafts[r.id]) for r in decode if plan.drafts.get(r.id)}
            drafts = {i: d for i, d in drafts.items() if d[0]}  # a drafter may find nothing: a plain row
            t1 = time.perf_counter()
            rows = [Row(torch.tensor([[r.pending, *drafts[r.id][0]]]), r.session.cache, "all", verify=True)
                    if r.id in drafts else Row(torch.tensor([[r.pending]]), r.session.cache) for r in decode]
            wants = [r.screen.wants(a, b) if r.screen is not None else "last" for r, a, b in chunks]
            rows += [Row(torch.tensor([r.prompt[a:b]]), r.session.cache, want, prompt=True)
                     for (r, a, b), want in zip(chunks, wants) if b > a]
            logits = s.lm.step(Batch(rows)) if rows else []
            seconds = time.perf_counter() - t1
        except Exception as e:  # which row failed is unknown: the step's caches may be half-written
            for r in (*decode, *(r for r, _, _ in chunks)):
                self._fail(r, e, events)
            s.counters["steps"] += 1
            return events
        at = len(decode)
        for (r, a, b), want in zip(chunks, wants):
            if b > a:
                if isinstance(want, range):
                    r.screen.take(a + want.start, logits[at][0], r.prompt)
                r.session.took(r.prompt[a:b], logits[at][0, -1])
                r.fed, at = b, at + 1
                s.counters["prefill_chunks"] += 1
        for r, _, _ in chunks:
            self._prefilled(r, events)
        if decode:
            s.counters["decode_steps"] += 1
            s.counters["decode_rows"] += len(decode)
        plain = [(r, lg) for r, lg in zip(decode, logits) if r.id not in drafts]
        tokens = self._sample([r for r, _ in plain], [lg for _, lg in plain])
        for (r, _), t in zip(plain, tokens):
            r.session.took([r.pending], None)
            if r.stats is not None:  # a speculative request's step without drafts
                r.stats.steps, r.stats.tokens = r.stats.steps + 1, r.stats.tokens + 1
                if r.adaptive:
                    r.adaptive.update(0, 0, 0.0, 0, seconds)
            self._emit(r, t, events)
        for r, lg in zip(decode, logits):
            if r.id in drafts:
                self._verified(r, lg[0], *drafts[r.id], seconds, events)
        s.counters["steps"] += 1
        return events

    @staticmethod
    def _draft(r: Request, k: int) -> tuple[list[int], torch.Tensor | None, float]:
        """(drafts, their probabilities or None, the drafter's seconds) for the context the row continues."""
        start = time.perf_counter()
        drafts, q = r.drafter.propose([*r.session.ids, r.pending], k, r.sampler)
        return drafts[:k], None if q is None else q[:len(drafts[:k])], time.perf_counter() - start

    def _verified(self, r: Request, logits: torch.Tensor, drafts: list[int], q, draft_s: float, step_s: float,
                  events: list[Event]) -> None:
        """A verification row's logits [K + 1, V]: the drafts the target agrees with and its own next token are
        the reply's next tokens (up to its stop); the cache keeps every one of them but the last."""
        n, nxt = verify(logits, drafts, q, r.sampler)
        cache, base = r.session.cache, r.session.cache.seen - len(drafts) - 1
        cache.truncate(base + 1 + n)
        r.session.took([r.pending, *drafts[:n]], None)
        st = r.stats
        st.drafted, st.accepted, st.steps = st.drafted + len(drafts), st.accepted + n, st.steps + 1
        if r.adaptive:
            r.adaptive.update(len(drafts), n, draft_s, len(drafts), step_s)
        emitted = 0
        for t in (*drafts[:n], nxt):
            self._emit(r, t, events, finish=False)
            emitted += 1
            if r.stop.reason is not None:
                break
        st.tokens += emitted
        if emitted <= n:  # stopped inside the kept drafts: the tokens past the last one emitted were never sampled
            r.session.unfeed(n + 1 - emitted)
        if r.stop.reason is not None:
            self._finish(r, events)

    def _prefilled(self, r: Request, events: list[Event]) -> None:
        """After a chunk: round robin on to the next newcomer, or the prompt is in: the request decodes."""
        s = self.s
        if r.fed < len(r.prompt):
            s.prefilling.remove(r)  # round robin: the newcomers after it go first next step
            s.prefilling.append(r)
            return
        s.prefilling.remove(r)
        if r.screen is not None and (flagged := r.screen.failure()) is not None:
            return self._fail(r, flagged, events)
        r.prefilled = True
        s.decoding.append(r)
        if r.stop.reason is not None:  # max_tokens 0
            return self._finish(r, events)
        try:
            if r.session.logits is None:
                raise AttnlabError("nothing to continue from: the prompt is empty")
            self._emit(r, int(r.sampler(r.session.logits[None])[0]), events)
            if r.stats is not None:
                r.stats.tokens += 1
        except Exception as e:
            self._fail(r, e, events)

    @staticmethod
    def _sample(rows: list[Request], logits: list[torch.Tensor]) -> list[int]:
        """Each row's next token by its own sampler; greedy rows in one argmax."""
        if not rows:
            return []
        if all(r.sampler.temperature == 0 for r in rows):
            return top_token(torch.cat([lg[:, -1] for lg in logits])).tolist()
        return [int(r.sampler(lg[:, -1])[0]) for r, lg in zip(rows, logits)]

    def _emit(self, r: Request, t: int, events: list[Event], finish: bool = True) -> None:
        """A sampled token: its event, then the request's end if the stop check says so."""
        r.reply.append(t)
        r.pending = t
        events.append(Event(r.id, "token", token=t, text=r.stop.push(t)))
        if finish and r.stop.reason is not None:
            self._finish(r, events)

    def _finish(self, r: Request, events: list[Event]) -> None:
        text = r.stop.tail()
        self.s.drop(r)
        events.append(Event(r.id, "done", text=text, reason=r.stop.reason))

    def _fail(self, r: Request, e: Exception, events: list[Event]) -> None:
        self.s.drop(r)
        events.append(Event(r.id, "error", error=e))
