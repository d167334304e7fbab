"""Quest's page selection in the native decode step (step.cpp + quest.cpp) against the eager reference.

Tiny random models, float32 / float16 / int8 caches, several budgets and pages, dense first layers, a team of
threads, a cache that evicts, and B conversations in one `LM.step` call each with its own pages: the native
logits equal eager's (float weights: relative 2e-5), a budget covering the context equals full attention bit for
bit, the page summaries the step keeps equal summaries recomputed from the cache, and a mutated bound (page
minima and maxima swapped: a lower bound ranks the pages) fails the same comparison."""
from __future__ import annotations

import pytest
import torch

from attnlab.batch import Batch
from attnlab.kernels import ops
from attnlab.kv import make_policy
from attnlab.model import native
from tests.conftest import tiny_lm
from tests.kv.test_quest import assert_summaries_fresh, decode_all

pytestmark = pytest.mark.skipif(not ops.load(), reason="no C++ kernels (attnlab info says why)")

IDS = torch.randint(1, 97, (1, 72), generator=torch.Generator().manual_seed(0))
PREFILL = 12


def _pair(kv, n_layers=3):
    """Two identical tiny LMs (eager, native), head size 32 (an int8 cache needs it), a `kv` cache."""
    pair = tiny_lm(seed=1, head_dim=32, n_layers=n_layers), tiny_lm(seed=1, head_dim=32, n_layers=n_layers)
    for lm in pair:
        lm.kv_dtype = kv
    pair[1].compile_decode()
    assert pair[1].compiled is not None
    return pair


def _rel(got, ref):
    return float((got - ref).norm() / ref.norm())


def _close(got, ref, kv):
    """Eager's logits to float noise. A float16 or int8 cache rounds each stored key and value: a 1e-7
    difference of the step's own RoPE loop flips an occasional float16 ulp or int8 code, and the flipped key
    stays (on these sharp models: one int8 code flipped at slot 43 moves full attention's logits by 2e-4,
    measured; quest at most 6.5e-4 over 24 steps). Pages chosen wrongly move them by several 1e-2."""
    assert _rel(got, ref) < (2e-5 if kv == torch.float32 else 2e-3)


def _sink():  # evicts in blocks, keys re-rotated at their new slots: summaries rebuilt between native steps
    return make_policy("sink", 40, positions="cache", n_sink=4, chunk=8, block=8)


KVS = [torch.float32, torch.float16, torch.int8]


@pytest.mark.parametrize("kv", KVS, ids=["f32", "f16", "int8"])
@pytest.mark.parametrize("spec", ["quest:16:4", "quest:24:8", "quest:32:4:1", "quest:16:4:0:5", "quest:24:8:1:32"])
def test_native_quest_equals_eager(kv, spec):
    eager, fast = _pair(kv)
    ref, _ = decode_all(eager.with_attention(spec), IDS, PREFILL)
    got, _ = decode_all(fast.with_attention(spec), IDS, PREFILL)
    assert fast.compiled.calls == {"native": IDS.shape[1] - PREFILL, "eager": 0}
    _close(got, ref, kv)
    full, _ = decode_all(fast, IDS, PREFILL)
    assert (got - full).abs().max() > 1e-2  # the selection changed the output


@pytest.mark.parametrize("kv", KVS, ids=["f32", "f16", "int8"])
@pytest.mark.parametrize("spec", ["quest:592:16", "quest:64:16", "quest:64:16:0:8"])
def test_a_long_cache(kv, spec):
    """600 keys: all pages but one or two chosen (runs of adjacent pages longer than 256 rows, read with a dense
    pass's prefetching, attend.cpp's `runs`, beside short ones), or 4 of 38 pages by the bound or by 8 channels
    (the ranking over many pages; the channel scores' 128-key passes on AVX-512), as eager reads them."""
    eager, fast = _pair(kv, n_layers=2)
    ids = torch.randint(1, 97, (1, 620), generator=torch.Generator().manual_seed(3))
    ref, _ = decode_all(eager.with_attention(spec), ids, 600)
    got, _ = decode_all(fast.with_attention(spec), ids, 600)
    assert fast.compiled.calls["eager"] == 0
    _close(got[:, 600:], ref[:, 600:], kv)


@pytest.mark.parametrize("fill", [0.0, float("nan")], ids=["zero", "nan"])
def test_tied_bounds_read_the_lowest_pages(fill):
    """Every middle page's summaries set to `fill` (bounds all zero, or all NaN, which ranks as -inf):
    the step reads the lowest of them, bit for bit as when those pages' bounds are made strictly highest."""
    _, fast = _pair(torch.float16, n_layers=2)
    view = fast.with_attention("quest:24:4")  # 6 pages of 4: the first, 4 chosen, the one the step opens

    def step(lowest_highest: bool):
        cache = view.new_cache(capacity=80)
        view.prefill(IDS[:, :60], cache)
        for layer in cache.layers:  # pages 1 .. 14; the step's slot 60 opens page 15
            layer.pages_lo[:, :, 1:15] = fill
            layer.pages_hi[:, :, 1:15] = fill
            if lowest_highest:
                layer.pages_lo[:, :, 1:5], layer.pages_hi[:, :, 1:5] = -1e4, 1e4
        return view.forward(IDS[:, 60:61], cache)

    tied = step(False)
    assert fast.compiled.calls["eager"] == 0
    assert torch.equal(tied, step(True))


@pytest.mark.parametrize("kv", KVS, ids=["f32", "f16", "int8"])
def test_native_quest_inside_an_eviction_policy(kv):
    eager, fast = _pair(kv)
    for spec in ("quest:16:4", "quest:16:4:0:6"):
        ref, _ = decode_all(eager.with_attention(spec), IDS, PREFILL, _sink())
        got, cache = decode_all(fast.with_attention(spec), IDS, PREFILL, _sink())
        assert len(cache) < IDS.shape[1] and fast.compiled.calls["eager"] == 0
        _close(got, ref, kv)


def test_a_budget_covering_the_context_is_full_attention_bit_for_bit():
    for kv in KVS:
        _, fast = _pair(kv)
        full, _ = decode_all(fast, IDS, PREFILL)
        got, _ = decode_all(fast.with_attention("quest:72:4"), IDS, PREFILL)
        assert torch.equal(got, full)


@pytest.mark.parametrize("kv", KVS, ids=["f32", "f16", "int8"])
def test_the_step_keeps_the_page_summaries(kv):
    """After native steps (and compactions between them) the summaries equal those recomputed from the keys."""
    _, fast = _pair(kv)
    for policy in (None, _sink()):
        for spec in ("quest:16:4", "quest:16:4:0:6"):
            _, cache = decode_all(fast.with_attention(spec), IDS, PREFILL, policy)
            assert_summaries_fresh(cache, 4)
            assert (cache.layers[0].keys_t is not None) == spec.endswith(":6")


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("kv", [torch.float16, torch.int8], ids=["f16", "int8"])
def test_a_team_of_threads_selects_as_eager(n, kv):
    """Threads share the bounds (pages cut in stretches) and the chosen pages (merged by log-sum-exp)."""
    if not torch.classes.attnlab.DecodeStep.openmp():
        pytest.skip("kernels built without OpenMP: the step runs on one thread")
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        eager, fast = _pair(kv)
        for spec in ("quest:16:4", "quest:24:8:1", "quest:24:8:0:7"):
            ref, _ = decode_all(eager.with_attention(spec), IDS, PREFILL)
            got, _ = decode_all(fast.with_attention(spec), IDS, PREFILL)
            _close(got, ref, kv)
        assert fast.compiled.threads == n and fast.compiled.calls["eager"] == 0
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kv", [torch.float16, torch.int8], ids=["f16", "int8"])
@pytest.mark.parametrize("spec", ["quest:16:4", "quest:16:4:0:6"])
def test_conversations_in_one_batch_each_select_their_pages(kv, spec):
    """Four conversations of different lengths (one still inside its budget) in one `LM.step` call per token,
    against each decoded alone by eager: the same greedy tokens and logits."""
    eager, fast = _pair(kv)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 97, (1, n), generator=g) for n in (20, 41, 9, 33)]
    steps = 24

    def alone(lm, prompt):
        view, cache = lm.with_attention(spec), None
        cache = view.new_cache(capacity=8)
        logits, out = view.prefill(prompt, cache), []
        for _ in range(steps):
            out.append(logits)
            logits = view.forward(logits.argmax(-1, keepdim=True), cache, last_only=True)[:, -1]
        return torch.cat(out)

    view = fast.with_attention(spec)
    caches = [view.new_cache(capacity=8) for _ in prompts]
    logits = torch.cat([view.prefill(p, c) for p, c in zip(prompts, caches)])
    got = []
    for _ in range(steps):
        got.append(logits)
        logits = torch.cat([lg[:, -1] for lg in view.step(Batch.decode(logits.argmax(-1), caches))])
    got = torch.stack(got, 1)  # [B, steps, V]
    assert fast.compiled.calls == {"native": steps, "eager": 0}
    for b, prompt in enumerate(prompts):
        ref = alone(eager, prompt)
        assert torch.equal(got[b].argmax(-1), ref.argmax(-1))
        _close(got[b], ref, kv)


def test_a_mutated_bound_fails_the_comparison(monkeypatch):
    """Page minima and maxima swapped when bound (q.k's lower bound ranks the pages): far from eager."""
    bind = native.NativeStep._bind

    def swapped(self, row, kvs):
        bind(self, row, kvs)
        self.step.bind_pages(row, kvs[0].page, [layer.pages_hi for layer in kvs], [layer.pages_lo for layer in kvs], [], [])

    eager, fast = _pair(torch.float16)
    ref, _ = decode_all(eager.with_attention("quest:16:4"), IDS, PREFILL)
    monkeypatch.setattr(native.NativeStep, "_bind", swapped)
    got, _ = decode_all(fast.with_attention("quest:16:4"), IDS, PREFILL)
    assert fast.compiled.calls["native"] > 0
    print(f"mutated bound: relative {_rel(got, ref):.3g}")
    with pytest.raises(AssertionError):
        _close(got, ref, torch.float16)


def test_mutated_channel_keys_fail_the_comparison(monkeypatch):
    """Quest's CHANNELS scoring keys read from another slot's place (keys_t bound with its slots reversed): far
    from eager, so the comparison above sees which keys the step scores."""
    bind = native.NativeStep._bind

    def reversed_slots(self, row, kvs):
        bind(self, row, kvs)
        self.junk = ([layer.keys_t.flip(-1).contiguous() for layer in kvs],
                     [layer.keys_s.flip(-1).contiguous() for layer in kvs])
        self.step.bind_pages(row, kvs[0].page, [layer.pages_lo for layer in kvs], [layer.pages_hi for layer in kvs],
                             *self.junk)

    eager, fast = _pair(torch.float16)
    spec = "quest:16:4:0:6"
    ref, _ = decode_all(eager.with_attention(spec), IDS, PREFILL)
    monkeypatch.setattr(native.NativeStep, "_bind", reversed_slots)
    got, _ = decode_all(fast.with_attention(spec), IDS, PREFILL)
    assert fast.compiled.calls["native"] > 0
    print(f"mutated channel keys: relative {_rel(got, ref):.3g}")
    with pytest.raises(AssertionError):
        _close(got, ref, torch.float16)
