"""The replicas' front (`attnlab.serve.front`) without Ray: in front of a stand-in for Serve's proxy it keeps
one server's key check (before relaying), header deadline and connection caps, streams answers as they come,
and closes the upstream request when its client leaves."""
from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest

from tests.serve.conftest import running

KEY = "front-test-key-1"


class Upstream:
    """Stands in for Ray Serve's proxy: counts what reaches it, streams 5 numbered chunks 0.2 s apart, and
    records a client that left (its http.disconnect)."""

    def __init__(self):
        self.calls, self.left = [], asyncio.Event()
        self.disconnects = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        body = (await receive()).get("body", b"")
        self.calls.append((scope["method"], scope["path"], dict(scope["headers"]).get(b"authorization"), body))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        if scope["path"] != "/slow":
            await send({"type": "http.response.body", "body": b"echo:" + body})
            return
        for i in range(5):
            await send({"type": "http.response.body", "body": f"{i}\n".encode(), "more_body": True})
            await asyncio.sleep(0.2)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


@pytest.fixture(scope="module")
def front():
    from attnlab.serve import Keys, Limits, ServeConfig
    from attnlab.serve.front import front_app
    up = Upstream()
    slow_up = StreamForever()
    with running(up) as inner, running(slow_up) as inner2:
        config = ServeConfig("m", max_body=64)
        limits = Limits(header_timeout=1.0, body_timeout=1.0, max_connections=50, max_per_client=4)
        with running(front_app(inner, config, Keys([KEY])), limits) as url, \
                running(front_app(inner2, config, Keys([KEY])), limits) as url2:
            yield url, up, url2, slow_up


class StreamForever:
    """An upstream whose answer never ends by itself: it stops only when its client leaves."""

    def __init__(self):
        self.stopped = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        gone = asyncio.ensure_future(receive())
        while not gone.done():
            await send({"type": "http.response.body", "body": b"tick\n", "more_body": True})
            await asyncio.sleep(0.05)
        self.stopped += 1


def test_the_key_is_checked_before_anything_is_relayed(front):
    url, up, _, _ = front
    before = len(up.calls)
    assert httpx.post(url + "/v1/completions", content=b"{}").status_code == 401
    r = httpx.post(url + "/v1/completions", content=b"{}", headers={"Authorization": "Bearer wrong-key-000"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    big = httpx.post(url + "/v1/completions", content=b"x" * 100, headers={"Authorization": f"Bearer {KEY}"})
    assert big.status_code == 413
    assert httpx.get(url + "/health", headers={"Host": "evil.example"}).status_code == 421
    assert len(up.calls) == before  # none of them reached the replicas
    ok = httpx.post(url + "/v1/x?a=1", content=b"hi", headers={"Authorization": f"Bearer {KEY}"})
    assert ok.status_code == 200 and ok.text == "echo:hi"
    assert up.calls[-1] == ("POST", "/v1/x", f"Bearer {KEY}".encode(), b"hi")  # the key goes on: owners


def test_answers_stream_through_as_they_come(front):
    url = front[0]
    arrivals = []
    with httpx.stream("GET", url + "/slow", headers={"Authorization": f"Bearer {KEY}"}) as r:
        for line in r.iter_lines():
            arrivals.append((line, time.monotonic()))
    assert [a for a, _ in arrivals] == ["0", "1", "2", "3", "4"]
    assert arrivals[-1][1] - arrivals[0][1] > 0.5  # chunk by chunk, not buffered whole


def test_header_deadline_and_connection_cap_hold_at_the_front(front):
    port = int(front[0].rsplit(":", 1)[1])
    half = socket.create_connection(("127.0.0.1", port))
    half.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the rest
    half.settimeout(5)
    t0 = time.monotonic()
    assert half.recv(100).startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 3
    half.close()
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(6)]
    try:
        time.sleep(0.3)
        closed = 0
        for s in socks:
            s.settimeout(0.5)
            try:
                closed += s.recv(1) == b""
            except ConnectionResetError:
                closed += 1
            except TimeoutError:
                pass  # open, waiting for a request
        assert closed == 2  # 4 per client address
    finally:
        for s in socks:
            s.close()


def test_a_client_that_leaves_closes_the_upstream_request(front):
    _, _, url2, slow = front
    with httpx.stream("POST", url2 + "/go", content=b"{}", headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = r.iter_lines()
        assert next(lines) == "tick"
    deadline = time.monotonic() + 5
    while slow.stopped == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert slow.stopped == 1
