"""What every request passes before any route runs: Host allow-list, API key, body size.

Why an ASGI middleware: these checks must hold before FastAPI reads and parses a body (a
5 MB body costs parsing time and memory even if the route would reject it), and for every
path alike. Failures get OpenAI's error body.

- Host: only names in `hosts` (default: the loopback names) — a DNS-rebinding page that
  makes a browser send requests to 127.0.0.1 carries its own domain as Host, and gets 421.
- Keys: with `keys`, every path but `/` and `/health` needs `Authorization: Bearer KEY`
  (what the `openai` client sends), else 401. The caller's identity, a hash of the key, goes
  to `request.state.caller`: conversations are namespaced by it. Admin keys see all sessions.
- Body: at most `max_body` bytes, by Content-Length or counted while reading, else 413.
"""
from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass

from attnlab.serve.config import LOOPBACK

OPEN_PATHS = ("/", "/health")


@dataclass(frozen=True)
class Caller:
    owner: str          # namespace of the caller's conversations ("" without keys)
    admin: bool         # sees and may inspect every conversation


def owner_of(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def host_name(header: str) -> str:
    """The name part of a Host header: 'example.com:80' -> 'example.com', '[::1]:8000' -> '::1'.

    Anything else after the name than ':' and a port (e.g. '[::1]evil.com') leaves the header whole,
    which matches no allowed name."""
    header = header.strip().lower()
    if header.startswith("["):
        end = header.find("]")
        rest = header[end + 1:]
        ok = end > 0 and (not rest or (rest[0] == ":" and rest[1:].isdigit()))
        return header[1:end] if ok else header
    name, colon, port = header.partition(":")
    return name if not colon or (port.isdigit() and ":" not in port) else header


def allowed_hosts(hosts) -> set[str] | None:
    return None if "*" in hosts else {h.lower().strip("[]") for h in hosts}


async def wrong_host(hosts: set[str] | None, scope, send) -> bool:
    """Answer 421 (and say True) when the request's Host is not one this server answers for."""
    if hosts is None:
        return False
    host = next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == b"host"), "")
    if host_name(host) in hosts:
        return False
    await reject(send, 421, "this server does not answer for that Host header (allowed: "
                            f"{', '.join(sorted(hosts))}; see --allowed-host)", "invalid_host")
    return True


class HostGuard:
    """The Host check alone, for the outside of the CORS middleware: a preflight naming a foreign Host
    gets 421 as every other request does (the CORS answer would otherwise come first)."""

    def __init__(self, app, hosts=LOOPBACK):
        self.app, self.hosts = app, allowed_hosts(hosts)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and await wrong_host(self.hosts, scope, send):
            return
        return await self.app(scope, receive, send)


class Guard:
    """health: `health(caller) -> dict`, the answer to GET /health, given here, before any route or task of the
    app (`Server.health_body`: read from counters, never waiting on the model thread)."""

    def __init__(self, app, max_body: int = 1 << 20, hosts=LOOPBACK, keys=(), admin_keys=(), health=None):
        self.app, self.max_body, self.health = app, max_body, health
        self.hosts = allowed_hosts(hosts)
        self.keys = [(k.encode(), False) for k in keys] + [(k.encode(), True) for k in admin_keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if await wrong_host(self.hosts, scope, send):
            return
        headers = {k.lower(): v.decode("latin-1") for k, v in scope["headers"]}
        caller = Caller("", True)
        if self.keys:
            caller = self.caller(headers.get(b"authorization", ""))
            if caller is None and scope["path"] not in OPEN_PATHS:
                return await reject(send, 401, "missing or incorrect API key: send 'Authorization: Bearer KEY'",
                                    "invalid_api_key")
        scope.setdefault("state", {})["caller"] = caller = caller or Caller("", False)
        if self.health is not None and scope["path"] == "/health" and scope.get("method") in ("GET", "HEAD"):
            return await answer(send, 200, self.health(caller))
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return await reject(send, 400, "Content-Length is not a number", "invalid_value")
            if int(length) > self.max_body:
                return await reject(send, 413, f"the request body has {length} bytes; this server takes at most "
                                               f"{self.max_body}", "request_too_large")
        body, more = [], True
        if scope.get("method") in ("POST", "PUT", "PATCH"):  # read it here, counted, then replay it
            size = 0
            while more:
                message = await receive()
                if message["type"] != "http.request":
                    return
                body.append(message.get("body", b""))
                size, more = size + len(body[-1]), message.get("more_body", False)
                if size > self.max_body:
                    return await reject(send, 413, f"the request body exceeds {self.max_body} bytes",
                                        "request_too_large")
        else:
            return await self.app(scope, receive, send)
        whole = b"".join(body)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": whole, "more_body": False}
            return await receive()  # then wait for the disconnect, as the server would

        return await self.app(scope, replay, send)

    def caller(self, authorization: str) -> Caller | None:
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key:
            return None
        given, found = key.strip().encode(), None
        for k, admin in self.keys:  # compare with every key, in constant time each
            if hmac.compare_digest(given, k) and found is None:
                found = Caller(owner_of(k.decode()), admin)
        return found


def layers(config, keys, health=None) -> list[tuple[type, dict]]:
    """The middleware in front of every route of a server (or the replicas' front), innermost first: the
    Guard alone, or with CORS origins the Host check, then CORS (browsers send preflights without the
    key), then keys and body."""
    guard = dict(max_body=config.max_body, hosts=config.hosts, keys=keys.api, admin_keys=keys.admin, health=health)
    if not config.cors_origins:
        return [(Guard, guard)]
    from starlette.middleware.cors import CORSMiddleware
    return [(Guard, {**guard, "hosts": ("*",)}),
            (CORSMiddleware, dict(allow_origins=list(config.cors_origins), allow_methods=["GET", "POST"],
                                  allow_headers=["Authorization", "Content-Type"])),
            (HostGuard, dict(hosts=config.hosts))]


def guarded(app, config, keys):
    """A plain ASGI app inside `layers(config, keys)`."""
    for cls, options in layers(config, keys):
        app = cls(app, **options)
    return app


async def reject(send, status: int, message: str, code: str) -> None:
    await answer(send, status, {"error": {"message": message, "type": "invalid_request_error", "param": None,
                                          "code": code}})


async def answer(send, status: int, content: dict) -> None:
    body = json.dumps(content).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
