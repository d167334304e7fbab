"""Issue 61, items 1: one key cannot starve another, and a slow reader holds no generation slot.

Through the official `openai` client (and raw sockets for a client that stops reading) against a real server
around the session's SmolLM2."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from openai import OpenAI

from tests.serve.conftest import running

MODEL, A, B = "smollm2-135m", "fairness-key-a", "fairness-key-b"
COUNT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"  # SmolLM2 goes on counting: no early end of text


def client(url, key, timeout=60):
    return OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=timeout)


def test_one_key_streaming_eight_long_replies_does_not_starve_another(smollm2):
    """Key A streams 8 replies of up to 4,000 tokens; key B's 4-token request answers within 2 s (it waited the
    whole queue timeout, then 503, when --max-active was one server-wide count): B's request takes the slot A
    leaves free and is done within the few steps its own tokens need."""
    from attnlab.serve import Keys, PolicySpec, ServeConfig, create_app
    app = create_app(smollm2, ServeConfig(MODEL, PolicySpec("sink", 64, 4, "cache"), chunk=32, max_tokens_cap=4096,
                                          queue_timeout=20), Keys([A, B]))
    server = app.state.server
    with running(app) as url:
        a, stop, started = client(url, A), threading.Event(), []

        def stream(i):
            s = a.completions.create(model=MODEL, prompt=f"{i}: " + COUNT, max_tokens=4000, temperature=0,
                                     stream=True)
            started.append(i)
            for _ in s:
                if stop.is_set():
                    break
            s.close()
        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(8)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while (len(started) < 7 or server.scheduler.summary()["decoding"] < 7) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(started) >= 7 and server.admission.busy >= 7  # A holds the server
        n0, t0 = server.scheduler.counters["steps"], time.monotonic()
        time.sleep(1.0)
        step = (time.monotonic() - t0) / max(1, server.scheduler.counters["steps"] - n0)  # one step of A's rows
        try:
            before, t0 = dict(server.scheduler.counters), time.monotonic()
            r = client(url, B, timeout=10).completions.create(model=MODEL, prompt="Hello", max_tokens=4,
                                                              temperature=0)
            took = time.monotonic() - t0
            assert r.choices[0].text and r.usage.completion_tokens <= 4
            steps = server.scheduler.counters["steps"] - before["steps"]
            # within 2 s, or (on a machine so loaded that a step of 8 rows takes over 0.25 s) within 8 steps
            assert steps <= 8 and took < max(2.0, 8 * step), (took, steps, step)
            assert server.scheduler.summary()["decoding"] >= 7  # A's streams went on meanwhile
        finally:
            stop.set()
            for t in threads:
                t.join(30)


def raw_stream(port: int, body: dict) -> socket.socket:
    """A streaming completion sent on a socket that reads nothing back (2 KiB receive buffer)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    s.connect(("127.0.0.1", port))
    data = json.dumps(body)
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n{data}".encode())
    return s


def read_all(s: socket.socket, seconds: float) -> tuple[bytes, bool]:
    """What the socket delivers within `seconds`; and whether the server ended it (EOF or reset)."""
    s.settimeout(0.5)
    got, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return b"".join(got), True
        if not chunk:
            return b"".join(got), True
        got.append(chunk)
        if b"data: [DONE]" in b"".join(got[-2:]):
            break
    return b"".join(got), False


def generated(server, seconds: float = 60) -> None:
    """Wait until the server's one request has been generated (its scheduler stepped, then idle)."""
    deadline = time.monotonic() + seconds
    while server.scheduler.counters["decode_steps"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    while not server.scheduler.idle and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.fixture(scope="module")
def slow_served(smollm2):
    """One generation slot; replies buffered in at most 4 KiB of socket (and 4 KiB queued) per connection."""
    from attnlab.serve import Limits, PolicySpec, ServeConfig, create_app
    app = create_app(smollm2, ServeConfig(MODEL, PolicySpec("sink", 64, 4, "cache"), max_active=1, queue_timeout=30))
    with running(app, Limits(send_buffer=4096, send_timeout=60)) as url:
        yield url, app


def test_a_slow_reader_frees_its_slot_when_generation_ends(slow_served):
    """A client that stops reading a 120-token stream (about 28 KB of events, many times what the connection
    buffers) holds its slot only while its tokens are generated: the next request is served while it still
    has not read, and it then reads its whole reply (bounded: the rest waited as events, not as socket data)."""
    url, app = slow_served
    server = app.state.server
    body = {"model": MODEL, "prompt": COUNT, "max_tokens": 120, "temperature": 0, "stream": True}
    s = raw_stream(int(url.rsplit(":", 1)[1]), body)
    try:
        generated(server)
        time.sleep(0.2)
        assert server.admission.busy == 0 and server.stats["active"] == 0
        t0 = time.monotonic()
        r = client(url, "unused", timeout=20).completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert r.choices[0].text is not None and time.monotonic() - t0 < 10
        data, ended = read_all(s, 30)
    finally:
        s.close()
    events = [line for line in data.split(b"\n") if line.startswith(b"data: {")]
    assert not ended and b"data: [DONE]" in data
    assert len(events) == 121 and json.loads(events[-1][6:])["choices"][0]["finish_reason"] == "length"


def test_a_reader_that_stalls_is_cut_after_the_send_timeout(smollm2):
    from attnlab.serve import Limits, PolicySpec, ServeConfig, create_app
    app = create_app(smollm2, ServeConfig(MODEL, PolicySpec("sink", 64, 4, "cache"), max_active=1))
    with running(app, Limits(send_buffer=4096, send_timeout=1.0)) as url:
        body = {"model": MODEL, "prompt": COUNT, "max_tokens": 120, "temperature": 0, "stream": True}
        s = raw_stream(int(url.rsplit(":", 1)[1]), body)
        try:
            server = app.state.server
            generated(server)
            time.sleep(2.0)  # past the send timeout: the server has given up on this reader
            data, ended = read_all(s, 10)
        finally:
            s.close()
        assert ended and b"data: [DONE]" not in data
        assert server.admission.busy == 0 and server.stats["server_errors"] == 0
