"""Which replica serves a request: session affinity for `attnlab serve --replicas N` (pure Python, no Ray).

Why: a replica holds the KV caches of the conversations it served (`sessions.py` finds a cache again by
the caller's key and the rendered history's prefix); a turn sent elsewhere would prefill the whole
history again. The OpenAI API has no conversation id and this server has no session header, so a
conversation is named by what every one of its turns resends unchanged: the caller's API key and its
messages up to and including the first user message. Two conversations that open alike share a replica,
which is also where their common prefix could be reused.

Replicas are chosen by rendezvous (highest-random-weight) hashing: each (key, replica) pair gets a hash
score and the key goes to the highest-scoring replica that is up. Losing a replica moves only the keys
it held (to each key's next choice); every other conversation keeps its replica, and its cache.
"""
from __future__ import annotations

import hashlib
import json

from attnlab.serve.guard import owner_of


def bearer(headers) -> str:
    """The caller's API key from `Authorization: Bearer KEY` ('' when absent); headers as ASGI byte pairs."""
    for name, value in headers:
        if name.lower() == b"authorization":
            kind, _, token = value.decode("latin-1").strip().partition(" ")
            return token.strip() if kind.lower() == "bearer" else ""
    return ""


def _text(content) -> str:
    """A message's content as the server reads it: a string, or its text parts joined."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content if isinstance(content, str) else json.dumps(content, sort_keys=True, default=str)


def opening(messages) -> list[list[str]]:
    """The messages that name a conversation: up to and including the first user message (all, if none)."""
    out = []
    for m in messages if isinstance(messages, list) else []:
        if not isinstance(m, dict):
            continue
        role = "system" if m.get("role") == "developer" else str(m.get("role"))
        out.append([role, _text(m.get("content"))])
        if role == "user":
            break
    return out


def conversation_key(method: str, path: str, headers, body: bytes) -> str:
    """The affinity key of a request: owner hash + a hash of what identifies its conversation.

    Chat: the opening messages. Raw completions (one-off caches, never reused): the prompt. Anything
    else (a body that is not JSON included): the path, so such requests spread by path only."""
    owner = owner_of(bearer(headers))
    what: object = [method, path]
    if method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
        try:
            req = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            req = None
        if isinstance(req, dict) and path == "/v1/chat/completions":
            what = ["chat", opening(req.get("messages"))]
        elif isinstance(req, dict):
            what = ["completion", _text(req.get("prompt"))]
    digest = hashlib.sha256(json.dumps(what, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace"))
    return f"{owner}:{digest.hexdigest()[:32]}"


def _score(key: str, replica: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{key}\0{replica}".encode()).digest()[:8], "big")


def ranking(key: str, replicas) -> list[str]:
    """Every replica in this key's order of preference (rendezvous hashing): the first is its home."""
    return sorted(replicas, key=lambda r: (-_score(key, r), r))


def route(key: str, replicas, down=()) -> list[str]:
    """The replicas to try for `key`, in order: its ranking without those marked down, then those (a replica
    marked down is only tried when no other is left)."""
    order = ranking(key, replicas)
    down = set(down)
    return [r for r in order if r not in down] + [r for r in order if r in down]
