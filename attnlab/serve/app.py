"""The FastAPI app: OpenAI's chat/completions endpoints over bounded-cache sessions, plus the cache view.

Concurrency: all model work runs on one worker thread, fed through a FIFO executor one step
at a time (a prompt prefill, or one decode token), so concurrent requests interleave token by
token and each only ever touches its own session's cache. At most `max_active` requests
generate at once; the others wait for a slot up to `queue_timeout` seconds, then get 503.
Decode steps of different requests are not batched: at batch 1 on a CPU a step is bound by
streaming the weights, and separate caches with different policies and lengths would need
padding and per-row eviction.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from attnlab.sampling import Sampler
from attnlab.serve.protocol import (APIError, ChatRequest, CommonRequest, CompletionRequest, StopScanner,
                                    cut_at_stop, validation_error)
from attnlab.serve.sessions import CacheSpec, SessionStore
from attnlab.session import Session
from attnlab.textstream import TextStream

PAGE = Path(__file__).parent / "static" / "index.html"


@dataclass
class Turn:
    """One request's generation: what it was fed, what it sampled, why it ended."""
    prompt_tokens: int
    fed: int
    reply: list[int] = field(default_factory=list)
    finish: str = "length"


def create_app(lm, model_name: str, spec: CacheSpec = CacheSpec(), max_sessions: int = 16,
               max_bytes: int = 1 << 30, max_tokens: int = 256, max_active: int = 8, queue_timeout: float = 60.0,
               max_prompt_tokens: int = 32768, chunk: int = 128) -> FastAPI:
    """An app serving `lm` as `model_name`; spec is the default cache policy of new conversations."""
    store = SessionStore(lm, max_sessions, max_bytes, chunk)
    store.policy(spec)  # a bad default fails at startup, not on the first request
    worker = ThreadPoolExecutor(1, thread_name_prefix="attnlab-model")
    stats = {"requests": 0, "active": 0, "tokens_generated": 0, "errors": 0}
    slots: dict[str, asyncio.Semaphore] = {}
    app = FastAPI(title="attnlab", docs_url=None, redoc_url=None)
    app.state.store, app.state.stats = store, stats

    async def on_worker(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(worker, fn, *args)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        stats["errors"] += 1
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        return await _api_error(request, validation_error(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        return await _api_error(request, APIError(e.status_code, str(e.detail), code="not_found"
                                                  if e.status_code == 404 else None))

    @app.exception_handler(Exception)
    async def _crash(request, e: Exception):  # never let one request take the server down
        return await _api_error(request, APIError(500, f"{type(e).__name__}: {e}", type="server_error"))

    # ------------------------------------------------------------ request -> session

    def check(req: CommonRequest) -> tuple[CacheSpec, Sampler, int, list[str]]:
        if req.model != model_name:
            raise APIError(404, f"The model {req.model!r} does not exist; this server has {model_name!r}",
                           param="model", code="model_not_found")
        if req.n not in (None, 1):
            raise APIError(400, "only n=1 is supported", param="n")
        o = req.attnlab
        s = CacheSpec(o.policy or spec.policy, o.budget or spec.budget,
                      spec.n_sink if o.n_sink is None else o.n_sink, o.positions or spec.positions,
                      spec.block) if o else spec
        try:
            store.policy(s)
        except ValueError as e:
            raise APIError(400, str(e), param="attnlab") from None
        temperature = 1.0 if req.temperature is None else req.temperature
        sampler = Sampler(temperature, 0, req.top_p or 1.0, req.seed)
        return s, sampler, req.limit(max_tokens), req.stops()

    def check_length(s: CacheSpec, held_seen: int, prompt: int, new: int, limit: int) -> None:
        if prompt > max_prompt_tokens:
            raise APIError(400, f"the prompt has {prompt} tokens; this server takes at most {max_prompt_tokens} "
                                f"per request", param="messages", code="context_length_exceeded")
        ctx = lm.cfg.context_length
        if s.policy == "full" and held_seen + new + limit > ctx:
            raise APIError(400, f"this conversation needs {held_seen + new + limit} tokens of cache (prompt + "
                                f"max_tokens) but policy 'full' holds at most {ctx}; use a bounded policy "
                                f"(attnlab.policy 'sink') to go on", param="messages", code="context_length_exceeded")

    async def admit() -> asyncio.Semaphore:
        sem = slots.setdefault("model", asyncio.Semaphore(max_active))
        try:
            await asyncio.wait_for(sem.acquire(), queue_timeout)
        except TimeoutError:
            raise APIError(503, f"server busy: no generation slot freed within {queue_timeout:g} s",
                           type="server_error", code="queue_timeout") from None
        return sem

    async def start(text: str | None, ids: list[int] | None, s: CacheSpec, limit: int):
        """Find or make the session, feed the prompt; returns (held or None, session, turn)."""
        if text is not None:  # chat: a stored, reusable conversation
            held, reused = await on_worker(store.acquire, text, s)
            session, feeding = held.session, False
            try:
                new = await on_worker(session.new_ids, text)
                prompt = await on_worker(lambda: len(lm.encode_rendered(text)))
                check_length(s, session.cache.seen, prompt, len(new), limit)
                feeding = True
                await feed(session, new)
                session.text = text
            except BaseException:  # keep a reused session only if its cache was not touched
                worker.submit(store.release, held, reused and not feeding)
                raise
            held.turns += 1
            return held, session, Turn(prompt, len(new))
        policy = store.policy(s)
        cache = lm.new_cache(policy=policy) if policy else lm.new_cache(max_capacity=lm.cfg.context_length)
        session = Session(lm, cache, chunk)
        check_length(s, 0, len(ids), len(ids), limit)
        await feed(session, ids)
        return None, session, Turn(len(ids), len(ids))

    async def feed(session: Session, ids: list[int]) -> None:
        """Prefill as one worker step per chunk, so a long prompt does not stall the other streams."""
        for i in range(0, len(ids), chunk):
            await on_worker(session.feed, ids[i:i + chunk])

    async def run(gen, turn: Turn, stops: list[str], request: Request | None):
        """Decode one token per worker step; yields text deltas (cut at stop strings)."""
        text, scan, eos = TextStream(lm.tokenizer), StopScanner(stops), lm.eos_ids
        while True:
            token = await on_worker(next, gen, None)
            if token is None:
                break
            turn.reply.append(token)
            stats["tokens_generated"] += 1
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

    def finish(held, sem, gen=None) -> None:
        """Stop the decode and release session and slot, after any step the worker still runs for this request."""
        stats["active"] -= 1
        sem.release()
        if gen is not None:
            worker.submit(gen.close)  # the Session records the reply tokens it fed
        if held is not None:
            worker.submit(store.release, held)

    def usage(turn: Turn) -> dict:
        return {"prompt_tokens": turn.prompt_tokens, "completion_tokens": len(turn.reply),
                "total_tokens": turn.prompt_tokens + len(turn.reply),
                "prompt_tokens_details": {"cached_tokens": max(0, turn.prompt_tokens - turn.fed)}}

    def extension(held, session: Session, turn: Turn) -> dict:
        return {"session": held.id if held else None, "fed_tokens": turn.fed, "tokens_seen": session.cache.seen,
                "slots_kept": len(session.cache), "cache_bytes": session.cache.nbytes()}

    async def respond(req: CommonRequest, request: Request, text: str | None, ids: list[int] | None, chat: bool):
        s, sampler, limit, stops = check(req)
        stats["requests"] += 1
        sem = await admit()
        stats["active"] += 1
        try:
            held, session, turn = await start(text, ids, s, limit)
        except BaseException:
            finish(None, sem)
            raise
        rid, created = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        gen = session.generate(sampler, limit)
        if not req.stream:
            try:
                async for _ in run(gen, turn, stops, request):
                    pass
            finally:
                finish(held, sem, gen)
            out = cut_at_stop(lm.tokenizer.decode(turn.reply, skip_special_tokens=True), stops)
            choice = ({"index": 0, "message": {"role": "assistant", "content": out}} if chat
                      else {"index": 0, "text": out})
            choice.update(finish_reason=turn.finish, logprobs=None)
            return {"id": rid, "object": kind, "created": created, "model": model_name, "choices": [choice],
                    "usage": usage(turn), "attnlab": extension(held, session, turn)}
        include_usage = bool((req.stream_options or {}).get("include_usage"))

        def chunk(delta: str | None, reason: str | None = None, first: bool = False) -> str:
            if chat:
                d = ({"role": "assistant", "content": ""} if first else {"content": delta} if delta else {})
                choice = {"index": 0, "delta": d, "finish_reason": reason, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": reason, "logprobs": None}
            body = {"id": rid, "object": kind + (".chunk" if chat else ""), "created": created,
                    "model": model_name, "choices": [choice]}
            if reason is not None or first:  # the page learns its session id from the first chunk
                body["attnlab"] = extension(held, session, turn)
            return f"data: {json.dumps(body)}\n\n"

        async def events():
            try:
                if chat:
                    yield chunk(None, first=True)
                async for delta in run(gen, turn, stops, None):
                    yield chunk(delta)
                yield chunk(None, turn.finish)
                if include_usage:
                    yield f"data: {json.dumps({'id': rid, 'object': kind + '.chunk', 'created': created, 'model': model_name, 'choices': [], 'usage': usage(turn)})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                finish(held, sem, gen)

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    # ------------------------------------------------------------ endpoints

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request):
        if not req.messages:
            raise APIError(400, "messages must contain at least one message", param="messages", code="empty_messages")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
        try:
            text = lm.render_chat(messages)
        except Exception as e:  # the template rejected this sequence of roles
            raise APIError(400, f"the chat template cannot render these messages: {e}", param="messages") from None
        return await respond(req, request, text, None, chat=True)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        if len(prompts) != 1:
            raise APIError(400, "exactly one prompt per request is supported", param="prompt")
        ids = lm.encode(prompts[0])
        if not ids:
            raise APIError(400, "the prompt is empty", param="prompt", code="empty_prompt")
        return await respond(req, request, None, ids, chat=False)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name}")
    async def model(name: str):
        if name != model_name:
            raise APIError(404, f"The model {name!r} does not exist", param="model", code="model_not_found")
        return model_card()

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created_at, "owned_by": "attnlab",
                "context_length": lm.cfg.context_length, "attnlab": spec.describe()}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "sessions": len(store.sessions), **stats}

    @app.get("/v1/sessions")
    async def sessions():
        return await on_worker(store.summary)

    @app.get("/v1/sessions/{sid}")
    async def session_info(sid: str):
        return (await on_worker(held_or_404, sid)).summary()

    @app.get("/v1/sessions/{sid}/cache")
    async def session_cache(sid: str):
        held = held_or_404(sid)
        return await on_worker(held.cache_view)

    def held_or_404(sid: str):
        held = store.get(sid)
        if held is None:
            raise APIError(404, f"no session {sid!r} (finished conversations are evicted LRU)", param="session",
                           code="session_not_found")
        return held

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return HTMLResponse(PAGE.read_text(encoding="utf-8").replace("{{MODEL}}", model_name))

    created_at = int(time.time())
    return app
