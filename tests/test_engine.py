"""The engine against itself: caching, chunking, batching and dtypes must not change the maths."""
from __future__ import annotations

import pytest
import torch

from attnlab.sampling import Sampler
from tests.conftest import tiny_lm


def test_chunked_prefill_and_decode_equal_full_forward(tiny):
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    full = tiny.logits(ids)
    cache = tiny.new_cache(batch=2, capacity=8)  # small on purpose: the cache must grow in place
    parts = [tiny.prefill(ids[:, :25], cache, chunk=7, all_logits=True)]
    parts += [tiny.forward(ids[:, t:t + 1], cache) for t in range(25, 40)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)
    assert len(cache) == 40


def test_cache_positions_equal_original_without_eviction(tiny):
    ids = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(2))
    ref = tiny.logits(ids)
    cache = tiny.new_cache(positions="cache")
    out = tiny.prefill(ids, cache, chunk=9, all_logits=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_bounded_cache_refuses_overflow(tiny):
    from attnlab.kv.cache import CacheFullError
    cache = tiny.new_cache(capacity=4, max_capacity=6)
    tiny.forward(torch.tensor([[1, 2, 3, 4, 5]]), cache)
    with pytest.raises(CacheFullError):
        tiny.forward(torch.tensor([[1, 2]]), cache)


def test_left_padded_batch_matches_each_row_alone(tiny):
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    batched = tiny.generate_ids(prompts, 12, Sampler())
    for prompt, got in zip(prompts, batched):
        alone = tiny.generate_ids([prompt], 12, Sampler())[0]
        assert got == alone


def test_generation_stops_at_eos():
    lm = tiny_lm(seed=3)
    prompt = [5, 6, 7]
    free = lm.generate_ids([prompt], 20, Sampler())[0]
    lm.cfg.eos_token_ids = [free[4]]  # pretend the 5th generated token is EOS
    stopped = lm.generate_ids([prompt], 20, Sampler())[0]
    assert stopped == free[:free.index(free[4]) + 1]


def test_bf16_close_to_fp32():
    lm = tiny_lm()
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(4))
    ref = lm.logits(ids)
    lm.model.to(torch.bfloat16)
    cache = lm.new_cache()
    out = lm.prefill(ids, cache, chunk=8, all_logits=True)
    assert out.dtype == torch.float32 and (out - ref).abs().max() < 0.1 * ref.abs().max()


def test_sampler_greedy_topk_topp_and_seed():
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0, 1.0]])
    assert Sampler()(logits).item() == 1
    draws = {Sampler(temperature=1.0, top_k=2, seed=s)(logits).item() for s in range(40)}
    assert draws == {1, 2}
    # top_p: token 1 alone holds < 0.5 of the mass, tokens 1 and 2 together > 0.5
    draws = {Sampler(temperature=1.0, top_p=0.5, seed=s)(logits).item() for s in range(40)}
    assert draws == {1, 2}
    a = [Sampler(temperature=1.0, seed=7)(logits.repeat(8, 1)).tolist() for _ in range(2)]
    assert a[0] == a[1]
    with pytest.raises(ValueError):
        Sampler(top_p=0.0)
