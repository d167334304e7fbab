"""The OpenAI-compatible server through the official `openai` client and raw HTTP."""
from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

MODEL = "smollm2-135m"


def ask(client, messages, max_tokens=12, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **kw)


def test_models_and_health(client, served):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    health = httpx.get(served[0] + "/health").json()
    assert health["status"] == "ok" and health["model"] == MODEL


def test_chat_completion_and_stream_join(client):
    messages = [{"role": "user", "content": "Name three colours."}]
    r = ask(client, messages)
    text = r.choices[0].message.content
    assert text and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    arrivals, pieces, reasons = [], [], []
    for chunk in ask(client, messages, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
            arrivals.append(time.monotonic())
        if chunk.choices and chunk.choices[0].finish_reason:
            reasons.append(chunk.choices[0].finish_reason)
    assert "".join(pieces) == text
    assert len(pieces) >= 3 and arrivals[-1] - arrivals[0] > 0.05  # token by token, not one blob
    assert reasons == [r.choices[0].finish_reason]


def test_ignore_eos_runs_the_reply_to_max_tokens(client):
    """vLLM's and llama-server's `ignore_eos`: the reply goes on past the model's end-of-turn token, and begins
    as the reply that stopped there."""
    messages = [{"role": "user", "content": "Say hello."}]
    ended = ask(client, messages, max_tokens=64)
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens < 64  # the model ends early
    full = ask(client, messages, max_tokens=64, extra_body={"ignore_eos": True})
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 64
    assert full.choices[0].message.content.startswith(ended.choices[0].message.content)
    with pytest.raises(openai.BadRequestError):  # strict, as every field is
        ask(client, messages, extra_body={"ignore_eos": "yes"})


def test_completions_endpoint_and_stop(client):
    r = client.completions.create(model=MODEL, prompt="One, two, three, four,", max_tokens=8, temperature=0)
    text = r.choices[0].text
    assert text and r.usage.completion_tokens <= 8
    stop = text.strip()[:2]
    cut = client.completions.create(model=MODEL, prompt="One, two, three, four,", max_tokens=8, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_second_turn_feeds_only_new_tokens(client, served, smollm2):
    store = served[1].state.store
    history = [{"role": "user", "content": "What is the capital of France?"}]
    first = ask(client, history, max_tokens=10)
    sid = first.model_extra["attnlab"]["session"]
    assert first.model_extra["attnlab"]["fed_tokens"] == first.usage.prompt_tokens  # turn 1 feeds everything
    held_text = store.get(sid).session.text
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "And of Italy?"}]
    rendered = smollm2.render_chat(history)
    assert rendered.startswith(held_text)
    second = ask(client, history, max_tokens=10)
    ext = second.model_extra["attnlab"]
    expected = len(smollm2.encode_rendered(rendered[len(held_text):]))
    assert ext["session"] == sid and ext["fed_tokens"] == expected
    assert expected < 20 < second.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - expected
    # the reused cache answers what a fresh cache over the whole history answers
    store.sessions.clear()
    fresh = ask(client, history, max_tokens=10)
    assert fresh.model_extra["attnlab"]["session"] != sid
    assert fresh.choices[0].message.content == second.choices[0].message.content


def test_concurrent_conversations_get_their_own_answers(client):
    questions = ["Write a haiku about the sea.", "List the days of the week."]
    alone = [ask(client, [{"role": "user", "content": q}], max_tokens=16).choices[0].message.content
             for q in questions]
    got, spans = {}, {}

    def talk(i):
        parts, times = [], []
        for chunk in ask(client, [{"role": "user", "content": questions[i]}], max_tokens=16, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
                times.append(time.monotonic())
        got[i], spans[i] = "".join(parts), (times[0], times[-1])

    threads = [threading.Thread(target=talk, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [got[0], got[1]] == alone
    assert spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1]  # the two streams overlapped in time


def _post(url, body=None, raw=None, path="/v1/chat/completions"):
    if raw is not None:
        return httpx.post(url + path, content=raw, headers={"content-type": "application/json"}, timeout=60)
    return httpx.post(url + path, json=body, timeout=60)


GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("name, change, status, code, param", [
    ("malformed JSON", "{not json", 400, "invalid_json", None),
    ("unknown model", {"model": "gpt-5"}, 404, "model_not_found", "model"),
    ("negative max_tokens", {"max_tokens": -1}, 400, "invalid_value", "max_tokens"),
    ("negative max_completion_tokens", {"max_completion_tokens": -5}, 400, "invalid_value", "max_completion_tokens"),
    ("empty messages", {"messages": []}, 400, "empty_messages", "messages"),
    ("missing messages", {"messages": None}, 400, "invalid_value", "messages"),
    ("bad role", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_value", None),
    ("n=2", {"n": 2}, 400, None, "n"),
    ("temperature out of range", {"temperature": 3}, 400, "invalid_value", "temperature"),
    ("unknown policy", {"attnlab": {"policy": "lru"}}, 400, None, "attnlab"),
    ("budget below the sinks", {"attnlab": {"policy": "sink", "budget": 3}}, 400, None, "attnlab"),
    ("prompt past a full cache", {"attnlab": {"policy": "full"}, "max_tokens": 9000}, 400,
     "context_length_exceeded", "messages"),
    ("prompt past the per-request limit", {"messages": [{"role": "user", "content": "word " * 5000}]}, 400,
     "context_length_exceeded", "messages"),
])
def test_bad_requests_get_openai_errors(served, name, change, status, code, param):
    url = served[0]
    if isinstance(change, str):
        r = _post(url, raw=change)
    else:
        body = {**GOOD, **change}
        r = _post(url, {k: v for k, v in body.items() if v is not None})
    assert r.status_code == status, (name, r.text)
    err = r.json()["error"]
    assert err["message"] and err["type"] == "invalid_request_error"
    if "param" in err and param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err


def test_errors_reach_the_openai_client_and_server_survives(client, served):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="at least one message"):
        client.chat.completions.create(model=MODEL, messages=[])
    r = httpx.get(served[0] + "/v1/nowhere")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(served[0] + "/v1/sessions/ffff/cache")
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    assert ask(client, [{"role": "user", "content": "hi"}], max_tokens=2).choices[0].message.content is not None


def test_disconnect_mid_stream_frees_the_work(served):
    url, app = served
    stats = app.state.stats
    body = {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 400, "temperature": 0, "stream": True}
    before = stats["tokens_generated"]
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen += 1
            if seen >= 4:
                break
    deadline = time.monotonic() + 10
    while stats["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    settled = stats["tokens_generated"]
    time.sleep(0.5)
    assert stats["active"] == 0 and stats["tokens_generated"] == settled
    assert settled - before < 60  # stopped soon after the client left, far from max_tokens=400
    assert not any(h.busy for h in app.state.store.sessions.values())


def test_sessions_endpoint_and_cache_view(client, served):
    r = ask(client, [{"role": "user", "content": "Tell me a story about a cat."}], max_tokens=8)
    sid = r.model_extra["attnlab"]["session"]
    listing = httpx.get(served[0] + "/v1/sessions").json()
    mine = next(s for s in listing["data"] if s["id"] == sid)
    assert mine["policy"] == "sink" and mine["budget"] == 256 and not mine["busy"]
    assert mine["tokens_seen"] == r.usage.prompt_tokens + r.usage.completion_tokens - 1
    assert mine["slots_kept"] == mine["tokens_seen"] and mine["bytes"] > 0
    view = httpx.get(served[0] + f"/v1/sessions/{sid}/cache").json()
    assert len(view["layers"]) == 30 and view["n_sink"] == 4
    assert all(layer == list(range(mine["tokens_seen"])) for layer in view["layers"])  # nothing evicted yet


def test_cache_view_shows_sinks_and_recent_window_after_eviction(client, served):
    """A per-request sink policy of 16 slots: every layer keeps positions 0-3 and the 12 latest."""
    r = ask(client, [{"role": "user", "content": "Describe the moon in one sentence."}], max_tokens=6,
            extra_body={"attnlab": {"policy": "sink", "budget": 16}})
    ext = r.model_extra["attnlab"]
    assert ext["slots_kept"] == 16 and ext["tokens_seen"] > 30
    view = httpx.get(served[0] + f"/v1/sessions/{ext['session']}/cache").json()
    seen = view["tokens_seen"]
    assert view["policy"] == "sink" and view["n_sink"] == 4 and view["n_recent"] == 12
    assert all(layer == [0, 1, 2, 3] + list(range(seen - 12, seen)) for layer in view["layers"])


def test_serve_command_rejects_bad_options(capsys):
    from attnlab.cli import main
    assert main(["serve", "--budget", "0.5"]) == 2
    assert "--budget in tokens" in capsys.readouterr().err
    assert main(["serve", "--policy", "sink,h2o"]) == 2


def test_busy_server_answers_503_after_the_bounded_wait(smollm2):
    from attnlab.serve import PolicySpec, ServeConfig, create_app
    from tests.serve.conftest import running
    app = create_app(smollm2, ServeConfig(MODEL, PolicySpec("sink", 64), max_active=1, queue_timeout=0.3))
    body = {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "max_tokens": 300, "temperature": 0,
            "stream": True}
    with running(app) as url, httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as first:
        assert first.status_code == 200
        lines = first.iter_lines()  # kept referenced: a discarded iterator closes the connection
        next(lines)                 # the first request holds the only slot (counting on: no early EOS)
        r = httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=60)
        assert app.state.stats["active"] == 1
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_timeout"


def test_speculative_requests_reply_as_plain_ones_and_report_their_drafts(client):
    """attnlab.speculative: n-gram drafts verified in the batched step; greedy text identical to plain decoding."""
    text = "the quick brown fox jumps over the lazy dog, " * 3
    messages = [{"role": "user", "content": f"Repeat this line three more times: {text}"}]
    plain = ask(client, messages, max_tokens=48, extra_body={"ignore_eos": True})
    fast = ask(client, messages, max_tokens=48, extra_body={"ignore_eos": True, "attnlab": {"speculative": "ngram:3:4"}})
    assert fast.choices[0].message.content == plain.choices[0].message.content
    assert fast.usage.completion_tokens == plain.usage.completion_tokens == 48
    counts = fast.model_extra["attnlab"]["speculative"]
    assert counts["accepted"] > 0 and counts["tokens"] == 48 and counts["tokens_per_step"] > 1
    assert "speculative" not in plain.model_extra["attnlab"]
    for bad, says in (("draft:/x.gguf", "ngram"), ("ngram:3:99", "at most"), ("ngram:x", "speculative")):
        with pytest.raises(openai.BadRequestError) as e:
            ask(client, messages, extra_body={"attnlab": {"speculative": bad}})
        assert says in e.value.message and e.value.body["param"] == "attnlab.speculative"
