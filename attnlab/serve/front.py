"""The replicas' front: one server's HTTP limits and checks, in front of Ray Serve's proxy.

Why: with `--replicas`, Ray Serve's proxy faced the clients. Its uvicorn keeps none of `conn.py`'s header
and body deadlines or connection caps, and it relayed every request to a replica before the replica
checked the key (issue 61). The front is one server's guarded uvicorn (`conn.serve_config`, same
`Limits`) and its `Guard` (Host, API key, body size, CORS), so a request reaches Ray only once it passed
all of them; Ray's proxy listens on loopback only (`ReplicaSet`). The front streams the answer back as it
comes and, when its client leaves, closes the upstream request, so the replica sees the disconnect and
stops generating.
"""
from __future__ import annotations

import asyncio

import httpx

from attnlab.serve.guard import guarded, reject

HOP_BY_HOP = {b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailers",
              b"transfer-encoding", b"upgrade"}


class Front:
    """An ASGI app relaying each request (already checked by the layers `front_app` puts around it) to
    `upstream` (Ray Serve's proxy, http://127.0.0.1:PORT)."""

    def __init__(self, upstream: str, connect_timeout: float = 10.0):
        self.upstream, self.connect_timeout = upstream.rstrip("/"), connect_timeout
        self.client: httpx.AsyncClient | None = None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        body, more = [], True
        while more:  # the Guard has read and counted it already: this is its replay
            message = await receive()
            if message["type"] != "http.request":
                return
            body.append(message.get("body", b""))
            more = message.get("more_body", False)
        if self.client is None:  # made inside the serving loop; no read timeout: a generation takes its time
            self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=self.connect_timeout),
                                            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        query = scope.get("query_string", b"").decode("latin-1")
        request = self.client.build_request(
            scope["method"], self.upstream + scope["path"] + (f"?{query}" if query else ""), content=b"".join(body),
            headers=[(k, v) for k, v in scope["headers"] if k.lower() not in HOP_BY_HOP])
        try:
            response = await self.client.send(request, stream=True)
        except httpx.HTTPError:
            return await reject(send, 503, "no replica is reachable; retry later", "no_replica")
        relay = asyncio.ensure_future(self.relay(response, send))
        gone = asyncio.ensure_future(disconnected(receive))
        try:
            await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (relay, gone):
                task.cancel()
            await response.aclose()  # the upstream connection closes: the replica sees its client leave
        if relay.done() and not relay.cancelled() and relay.exception() is not None:
            raise relay.exception()

    @staticmethod
    async def relay(response: httpx.Response, send) -> None:
        headers = [(k, v) for k, v in response.headers.raw if k.lower() not in HOP_BY_HOP]
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        async for chunk in response.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()


async def disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def front_app(upstream: str, config, keys):
    """The front as served: `Front` inside one server's middleware (`guard.guarded`) for `config` and `keys`."""
    return guarded(Front(upstream), config, keys)
