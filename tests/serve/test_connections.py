"""Issue 38 item 1: half-sent and trickling connections against the server's own uvicorn config.

The attacker's sockets come from other loopback addresses (127.0.0.2, 127.0.0.3: all of 127/8 is
loopback on Linux), so the per-address cap can be told apart from the total one, and /health from
127.0.0.1 must keep answering while they are open.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time

import httpx
import pytest

from attnlab.serve.conn import Limits

HALF = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-a: "
LIMITS = Limits(header_timeout=3.0, body_timeout=2.0, keep_alive=1.0, max_connections=400, max_per_client=150,
                log_interval=60)


@pytest.fixture(scope="module")
def guarded_http(smollm2):
    from attnlab.serve import Keys, PolicySpec, ServeConfig, create_app
    from tests.serve.conftest import running
    app = create_app(smollm2, ServeConfig("smollm2-135m", PolicySpec("sink", 64, 4, "cache")),
                     Keys(api=["key-connections-1"]))
    with running(app, LIMITS) as url:
        yield url, int(url.rsplit(":", 1)[1])


def half_sent(port: int, source: str, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
        s.sendall(HALF)
        socks.append(s)
    return socks


def closed_by_server(s: socket.socket, within: float) -> tuple[bool, bytes]:
    """Whether the server closed s within `within` seconds, and what it sent before closing."""
    s.settimeout(within)
    got = b""
    try:
        while chunk := s.recv(4096):
            got += chunk
    except TimeoutError:
        return False, got
    except OSError:  # reset: closed as well
        pass
    return True, got


def test_hundreds_of_half_sent_sockets_are_capped_and_dropped_while_health_answers(guarded_http):
    url, port = guarded_http
    t0 = time.monotonic()
    flood = half_sent(port, "127.0.0.2", 300)   # 150 over the per-address cap
    other = half_sent(port, "127.0.0.3", 100)   # a second address: its own share
    try:
        for _ in range(5):                       # the service stays up meanwhile
            r = httpx.get(url + "/health", timeout=2)
            assert r.status_code == 200 and r.json()["status"] == "ok"
        # those past the per-address cap were closed at once, without a reply
        refused = [closed_by_server(s, 0.05) for s in flood[LIMITS.max_per_client:]]
        assert all(closed and not got for closed, got in refused)
        # the rest get 408 and are closed once the header deadline passes, seconds after they opened
        dropped = [closed_by_server(s, LIMITS.header_timeout + 3) for s in flood[:LIMITS.max_per_client] + other]
        elapsed = time.monotonic() - t0
        assert all(closed for closed, _ in dropped), sum(not c for c, _ in dropped)
        assert all(got.startswith(b"HTTP/1.1 408") for _, got in dropped)
        assert elapsed < LIMITS.header_timeout + 6, elapsed
    finally:
        for s in flood + other:
            s.close()
    assert httpx.get(url + "/health", timeout=2).status_code == 200


def test_the_total_cap_closes_connections_past_it(smollm2):
    from attnlab.serve import ServeConfig, create_app
    from tests.serve.conftest import running
    limits = Limits(header_timeout=60, max_connections=100, max_per_client=60)  # no deadline passes meanwhile
    with running(create_app(smollm2, ServeConfig("smollm2-135m")), limits) as url:
        port, socks = int(url.rsplit(":", 1)[1]), []
        try:
            for i in range(3):  # 3 x 40 = 120 > 100 in total, each address under its own cap
                socks += half_sent(port, f"127.0.0.{4 + i}", 40)
            time.sleep(0.2)
            refused = [s for s in socks if closed_by_server(s, 0.01) == (True, b"")]
            assert len(refused) == 20 and set(refused) == set(socks[100:])
        finally:
            for s in socks:
                s.close()
        time.sleep(0.2)
        assert httpx.get(url + "/health", timeout=2).status_code == 200


def test_a_trickling_client_is_dropped_at_the_header_deadline(guarded_http):
    _, port = guarded_http
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-slow: " + b"a" * 40 + b"\r\n\r\n"
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    t0, sent, got = time.monotonic(), 0, b""
    try:
        while sent < len(request):  # one byte every 0.1 s: the whole request would take 8 s
            s.sendall(request[sent:sent + 1])
            sent += 1
            time.sleep(0.1)
    except OSError:
        pass
    s.settimeout(3)
    try:
        got = s.recv(4096)
    except OSError:
        pass
    s.close()
    assert sent < len(request) and got.startswith(b"HTTP/1.1 408"), (sent, got[:40])
    assert time.monotonic() - t0 < LIMITS.header_timeout + 1.5


def test_a_body_that_never_comes_is_dropped(guarded_http):
    _, port = guarded_http
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer key-connections-1\r\n"
              b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\": ")
    t0 = time.monotonic()
    closed, got = closed_by_server(s, LIMITS.body_timeout + 3)
    s.close()
    assert closed and got.startswith(b"HTTP/1.1 408"), got[:60]
    assert LIMITS.body_timeout - 0.2 < time.monotonic() - t0 < LIMITS.body_timeout + 2


def test_a_kept_alive_connection_still_serves_requests(guarded_http):
    url, _ = guarded_http
    with httpx.Client() as c:  # three requests on one connection, the pause shorter than keep-alive
        for _ in range(3):
            assert c.get(url + "/health").status_code == 200
            time.sleep(0.3)


def test_accept_errors_are_logged_once_per_interval(caplog):
    from attnlab.serve.conn import quiet_accept_errors

    async def flood():
        loop = asyncio.get_running_loop()
        quiet_accept_errors(loop, interval=60)
        for _ in range(1000):
            loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                         "exception": OSError(24, "Too many open files")})
    with caplog.at_level(logging.ERROR):
        asyncio.run(flood())
    lines = [r for r in caplog.records if "accept" in r.getMessage()]
    assert len(lines) == 1 and "Too many open files" in lines[0].getMessage()
