"""OpenAI request shapes and OpenAI-style errors for the server (stop strings: `attnlab.stop`).

Requests are validated by pydantic; every failure becomes OpenAI's error body
`{"error": {"message", "type", "param", "code"}}` with a 4xx status (see `app.py`).
Unknown top-level fields that OpenAI defines (user, presence_penalty, ...) are accepted
and ignored; the `attnlab` field is ours: it picks the cache policy per request.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from attnlab.stop import StopScanner  # noqa: F401 (where the server's callers have found it)


MAX_STOPS, MAX_STOP_CHARS = 4, 1000
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # what torch.Generator.manual_seed takes


def clip(text: str, n: int = 64) -> str:
    """repr of a client's string for an error message, at most about n characters (a 100 KB id is not echoed)."""
    return repr(text[:n]) + (f"... ({len(text)} characters)" if len(text) > n else "")


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def lone_surrogate(data) -> str | None:
    """The path of the first string in a parsed JSON body that is not valid UTF-8 (a lone surrogate), or None.

    Why: json.loads turns "\\ud800" into a str the tokenizer cannot encode (a TypeError deep inside).
    Iterative, so a deeply nested body cannot exhaust the stack.
    """
    todo = [("", data)]
    while todo:
        path, x = todo.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(x, dict):
            todo.extend((f"{path}.{k}" if path else str(k), v) for k, v in x.items())
            bad = next((k for k in x if isinstance(k, str) and lone_surrogate(k)), None)
            if bad is not None:
                return path or "body"
        elif isinstance(x, list):
            todo.extend((f"{path}.{i}" if path else str(i), v) for i, v in enumerate(x))
    return None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        """Plain text of the content; OpenAI content parts must all be of type text here."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"unsupported content part of type {str(part.get('type'))[:40]!r}; only text",
                               param="messages")
            parts.append(part["text"])
        return "".join(parts)


class AttnlabOptions(BaseModel):
    """Per-request cache policy (defaults: the server's --policy/--budget/--n-sink/--positions).

    Upper bounds (the model's context, the server's cache bytes) are checked by the server.
    """
    model_config = ConfigDict(extra="forbid", strict=True)
    policy: str | None = Field(None, max_length=64)
    budget: int | None = Field(None, ge=1)
    n_sink: int | None = Field(None, ge=0)
    positions: Literal["cache", "original"] | None = None
    speculative: str | None = Field(None, max_length=64)  # ngram[:N[:K]] or none; default: the server's --speculative


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool | None = None


class CommonRequest(BaseModel):
    """Fields both endpoints share. Strict: OpenAI rejects "10" for an integer, so do we."""
    model_config = ConfigDict(extra="allow", strict=True)
    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None  # vLLM's and llama-server's field: decode max_tokens whatever the model ends on
    attnlab: AttnlabOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _utf8(cls, data):
        bad = lone_surrogate(data)
        if bad is not None:
            raise ValueError(f"{bad} is not valid UTF-8 (it contains a lone surrogate)")
        return data

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise APIError(400, f"stop must be at most {MAX_STOPS} non-empty strings", param="stop")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise APIError(400, f"each stop string may have at most {MAX_STOP_CHARS} characters", param="stop",
                           code="invalid_value")
        return stops

    def limit(self, default: int, cap: int | None = None) -> int:
        """max_tokens of the reply: the request's, else the server default; 400 past the server's cap."""
        n = self.max_completion_tokens or self.max_tokens or default
        if cap is not None and n > cap:
            param = "max_completion_tokens" if self.max_completion_tokens else "max_tokens"
            raise APIError(400, f"{param} is {n}; this server generates at most {cap} tokens per request",
                           param=param, code="invalid_value")
        return n


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
