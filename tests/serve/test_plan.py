"""The scheduler's plan as data, round robin over keys, and batch invariance through it on SmolLM2.

Batch invariance: a conversation's logits are the same bits alone, in a batch of 8, and with its prompt prefilled
whole or in 8-token chunks between the other rows' decode steps (SmolLM2 as `attnlab.load()` gives it, its file's
int4 weights, eager and native). A prompt's tokens always take the chunk's kernels (even a last chunk of one
token), sampled tokens the decode step's, and the kernels compute a row alike whatever rows share the call: where
the weights are repacked into 16-row blocks and prompt attention is the C++ kernel (AVX-512 VNNI, AMX). On other
CPUs the dequantised float matmul past 256 rows and torch's attention for a prompt's chunk depend on the chunk's
shape, so there the test is skipped.
"""
from __future__ import annotations

import copy

import pytest
import torch

from attnlab.kernels import build
from attnlab.sampling import Sampler
from attnlab.serve.scheduler import Plan, Scheduler
from attnlab.session import Session
from tests.serve.test_scheduler import _lm, _prompts, _session, _tokens

NEW = 8


def test_schedule_returns_the_step_as_data_and_runs_nothing():
    lm = _lm()
    sched = Scheduler(lm, max_batch=4, chunk=8)
    sessions = [_session(lm, 0) for _ in range(3)]
    ids = [sched.submit(s, p, Sampler(0.0), 4, ()) for s, p in zip(sessions, _prompts(3, [6, 6, 20]))]
    plan = sched.schedule()
    assert isinstance(plan, Plan) and plan.decode == [] and plan.chunks == [(ids[0], 0, 6)]
    assert all(s.cache.seen == 0 for s in sessions)  # deciding fed nothing
    sched.runner.run(plan)
    plan = sched.schedule()
    assert plan.decode == [ids[0]] and plan.chunks == [(ids[1], 0, 6)]


def test_slots_go_round_robin_over_keys():
    """Key a sends 4 requests before b and c send one each: with 3 slots, a, b and c get one each first."""
    lm = _lm()
    sched = Scheduler(lm, max_batch=3, chunk=8)
    keys = ["a", "a", "a", "a", "b", "c"]
    ids = [sched.submit(_session(lm, 0), p, Sampler(0.0), 3, (), key=k) for p, k in zip(_prompts(6), keys)]
    sched.schedule()
    assert sorted(r.key for r in sched.prefilling) == ["a", "b", "c"]
    assert [r.id for r in sched.queued] == ids[1:4]
    capped = Scheduler(lm, max_batch=3, chunk=8)  # a cap per key: a holds at most one slot
    for p, k in zip(_prompts(6), keys):
        capped.submit(_session(lm, 0), p, Sampler(0.0), 3, (), key=k)
    capped.schedule(caps={"a": 1})
    assert sorted(r.key for r in capped.prefilling) == ["a", "b", "c"]
    got = {}
    while not sched.idle:
        for e in sched.step():
            got.setdefault(e.id, []).append(e)
    assert all(len(_tokens(got[i])) == 3 for i in ids)


@pytest.fixture(scope="module")
def smollm2_native():
    import attnlab
    return attnlab.load()


@pytest.fixture(scope="module")
def qwen_native():
    import attnlab
    from attnlab.model.files import resolve
    try:
        resolve("qwen2.5-coder-0.5b")
    except Exception as e:  # noqa: BLE001 - not fetched here
        pytest.skip(f"the Qwen2.5-Coder-0.5B file is not fetched ({e})")
    return attnlab.load("qwen2.5-coder-0.5b")


def _logits_of(lm, run) -> dict:
    """Per cache, the logits each step returned for it (a chunk's last row, a decode row), during run()."""
    seen: dict = {}
    real = lm.step

    def step(batch):
        out = real(batch)
        for row, logits in zip(batch.rows, out):
            seen.setdefault(id(row.cache), []).append(logits[0, -1].clone())
        return out
    lm.step = step
    try:
        run()
    finally:
        del lm.step
    return seen


def _serve(lm, prompts, chunk, order, stagger=0) -> dict[int, torch.Tensor]:
    """Serve prompts[i] for i in order (stagger: decode steps between arrivals); each one's last NEW logits."""
    sched = Scheduler(lm, max_batch=8, chunk=chunk)
    sessions = {i: Session(lm, lm.new_cache(capacity=512), 512) for i in order}

    def run():
        for i in order:
            sched.submit(sessions[i], prompts[i], Sampler(0.0), NEW, ())
            for _ in range(stagger):
                sched.step()
        while not sched.idle:
            sched.step()
    seen = _logits_of(lm, run)
    return {i: torch.stack(seen[id(s.cache)][-NEW:]) for i, s in sessions.items()}


INVARIANT = pytest.mark.skipif(not (build.repacks() and build.wide()), reason="bit-level batch invariance needs "
                               "weights repacked into 16-row blocks and the C++ prompt attention (AVX-512 VNNI or AMX)")


@INVARIANT
@pytest.mark.parametrize("native", [True, False], ids=["native", "eager"])
def test_a_conversation_gets_the_same_bits_alone_in_a_batch_of_8_and_chunked(smollm2_native, native):
    _invariant(smollm2_native, native)


@INVARIANT
@pytest.mark.real
@pytest.mark.parametrize("native", [True, False], ids=["native", "eager"])
def test_qwen_q4_k_m_gets_the_same_bits_alone_in_a_batch_of_8_and_chunked(qwen_native, native):
    """The real checkpoint's mix (Q4_K and Q6_K superblocks, layers of parts, an untied head)."""
    _invariant(qwen_native, native)


def _invariant(lm, native: bool) -> None:
    if not native:
        lm = copy.copy(lm)
        lm.compiled = None
    assert lm.quant is not None and (lm.compiled is not None) == native
    text = lm.encode("The history of the world is long, and full of stories of kings, farmers and sailors. " * 12)
    prompts = [text[3 * i:3 * i + n] for i, n in enumerate((17, 41, 9, 100, 33, 64, 25, 130))]  # some 8k + 1 long
    alone = {i: _serve(lm, prompts, 256, [i])[i] for i in (0, 2, 3, 7)}
    together = _serve(lm, prompts, 256, list(range(8)))
    chunked = _serve(lm, prompts, 8, list(range(1, 8)) + [0], stagger=2)  # 8-token chunks beside decoding rows
    for i, want in alone.items():
        assert torch.equal(together[i], want), i
        assert torch.equal(chunked[i], want), i
    assert len({tuple(a.argmax(-1).tolist()) for a in alone.values()}) > 1  # the conversations differ
