"""Speculative requests in the scheduler: verification rows in the batch beside plain decode rows and prompt chunks.

A greedy request that decodes speculatively gets the tokens plain decoding gives (alone or in the batch), whatever
its neighbours and its cache's policy; a reply that stops inside the drafts it kept leaves its session as a plain
reply would (every token but the last fed); a policy that cannot cut its cache back is refused.
"""
from __future__ import annotations

import pytest

from attnlab.errors import AttnlabError
from attnlab.sampling import Sampler
from attnlab.serve.scheduler import Scheduler
from attnlab.session import Session
from tests.serve.test_scheduler import CHUNK, _alone, _lm, _prompts, _run, _session, _tokens, needs_kernels


def _repetitive(n: int) -> list[list[int]]:
    """Prompts that repeat a phrase, so n-gram drafts are often right (the tiny model copies its context)."""
    return [(p[:5] * 4)[:5 + 3 * i] + p for i, p in enumerate(_prompts(n, [7, 9, 6, 11, 8, 10]))]


def _policy_of(i: int) -> int:
    return 0 if i % 2 == 0 else 1  # full and sink in turn (h2o scores by attention: refused, below)


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=needs_kernels)], ids=["eager", "native"])
@pytest.mark.parametrize("spec", ["ngram:2:4", "ngram"])  # fixed K, adaptive K
def test_speculative_requests_get_the_tokens_plain_decoding_gives(native, spec):
    lm = _lm(native)
    prompts = _repetitive(6)
    limits = [40, 33, 37, 29, 35, 31]
    alone = [_alone(lm, _policy_of(i), p, n) for i, (p, n) in enumerate(zip(prompts, limits))]
    sched = Scheduler(lm, max_batch=6, chunk=CHUNK, speculate_rows=6)
    sessions = [_session(lm, _policy_of(i)) for i in range(6)]
    # every other request speculates: verification rows and plain rows share each step
    ids = [sched.submit(s, p, Sampler(0.0), n, lm.eos_ids, speculative=spec if i % 3 else None)
           for i, (s, p, n) in enumerate(zip(sessions, prompts, limits))]
    verifying = []
    got = _run(sched, each=lambda n, ev: verifying.append(len(sched.last.drafts)))
    assert [_tokens(got[i]) for i in ids] == alone
    assert max(verifying) >= 2  # several verification rows in one step
    speculative = [i for i in range(6) if i % 3]
    assert sum(sessions[i].stats.accepted if spec == "ngram:2:4" else sessions[i].stats.drafted
               for i in speculative) > 0  # adaptive K on a random tiny model mostly stops drafting: drafts at least
    for i in speculative:
        st = sessions[i].stats
        assert st.drafted >= st.accepted and st.tokens == len(_tokens(got[ids[i]])) <= 1 + st.steps + st.accepted
    for s, p, a in zip(sessions, prompts, alone):  # Session's invariant holds for speculative replies too
        assert s.ids == p + a[:-1] and s.cache.seen == len(s.ids) == s.fed and s.logits is None


class Oracle:
    """A drafter that knows each reply (the tokens plain decoding gives): every draft is right, so replies stop
    inside the drafts they kept."""

    def __init__(self, sequences):
        self.sequences = sequences

    def propose(self, context, k, sampler):
        for seq in self.sequences:
            if seq[:len(context)] == context:
                return seq[len(context):len(context) + k], None
        return [], None


def test_a_reply_that_stops_inside_its_kept_drafts_feeds_what_a_plain_reply_feeds(monkeypatch):
    import attnlab.serve.scheduler as scheduler
    lm = _lm()
    cut = []
    unfeed = Session.unfeed
    monkeypatch.setattr(Session, "unfeed", lambda self, k: (cut.append(k), unfeed(self, k)))
    prompts = _repetitive(6)
    plain = [_alone(lm, 0, p, 40, eos=False) for p in prompts]
    monkeypatch.setattr(scheduler, "make_drafter", lambda lm, spec: Oracle([p + a for p, a in zip(prompts, plain)]))
    stops = [a[12 + i] for i, a in enumerate(plain)]  # each reply ends at the first of one of its later tokens
    expected = [a[:a.index(t) + 1] for a, t in zip(plain, stops)]
    sched = Scheduler(lm, max_batch=6, chunk=CHUNK, speculate_rows=6)
    sessions = [_session(lm, 0) for _ in prompts]
    ids = [sched.submit(s, p, Sampler(0.0), 40, (t,), speculative="ngram:2:6")
           for s, p, t in zip(sessions, prompts, stops)]
    got = _run(sched)
    assert [_tokens(got[i]) for i in ids] == expected
    assert len(cut) >= 3  # replies did stop inside the drafts they kept: the tokens after the stop were taken back
    assert all(s.stats.accepted == s.stats.drafted for s in sessions)  # right drafts are all kept
    assert sum(s.stats.drafted for s in sessions) > 0
    for s, p, e, i in zip(sessions, prompts, expected, ids):
        assert s.ids == p + e[:-1] and s.cache.seen == len(s.ids) and got[i][-1].reason == "stop"
    # the conversation goes on from there as plain decoding's would
    monkeypatch.undo()
    more = sched.submit(sessions[0], [expected[0][-1], 5, 6], Sampler(0.0), 10, (), speculative="ngram:2:6")
    s = _session(lm, 0)
    s.feed(prompts[0] + expected[0] + [5, 6])
    assert _tokens(_run(sched)[more]) == list(s.generate(Sampler(0.0), 10, stop_at_eos=False))


def test_seeded_speculative_sampling_keeps_the_session_consistent():
    lm = _lm()
    prompts = _repetitive(3)
    sched = Scheduler(lm, max_batch=3, chunk=CHUNK, speculate_rows=3)
    sessions = [_session(lm, _policy_of(i)) for i in range(3)]
    ids = [sched.submit(s, p, Sampler(0.8, 0, 1.0, 7 + i), 30, (), speculative="ngram:2:4")
           for i, (s, p) in enumerate(zip(sessions, prompts))]
    got = _run(sched)
    for s, p, i in zip(sessions, prompts, ids):
        reply = _tokens(got[i])
        assert len(reply) == 30 and s.ids == p + reply[:-1] and s.cache.seen == len(s.ids)
        assert s.stats.tokens == 1 + s.stats.steps + s.stats.accepted  # the first token, then each step's


def test_a_policy_that_cannot_cut_its_cache_back_is_refused():
    lm = _lm()
    sched = Scheduler(lm, max_batch=2, chunk=CHUNK)
    with pytest.raises(AttnlabError, match="cuts its cache back"):
        sched.submit(_session(lm, 2), [1, 2, 3], Sampler(0.0), 5, (), speculative="ngram")  # h2o
    with pytest.raises(AttnlabError, match="speculative"):
        sched.submit(_session(lm, 0), [1, 2, 3], Sampler(0.0), 5, (), speculative="ngram:x")
    assert sched.idle


def test_a_busy_batch_decodes_plainly():
    """Drafts only while at most speculate_rows conversations decode (a CPU's batched step is compute-bound)."""
    lm = _lm()
    prompts = _repetitive(4)
    limits = [12, 20, 28, 36]  # the batch shrinks from 4 rows to 1
    alone = [_alone(lm, 0, p, n, eos=False) for p, n in zip(prompts, limits)]
    sched = Scheduler(lm, max_batch=4, chunk=CHUNK, speculate_rows=2)
    ids = [sched.submit(_session(lm, 0), p, Sampler(0.0), n, (), speculative="ngram:2:4")
           for p, n in zip(prompts, limits)]
    planned = []
    got = _run(sched, each=lambda n, ev: planned.append((len(sched.last.decode), len(sched.last.drafts))))
    assert [_tokens(got[i]) for i in ids] == alone
    assert all(d == 0 for rows, d in planned if rows > 2) and any(d > 0 for rows, d in planned if rows <= 2)
