"""OpenAI request shapes, OpenAI-style errors, and stop-string scanning for the server.

Requests are validated by pydantic; every failure becomes OpenAI's error body
`{"error": {"message", "type", "param", "code"}}` with a 4xx status (see `app.py`).
Unknown top-level fields that OpenAI defines (user, presence_penalty, ...) are accepted
and ignored; the `attnlab` field is ours: it picks the cache policy per request.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        """Plain text of the content; OpenAI content parts must all be of type text here."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"unsupported content part of type {part.get('type')!r}; only text",
                               param="messages")
            parts.append(part["text"])
        return "".join(parts)


class AttnlabOptions(BaseModel):
    """Per-request cache policy (defaults: the server's --policy/--budget/--n-sink/--positions)."""
    model_config = ConfigDict(extra="forbid")
    policy: str | None = None
    budget: int | None = Field(None, ge=1)
    n_sink: int | None = Field(None, ge=0)
    positions: Literal["cache", "original"] | None = None


class CommonRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: dict | None = None
    attnlab: AttnlabOptions | None = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise APIError(400, "stop must be at most 4 non-empty strings", param="stop")
        return stops

    def limit(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


class ChatRequest(CommonRequest):
    messages: list[Message]


class CompletionRequest(CommonRequest):
    prompt: str | list[str]


def validation_error(errors: list[dict]) -> APIError:
    """A pydantic/FastAPI validation failure as one OpenAI error (the first problem found)."""
    e = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    loc = [str(x) for x in e.get("loc", ()) if x not in ("body",)]
    if e.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {e.get('msg')}", code="invalid_json")
    param = ".".join(loc) or None
    return APIError(400, f"{param or 'body'}: {e.get('msg')}", param=param, code="invalid_value")


class StopScanner:
    """Cuts streamed text at the first stop string, holding back only what may start one."""

    def __init__(self, stops: list[str]):
        self.stops, self.buf, self.stopped = stops, "", False

    def push(self, delta: str) -> str:
        if self.stopped:
            return ""
        self.buf += delta
        hits = [i for i in (self.buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.buf, self.stopped = self.buf[:min(hits)], "", True
            return out
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.buf.endswith(s[:k])), default=0)
        out, self.buf = self.buf[:len(self.buf) - hold], self.buf[len(self.buf) - hold:]
        return out

    def flush(self) -> str:
        out, self.buf = ("" if self.stopped else self.buf), ""
        return out


def cut_at_stop(text: str, stops: list[str]) -> str:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[:min(hits)] if hits else text
