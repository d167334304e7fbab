"""The HTTP layer's own limits: header and body read timeouts, caps on open connections, quiet accept errors.

Why here and not in `guard.Guard`: the ASGI app only sees a request once its headers are complete,
so a client that sends half a request line and then nothing, or one byte every few seconds, never
reaches it, and uvicorn has no header-read timeout of its own. Hundreds of such sockets would
hold the process's file descriptors until `accept()` fails for everyone. `GuardedH11` is uvicorn's
h11 protocol with deadlines by h11 state: a connection must deliver its request headers within
`header_timeout` seconds of its first byte (or of opening, or of its previous response), and its
body within `body_timeout` seconds of the headers, else it gets 408 and is closed. Connections
past `max_connections` in total or `max_per_client` from one address are closed as soon as they
are accepted. A reply the client stops reading (the socket's buffers full, writes paused) for
`send_timeout` seconds is cut: the connection is closed. A connection's reply buffers are bounded
(`send_buffer` bytes in the socket, as many queued in the transport), so a slow reader holds no more
than that, its reply's remaining events (at most its max_tokens) and no generation slot (`replies.py`). `serve_config` builds the uvicorn config `attnlab serve` (and the tests) run.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import Counter

import h11
from uvicorn import Config, Server
from uvicorn.protocols.http.h11_impl import H11Protocol

from attnlab.serve.config import Limits

log = logging.getLogger("attnlab.serve")
TIMEOUT_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain\r\nconnection: close\r\n"
               b"content-length: 16\r\n\r\nrequest timeout\n")


class Throttle:
    """Allows one event per `interval` seconds and counts the ones it held back."""

    def __init__(self, interval: float):
        self.interval, self.last, self.held = interval, -float("inf"), 0

    def __call__(self) -> int | None:
        """None to stay quiet, else how many events were held back since the last allowed one."""
        now = time.monotonic()
        if now - self.last < self.interval:
            self.held += 1
            return None
        held, self.last, self.held = self.held, now, 0
        return held


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with read deadlines and connection caps (one subclass per server: `protocol`)."""

    limits = Limits()
    open_by_client: Counter
    refused_log: Throttle

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.deadline: asyncio.TimerHandle | None = None
        self.address = self.client[0] if self.client else ""
        lim, counts = self.limits, self.open_by_client
        if len(self.connections) > lim.max_connections or counts[self.address] >= lim.max_per_client:
            self.counted = False
            held = self.refused_log()
            if held is not None:
                log.warning("refused a connection from %s: %d open (at most %d), %d from it (at most %d)%s",
                            self.address, len(self.connections), lim.max_connections, counts[self.address],
                            lim.max_per_client, f"; {held} more refused since the last line" if held else "")
            transport.abort()
            return
        self.counted = True
        counts[self.address] += 1
        self.bound_buffers(transport, lim.send_buffer)
        self.arm(lim.header_timeout)

    def connection_lost(self, exc) -> None:
        self.disarm()
        self.unstall()
        if getattr(self, "counted", False):
            self.counted = False
            self.open_by_client[self.address] -= 1
            if self.open_by_client[self.address] <= 0:
                del self.open_by_client[self.address]
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        before = self.conn.their_state
        super().data_received(data)
        after = self.conn.their_state
        if after is h11.SEND_BODY and before is not h11.SEND_BODY:
            self.arm(self.limits.body_timeout)
        elif after is not h11.IDLE and after is not h11.SEND_BODY:
            self.disarm()  # the request is in: the reply may take as long as it takes
        elif after is h11.IDLE and self.deadline is None and data:
            self.arm(self.limits.header_timeout)  # the first byte of a request on a kept-alive connection

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self.disarm()  # uvicorn's keep-alive timer closes an idle connection; a started request gets this
            self.deadline = None

    @staticmethod
    def bound_buffers(transport, size: int) -> None:
        """At most `size` bytes queued in the socket (the kernel would grow it to megabytes for a client that
        does not read) and as many in the transport before writes pause; TCP_NODELAY always: asyncio sets it
        only where the listening socket was made with proto IPPROTO_TCP (not `socket.socket()`, nor an
        inherited descriptor), and without it a reply's body, written after its headers, waits for the
        client's delayed ACK: 40 ms for every /health, idle or not."""
        sock = transport.get_extra_info("socket")
        if sock is not None:
            for level, option, value in ((socket.SOL_SOCKET, socket.SO_SNDBUF, size),
                                         (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)):
                try:
                    sock.setsockopt(level, option, value)
                except OSError:  # not TCP (a Unix socket has no TCP_NODELAY)
                    pass
        transport.set_write_buffer_limits(high=size)

    def pause_writing(self) -> None:
        """The client is not reading what we send: it has `send_timeout` seconds to start again."""
        super().pause_writing()
        if getattr(self, "stall", None) is None:
            self.stall = self.loop.call_later(self.limits.send_timeout, self.transport.abort)

    def resume_writing(self) -> None:
        self.unstall()
        super().resume_writing()

    def unstall(self) -> None:
        if getattr(self, "stall", None) is not None:
            self.stall.cancel()
            self.stall = None

    def arm(self, seconds: float) -> None:
        self.disarm()
        self.deadline = self.loop.call_later(seconds, self.expire)

    def disarm(self) -> None:
        if getattr(self, "deadline", None) is not None:
            self.deadline.cancel()
            self.deadline = None

    def expire(self) -> None:
        """A deadline passed before the request was in: 408 unless a reply already started, then close."""
        self.deadline = None
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is not h11.IDLE and state is not h11.SEND_BODY:
            return
        replying = self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete
        if not replying and self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
            self.transport.write(TIMEOUT_408)
        self.transport.close()


def protocol(limits: Limits) -> type[GuardedH11]:
    """A GuardedH11 subclass with these limits and its own per-address counts (one per server)."""
    return type("GuardedH11", (GuardedH11,), {"limits": limits, "open_by_client": Counter(),
                                              "refused_log": Throttle(limits.log_interval)})


def quiet_accept_errors(loop: asyncio.AbstractEventLoop, interval: float) -> None:
    """Log asyncio's 'socket.accept() out of system resource' once per interval, not once per attempt."""
    throttle, default = Throttle(interval), loop.get_exception_handler()

    def handler(loop, context):
        if "accept" not in str(context.get("message", "")):
            return default(loop, context) if default else loop.default_exception_handler(context)
        held = throttle()
        if held is not None:
            log.error("%s: %s%s", context.get("message"), context.get("exception"),
                      f" ({held} more since the last line)" if held else "")
    loop.set_exception_handler(handler)


class GuardedServer(Server):
    """uvicorn's Server that installs `quiet_accept_errors` on the loop it serves from, and runs `tasks` (coroutine
    functions, e.g. the side /health's heartbeat, `health.py`) there while it serves."""

    def __init__(self, config: Config, tasks=()):
        super().__init__(config)
        self.tasks, self.running = tasks, []

    async def startup(self, sockets=None) -> None:
        loop = asyncio.get_running_loop()
        quiet_accept_errors(loop, self.config.http.limits.log_interval)
        self.running = [loop.create_task(task()) for task in self.tasks]
        await super().startup(sockets)


def serve_config(app, host: str = "127.0.0.1", port: int = 8000, limits: Limits = Limits(),
                 log_level: str = "warning", **extra) -> Config:
    """The uvicorn config of `attnlab serve`: the guarded h11 protocol and these limits."""
    return Config(app, host=host, port=port, http=protocol(limits), timeout_keep_alive=limits.keep_alive,
                  backlog=max(128, limits.max_connections), log_level=log_level, ws="none", **extra)
