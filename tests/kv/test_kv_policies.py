"""Eviction policies on tiny random models: exact agreement with brute-force references, invariants."""
import pytest
import torch

from attnlab.engine import LM
from attnlab.kv import H2O, Full, make_policy, parse_budget
from attnlab.model.llama import ModelConfig, Transformer
from tests.kv.kv_reference import NEVER, cache_reference, original_reference, run

EVICTING = ["window", "sink", "h2o", "sink_h2o", "tova", "snapkv"]
BUDGET, CHUNK = 12, 8
STEPS = [8, 8] + [1] * 24  # chunked prefill with eviction between chunks, then token by token


@pytest.fixture(scope="module")
def lm():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64, context_length=128)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # sharper attention than the default init, so scores differ between slots
        model.layers[0].attn.wqkv.weight.mul_(3)
        model.layers[1].attn.wqkv.weight.mul_(3)
    return LM(model)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 64, (2, sum(STEPS)), generator=torch.Generator().manual_seed(1))


def policy(name, positions, budget=BUDGET, **kw):
    return make_policy(name, budget, positions=positions, n_sink=2, chunk=CHUNK, **kw)


def test_full_equals_plain_engine(lm, ids):
    ref = lm.logits(ids)
    for steps in (STEPS, [ids.shape[1]]):
        logits, evicted, sizes, _ = run(lm, ids, Full(), steps)
        torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-4)
        assert (evicted == NEVER).all() and sizes[-1] == ids.shape[1]


@pytest.mark.parametrize("name", EVICTING)
def test_original_positions_equal_masked_full_attention(lm, ids, name):
    logits, evicted, sizes, _ = run(lm, ids, policy(name, "original"), STEPS)
    assert (evicted < NEVER).any()  # the test is vacuous unless something was evicted
    torch.testing.assert_close(logits, original_reference(lm, ids, evicted, STEPS), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", EVICTING)
def test_cache_positions_equal_rerotated_reference(lm, ids, name):
    logits, evicted, sizes, _ = run(lm, ids, policy(name, "cache"), STEPS)
    torch.testing.assert_close(logits, cache_reference(lm, ids, evicted, STEPS), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", EVICTING)
@pytest.mark.parametrize("positions", ["cache", "original"])
def test_cache_never_exceeds_budget_and_keeps_sinks_and_recent(lm, ids, name, positions):
    p = policy(name, positions)
    _, evicted, sizes, cache = run(lm, ids, p, STEPS)
    assert max(sizes) <= BUDGET and sizes[-1] == BUDGET
    assert all(layer.capacity == BUDGET + CHUNK for layer in cache.layers)  # memory allocated = budget + chunk
    assert len({layer.n for layer in cache.layers}) == 1
    end = torch.tensor([sum(STEPS[:i + 1]) - 1 for i in range(len(STEPS))])
    for e in end.tolist():  # after every step: sinks and the recent window are still there
        alive = evicted[..., :e + 1] > e
        assert alive[..., :p.n_sink(BUDGET)].all()
        assert alive[..., e + 1 - p.n_recent(BUDGET):].all()


def test_sink_and_window_keep_exactly_what_they_promise(lm, ids):
    for name, expect in (("window", list(range(28, 40))), ("sink", [0, 1] + list(range(30, 40)))):
        _, _, _, cache = run(lm, ids, policy(name, "cache"), STEPS)
        for layer in cache.layers:
            assert (layer.pos[:, :, layer.first:layer.n] == torch.tensor(expect)).all()


class RecordingH2O(H2O):
    """H2O that checks, at every eviction, that the kept heavy hitters outscore every evicted token."""

    def to_keep(self, kv):
        n, budget = kv.n, self.tokens
        score, pos = self.score(kv).clone(), kv.pos[:, :, :n].clone()
        idx = super().to_keep(kv)
        kept = torch.zeros_like(pos, dtype=torch.bool).scatter_(2, idx, True)
        free = pos < pos.max(-1, keepdim=True).values - self.n_recent(budget) + 1  # not in the recent window
        lo = score.masked_fill(~(kept & free), float("inf")).min(-1).values
        hi = score.masked_fill(~(~kept & free), float("-inf")).max(-1).values
        assert (lo >= hi).all()
        self.evictions = getattr(self, "evictions", 0) + 1
        return idx


def test_h2o_keeps_the_highest_accumulated_scores(lm, ids):
    p = RecordingH2O(budget=BUDGET, positions="original", chunk=CHUNK)
    run(lm, ids, p, STEPS)
    assert p.evictions > 0


def test_h2o_accumulates_attention_mass(lm, ids):
    _, _, _, cache = run(lm, ids[:, :10], policy("h2o", "original"), [1] * 10)  # no eviction yet: budget 12
    acc = cache.layers[0].policy_state["acc"]
    # every query spreads mass 1 over the slots (averaged over its group), so the total is the query count
    torch.testing.assert_close(acc.sum(-1), torch.full(acc.shape[:2], 10.0))


def test_batch_rows_keep_their_own_tokens(lm, ids):
    for name in ("h2o", "sink_h2o", "tova"):
        both, _, _, _ = run(lm, ids, policy(name, "cache"), STEPS)
        for b in range(2):
            alone, _, _, _ = run(lm, ids[b:b + 1], policy(name, "cache"), STEPS)
            torch.testing.assert_close(both[b:b + 1], alone, atol=1e-5, rtol=1e-4)


def test_chunked_prefill_of_a_long_prompt_stays_bounded(lm):
    ids = torch.randint(0, 64, (1, 300), generator=torch.Generator().manual_seed(2))
    cache = lm.new_cache(policy=policy("sink_h2o", "cache"))
    before = cache.nbytes()
    lm.prefill(ids, cache, chunk=CHUNK)
    assert len(cache) == BUDGET and cache.nbytes() == before
    assert cache.seen == 300


def test_generation_with_a_policy_streams_past_the_budget(lm):
    from attnlab.sampling import Sampler
    out = lm.generate_ids([[1, 2, 3], [4, 5, 6, 7, 8]], 40, Sampler(), policy("sink", "cache"))
    assert [len(o) for o in out] == [40, 40]


def test_fraction_budgets_resolve_against_a_length():
    p = make_policy("h2o", "20%")
    assert p.budget == 0.2 and p.resolve(1000).tokens == 200
    with pytest.raises(ValueError, match="resolve"):
        p.capacity
    assert parse_budget("0.05") == 0.05 and parse_budget("256") == 256


@pytest.mark.parametrize("args, message", [
    (("sink", 4), "must exceed n_sink"),
    (("sink_h2o", 5), "must exceed n_sink"),
    (("h2o", "1.5"), r"\(0, 1\]"),
    (("h2o", "0%"), r"\(0, 1\]"),
    (("h2o", "0"), ">= 1"),
    (("lru", 64), "unknown policy"),
    (("sink", "many"), "token count"),
])
def test_bad_options_raise_one_line_errors(args, message):
    with pytest.raises(ValueError, match=message):
        make_policy(*args)


def test_unknown_positions_rejected():
    with pytest.raises(ValueError, match="positions"):
        make_policy("sink", 64, positions="absolute")


@pytest.mark.parametrize("name", ["window", "sink", "h2o", "sink_h2o"])
@pytest.mark.parametrize("positions", ["original", "cache"])
def test_block_eviction_equals_masked_reference(lm, ids, name, positions):
    """Evicting every 5 tokens: the same brute-force references hold, and the cache breathes
    between budget and budget + block - 1 instead of staying at budget."""
    p = policy(name, positions, block=5)
    logits, evicted, sizes, cache = run(lm, ids, p, STEPS)
    reference = original_reference if positions == "original" else cache_reference
    torch.testing.assert_close(logits, reference(lm, ids, evicted, STEPS), atol=1e-5, rtol=1e-4)
    decode = sizes[2:]
    assert max(decode) == BUDGET + 4 and min(decode) == BUDGET  # evicted in blocks, not every step
    assert cache.layers[0].capacity == BUDGET + 4 + CHUNK
    per_token, *_ = run(lm, ids, policy(name, positions), STEPS)
    assert not torch.allclose(per_token, logits)  # block eviction keeps more: a different model of the stream


def test_cache_positions_rerotation_keeps_yarn_magnitude(ids):
    """YaRN's tables carry its attention factor; moving a key on eviction must only rotate it."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64, context_length=128,
                      rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
    yarn = LM(Transformer(cfg).eval())
    assert yarn.model.rope.attention_factor > 1
    logits, evicted, _, _ = run(yarn, ids, policy("sink", "cache", block=3), STEPS)
    torch.testing.assert_close(logits, cache_reference(yarn, ids, evicted, STEPS), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("positions", ["cache", "original"])
def test_per_token_eviction_leaves_the_window_in_place(lm, ids, positions):
    """sink evicting one token per step moves only its sinks up a slot (`LayerKV.slide`): the window's keys and
    values stay in their slots, untouched, until the cache needs the room of the slots left behind and compacts
    them in one go (`KVCache.begin`); the logits are the reference's throughout (the tests above)."""
    cache = lm.new_cache(2, policy=policy("sink", positions))
    lm.prefill(ids[:, :16], cache, chunk=CHUNK)
    slid = compacted = 0
    for t in range(16, ids.shape[1]):
        before = [(layer.first, layer.n, layer.k.clone(), layer.v.clone()) for layer in cache.layers]
        lm.forward(ids[:, t:t + 1], cache)
        assert len(cache) == BUDGET
        for (first, n, k, v), layer in zip(before, cache.layers):
            if layer.first == first + 1:  # slid: the window [first + 2 + 1, n) did not move
                slid += 1
                window = slice(first + 3, n)
                assert torch.equal(layer.k[:, :, window], k[:, :, window])
                assert torch.equal(layer.v[:, :, window], v[:, :, window])
                assert (layer.pos[:, :, first] == -1).all()  # the sink's old slot is not read any more
            else:
                compacted += 1
                assert layer.first == 1 and layer.n == BUDGET + 1  # compacted to BUDGET slots, one written, one slid
    assert slid and compacted
