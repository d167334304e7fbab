"""`attnlab serve --replicas`: two replicas on a loopback Ray cluster, one killed mid-conversation
(marker `cluster`, `make test-scale`).

Ray's own `ray.cluster_utils.Cluster`: a head with no CPUs and two one-CPU worker nodes, one replica on
each. Eight conversations through the official `openai` client (half of them streamed); after their
first turn the replica holding conversation 0 is killed (`ray.kill` of its actor). Every second turn
must answer, equal to what a single server answers for the same messages (float32 eager, greedy); the
survivors' turns must continue their caches (same session, only the new tokens fed, 2 turns on the
session), and the lost ones must start fresh caches on a live replica. Then the other replica's node is
removed (Serve cannot place its replacement: no CPU left): every third turn is answered by the replica
left, and the conversations that replica held keep their caches. Last, a client that leaves mid-stream
stops its replica's generation.
"""
from __future__ import annotations

import json
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.cluster
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray is imported: loopback only
ray = pytest.importorskip("ray")
pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from tests.serve.conftest import running  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL, KEY, ADMIN = "smollm2-135m", "replica-test-key", "replica-admin-key"
OPENERS = ["Name a colour.", "What is two plus two?", "Say hello in French.", "Name a fruit.",
           "What day comes after Monday?", "Name an animal that swims.", "What is the opposite of hot?",
           "Name a planet."]


def make_app():
    """Each replica's server (and the single reference server): float32 eager, so a cache rebuilt from the
    messages answers exactly what a continued one does."""
    import torch

    import attnlab
    from attnlab.serve import Keys, PolicySpec, ServeConfig, create_app
    torch.set_num_threads(1)
    lm = attnlab.load(MODEL, dtype="float32", compile=False, kv_dtype="float32")
    return create_app(lm, ServeConfig(MODEL, PolicySpec("sink", 256, 4, "cache"), chunk=64, max_tokens=8),
                      Keys(api=[KEY], admin=[ADMIN]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def replicas():
    from ray.cluster_utils import Cluster

    from attnlab.serve.replicas import ReplicaSet
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1"})
    for _ in range(2):
        c.add_node(num_cpus=1, node_ip_address="127.0.0.1")
    c.wait_for_nodes()
    nodes = {n.node_id: n for n in c.list_all_nodes()}
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}})
    t0 = time.perf_counter()
    rs = ReplicaSet(make_app, 2, port=free_port(), address=c.address, cpus=1)
    print(f"\n2 replicas up in {time.perf_counter() - t0:.1f} s")
    rs.cluster, rs.nodes = c, nodes
    yield rs
    rs.close()
    ray.shutdown()
    c.shutdown()


def active(rs, replica: str) -> int:
    """Requests the replica is serving now (its /health for an admin key, asked of that replica directly)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": "/health", "raw_path": b"/health", "root_path": "", "query_string": b"",
             "headers": [(b"host", b"127.0.0.1"), (b"authorization", f"Bearer {ADMIN}".encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    messages = list(rs.replicas[replica].options(stream=True).remote(scope, b""))
    return json.loads(b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body"))["active"]


def turn(client, messages, stream: bool, max_tokens: int = 8):
    """(reply text, attnlab extension, cached tokens, replica name) of one greedy turn."""
    kw = dict(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    if not stream:
        raw = client.chat.completions.with_raw_response.create(**kw)
        r = raw.parse()
        return (r.choices[0].message.content, r.model_extra["attnlab"], r.usage.prompt_tokens_details.cached_tokens,
                raw.headers.get("x-attnlab-replica"))
    raw = client.chat.completions.with_raw_response.create(**kw, stream=True, stream_options={"include_usage": True})
    parts, ext, cached = [], None, None
    for chunk in raw.parse():
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
        ext = (chunk.model_extra or {}).get("attnlab") or ext
    return "".join(parts), ext, cached, raw.headers.get("x-attnlab-replica")


def history(opener: str, *replies: str) -> list[dict]:
    """A conversation's messages after these replies: the opener, then each reply and a follow-up."""
    out = [{"role": "user", "content": opener}]
    for reply, follow in zip(replies, ["Why?", "Say it again."]):
        out += [{"role": "assistant", "content": reply}, {"role": "user", "content": follow}]
    return out


def test_replica_killed_mid_conversation(replicas):
    client = openai.OpenAI(base_url=replicas.url + "/v1", api_key=KEY, max_retries=0, timeout=300)
    pool = ThreadPoolExecutor(8)
    t0 = time.perf_counter()
    first = list(pool.map(lambda i: turn(client, [{"role": "user", "content": OPENERS[i]}], i % 2 == 1), range(8)))
    homes = [f[3] for f in first]
    assert set(homes) == set(replicas.replicas), homes  # both replicas hold conversations
    victim = homes[0]
    lost = [i for i in range(8) if homes[i] == victim]
    kept = [i for i in range(8) if homes[i] != victim]
    actor = replicas.where(victim)["actor"]
    pending = [pool.submit(turn, client, history(OPENERS[i], first[i][0]), i in kept and i % 2 == 0, 24)
               for i in range(8)]
    while active(replicas, victim) == 0:  # the victim's turns have arrived: kill it with them in flight
        assert not all(pending[i].done() for i in lost), "the victim answered before it could be killed"
    ray.kill(actor, no_restart=True)
    second = [p.result() for p in pending]
    print(f"16 turns through 2 replicas (one killed during the second 8) in {time.perf_counter() - t0:.1f} s; "
          f"homes {homes}, second turns on {[s[3] for s in second]}")

    for i in kept:  # the survivors' caches were continued, never rebuilt
        text, ext, cached, where = second[i]
        assert where == homes[i] and ext["session"] == first[i][1]["session"], (i, where, ext)
        assert cached > ext["fed_tokens"] > 0, (i, cached, ext)  # most of the prompt was already held
    for i in lost:  # the lost ones: a fresh cache on a live replica, built from the resent messages
        text, ext, cached, where = second[i]
        assert where is not None and ext["session"] != first[i][1]["session"] and cached == 0, (i, where, ext)

    listing = client.get("/sessions", cast_to=object)  # merged over the live replicas
    turns = {s["id"]: s["turns"] for s in listing["data"]}
    assert all(turns[first[i][1]["session"]] == 2 for i in kept), turns
    assert all(turns[second[i][1]["session"]] == 1 for i in lost), turns

    # the node of the replica that survived the kill goes away; its replacement has no CPU to start on
    gone = homes[kept[0]]
    replicas.cluster.remove_node(replicas.nodes[replicas.where(gone)["node"]], allow_graceful=False)
    t1 = time.perf_counter()
    while replicas.router.view.remote().result(timeout_s=60)["up"] != [victim]:  # the router sees it gone
        assert time.perf_counter() - t1 < 60, replicas.router.view.remote().result(timeout_s=60)
        time.sleep(0.5)
    print(f"the router saw {gone} gone after {time.perf_counter() - t1:.1f} s")
    t1 = time.perf_counter()
    third = list(pool.map(lambda i: turn(client, history(OPENERS[i], first[i][0], second[i][0]), False), range(8)))
    print(f"8 third turns with {gone}'s node removed in {time.perf_counter() - t1:.1f} s, on {[t[3] for t in third]}")
    assert all(t[3] != gone for t in third)
    view = replicas.router.view.remote().result(timeout_s=60)
    assert sum(view["served"].values()) == 24 and view["moved"] == len(kept), view  # listings are not relayed
    for i in range(8):  # those already on the replica left continue their caches, the others start fresh
        ext, cached, stayed = third[i][1], third[i][2], second[i][3] == third[i][3]
        assert (ext["session"] == second[i][1]["session"]) == stayed and (cached > 0) == stayed, (i, third[i])

    # a client that leaves mid-stream: the replica stops generating (2000 tokens would take minutes here)
    body = {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "max_tokens": 2000, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", replicas.url + "/v1/completions", json=body, timeout=120,
                      headers={"authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200 and r.headers["x-attnlab-replica"] == victim
        lines = r.iter_lines()
        assert sum(1 for _, line in zip(range(6), lines) if line.startswith("data: {")) == 3  # 3 tokens so far
        assert active(replicas, victim) == 1
    t2 = time.perf_counter()
    while active(replicas, victim):
        assert time.perf_counter() - t2 < 20, "the replica kept generating for a client that left"
        time.sleep(0.2)
    print(f"a client left mid-stream: the replica stopped after {time.perf_counter() - t2:.1f} s")

    with running(make_app()) as url:  # the single server, same messages, same order of turns
        single = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300)
        ref1 = [turn(single, history(o), False)[0] for o in OPENERS]
        ref2 = [turn(single, history(OPENERS[i], ref1[i]), False, 24)[0] for i in range(8)]
        ref3 = [turn(single, history(OPENERS[i], ref1[i], ref2[i]), False)[0] for i in range(8)]
    assert [f[0] for f in first] == ref1
    assert [s[0] for s in second] == ref2  # every conversation answered, as one server answers it
    assert [t[0] for t in third] == ref3
