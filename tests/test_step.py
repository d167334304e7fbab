"""The engine's one step (`LM.step`) on rows of every kind, and `KVCache.truncate`.

A row of k + 1 tokens scored against its cache (speculative verification) gives the logits that feeding them one
at a time gives (to rounding: a chunk's attention is another kernel than a decode step's) and the same greedy
choices; a prompt chunk and decode rows in one step give each row what it gets alone, bit for bit; a cache cut
back with `truncate` continues bit for bit as it did the first time (float16 and int8 caches, Quest's pages, a
policy that evicted before the cut), and refuses a cut it cannot make.
"""
from __future__ import annotations

import pytest
import torch

from attnlab.batch import Batch, Row
from attnlab.errors import AttnlabError
from attnlab.kernels import ops
from attnlab.kv import make_policy
from tests.conftest import tiny_lm

needs_kernels = pytest.mark.skipif(not ops.load(), reason="no C++ kernels (attnlab info says why)")
G = torch.Generator().manual_seed(3)
PROMPT = torch.randint(1, 97, (1, 37), generator=G)
DRAFT = torch.randint(1, 97, (1, 6), generator=G)


def _lm(native: bool, kv=torch.float16, quest=None):
    from attnlab.quant import quantize_model
    lm = tiny_lm(dim=64, hidden_dim=128, head_dim=32)
    lm.kv_dtype = kv
    quantize_model(lm.model, "int4:32")
    if native:
        lm.compile_decode()
    return lm.with_attention(quest) if quest else lm


def _one_at_a_time(lm, cache, ids) -> torch.Tensor:
    return torch.cat([lm.step(Batch.one(ids[:, t:t + 1], cache))[0] for t in range(ids.shape[1])], 1)


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=needs_kernels)], ids=["eager", "native"])
def test_a_row_of_draft_tokens_scores_what_feeding_them_one_by_one_scores(native):
    lm = _lm(native)
    a, b = lm.new_cache(capacity=8), lm.new_cache(capacity=8)
    lm.prefill(PROMPT, a)
    lm.prefill(PROMPT, b)
    together = lm.step(Batch.one(DRAFT, a, "all"))[0]
    alone = _one_at_a_time(lm, b, DRAFT)
    assert together.shape == alone.shape == (1, DRAFT.shape[1], lm.cfg.vocab_size)
    torch.testing.assert_close(together, alone, atol=1e-4, rtol=1e-4)
    assert torch.equal(together.argmax(-1), alone.argmax(-1))
    assert a.seen == b.seen == PROMPT.shape[1] + DRAFT.shape[1]


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=needs_kernels)], ids=["eager", "native"])
def test_a_prompt_chunk_beside_decode_rows_changes_no_rows_bits(native):
    """One step: three conversations' next tokens and a fourth's prompt chunk; each row's logits equal the same
    row's in a step of its own."""
    lm = _lm(native)
    prompts = [torch.randint(1, 97, (1, n), generator=torch.Generator().manual_seed(n)) for n in (9, 20, 14, 30)]

    def start():
        caches = [lm.new_cache(capacity=8) for _ in prompts]
        tokens = [lm.prefill(p, c).argmax(-1) for p, c in zip(prompts[:3], caches)]
        lm.prefill(prompts[3][:, :10], caches[3])
        return caches, tokens
    caches, tokens = start()
    rows = [Row(t[:, None], c) for t, c in zip(tokens, caches)] + [Row(prompts[3][:, 10:], caches[3])]
    together = lm.step(Batch(rows))
    caches, tokens = start()
    alone = [lm.step(Batch.one(t[:, None], c))[0] for t, c in zip(tokens, caches)]
    alone.append(lm.step(Batch.one(prompts[3][:, 10:], caches[3]))[0])
    assert all(torch.equal(x, y) for x, y in zip(together, alone))


def test_rows_want_their_logits_and_refuse_a_cache_twice():
    lm = _lm(False)
    c, d = lm.new_cache(), lm.new_cache()
    out = lm.step(Batch([Row(PROMPT, c, "none"), Row(PROMPT[:, :5], d, "all")]))
    assert out[0] is None and out[1].shape == (1, 5, lm.cfg.vocab_size) and c.seen == 37 and d.seen == 5
    with pytest.raises(AttnlabError, match="distinct caches"):
        Batch([Row(PROMPT, c), Row(PROMPT, c)])
    with pytest.raises(AttnlabError, match="logits"):
        Row(PROMPT, c, "first")
    for bad in (range(3, 38), range(5, 2), range(0, 10, 2)):  # past the row, backwards, strided
        with pytest.raises(AttnlabError, match="range"):
            Row(PROMPT, c, bad, prompt=True)
    with pytest.raises(AttnlabError, match="range"):
        Row(PROMPT, c, range(2, 5))  # a range is a prompt chunk's (a guard scoring it), not sampled tokens'


@pytest.mark.parametrize("policy", [None, "sink"])
def test_a_prompt_row_returns_the_logits_of_a_range_of_its_positions(policy):
    """The head over some positions only (a guard's NLL of the user's tokens): those positions' logits of the whole
    row, also when a bounded cache takes the row in parts."""
    lm = _lm(False)

    def cache():
        return lm.new_cache(capacity=64, policy=make_policy("sink", 24, n_sink=2, chunk=8, block=4) if policy else None)
    whole = lm.step(Batch.one(PROMPT, cache(), "all", prompt=True))[0]
    for want in (range(5, 37), range(30, 33), range(12, 12), range(0, 37)):
        c = cache()
        part = lm.step(Batch.one(PROMPT, c, want, prompt=True))[0]
        assert part.shape == (1, len(want), lm.cfg.vocab_size) and c.seen == 37
        torch.testing.assert_close(part, whole[:, want.start:want.stop], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=needs_kernels)], ids=["eager", "native"])
@pytest.mark.parametrize("kv,quest", [(torch.float16, None), (torch.int8, None), (torch.float16, "quest:16:4"),
                                      (torch.int8, "quest:16:4:0:6")])
def test_a_truncated_cache_continues_bit_for_bit_as_it_did(native, kv, quest):
    lm = _lm(native, kv, quest)
    cache = lm.new_cache(capacity=8)
    lm.prefill(PROMPT, cache)
    first = _one_at_a_time(lm, cache, DRAFT)
    pages = [(layer.page_min.clone(), layer.page_max.clone()) for layer in cache.layers] if quest else None
    cache.truncate(PROMPT.shape[1] + 2)
    assert cache.seen == len(cache) == PROMPT.shape[1] + 2
    again = _one_at_a_time(lm, cache, DRAFT[:, 2:])
    assert torch.equal(again, first[:, 2:])
    if quest:  # the pages' summaries are what they were with the same keys in
        assert all(torch.equal(a, layer.page_min) and torch.equal(b, layer.page_max)
                   for (a, b), layer in zip(pages, cache.layers))


def test_truncate_after_an_eviction_only_back_to_it():
    lm = _lm(False)
    cache = lm.new_cache(capacity=8, policy=make_policy("sink", 24, n_sink=2, chunk=4, block=4))
    lm.prefill(PROMPT, cache)
    kept, n = cache.kept_from, PROMPT.shape[1]
    assert 0 < kept <= n
    first, t = [], 0
    while cache.kept_from == kept:  # decode until the policy evicts again
        first.append(lm.step(Batch.one(DRAFT[:, t:t + 1], cache))[0])
        t += 1
    assert t > 1 and cache.kept_from > n
    with pytest.raises(AttnlabError, match="evicted"):
        cache.truncate(n)
    cache = lm.new_cache(capacity=8, policy=make_policy("sink", 24, n_sink=2, chunk=4, block=4))
    lm.prefill(PROMPT, cache)
    _one_at_a_time(lm, cache, DRAFT[:, :t - 1])
    cache.truncate(n)
    assert torch.equal(_one_at_a_time(lm, cache, DRAFT[:, :t - 1]), torch.cat(first[:t - 1], 1))
    h2o = lm.new_cache(capacity=8, policy=make_policy("h2o", 64, chunk=4, block=4))
    lm.prefill(PROMPT[:, :20], h2o)
    with pytest.raises(AttnlabError, match="scores by attention"):
        h2o.truncate(19)
    with pytest.raises(AttnlabError, match="cannot truncate"):
        h2o.truncate(21)
