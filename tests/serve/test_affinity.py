"""`attnlab serve --replicas`, without Ray: which replica a request goes to, the relay, and the error
when Ray is missing. (The replicas on a real Ray cluster: tests/serve/test_replicas_cluster.py.)"""
from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter

import pytest

from attnlab.errors import AttnlabError
from attnlab.serve import affinity
from attnlab.serve.affinity import conversation_key, opening, ranking, route
from tests.test_cli import run

CHAT = "/v1/chat/completions"


def key(messages, token="k1", path=CHAT, **extra):
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    return conversation_key("POST", path, headers, json.dumps({"model": "m", "messages": messages, **extra}).encode())


def test_every_turn_of_a_conversation_has_its_key():
    t1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    t2 = t1 + [{"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Why?"}]
    t3 = t2 + [{"role": "assistant", "content": "It is."}, {"role": "user", "content": "Again."}]
    assert key(t1) == key(t2) == key(t3)
    assert key(t1, max_tokens=5, temperature=0) == key(t1, stream=True)  # sampling options do not matter
    # the server reads text parts as their text, developer as system: the same conversation
    parts = [{"role": "developer", "content": "Be brief."},
             {"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]}]
    assert key(parts) == key(t1)


def test_keys_separate_callers_and_openings():
    t1 = [{"role": "user", "content": "Name a colour."}]
    assert key(t1, "k1") != key(t1, "k2")  # another API key: another namespace on the server too
    assert key(t1, "k1").split(":")[0] != key(t1, None).split(":")[0]
    assert key(t1) != key([{"role": "user", "content": "Name a fruit."}])
    assert key(t1) != key([{"role": "system", "content": "Be brief."}, *t1])
    assert opening([{"role": "assistant", "content": "a"}, {"role": "tool", "content": "b"}]) == [
        ["assistant", "a"], ["tool", "b"]]  # no user message: all of them


def test_odd_bodies_get_a_key_and_never_raise():
    headers = [(b"authorization", b"Bearer k1")]
    for body in [b"{not json", b"\xff\xfe", b"[1, 2]", b'{"messages": "x"}', b'{"messages": [1, null, {}]}',
                 b"[" * 100_000, json.dumps({"messages": [{"role": "user", "content": {"a": 1}}]}).encode()]:
        assert conversation_key("POST", CHAT, headers, body)
    p1 = conversation_key("POST", "/v1/completions", headers, b'{"prompt": "One, two,"}')
    assert p1 == conversation_key("POST", "/v1/completions", headers, b'{"prompt": "One, two,", "max_tokens": 3}')
    assert p1 != conversation_key("POST", "/v1/completions", headers, b'{"prompt": "Three,"}')
    assert conversation_key("GET", "/v1/models", headers, b"") == conversation_key("GET", "/v1/models", headers, b"")
    assert affinity.bearer([(b"Authorization", b"bearer  abc ")]) == "abc"
    assert affinity.bearer([(b"authorization", b"Basic abc")]) == ""


def test_rendezvous_ranking_is_stable_and_spread():
    names = [f"replica-{i}" for i in range(4)]
    keys = [f"owner:{i}" for i in range(4000)]
    homes = {k: ranking(k, names)[0] for k in keys}
    assert all(sorted(ranking(k, names)) == names for k in keys[:50])
    assert homes == {k: ranking(k, list(reversed(names)))[0] for k in keys}  # order of the names is irrelevant
    counts = Counter(homes.values())
    assert all(800 <= counts[n] <= 1200 for n in names), counts  # about a quarter each
    # losing replica-2 moves only its keys, each to its second choice; a new replica takes keys only for itself
    after = {k: ranking(k, [n for n in names if n != "replica-2"])[0] for k in keys}
    assert all(after[k] == homes[k] for k in keys if homes[k] != "replica-2")
    assert all(after[k] == ranking(k, names)[1] for k in keys if homes[k] == "replica-2")
    grown = {k: ranking(k, [*names, "replica-4"])[0] for k in keys}
    assert all(grown[k] in (homes[k], "replica-4") for k in keys)


def test_route_tries_replicas_marked_down_last():
    names = ["a", "b", "c"]
    order = ranking("some-key", names)
    assert route("some-key", names) == order
    assert route("some-key", names, down=[order[0]]) == [order[1], order[2], order[0]]
    assert route("some-key", names, down=names) == order  # nothing up: still try, in order


replicas = pytest.importorskip("attnlab.serve.replicas")  # needs starlette (the serve extra), not Ray


class FakeHandle:
    """A DeploymentHandle stand-in: `.options(stream=True).remote(scope, body)` streams an app's messages."""

    def __init__(self, app=None, error=None):
        self.app, self.error, self.calls = app, error, 0

    def options(self, **kw):
        return self

    def remote(self, scope, body):
        self.calls += 1
        if self.error is not None:
            async def broken():
                raise self.error
                yield  # noqa: unreachable (an async generator)
            return broken()
        return replicas.Replica(lambda: self.app)(scope, body)


async def echo(scope, receive, send):
    """An ASGI app that answers its body and the path, in two body chunks."""
    message = await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": scope["path"].encode(), "more_body": True})
    await send({"type": "http.response.body", "body": b" " + message["body"]})


def relay(router, k, body=b"hi"):
    sent = []

    async def send(m):
        sent.append(m)
    scope = {"type": "http", "method": "POST", "path": CHAT, "headers": []}
    asyncio.run(router.relay(k, scope, body, send))
    head = dict(sent[0]["headers"])
    return sent[0]["status"], head.get(b"x-attnlab-replica", b"").decode(), b"".join(m.get("body", b"")
                                                                                    for m in sent[1:])


def test_replica_bridge_streams_and_signals_disconnect():
    seen = []

    async def slow(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        seen.append(await receive())  # waits until the caller has gone

    async def main():
        stream = replicas.Replica(lambda: slow)({"type": "http", "path": "/"}, b"")
        assert (await stream.__anext__())["status"] == 200
        assert (await stream.__anext__())["body"] == b"a"
        await stream.aclose()  # the client left
    asyncio.run(main())
    assert seen == [{"type": "http.disconnect"}]
    status, headers, body = asyncio.run(replicas.collect(replicas.Replica(lambda: echo)(
        {"type": "http", "path": "/x"}, b"body")))
    assert (status, body) == (200, b"/x body")


def test_relay_follows_affinity_and_moves_off_a_lost_replica(monkeypatch):
    monkeypatch.setattr(replicas, "dead", lambda e: isinstance(e, ConnectionError))
    handles = {n: FakeHandle(echo) for n in ("replica-0", "replica-1", "replica-2")}
    router = replicas.Router(handles)
    k = "owner:conversation"
    home, second = ranking(k, handles)[:2]
    assert relay(router, k) == (200, home, f"{CHAT} hi".encode())
    handles[home].error = ConnectionError("actor died")  # the home is lost before answering this turn
    assert relay(router, k) == (200, second, f"{CHAT} hi".encode())  # no error: the next replica answers
    handles[home].error = None  # its replacement is up (empty): the conversation stays where its cache is now
    router.failed.clear()
    assert relay(router, k)[1] == second and router.moved == {k: second}
    router.up = set(handles) - {second}  # Serve reports that one gone too: back to the first choice up
    assert relay(router, k)[1] == home and k not in router.moved
    calls = {n: h.calls for n, h in handles.items()}
    for n in handles:  # nothing up answers: 503 with OpenAI's error body, not a hang or a 500
        handles[n].error = ConnectionError("gone")
    status, _, body = relay(router, "other")
    assert status == 503 and json.loads(body)["error"]["code"] == "no_replica"
    assert all(h.calls == calls[n] + 1 for n, h in handles.items())  # each tried once
    handles["replica-0"].error = ValueError("a bug")  # not a lost replica: raised, never retried elsewhere
    router.failed.clear()
    with pytest.raises(ValueError):
        relay(router, next(f"k{i}" for i in range(99) if ranking(f"k{i}", handles)[0] == "replica-0"))


def test_sessions_listing_merges_replicas():
    a = {"object": "list", "data": [{"id": "x", "last_used": 5}], "max_sessions": 16, "total_bytes": 10,
         "evicted": 1, "requests": 3, "tokens_generated": 7}
    b = {"object": "list", "data": [{"id": "y", "last_used": 9}], "max_sessions": 16, "total_bytes": 5,
         "evicted": 0, "requests": 2, "tokens_generated": 1}
    m = replicas.merge_sessions([a, b])
    assert [s["id"] for s in m["data"]] == ["y", "x"]
    assert (m["max_sessions"], m["total_bytes"], m["evicted"], m["requests"], m["tokens_generated"]) == (32, 15, 1, 5, 8)


def test_without_ray_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    with pytest.raises(AttnlabError, match=r"--replicas needs Ray Serve: pip install 'attnlab\[scale\]'"):
        replicas.ReplicaSet(lambda: None, 2)
    monkeypatch.setattr("attnlab.cli.serve.load_lm", lambda *a, **k: pytest.fail("model loaded"))
    code, out, err = run(capsys, "serve", "--replicas", "2")
    assert code == 2 and "pip install 'attnlab[scale]'" in err and "Traceback" not in err, err
    code, out, err = run(capsys, "serve", "--ray", "127.0.0.1:6379")
    assert code == 2 and "--ray ADDRESS needs --replicas N" in err, err


class FakeRequest:
    """What Serve hands the router: the ASGI scope and the body as a stream of chunks."""

    def __init__(self, method, path, chunks=()):
        self.scope = {"type": "http", "method": method, "path": path, "headers": [], "app": object()}
        self.chunks = chunks

    async def stream(self):
        for c in self.chunks:
            yield c


def answer(router, request) -> tuple[int, bytes]:
    sent = []

    async def main():
        async def send(m):
            sent.append(m)
        response = await router(request)
        await response({"type": "http"}, None, send)
    asyncio.run(main())
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_router_refuses_big_bodies_and_merges_session_lists():
    ids = iter(range(100))

    async def sessions(scope, receive, send):  # each replica lists its own, or 404s another's session id
        await receive()
        mine = {"data": [{"id": f"s{next(ids)}", "last_used": 1}], "requests": 2}
        status, body = (200, mine) if scope["path"] == "/v1/sessions" else (404, {"error": {}})
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})
    handles = {n: FakeHandle(sessions) for n in ("replica-0", "replica-1")}
    router = replicas.Router(handles, max_body=10)
    router.watcher = "no Ray here"
    status, body = answer(router, FakeRequest("POST", CHAT, [b"x" * 6, b"y" * 6]))
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    assert all(h.calls == 0 for h in handles.values())  # refused before any replica saw it
    status, body = answer(router, FakeRequest("GET", "/v1/sessions"))
    assert status == 200 and json.loads(body)["requests"] == 4 and len(json.loads(body)["data"]) == 2
    assert answer(router, FakeRequest("GET", "/v1/sessions/abc"))[0] == 404  # on no replica
