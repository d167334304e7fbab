"""The server's scheduler without HTTP: continuous batching of conversations over `LM.step`.

A request's tokens inside a batch are the tokens it gets alone (`Session.generate`, the one-conversation
loop), greedy and seeded; a newcomer's prompt goes in chunks while the others advance one token per step;
max_batch holds, the oldest waiting request takes a freed slot first, cancel and stop strings end a
request where they should.
"""
from __future__ import annotations

import pytest
import torch

from attnlab.errors import AttnlabError
from attnlab.kernels import ops
from attnlab.kv import make_policy
from attnlab.sampling import Sampler
from attnlab.serve.scheduler import Scheduler
from attnlab.session import Session
from tests.conftest import tiny_lm

LENGTHS = [5, 17, 9, 30, 3, 22, 12, 26]
CHUNK = 8
needs_kernels = pytest.mark.skipif(not ops.load(), reason="no C++ kernels (attnlab info says why)")


def _lm(native: bool = False):
    """int4 weights: a batch's rows give bit-identical logits to the same rows alone (tests/test_step_batch.py)."""
    from attnlab.quant import quantize_model
    lm = tiny_lm(dim=64, hidden_dim=128, head_dim=32)
    lm.kv_dtype = torch.float16
    quantize_model(lm.model, "int4:32")
    if native:
        lm.compile_decode()
        assert lm.compiled is not None
    return lm


def _policy(i: int):
    """Each conversation its own policy: full, sink, h2o in turn."""
    return [None, make_policy("sink", 24, n_sink=2, chunk=4, block=4), make_policy("h2o", 24, chunk=4, block=4)][i % 3]


def _prompts(n=len(LENGTHS), lengths=LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 97, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def _session(lm, i: int) -> Session:
    return Session(lm, lm.new_cache(capacity=8, policy=_policy(i)), CHUNK)


def _alone(lm, i: int, prompt, max_tokens, sampler=None, eos=True) -> list[int]:
    """The request alone, through the one-conversation loop (`Session.generate`, `LM.decode`)."""
    s = _session(lm, i)
    s.feed(prompt)
    return list(s.generate(sampler or Sampler(0.0), max_tokens, stop_at_eos=eos))


def _run(sched, limit=10_000, each=None) -> dict[int, list]:
    """Step until idle; per request id its events in order. each(step_number, events) is called after every step."""
    out: dict[int, list] = {}
    for n in range(limit):
        if sched.idle:
            return out
        events = sched.step()
        for e in events:
            out.setdefault(e.id, []).append(e)
        if each is not None:
            each(n, events)
    raise AssertionError("the scheduler did not finish")


def _tokens(events) -> list[int]:
    return [e.token for e in events if e.kind == "token"]


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=needs_kernels)], ids=["eager", "native"])
def test_a_request_among_7_others_gets_the_tokens_it_gets_alone(native):
    lm = _lm(native)
    prompts = _prompts()
    limits = [30, 26, 28, 32, 25, 29, 31, 27]  # rows join (prefill: 20 steps in all) and leave at different steps
    alone = [_alone(lm, i, p, n) for i, (p, n) in enumerate(zip(prompts, limits))]
    assert len({tuple(a) for a in alone}) == len(prompts)
    sched = Scheduler(lm, max_batch=8, chunk=CHUNK)
    sessions = [_session(lm, i) for i in range(8)]
    ids = [sched.submit(s, p, Sampler(0.0), n, lm.eos_ids) for s, p, n in zip(sessions, prompts, limits)]
    sizes = []
    got = _run(sched, each=lambda n, ev: sizes.append(len(sched.last.batch)))
    assert [_tokens(got[i]) for i in ids] == alone
    assert max(sizes) == 8  # all eight did decode together
    for s, p, a, i in zip(sessions, prompts, alone, ids):  # Session's invariant: every reply token but the last fed
        assert s.ids == p + a[:-1] and s.cache.seen == len(s.ids) and s.logits is None
        assert got[i][-1].kind == "done" and got[i][-1].reason in ("stop", "length")


def test_seeds_per_request_reproduce():
    lm = _lm()
    prompts = _prompts(4)
    seeds = [11, 12, 11, 13]
    alone = [_alone(lm, i, p, 16, Sampler(0.9, 0, 0.95, seed)) for i, (p, seed) in enumerate(zip(prompts, seeds))]
    sched = Scheduler(lm, max_batch=4, chunk=CHUNK)
    ids = [sched.submit(_session(lm, i), p, Sampler(0.9, 0, 0.95, seed), 16, lm.eos_ids)
           for i, (p, seed) in enumerate(zip(prompts, seeds))]
    twin = sched.submit(_session(lm, 0), prompts[0], Sampler(0.9, 0, 0.95, 11), 16, lm.eos_ids)  # waits for a slot
    got = _run(sched)
    assert [_tokens(got[i]) for i in ids] == alone
    assert _tokens(got[twin]) == alone[0]  # the same prompt and seed, decoded later with other neighbours
    greedy = _alone(lm, 0, prompts[0], 16)
    assert alone[0] != greedy  # the seeds did sample


def test_cancel_mid_decode_and_mid_prefill():
    lm = _lm()
    prompts = _prompts(3, [6, 6, 40])
    sessions = [_session(lm, 0) for _ in range(3)]
    sched = Scheduler(lm, max_batch=3, chunk=CHUNK)
    ids = [sched.submit(s, p, Sampler(0.0), 30, ()) for s, p in zip(sessions, prompts)]
    got: dict[int, list] = {}
    for _ in range(6):  # two prefill steps for the short ones, then the long one's chunks while they decode
        for e in sched.step():
            got.setdefault(e.id, []).append(e)
    assert sched.last.batch == ids[:2] and sched.last.prefill == ids[2]
    cut = sched.cancel(ids[0])
    assert cut is not None and cut.prefilled
    long = sched.cancel(ids[2])
    assert long is not None and not long.prefilled and sched.cancel(ids[2]) is None
    rest = _run(sched)
    assert set(rest) == {ids[1]}  # the cancelled rows dropped out at the next step
    reply = _tokens(got[ids[0]])
    assert 0 < len(reply) < 30
    assert sessions[0].ids == prompts[0] + reply[:-1] and sessions[0].cache.seen == len(sessions[0].ids)
    assert _tokens(got[ids[1]] + rest[ids[1]]) == _alone(lm, 0, prompts[1], 30, eos=False)


def test_a_long_prompt_is_prefilled_in_chunks_while_4_others_advance_one_token_a_step():
    lm = _lm()
    prompts = _prompts(4)
    sched = Scheduler(lm, max_batch=8, chunk=CHUNK)
    ids = [sched.submit(_session(lm, i), p, Sampler(0.0), 200, ()) for i, p in enumerate(prompts)]
    while len(sched.decoding) < 4:
        sched.step()
    long = sched.submit(_session(lm, 0), _prompts(1, [100], seed=5)[0], Sampler(0.0), 5, ())
    steps, first = 0, None
    while first is None:
        events = sched.step()
        steps += 1
        assert sched.last.prefill == long and 0 < sched.last.prefill_tokens <= CHUNK
        per = [sum(e.id == i and e.kind == "token" for e in events) for i in ids]
        assert per == [1, 1, 1, 1]  # every decoding conversation advanced by exactly one token
        first = next((e for e in events if e.id == long), None)
    assert steps == -(-100 // CHUNK)  # one chunk per step, and its first token with the last chunk
    assert first.kind == "token"


@pytest.mark.parametrize("decoding,expected", [(0, 64), (4, 8), (6, 12), (8, 16)])
def test_a_newcomers_chunk_beside_decoding_rows_costs_about_what_they_cost(decoding, expected):
    """Alone a prompt goes in `chunk` tokens a step; beside B decoding rows, 2 tokens per row (at least 8), so
    the others' next token does not wait for a long chunk."""
    lm = _lm()
    sched = Scheduler(lm, max_batch=16, chunk=64)
    for i, p in enumerate(_prompts(decoding)):
        sched.submit(_session(lm, i), p, Sampler(0.0), 500, ())
    while len(sched.decoding) < decoding:
        sched.step()
    sched.submit(_session(lm, 0), _prompts(1, [300], seed=5)[0], Sampler(0.0), 5, ())
    sched.step()
    assert sched.last.prefill_tokens == expected
    for i in range(decoding):  # a burst: as many newcomers as decoding rows go in whole chunks
        sched.submit(_session(lm, i), _prompts(1, [300], seed=6 + i)[0], Sampler(0.0), 5, ())
    sched.step()
    assert sched.last.prefill_tokens == 64


def test_a_newcomer_that_would_decode_alone_goes_in_whole_chunks():
    """Beside rows with fewer tokens left than the newcomer's reply, small chunks would only leave it to decode alone
    once they end: its prompt goes in `chunk` tokens a step; beside rows with a long way to go, small chunks."""
    for left, expected in ((80, 64), (400, 8)):  # 80: the old rule (all rows ending first) gave 8
        lm = _lm()
        sched = Scheduler(lm, max_batch=16, chunk=64)
        for i, p in enumerate(_prompts(4)):
            sched.submit(_session(lm, i), p, Sampler(0.0), left, ())
        while len(sched.decoding) < 4:
            sched.step()
        sched.submit(_session(lm, 0), _prompts(1, [300], seed=5)[0], Sampler(0.0), 64, ())
        sched.step()
        assert sched.last.prefill_tokens == expected, left


def test_max_batch_holds_and_the_oldest_waiting_request_goes_first():
    lm = _lm()
    prompts = _prompts(7)
    limits = [4, 9, 6, 3, 8, 5, 7]
    alone = [_alone(lm, 0, p, n) for p, n in zip(prompts, limits)]
    sched = Scheduler(lm, max_batch=3, chunk=CHUNK)
    ids = [sched.submit(_session(lm, 0), p, Sampler(0.0), n, lm.eos_ids) for p, n in zip(prompts, limits)]
    slots, widths = {}, []

    def each(n, events):
        widths.append(len(sched.prefilling) + len(sched.decoding))
        assert len(sched.last.batch) <= 3
        for r in (*sched.prefilling, *sched.decoding):
            slots.setdefault(r.id, n)
    got = _run(sched, each=each)
    assert max(widths) == 3 and [_tokens(got[i]) for i in ids] == alone
    assert [slots[i] for i in ids] == sorted(slots.values()) and slots[ids[3]] > 0  # slots in arrival order


def test_no_starvation_under_a_steady_stream_of_newcomers():
    """max_batch 2, a new request every step: each one still gets a slot in its turn and ends."""
    lm = _lm()
    sched = Scheduler(lm, max_batch=2, chunk=CHUNK)
    prompts = _prompts(30, [4, 12, 7])
    ids, slots, ends = [], {}, {}
    for n in range(2000):
        if len(ids) < 30:
            ids.append(sched.submit(_session(lm, 0), prompts[len(ids)], Sampler(0.0), 6, ()))
        elif sched.idle:
            break
        for e in sched.step():
            if e.kind == "done":
                ends[e.id] = n
        for r in (*sched.prefilling, *sched.decoding):
            slots.setdefault(r.id, n)
    assert set(ends) == set(ids) and len(sched.queued) == 0
    assert [slots[i] for i in ids] == sorted(slots[i] for i in ids)  # nobody overtaken for a slot
    assert max(ends[i] - slots[i] for i in ids) <= 2 + 6  # and once in, at most 2 prefill steps + 6 tokens


def test_a_failing_step_ends_its_rows_with_an_error_and_the_rest_goes_on(monkeypatch):
    lm = _lm()
    sched = Scheduler(lm, max_batch=2, chunk=CHUNK)
    prompts = _prompts(3)
    ids = [sched.submit(_session(lm, 0), p, Sampler(0.0), 5, lm.eos_ids) for p in prompts]
    while len(sched.decoding) < 2:
        sched.step()

    def broken(batch):
        raise RuntimeError("boom")
    monkeypatch.setattr(lm, "step", broken)
    errors = [e for e in sched.step() if e.kind == "error"]
    assert sorted(e.id for e in errors) == ids[:2] and str(errors[0].error) == "boom"
    monkeypatch.undo()
    assert _tokens(_run(sched)[ids[2]]) == _alone(lm, 0, prompts[2], 5)


def test_bad_submissions_are_refused():
    lm = _lm()
    sched = Scheduler(lm)
    s = _session(lm, 0)
    sched.submit(s, [1, 2], Sampler(0.0), 3)
    with pytest.raises(AttnlabError, match="already being served"):
        sched.submit(s, [3], Sampler(0.0), 3)
    with pytest.raises(AttnlabError, match="tokenizer"):
        sched.submit(_session(lm, 0), [3], Sampler(0.0), 3, stops=["x"])
    empty = sched.submit(_session(lm, 0), [], Sampler(0.0), 3)
    assert _run(sched)[empty][-1].kind == "error"  # nothing to continue from


def test_stop_strings_cut_the_reply_and_end_it(smollm2):
    """Text (a tiny random model speaking through SmolLM2's tokenizer): the reply's deltas join to the reply cut
    before the stop; the request ends at the token that completes it, while its neighbours go on."""
    tok = smollm2.tokenizer
    lm = tiny_lm(vocab_size=len(tok))
    lm.tokenizer = tok
    prompts = [tok.encode(p) for p in ("One, two, three, four,", "The capital of France is", "Once upon a time")]

    def run(stops_of_first):
        sched = Scheduler(lm, max_batch=3, chunk=4)
        ids = [sched.submit(Session(lm, lm.new_cache(capacity=64), 4), p, Sampler(0.0), 24, lm.eos_ids,
                            stops_of_first if i == 0 else ()) for i, p in enumerate(prompts)]
        got = _run(sched)
        return [("".join(e.text for e in got[i]), _tokens(got[i]), got[i][-1].reason) for i in ids]
    plain = run(())
    text, tokens, _ = plain[0]
    assert len(tokens) == 24 and len(text) > 40
    stop = text[len(text) // 2:len(text) // 2 + 3]  # three characters from the middle
    cut = run([stop, "never-there"])
    assert cut[0][0] == text[:text.index(stop)] and cut[0][2] == "stop"
    n = len(cut[0][1])
    assert tokens[:n] == cut[0][1] and n < len(tokens)
    said = [tok.decode(tokens[:k], skip_special_tokens=True) for k in (n - 1, n)]
    assert stop not in said[0] and stop in said[1]  # it ended at the token that completed the stop
    assert cut[1:] == plain[1:]


def test_the_model_thread_ends_a_request_before_its_last_events_and_cancels_between_steps():
    """`ModelThread` (the server's): calls and cancels run between steps, in order; a request's end(keep) runs
    before its last events are handed over (keep: the prompt was in), and nothing is handed over after a cancel."""
    import threading
    import time

    from attnlab.serve.worker import ModelThread
    lm = _lm()
    worker = ModelThread(Scheduler(lm, max_batch=4, chunk=CHUNK))
    log, finished = [], threading.Event()

    def deliver(events):
        log.append([(e.kind, e.token) for e in events])
        if events[-1].kind == "done":
            finished.set()

    def request(prompt, n):
        return dict(session=_session(lm, 0), prompt=prompt, sampler=Sampler(0.0), max_tokens=n, stop_ids=())
    try:
        prompt = _prompts(1)[0]
        worker.submit(deliver, lambda keep: log.append(("end", keep)), **request(prompt, 6)).result(30)
        assert finished.wait(30)
        assert log[-2] == ("end", True) and log[-1][-1][0] == "done"
        assert [t for step in log if step[0] != "end" for kind, t in step if kind == "token"] == \
            _alone(lm, 0, prompt, 6, eos=False)
        gate, ends = threading.Event(), []  # hold the thread: submit and cancel then run before any step
        worker.call(gate.wait, 30)
        second = worker.submit(deliver, ends.append, **request(prompt, 6))
        cancelled = worker.cancel(1)  # the id it gets: the scheduler numbers its requests 0, 1, ...
        gate.set()
        assert second.result(30) == 1 and cancelled.result(30) is None and ends == [False]
        log.clear()
        rid = worker.submit(deliver, ends.append, **request(prompt, 10_000)).result(30)
        while len(log) < 3:
            time.sleep(0.01)
        worker.cancel(rid).result(30)
        seen = len(log)
        time.sleep(0.2)
        assert ends == [False, True] and len(log) == seen and worker.scheduler.idle
    finally:
        worker.close()
