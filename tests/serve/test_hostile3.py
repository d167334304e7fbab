"""Issue 38 (hostile input, third round): each reported break replayed against a real server.

Connections (item 1) are in test_connections.py, the cached continuation (item 6) in test_continuation.py.
"""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from attnlab.sampling import Sampler
from tests.serve.test_hostile import assert_openai_error

MODEL = "smollm2-135m"
A, B, ADMIN = "key-alpha-0001", "key-beta-00002", "key-admin-0003"
HI = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3, "temperature": 0}
WORDS = ("the quick brown fox jumps over the lazy dog while seven wizards quietly hex jolly kings " * 40).split()


@pytest.fixture(scope="module")
def server(smollm2):
    """Keys A and B (and an admin), 4 conversations and 64 MiB of cache in all: 2 and 32 MiB per... key."""
    from attnlab.serve import Keys, PolicySpec, ServeConfig, create_app
    from tests.serve.conftest import running
    app = create_app(smollm2, ServeConfig(MODEL, PolicySpec("sink", 64, 4, "cache"), max_sessions=4, max_bytes=64 << 20,
                                          chunk=16, max_tokens=8, max_tokens_cap=2048, key_sessions=2,
                                          key_bytes=32 << 20, cors_origins=["https://ok.example"]),
                     Keys(api=[A, B], admin=[ADMIN]))
    with running(app) as url:
        yield url, app


def post(url, body, key=A, path="/v1/chat/completions", **kw):
    return httpx.post(url + path, content=json.dumps(body), timeout=120,
                      headers={"content-type": "application/json", "authorization": f"Bearer {key}"}, **kw)


def get(url, path, key=None):
    return httpx.get(url + path, headers={"authorization": f"Bearer {key}"} if key else {}, timeout=30)


# ------------------------------------------------------------------ item 2: tiny temperature / top_p, NaN

@pytest.mark.parametrize("change", [{"temperature": 1e-300}, {"temperature": 1e-45}, {"temperature": 5e-324},
                                    {"temperature": 1, "top_p": 5e-324}, {"temperature": 2, "top_p": 1e-7}])
def test_tiny_temperature_and_top_p_are_greedy(server, change):
    url, app = server
    before = app.state.stats["server_errors"]
    greedy = post(url, HI).json()["choices"][0]["message"]["content"]
    r = post(url, {**HI, **change})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == greedy  # the documented rule: below the floor, greedy
    streamed = post(url, {**HI, **change, "stream": True})
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]"), streamed.text[-200:]
    assert app.state.stats["server_errors"] == before


@pytest.mark.parametrize("field, raw", [("temperature", "NaN"), ("temperature", "Infinity"), ("top_p", "NaN"),
                                        ("top_p", "-Infinity"), ("temperature", "1e400")])
def test_non_finite_sampling_fields_are_told_so(server, field, raw):
    url, _ = server
    body = json.dumps(HI)[:-1] + f', "{field}": {raw}}}'  # Python's json reads NaN and Infinity
    r = httpx.post(url + "/v1/chat/completions", content=body, timeout=60,
                   headers={"content-type": "application/json", "authorization": f"Bearer {A}"})
    assert_openai_error(r, 400, "invalid_value", field)
    assert "finite" in r.json()["error"]["message"], r.text


def test_sampler_never_returns_nan_probabilities():
    import torch
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9]])
    for t, p in [(1e-300, 1.0), (5e-324, 1.0), (1.0, 5e-324), (1e-4, 1e-9), (1e-3, 1.0)]:
        assert Sampler(t, 0, p, seed=0)(logits).item() == 1
    assert Sampler(0.5, 0, 1e-6 * 2, seed=0).temperature == 0.5  # above both floors: sampled
    weird = torch.tensor([[float("nan"), 1.0, float("inf"), 0.0]])
    assert Sampler(1.0, 0, 0.9, seed=0)(weird).item() == 2      # not finite: the top token, no crash


# ------------------------------------------------------------------ item 3: the cache cap on every allocation

def full(messages, max_tokens, key=A):
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "attnlab": {"policy": "full"}}


def test_a_continued_full_conversation_cannot_grow_past_the_cap(server):
    url, app = server
    store = app.state.store
    history = [{"role": "user", "content": "Name a colour."}]
    first = post(url, full(history, 4), key=B)
    assert first.status_code == 200, first.text
    sid = first.json()["attnlab"]["session"]
    held = store.get(sid)
    cache = held.session.cache
    slot = store.slot_bytes(held.spec)
    # a new full cache is sized for prompt + max_tokens exactly, and counted with positions
    assert cache.layers[0].capacity == first.json()["usage"]["prompt_tokens"] + 4
    assert held.nbytes() == cache.layers[0].capacity * slot + store.own == first.json()["attnlab"]["cache_bytes"]
    history += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                {"role": "user", "content": " ".join(WORDS[:400])}]
    # ~450 tokens + max_tokens 1300: about 78 MiB > 32 MiB per key: refused before any work, session kept
    t = time.perf_counter()
    r = post(url, full(history, 1300), key=B)
    assert_openai_error(r, 400, "cache_limit_exceeded", "attnlab")
    assert time.perf_counter() - t < 2 and store.get(sid) is held and cache.seen == len(held.session.ids)
    assert store.total_bytes() <= store.max_bytes
    # a turn that fits grows the cache to exactly what it needs (no doubling), and reuses it
    ok = post(url, full(history, 8), key=B)
    assert ok.status_code == 200, ok.text
    body = ok.json()
    assert body["attnlab"]["session"] == sid and body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert cache.layers[0].capacity == body["usage"]["prompt_tokens"] + 8
    assert body["attnlab"]["cache_bytes"] == held.nbytes() <= store.key_bytes
    assert get(url, "/v1/sessions", B).json()["total_bytes"] <= store.key_bytes


def test_a_raw_completion_counts_against_the_cap(server):
    url, app = server
    r = post(url, {"model": MODEL, "prompt": "One, two,", "max_tokens": 2000, "attnlab": {"policy": "full"}},
             path="/v1/completions")
    assert_openai_error(r, 400, "cache_limit_exceeded")
    ok = post(url, {"model": MODEL, "prompt": "One, two,", "max_tokens": 2, "attnlab": {"policy": "full"}},
              path="/v1/completions")
    assert ok.status_code == 200 and ok.json()["attnlab"]["session"] is None
    deadline = time.monotonic() + 5
    while app.state.store.loose and time.monotonic() < deadline:  # released by the model thread after the reply
        time.sleep(0.02)
    assert not app.state.store.loose


# ------------------------------------------------------------------ item 4: a client that leaves stops its prefill

def test_a_client_that_leaves_during_prefill_stops_within_a_chunk(server, monkeypatch):
    url, app = server
    from attnlab.session import Session
    calls, real = [], Session.took

    def counted(self, ids, logits):
        if len(ids) > 1:  # a prefill chunk went in (decode rows take one token)
            calls.append(time.monotonic())
            time.sleep(0.05)  # a slow chunk, so the client surely leaves mid-prompt
        return real(self, ids, logits)
    monkeypatch.setattr(Session, "took", counted)
    body = json.dumps({**HI, "stream": True, "messages": [{"role": "user", "content": " ".join(WORDS[:500])}]})
    port = int(url.rsplit(":", 1)[1])
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {A}\r\n"
              f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
    deadline = time.monotonic() + 30
    while len(calls) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    s.close()
    gone = time.monotonic()
    time.sleep(1.5)
    after = [t for t in calls if t > gone]
    assert 3 <= len(calls) < 20 and len(after) <= 2, (len(calls), len(after))  # ~35 chunks of 16 in the prompt
    deadline = time.monotonic() + 10
    while app.state.stats["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert app.state.stats["active"] == 0


# ------------------------------------------------------------------ item 5: keys do not affect each other

def test_one_key_evicts_only_its_own_conversations(server):
    url, app = server
    talk = {**HI, "max_tokens": 2}
    mine = [{"role": "user", "content": "B's own question."}]
    b1 = post(url, {**talk, "messages": mine}, key=B)
    sid = b1.json()["attnlab"]["session"]
    before_b = get(url, "/v1/sessions", B).json()["evicted"]
    before_a = get(url, "/v1/sessions", A).json()["evicted"]
    for i in range(4):  # A opens 4 conversations against its quota of 2
        assert post(url, {**talk, "messages": [{"role": "user", "content": f"A's question {i}."}]}).status_code == 200
    a = get(url, "/v1/sessions", A).json()
    assert len(a["data"]) == 2 and a["max_sessions"] == 2 and a["evicted"] >= before_a + 2
    b = get(url, "/v1/sessions", B).json()
    assert sid in {s["id"] for s in b["data"]} and b["evicted"] == before_b
    mine += [{"role": "assistant", "content": b1.json()["choices"][0]["message"]["content"]},
             {"role": "user", "content": "And again?"}]
    b2 = post(url, {**talk, "messages": mine}, key=B)  # B's next turn still finds its cache
    assert b2.json()["attnlab"]["session"] == sid and b2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert a["requests"] >= 4 and b["requests"] >= 1 and a["tokens_generated"] >= 4


def test_health_shows_activity_only_to_the_admin(server):
    url, _ = server
    assert get(url, "/health").json() == {"status": "ok", "model": MODEL}
    assert get(url, "/health", A).json() == {"status": "ok", "model": MODEL}
    full_view = get(url, "/health", ADMIN).json()
    assert full_view["requests"] >= 0 and "sessions" in full_view and "tokens_generated" in full_view


# ------------------------------------------------------------------ the lesser items

@pytest.mark.parametrize("host", ["[::1]evil.com", "[::1]:80evil", "127.0.0.1:80:80", "localhost:x"])
def test_hosts_with_junk_after_the_name_get_421(server, host):
    url, _ = server
    assert_openai_error(httpx.get(url + "/health", headers={"host": host}), 421, "invalid_host")


def test_cors_preflight_is_checked_for_the_host_first(server):
    url, _ = server
    pre = {"origin": "https://ok.example", "access-control-request-method": "POST",
           "access-control-request-headers": "authorization,content-type"}
    assert httpx.options(url + "/v1/chat/completions", headers=pre).status_code == 200
    evil = httpx.options(url + "/v1/chat/completions", headers={**pre, "host": "evil.com"})
    assert_openai_error(evil, 421, "invalid_host")
    assert "access-control-allow-origin" not in evil.headers


def test_stream_options_are_typed(server):
    url, _ = server
    assert_openai_error(post(url, {**HI, "stream": True, "stream_options": {"include_usage": "yes"}}), 400,
                        "invalid_value", "stream_options.include_usage")
    ok = post(url, {**HI, "stream": True, "stream_options": {"include_usage": True}})
    assert ok.status_code == 200 and '"usage"' in ok.text


def test_a_huge_model_id_is_not_echoed(server):
    url, _ = server
    r = post(url, {**HI, "model": "m" * 100_000})
    assert_openai_error(r, 404, "model_not_found")
    assert len(r.text) < 1000 and "100000 characters" in r.text
    g = get(url, "/v1/models/" + "m" * 5000, A)
    assert g.status_code == 404 and len(g.text) < 1000
