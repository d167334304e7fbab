"""The FastAPI app: OpenAI's chat/completions endpoints over bounded-cache sessions, plus the cache view.

Concurrency: all model work runs on one model thread (`worker.py`) that steps the scheduler
(`scheduler.py`): `schedule()` plans a step (prompt chunks of newcomers, one token of every decoding
conversation) and the runner executes it as one `Batch` through `LM.step` (each row over its own
cache), so concurrent requests share each weight read. Requests become `submit`s, the scheduler's events
become the streamed or whole answers, a client that leaves is `cancel`led. At most `max_active`
requests are in the scheduler at once, shared fairly between API keys (`admission.py`: round robin,
a busy key leaves a slot for a key that holds none); the others wait up to `queue_timeout` seconds,
then get 503. A slot is freed when its generation ends, however far behind its reader is.

Tokenising and rendering run on a separate small pool, never on the model thread, and only
after the cheap checks on the raw request: a request that would cost more than the server's
limits is refused (400/413) before any work for it reaches the model. Client-caused failures
are 400s with OpenAI's error body; anything else is logged with its traceback and answered
with a generic 500.

`Server` holds the state (model, session store, admission, worker) under one `ServeConfig` (every
limit, `config.py`), and checks each request against those limits with `checks.Checks`; `create_app`
registers its methods as FastAPI routes behind `guard.Guard` (Host allow-list, API keys, body size).
"""
from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections import Counter, defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from attnlab.errors import AttnlabError
from attnlab.robust.defenses import CONTEXTS, Screen, user_spans
from attnlab.sampling import Sampler
from attnlab.serve import memory
from attnlab.serve.admission import Admission
from attnlab.serve.checks import Checks
from attnlab.serve.config import Keys, ServeConfig
from attnlab.serve.guard import layers
from attnlab.serve.memory import Trimmer
from attnlab.serve.protocol import APIError, ChatRequest, CommonRequest, CompletionRequest, clip, validation_error
from attnlab.serve.replies import GONE, Reply, Turn
from attnlab.options import PolicySpec
from attnlab.serve.scheduler import Scheduler
from attnlab.serve.sessions import SessionStore
from attnlab.serve.text import ChatText
from attnlab.serve.worker import ModelThread

log = logging.getLogger("attnlab.serve")
PAGE = Path(__file__).parent / "static" / "index.html"


class Server:
    """One model served to many clients: session store, limits, the model thread and the request flow."""

    def __init__(self, lm, config: ServeConfig, keys: Keys = Keys()):
        self.lm, self.config, self.keys = lm, config, keys
        self.model_name, self.spec, self.chunk = config.model_name, config.spec, config.chunk
        self.max_tokens, self.max_tokens_cap = config.max_tokens, config.max_tokens_cap
        self.max_prompt_tokens = config.max_prompt_tokens
        key_sessions, key_bytes = config.quotas(keys)
        self.store = SessionStore(lm, config.max_sessions, config.max_bytes, config.chunk, key_sessions, key_bytes)
        self.store.policy(config.spec)  # a bad default fails at startup, not on the first request
        self.text = ChatText(lm.tokenizer)
        self.checks = Checks(lm, config, self.store, self.text)
        self.scheduler = Scheduler(lm, config.max_batch, config.chunk)
        self.worker = ModelThread(self.scheduler)
        self.tokenizing = ThreadPoolExecutor(2, thread_name_prefix="attnlab-text")
        memory.configure()  # freed buffers go back to the system (`memory.py`)
        # the model thread's Python between kernels hands the GIL to the event loop within 1 ms, not 5 (/health)
        sys.setswitchinterval(min(sys.getswitchinterval(), 0.001))
        self.trimmer = Trimmer()
        self.stats = {"requests": 0, "active": 0, "tokens_generated": 0, "errors": 0, "server_errors": 0}
        self.by_owner: defaultdict[str, Counter] = defaultdict(Counter)  # requests, tokens_generated per key
        self.admission = Admission(config.max_active, keys.owners, config.key_active, config.key_queued,
                                   config.queue_timeout)
        self.created_at = int(time.time())
        self.guard = ({context: config.guard.build(lm, context) for context in CONTEXTS}  # --guard (attnlab.robust):
                      if config.guard is not None else None)                      # chat messages, raw prompts

    async def on_worker(self, fn, *args):
        """Run on the model thread (the only one that touches a cache), between scheduler steps."""
        return await asyncio.wrap_future(self.worker.call(fn, *args))

    async def on_text(self, fn, *args):
        """Run text work (template rendering, tokenising) off the model thread and off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, fn, *args)

    # ------------------------------------------------------------ errors

    async def api_error(self, request, e: APIError):
        self.stats["errors"] += 1
        return JSONResponse(e.body(), status_code=e.status)

    async def invalid(self, request, e: RequestValidationError):
        return await self.api_error(request, validation_error(e.errors()))

    async def http_error(self, request, e: StarletteHTTPException):
        code = "not_found" if e.status_code == 404 else None
        return await self.api_error(request, APIError(e.status_code, str(e.detail), code=code))

    async def user_error(self, request, e: AttnlabError):
        return await self.api_error(request, APIError(400, str(e)))

    async def crash(self, request, e: Exception):
        """A bug, not the client's fault: the traceback goes to the log, the client gets no internal detail."""
        self.stats["server_errors"] += 1
        log.error("error serving %s %s", request.method, request.url.path, exc_info=e)
        return await self.api_error(request, APIError(500, "internal server error", type="server_error"))

    # ------------------------------------------------------------ request -> session

    async def start(self, request: Request, text: str | None, ids: list[int], s: PolicySpec, limit: int):
        """Find or make the session and give its cache room; returns (held, turn, the ids to feed).

        text: the escaped rendered chat (ids: all its tokens), or None for a raw completion prompt.
        Every byte of cache is checked against the limits before any prefill (`SessionStore.grow`).
        """
        owner = request.state.caller.owner
        if text is None:
            self.checks.length(s, 0, len(ids), len(ids), limit)
            held = await self.on_worker(self.store.one_off, s, owner, len(ids) + limit)
            return held, Turn(len(ids), len(ids)), ids
        held, reused = await self.on_worker(self.store.acquire, text, s, owner, len(ids) + limit)
        session, touched = held.session, False
        try:
            # the tokens a fresh replay of this history would feed (item 6 of issue 38): where the held ones
            # are a prefix of them, only the rest; where they differ (a reply sampled as other tokens than
            # its text encodes to), back to where they agree, if the cache never evicted (and keeps no scores)
            keep, rewind = common_prefix(session.ids, ids), False
            if keep == len(session.ids) and (keep < len(ids) or session.logits is not None):
                new = ids[keep:]
            elif all(layer.natural for layer in session.cache.layers) and not session.cache.needs_probs:
                keep, rewind = min(keep, len(ids) - 1), True
                new = ids[keep:]
            else:  # an evicted cache cannot go back: feed the rest of the text as tokens of its own
                rest = text[len(session.text):]
                new = await self.on_text(self.text.encode, rest) if rest else []
            held_now = keep if rewind else len(session.cache)
            self.checks.length(s, keep if rewind else session.cache.seen, len(ids), len(new), limit)
            await self.on_worker(self.store.grow, held, held_now + len(new) + limit)  # room first, then work
            touched = True
            if rewind:
                await self.on_worker(session.rewind, keep)
            session.text = text  # what the cache holds once the scheduler has fed `new` (else it is dropped)
        except BaseException:  # keep a reused session only if its cache was not touched
            self.worker.call(self.store.release, held, reused and not touched)
            raise
        held.turns += 1
        return held, Turn(len(ids), len(new)), new

    async def submit(self, reply: Reply, request: Request, new: list[int], sampler: Sampler, limit: int,
                     stops: list[str], ignore_eos: bool = False, speculative=None, screen=None) -> None:
        """Hand the request to the scheduler and wait for its first event (the prompt is in, or it failed):
        a failure is the request's status, not a broken stream. A client that leaves is cancelled (499)."""
        held = reply.held
        future = self.worker.submit(reply.inbox.deliver, lambda keep: self.store.release(held, keep),
                                   session=held.session, prompt=new, sampler=sampler, max_tokens=limit,
                                   stop_ids=() if ignore_eos else self.lm.eos_ids, stops=stops, key=held.owner,
                                   speculative=speculative, screen=screen)
        try:
            reply.rid = await asyncio.shield(asyncio.wrap_future(future))
        except asyncio.CancelledError:
            future.add_done_callback(self.settle(held))
            raise
        except BaseException:  # not submitted: the session is ours to drop
            self.worker.call(self.store.release, held, False)
            raise
        reply.watcher = asyncio.create_task(reply.watch(request))
        first = await reply.inbox.peek()
        if first is GONE:
            raise APIError(499, "the client closed the connection", code="client_closed")
        if first.kind == "error":
            raise first.error

    def settle(self, held):
        """For a submit whose caller was cancelled: cancel the request once it has an id, else drop the session."""
        def done(future: Future) -> None:
            if future.exception() is None:
                self.worker.cancel(future.result())
            else:
                self.worker.call(self.store.release, held, False)
        return done

    def finish(self, slot) -> None:
        """The request's generation is over (or never started): its slot goes to the next key in turn."""
        if slot.held:
            self.stats["active"] -= 1
            slot.release()
            self.trimmer.soon()

    async def respond(self, req: CommonRequest, request: Request, plan, text: str | None, ids: list[int],
                      screen: Screen | None = None):
        s, sampler, limit, stops, speculative = plan.spec, plan.sampler, plan.limit, plan.stops, plan.speculative
        self.stats["requests"] += 1
        owner = request.state.caller.owner
        slot = await self.admission.acquire(owner)
        self.stats["active"] += 1
        try:
            held, turn, new = await self.start(request, text, ids, s, limit)
        except BaseException:
            self.finish(slot)
            raise
        turn.owner, turn.speculative = owner, speculative is not None
        if screen is not None:
            screen.fed_from(len(ids) - len(new))
        self.by_owner[owner]["requests"] += 1
        reply = Reply(self, held, turn, text is not None, lambda: self.finish(slot))
        try:
            await self.submit(reply, request, new, sampler, limit, stops, bool(req.ignore_eos), speculative, screen)
        except BaseException:
            reply.close()
            raise
        if not req.stream:
            return await reply.whole()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(reply.events(include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    # ------------------------------------------------------------ endpoints

    async def chat_completions(self, req: ChatRequest, request: Request):
        if not req.messages:
            raise APIError(400, "messages must contain at least one message", param="messages", code="empty_messages")
        plan = self.checks.request(req)
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": self.text.escape(m.text())}
                    for m in req.messages]
        self.checks.prompt(chars=sum(len(m["content"]) for m in messages))
        text = await self.on_text(self.render, messages)
        ids = await self.on_text(self.text.encode, text)
        self.checks.prompt(tokens=len(ids))
        spans = (await self.on_text(user_spans, messages, text, self.render, self.text.encode)
                 if self.guard is not None else [])
        return await self.respond(req, request, plan, text, ids, self.screen("messages", "chat", spans))

    def screen(self, param: str, context: str, spans: list[tuple[int, int]]) -> Screen | None:
        """--guard: the user's tokens scored in the request's own prefill (`Screen`); a flagged prompt fails
        before its first token with a 400 naming why."""
        if self.guard is None:
            return None
        return Screen(self.guard[context], spans,
                      lambda v: APIError(400, v.reason, param=param, code="prompt_flagged"))

    def render(self, messages: list[dict]) -> str:
        try:
            return self.lm.render_chat(messages)
        except Exception as e:  # the template rejected this sequence of roles
            raise APIError(400, f"the chat template cannot render these messages: {str(e)[:200]}",
                           param="messages") from None

    async def completions(self, req: CompletionRequest, request: Request):
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        if len(prompts) != 1:
            raise APIError(400, "exactly one prompt per request is supported", param="prompt")
        plan = self.checks.request(req)
        self.checks.prompt(chars=len(prompts[0]), param="prompt")
        ids = await self.on_text(self.lm.encode, prompts[0])
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt", code="empty_prompt")
        self.checks.prompt(tokens=len(ids), param="prompt")
        return await self.respond(req, request, plan, None, ids, self.screen("prompt", "text", [(0, len(ids))]))

    async def models(self):
        return {"object": "list", "data": [self.model_card()]}

    async def model(self, name: str):
        if name != self.model_name:
            raise APIError(404, f"The model {clip(name)} does not exist", param="model", code="model_not_found")
        return self.model_card()

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created_at, "owned_by": "attnlab",
                "context_length": self.lm.cfg.context_length, "attnlab": self.spec.describe()}

    async def health(self, request: Request):
        """(Answered by the Guard before any route: `health_body`; the route stays for the API schema.)"""
        return self.health_body(request.state.caller)

    def health_body(self, caller) -> dict:
        """Up or not for anyone; the server-wide counters only for an admin key (or a keyless server). Read from
        counters only: nothing here waits on the model thread."""
        if not caller.admin:
            return {"status": "ok", "model": self.model_name}
        return {"status": "ok", "model": self.model_name, "sessions": len(self.store.sessions), **self.stats,
                "admission": self.admission.summary(), "scheduler": self.scheduler.summary(),
                "memory": self.trimmer.stats()}

    async def sessions(self, request: Request):
        owner = self.visible(request)
        out = await self.on_worker(self.store.summary, owner)
        mine = sum(self.by_owner.values(), Counter()) if owner is None else self.by_owner[owner]
        return {**out, "requests": mine["requests"], "tokens_generated": mine["tokens_generated"]}

    async def session_info(self, sid: str, request: Request):
        return (await self.on_worker(self.held_or_404, sid, self.visible(request))).summary()

    async def session_cache(self, sid: str, request: Request):
        owner = self.visible(request)  # looked up on the model thread: not evicted (and freed) in between
        return await self.on_worker(lambda: self.held_or_404(sid, owner).cache_view())

    @staticmethod
    def visible(request: Request) -> str | None:
        """Whose sessions the caller may see: its own, or everyone's (None) for an admin or a keyless server."""
        caller = request.state.caller
        return None if caller.admin else caller.owner

    def held_or_404(self, sid: str, owner: str | None):
        held = self.store.get(sid, owner)
        if held is None:  # another caller's session looks exactly like a missing one
            raise APIError(404, f"no session {sid[:40]!r} (finished conversations are evicted LRU)", param="session",
                           code="session_not_found")
        return held

    async def page(self):
        return HTMLResponse(PAGE.read_text(encoding="utf-8").replace("{{MODEL}}", self.model_name))

    # ------------------------------------------------------------ wiring

    def app(self) -> FastAPI:
        """A FastAPI app whose routes and error handlers are thin calls to this server's methods."""
        app = FastAPI(title="attnlab", docs_url=None, redoc_url=None,
                      openapi_url="/openapi.json" if self.config.openapi else None)
        app.state.server, app.state.store, app.state.stats = self, self.store, self.stats
        for cls, options in layers(self.config, self.keys, self.health_body):
            app.add_middleware(cls, **options)
        app.add_exception_handler(APIError, self.api_error)
        app.add_exception_handler(AttnlabError, self.user_error)
        app.add_exception_handler(RequestValidationError, self.invalid)
        app.add_exception_handler(StarletteHTTPException, self.http_error)
        app.add_exception_handler(Exception, self.crash)
        app.post("/v1/chat/completions")(self.chat_completions)
        app.post("/v1/completions")(self.completions)
        app.get("/v1/models")(self.models)
        app.get("/v1/models/{name}")(self.model)
        app.get("/health")(self.health)
        app.get("/v1/sessions")(self.sessions)
        app.get("/v1/sessions/{sid}")(self.session_info)
        app.get("/v1/sessions/{sid}/cache")(self.session_cache)
        app.get("/", response_class=HTMLResponse)(self.page)
        return app


def create_app(lm, config: ServeConfig, keys: Keys = Keys()) -> FastAPI:
    """An app serving `lm` under `config` (its name, default cache policy and every limit) to `keys`."""
    return Server(lm, config, keys).app()


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])
