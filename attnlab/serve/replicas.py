"""`attnlab serve --replicas N`: N copies of the server as one Ray Serve application, with session affinity.

Why this shape: each replica is today's server unchanged (`create_app`, its own sessions and KV caches,
limits, keys), run in a Ray actor; a thin ingress (`Router`) reads each request, names its conversation
(`affinity.conversation_key`) and relays it to that conversation's replica (`affinity.route`), streaming
the replica's ASGI messages back as they come. Every replica is its own one-replica Serve deployment
(`replica-0` ...), so the router picks a replica, not Serve's load balancer. Serve restarts a lost replica
(empty); until it is up, and for a request that found its replica dead before any byte was answered,
the conversation goes to the next replica in its ranking, which rebuilds the cache from the messages the
client resent: a replica's loss costs its conversations one prefill each, nothing else (docs/serve.md).

Clients never reach Serve's proxy: it listens on loopback, behind one server's guarded front (`front.py`:
the same deadlines, connection caps, Host and key checks, before anything is relayed). The cache and
session limits are for the whole set: each replica runs `ServeConfig.per_replica()` (the limits divided
by N), which `attnlab serve` prints at startup.

Ray is optional (`pip install 'attnlab[scale]'`) and imported only when a replica set starts.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict

from starlette.responses import Response

from attnlab.errors import AttnlabError
from attnlab.serve.affinity import conversation_key, route
from attnlab.serve.guard import reject

log = logging.getLogger("attnlab.serve.replicas")
HOLD_S = 10.0            # how long a replica that failed a request is tried last
MOVED_KEYS = 1 << 16     # conversations remembered on a replica other than their home (LRU)
FORWARDED = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "root_path",
             "query_string", "headers", "client", "server")


class Replica:
    """One server in a Ray actor: runs the relayed request through the app `factory()` built and yields its
    ASGI messages (response start, body chunks) as they are sent."""

    def __init__(self, factory):
        self.app = factory()

    async def __call__(self, scope: dict, body: bytes):
        messages: asyncio.Queue = asyncio.Queue()
        gone, fed = asyncio.Event(), False

        async def receive():
            nonlocal fed
            if not fed:
                fed = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()  # the caller left (the relay was cancelled): the app stops its generation
            return {"type": "http.disconnect"}

        async def run():
            try:
                await self.app(dict(scope), receive, messages.put)
            finally:
                await messages.put(None)

        task = asyncio.ensure_future(run())
        try:
            while (message := await messages.get()) is not None:
                yield message
            await task
        finally:
            gone.set()
            if not task.done():
                try:
                    await asyncio.wait_for(asyncio.shield(task), 30)
                except (TimeoutError, asyncio.CancelledError):
                    task.cancel()

    def where(self) -> dict:
        """The Ray actor holding this replica (its name in namespace 'serve': what `ray.kill` needs) and node."""
        import ray
        ctx = ray.get_runtime_context()
        return {"actor": ctx.get_actor_name(), "node": ctx.get_node_id()}


async def collect(stream) -> tuple[int, list, bytes]:
    """A whole relayed response: (status, headers, body)."""
    status, headers, body = 500, [], []
    async for m in stream:
        if m["type"] == "http.response.start":
            status, headers = m["status"], m.get("headers", [])
        elif m["type"] == "http.response.body":
            body.append(m.get("body", b""))
    return status, headers, b"".join(body)


def merge_sessions(pages: list[dict]) -> dict:
    """GET /v1/sessions over every replica: one list, most recent first; counts and quotas summed."""
    out = {"object": "list", "data": sorted((s for p in pages for s in p.get("data", [])),
                                            key=lambda s: -s.get("last_used", 0))}
    for p in pages:
        for k, v in p.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + v
    return out


class Router:
    """The ingress: affinity routing, relaying, fan-out for the endpoints that name a session by id."""

    def __init__(self, replicas: dict, max_body: int = 1 << 20):
        self.replicas, self.max_body = replicas, max_body  # name -> DeploymentHandle
        self.up: set[str] = set(replicas)                   # replicas Serve reports running (polled)
        self.failed: dict[str, float] = {}                  # name -> when a request found it dead
        self.moved: OrderedDict[str, str] = OrderedDict()   # key -> replica it moved to when its home was lost
        self.served: dict[str, int] = dict.fromkeys(replicas, 0)
        self.watcher: asyncio.Task | None = None

    async def watch(self) -> None:
        """Poll Serve's view of the replicas every second: one being restarted (empty) or that cannot be
        placed (its node is gone) is passed over, so requests do not wait in its queue."""
        from ray import serve
        app = serve.get_replica_context().replica_id.deployment_id.app_name
        while True:
            try:
                status = await asyncio.to_thread(serve.status)
                deployments = status.applications[app].deployments
                self.up = {n for n in self.replicas if n in deployments and running(deployments[n].replica_states)}
            except Exception as e:  # noqa: BLE001  (a controller hiccup: keep the last view)
                log.warning("replica status unavailable: %s", e)
            await asyncio.sleep(1.0)

    def view(self) -> dict:
        """What the router knows (for operators and tests): replicas up, requests each answered, keys moved."""
        return {"up": sorted(self.up), "served": dict(self.served), "moved": len(self.moved),
                "failed": sorted(self.failed)}

    def order(self, key: str) -> list[str]:
        """Replicas to try: where the key moved (if that one is up), else its ranking over those up first."""
        now = time.monotonic()
        unavailable = {r for r in self.replicas if r not in self.up or now - self.failed.get(r, -HOLD_S) < HOLD_S}
        order = route(key, self.replicas, unavailable)
        there = self.moved.get(key)
        return [there, *(r for r in order if r != there)] if there and there not in unavailable else order

    def settle(self, key: str, name: str) -> None:
        """Remember a key served away from its home, so it stays where its cache now is."""
        if name == route(key, self.replicas)[0]:
            self.moved.pop(key, None)
            return
        self.moved[key] = name
        self.moved.move_to_end(key)
        while len(self.moved) > MOVED_KEYS:
            self.moved.popitem(last=False)

    def call(self, name: str, scope: dict, body: bytes):
        return self.replicas[name].options(stream=True).remote(scope, body)

    async def __call__(self, request):
        if self.watcher is None:
            self.watcher = asyncio.ensure_future(self.watch())
        scope = {k: request.scope[k] for k in FORWARDED if k in request.scope}
        body, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body:
                return Relay(lambda send: reject(send, 413, f"the request body exceeds {self.max_body} bytes",
                                                 "request_too_large"))
            body.append(chunk)
        body = b"".join(body)
        path = scope["path"]
        if scope["method"] == "GET" and path.startswith("/v1/sessions"):
            status, headers, data = await self.fan_out(scope, body, merge=path.rstrip("/") == "/v1/sessions")
            return Response(data, status, headers={k.decode("latin-1"): v.decode("latin-1") for k, v in headers
                                                   if k.lower() != b"content-length"})
        return Relay(lambda send: self.relay(conversation_key(scope["method"], path, scope["headers"], body),
                                             scope, body, send))

    async def relay(self, key: str, scope: dict, body: bytes, send) -> None:
        """Stream the answer of the key's replica; a replica found dead before its first message is skipped."""
        for name in self.order(key):
            stream = self.call(name, scope, body)
            try:
                first = await stream.__anext__()
            except StopAsyncIteration:
                return
            except Exception as e:  # noqa: BLE001  (which exception a dead actor raises varies by Ray version)
                if not dead(e):
                    raise
                self.failed[name] = time.monotonic()
                log.warning("replica %s is gone (%s); its conversations go to the next replica", name,
                            type(e).__name__)
                continue
            self.failed.pop(name, None)
            self.settle(key, name)
            self.served[name] += 1
            if first["type"] == "http.response.start":
                first = {**first, "headers": [*first.get("headers", []), (b"x-attnlab-replica", name.encode())]}
            try:
                await send(first)
                async for message in stream:
                    await send(message)
            except BaseException:  # the client left (Serve cancels this request) or the replica died mid-answer:
                getattr(stream, "cancel", lambda: None)()  # the replica sees a disconnect and stops generating
                raise
            return
        body = json.dumps({"error": {"message": "no replica is up; retry later", "type": "server_error",
                                     "param": None, "code": "no_replica"}}).encode()
        await send({"type": "http.response.start", "status": 503, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    async def fan_out(self, scope: dict, body: bytes, merge: bool) -> tuple[int, list, bytes]:
        """Session endpoints: a session lives on one replica (the first answer that is not a 404); the list
        is every live replica's, merged. A replica that is down is left out."""
        names = [n for n in self.replicas if n in self.up] or list(self.replicas)
        answers = await asyncio.gather(*(collect(self.call(n, scope, body)) for n in names), return_exceptions=True)
        live = [a for a in answers if not isinstance(a, BaseException)]
        if not live:
            raise next(a for a in answers if isinstance(a, BaseException))
        if merge and all(a[0] == 200 for a in live):
            return 200, [(b"content-type", b"application/json")], json.dumps(
                merge_sessions([json.loads(a[2]) for a in live])).encode()
        return next((a for a in live if a[0] != 404), live[0])


class Relay(Response):
    """An ASGI response whose messages `run(send)` sends (what the Router hands back to Serve's proxy)."""

    def __init__(self, run):  # noqa: D107  (no body or headers of its own: run sends them)
        self.run, self.background = run, None

    async def __call__(self, scope, receive, send):
        await self.run(send)


def running(replica_states: dict) -> bool:
    """Whether a deployment's replica counts (Serve's ReplicaState -> n) include a running one."""
    return any(getattr(state, "value", state) == "RUNNING" and n > 0 for state, n in replica_states.items())


def dead(e: BaseException) -> bool:
    """Whether an error means the replica's actor is gone (not an error of the request)."""
    import ray.exceptions as rx
    from ray.serve import exceptions as sx
    kinds = (rx.RayActorError, rx.ActorUnavailableError, sx.ReplicaUnavailableError, sx.DeploymentUnavailableError)
    return isinstance(e, kinds) or isinstance(getattr(e, "cause", None), kinds)


def import_serve(address: str | None):
    """(ray, ray.serve), the loopback switch set first for a local instance; AttnlabError when missing."""
    from attnlab.scale.backends import import_ray, is_loopback
    need = "attnlab serve --replicas needs Ray Serve: pip install 'attnlab[scale]' (or pip install 'ray[serve]')"
    ray = import_ray(is_loopback(address) and address != "auto", need=need)
    try:
        from ray import serve
    except ImportError as e:
        raise AttnlabError(f"{need} ({e.name or e} is missing)") from None
    return ray, serve


class ReplicaSet:
    """N replicas of `factory()`'s app behind one Router, as the Ray Serve application `name`, and in front of
    Serve's proxy (which listens on loopback only) one server's guarded HTTP front (`front.py`) on host:port.

    address: None starts a local Ray instance on loopback (stopped by `close`); 'auto' or HOST:PORT joins
    a running cluster, where every node needs attnlab (and the model file, at the same path) installed.
    cpus: Ray CPUs each replica reserves (its torch threads). config, keys: the front's limits and keys
    (`ServeConfig`, `Keys`; default: loopback, keyless, the default limits)."""

    def __init__(self, factory, replicas: int, host: str = "127.0.0.1", port: int = 8000,
                 address: str | None = None, cpus: float = 1, config=None, keys=None, name: str = "attnlab"):
        if replicas < 1:
            raise AttnlabError(f"--replicas must be at least 1, got {replicas}")
        self.ray, self.serve = import_serve(address)
        from attnlab.scale.backends import RayBackend
        from attnlab.serve.config import Keys, ServeConfig
        config, keys = config or ServeConfig(name), keys or Keys()
        self.name, self.url, self.front = name, f"http://{host}:{port}", None
        self.backend = RayBackend(address)  # joins, or starts a loopback instance it owns
        serve = self.serve
        inner = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": inner})
        names = [f"replica-{i}" for i in range(replicas)]
        bound = {n: serve.deployment(Replica).options(name=n, num_replicas=1, ray_actor_options={"num_cpus": cpus},
                                                      max_ongoing_requests=256, health_check_period_s=2,
                                                      max_constructor_retry_count=1)
                 .bind(factory) for n in names}
        head = {"num_cpus": 0, "resources": {"node:__internal_head__": 0.001}}  # beside Serve's proxy and controller
        ingress = serve.deployment(Router).options(name="router", num_replicas=1, ray_actor_options=head,
                                                   max_ongoing_requests=4096).bind(bound, config.max_body)
        try:
            serve.run(ingress, name=name, route_prefix="/")
        except RuntimeError as e:  # a replica's constructor failed (a model file that does not load, ...)
            self.close()
            last = [line for line in str(e).splitlines() if line.strip()][-1:] or [type(e).__name__]
            raise AttnlabError(f"the replicas did not start: {last[0].strip()[:300]}") from None
        self.replicas = {n: serve.get_deployment_handle(n, app_name=name) for n in names}
        self.router = serve.get_deployment_handle("router", app_name=name)
        self.front = FrontServer(f"http://127.0.0.1:{inner}", host, port, config, keys)

    def where(self, replica: str) -> dict:
        """{actor: the Ray actor now holding `replica` (e.g. to kill it), node: the id of its node}."""
        at = self.replicas[replica].where.remote().result(timeout_s=120)
        return {"actor": self.ray.get_actor(at["actor"], namespace="serve"), "node": at["node"]}

    def close(self) -> None:
        if self.front is not None:
            self.front.close()
        try:
            self.serve.delete(self.name)  # waits for the replicas to finish; a local instance then stops whole
        finally:
            self.backend.close()


class FrontServer:
    """The front (`front.front_app`) under one server's guarded uvicorn, in a thread of this process."""

    def __init__(self, upstream: str, host: str, port: int, config, keys):
        import threading

        from attnlab.serve.conn import GuardedServer, serve_config
        from attnlab.serve.front import front_app
        self.server = GuardedServer(serve_config(front_app(upstream, config, keys), host, port, config.http,
                                                 lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, name="attnlab-front", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise AttnlabError(f"the front did not start on {host}:{port} (is the port free?)")
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def free_port() -> int:
    """A free TCP port on loopback (Serve's proxy, behind the front)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
