"""/health from a process of its own (`attnlab serve --health-port N`): answered in the machine's time, not the model's.

Why a process: the server's own /health runs on its event loop, which shares Python's GIL with the model thread,
and every socket call of a reply gives the GIL up and waits to get it back. Measured under the soak's load
(16 clients, py-spy): the model thread holds the GIL about 30% of the time (the eager prefill, cache
bookkeeping between kernels), the event loop 5%, and /health took p50 17 / p99.9 146 ms, while a bare asyncio
process beside it answered in p50 0.9 / p99.9 28 ms (a shared 2-core machine, load 13). A process has a GIL
of its own.

It knows the server is alive from a heartbeat: the server's event loop writes the monotonic clock (one clock
for every process on Linux) into a shared 8-byte file every `BEAT` seconds; the side answers 200 while the
beat is younger than `stale` seconds, else 503 (the event loop is stuck), and exits when the server does.
Run by path, it imports nothing of attnlab (no torch), so it is up before the model has loaded. It answers `GET /health`
(200/503) and nothing else (404); a connection is closed after `IDLE` s without a complete request, and past
`MAX_CONNECTIONS` open ones.
"""
from __future__ import annotations

import asyncio
import json
import mmap
import os
import struct
import subprocess
import sys
import tempfile
import time

BEAT, IDLE, MAX_CONNECTIONS, MAX_HEAD = 0.25, 10.0, 64, 8192


class Heartbeat:
    """The server's end: a file of one double (the monotonic clock), written every BEAT s by `run` on the serving
    loop, so a stuck loop stops it."""

    def __init__(self):
        fd, self.path = tempfile.mkstemp(prefix="attnlab-health-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        os.write(fd, struct.pack("d", time.monotonic()))
        self.map = mmap.mmap(fd, 8)
        os.close(fd)

    def write(self) -> None:
        self.map[:8] = struct.pack("d", time.monotonic())

    async def run(self) -> None:
        while True:
            self.write()
            await asyncio.sleep(BEAT)

    def close(self) -> None:
        self.map.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass


def start(host: str, port: int, stale: float = 10.0) -> tuple[subprocess.Popen, Heartbeat]:
    """The side process answering /health on host:port for this process, and the heartbeat it reads."""
    beat = Heartbeat()
    side = subprocess.Popen([sys.executable, os.path.abspath(__file__), host, str(port), beat.path, str(stale),
                             str(os.getpid())])
    return side, beat


def reply(status: int, body: dict, keep: bool) -> bytes:
    data = json.dumps(body).encode()
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 503: "Service Unavailable"}[status]
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n"
            f"connection: {'keep-alive' if keep else 'close'}\r\n\r\n").encode() + data


class Answer(asyncio.Protocol):
    """One connection to the side: requests without bodies, answered as their heads arrive."""

    open = 0

    def __init__(self, beat: mmap.mmap, stale: float):
        self.beat, self.stale, self.buf, self.timer, self.transport = beat, stale, b"", None, None

    def connection_made(self, transport) -> None:
        self.transport = transport
        Answer.open += 1
        if Answer.open > MAX_CONNECTIONS:
            transport.abort()
            return
        self.timer = asyncio.get_running_loop().call_later(IDLE, transport.close)

    def connection_lost(self, exc) -> None:
        Answer.open -= 1
        if self.timer is not None:
            self.timer.cancel()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while b"\r\n\r\n" in self.buf:
            head, self.buf = self.buf.split(b"\r\n\r\n", 1)
            self.timer.cancel()
            self.timer = asyncio.get_running_loop().call_later(IDLE, self.transport.close)
            self.transport.write(self.answer(head))
            if self.transport.is_closing():
                return
        if len(self.buf) > MAX_HEAD:
            self.transport.write(reply(400, {"error": "request head too large"}, False))
            self.transport.close()

    def answer(self, head: bytes) -> bytes:
        parts = head.split(b"\r\n", 1)[0].split(b" ")
        if len(parts) != 3 or b"content-length" in head.lower() or b"transfer-encoding" in head.lower():
            self.transport.close()  # malformed, or a body this side would not read
            return reply(400, {"error": "GET /health only, without a body"}, False)
        if parts[0] not in (b"GET", b"HEAD") or parts[1].split(b"?", 1)[0] != b"/health":
            return reply(404, {"error": "this port answers GET /health only"}, True)
        age = time.monotonic() - struct.unpack("d", self.beat[:8])[0]
        ok = age < self.stale
        out = reply(200 if ok else 503, {"status": "ok" if ok else "stalled", "beat_age_ms": round(1e3 * age, 1)},
                    True)
        return out.split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n" if parts[0] == b"HEAD" else out


async def serve(host: str, port: int, path: str, stale: float, parent: int) -> None:
    with open(path, "rb") as f:
        beat = mmap.mmap(f.fileno(), 8, access=mmap.ACCESS_READ)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Answer(beat, stale), host, port, reuse_address=True)
    async with server:
        while os.getppid() == parent:  # the server exited (or was killed): so does its side
            await asyncio.sleep(1.0)


if __name__ == "__main__":
    host, port, path, stale, parent = sys.argv[1:6]
    try:
        asyncio.run(serve(host, int(port), path, float(stale), int(parent)))
    except KeyboardInterrupt:
        pass
