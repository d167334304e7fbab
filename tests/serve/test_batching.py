"""Continuous batching through HTTP: 8 concurrent streamed conversations through the official `openai` client.

SmolLM2 as `attnlab serve` loads it by default (the file's int4 weights, the native step): a conversation's
greedy answer inside a batch is the answer it gets alone, token for token (int4 rows are exact whatever the
batch; float weights would agree to rounding only). The model thread really batches them (the decode steps'
widths are recorded), and `max_batch` bounds the width.
"""
from __future__ import annotations

import threading

import pytest

MODEL = "smollm2-135m"
QUESTIONS = ["Write a haiku about the sea.", "List the days of the week.", "What is the capital of France?",
             "Name three colours.", "Count from one to ten.", "Describe a cat in one sentence.",
             "Why is the sky blue?", "Give me a word that rhymes with moon."]


@pytest.fixture(scope="module")
def int4_lm():
    import attnlab
    return attnlab.load(MODEL)


@pytest.fixture
def widths(int4_lm, monkeypatch):
    """The number of conversations in each step that decodes (its rows of one token)."""
    seen, real = [], int4_lm.step

    def recorded(batch):
        rows = sum(r.single for r in batch.rows)
        if rows:
            seen.append(rows)
        return real(batch)
    monkeypatch.setattr(int4_lm, "step", recorded)
    return seen


def _app(lm, **limits):
    from attnlab.serve import PolicySpec, ServeConfig, create_app
    return create_app(lm, ServeConfig(MODEL, PolicySpec("sink", 128, 4, "cache"), chunk=32, max_tokens=16, **limits))


def _serve(lm, **limits):
    from tests.serve.conftest import running
    return running(_app(lm, **limits))


def _client(url):
    from openai import OpenAI
    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _talk(client, question: str) -> tuple[str, str]:
    """A streamed greedy chat turn: (the joined text, the finish reason)."""
    parts, reason = [], None
    for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                                max_tokens=16, temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            reason = chunk.choices[0].finish_reason
    return "".join(parts), reason


def _together(client, questions) -> list:
    got = [None] * len(questions)
    start = threading.Barrier(len(questions))

    def one(i):
        start.wait()
        got[i] = _talk(client, questions[i])
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return got


def test_8_concurrent_streamed_conversations_answer_what_each_answers_alone(int4_lm, widths):
    with _serve(int4_lm) as url:
        client = _client(url)
        alone = [_talk(client, q) for q in QUESTIONS]
        assert set(widths) == {1} and all(text for text, _ in alone)
        widths.clear()
        together = _together(client, QUESTIONS)
    assert together == alone
    assert max(widths) >= 4, widths  # they did decode together (arrivals spread over a few steps)


def test_max_batch_bounds_the_decode_step(int4_lm, widths):
    with _serve(int4_lm, max_batch=2) as url:
        client = _client(url)
        alone = [_talk(client, q) for q in QUESTIONS[:4]]
        widths.clear()
        together = _together(client, QUESTIONS[:4])
    assert together == alone and max(widths) == 2


def test_a_client_that_leaves_a_whole_answer_is_cancelled(int4_lm):
    """Not streamed: the server notices the disconnect while it decodes and drops the request from the batch."""
    import time

    import httpx
    from tests.serve.conftest import running
    app = _app(int4_lm, max_tokens_cap=2000)
    stats = app.state.stats
    body = {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 2000, "temperature": 0}
    with running(app) as url:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=body, timeout=1.5)
        deadline = time.monotonic() + 10
        while stats["active"] and time.monotonic() < deadline:
            time.sleep(0.05)
        settled = stats["tokens_generated"]
        time.sleep(0.5)
        assert stats["active"] == 0 and stats["tokens_generated"] == settled < 2000
        assert app.state.server.scheduler.idle and not app.state.store.loose
