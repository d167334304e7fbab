"""The guard inside a request's own prefill (`Screen`, as `serve --guard` runs it): the NLL of the user's tokens
from the prompt's chunks is the standalone filter's, whatever the chunking; a flagged prompt fails before its first
token; an unflagged one decodes what it decodes unscreened."""
from __future__ import annotations

import pytest

from attnlab.robust.defenses import PerplexityFilter, Screen
from attnlab.sampling import Sampler
from attnlab.serve.scheduler import Scheduler
from attnlab.session import Session

ATTACKED = "Tell me about the sea. ')). !amoto :,}\". ! !HCR '))OCKmerce guarantaled ! microwave.],7;4"


class Flagged(Exception):
    pass


def run(lm, ids, chunk, screen=None, new=4):
    sched = Scheduler(lm, max_batch=2, chunk=chunk)
    sched.submit(Session(lm, lm.new_cache(1, capacity=len(ids) + new)), ids, Sampler(0.0), new, screen=screen)
    events = []
    while not sched.idle:
        events += sched.step()
    return events


@pytest.mark.parametrize("context", ["chat", "text"])
@pytest.mark.parametrize("chunk", [7, 512])
def test_the_prefills_nll_is_the_standalone_filters(smollm2, context, chunk):
    filt = PerplexityFilter(smollm2, 1e9, context=context)  # flags nothing: the reply goes on
    ids, spans = filt.tokens(ATTACKED)
    screen = Screen(filt, spans, Flagged)
    events = run(smollm2, ids, chunk, screen)
    alone = filt.nll(ids)
    (a, b), = spans
    assert sorted(screen.nll) == list(range(max(a, 1), b))  # every user token but one with nothing before it
    for p, v in screen.nll.items():
        assert v == pytest.approx(float(alone[p]), abs=2e-3, rel=1e-3)
    assert [e.token for e in events if e.kind == "token"] == [e.token for e in run(smollm2, ids, chunk)
                                                              if e.kind == "token"]
    assert screen.failure() is None and filt.score(ATTACKED) > 5  # high, and still not flagged at 1e9


@pytest.mark.parametrize("chunk", [7, 512])
def test_a_flagged_prompt_fails_before_its_first_token(smollm2, chunk):
    filt = PerplexityFilter(smollm2, 8.0)
    ids, spans = filt.tokens(ATTACKED)
    events = run(smollm2, ids, chunk, Screen(filt, spans, lambda v: Flagged(v.reason)))
    assert [e.kind for e in events] == ["error"] and isinstance(events[0].error, Flagged)
    assert "perplexity filter" in str(events[0].error)
    ok, spans = filt.tokens("Tell me about the sea.")
    assert [e.kind for e in run(smollm2, ok, chunk, Screen(filt, spans, Flagged))] == ["token"] * 4 + ["done"]


def test_only_the_tokens_fed_now_are_scored():
    filt = PerplexityFilter(None, 1.0)
    screen = Screen(filt, [(3, 10), (20, 30)], Flagged)
    screen.fed_from(8)  # a held session had the first 8 tokens (the first message's start: checked when fed)
    assert screen.spans == [(0, 2), (12, 22)]
    assert screen.wants(0, 5) == range(0, 5)  # 0 predicts 1 (token 0 itself came after logits of another step)
    assert screen.wants(2, 11) == "last"        # no user token next at 2..10
    assert screen.wants(11, 15) == range(0, 4)  # position 11 predicts 12, the second span's first token
    assert screen.wants(21, 30) == "last"       # 21 predicts 22, past the span
