"""`LM.step` on a decode batch: B conversations advanced by one token each, every one over its own cache.

The must-show of continuous batching: a greedy conversation gives the same tokens alone and inside a
batch of 8 conversations of different lengths, eager and native, under full, sink and h2o policies and
float16 / int8 caches. A batch whose rows are handed the wrong caches fails the same comparison.
"""
import pytest
import torch

from attnlab.batch import Batch
from attnlab.kernels import ops
from attnlab.kv import make_policy
from tests.conftest import tiny_lm

LENGTHS = [5, 17, 9, 30, 3, 22, 12, 26]  # eight prompts of different lengths
STEPS = 24


def _policy(name):
    if name == "sink":
        return make_policy("sink", 24, n_sink=2, chunk=4, block=4)
    if name == "h2o":
        return make_policy("h2o", 24, chunk=4, block=4)
    return None


def step_batch(lm, tokens, caches):
    """One token per cache through the engine's one step -> logits [B, vocab]."""
    return torch.cat([lg[:, -1] for lg in lm.step(Batch.decode(tokens, caches))])


def _lm(native: bool, kv, spec=None):
    lm = tiny_lm(dim=64, hidden_dim=128, head_dim=32)
    lm.kv_dtype = kv
    if spec:
        from attnlab.quant import quantize_model
        quantize_model(lm.model, spec)
    if native:
        lm.compile_decode()
        assert lm.compiled is not None
    return lm


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 97, (1, n), generator=g) for n in LENGTHS]


def _start(lm, prompt, policy):
    cache = lm.new_cache(capacity=8, policy=_policy(policy))
    return cache, lm.prefill(prompt, cache)


def _alone(lm, prompt, policy):
    cache, logits = _start(lm, prompt, policy)
    out = []
    for _ in range(STEPS):
        out.append(int(logits.argmax(-1)))
        logits = lm.forward(torch.tensor([[out[-1]]]), cache, last_only=True)[:, -1]
    return out


def _batched(lm, prompts, policy, order=None):
    """Greedy decoding of every prompt in one batch; order: which cache each row is handed (a mix-up)."""
    started = [_start(lm, p, policy) for p in prompts]
    caches = [c for c, _ in started]
    logits = torch.cat([lg for _, lg in started])
    outs = [[] for _ in prompts]
    for _ in range(STEPS):
        tokens = logits.argmax(-1)
        for b, t in enumerate(tokens.tolist()):
            outs[b].append(t)
        rows = caches if order is None else [caches[i] for i in order]
        logits = step_batch(lm, tokens, rows)
    return outs


needs_kernels = pytest.mark.skipif(not ops.load(), reason="no C++ kernels (attnlab info says why)")


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=needs_kernels)], ids=["eager", "native"])
@pytest.mark.parametrize("policy", [None, "sink", "h2o"])
@pytest.mark.parametrize("kv", [torch.float16, torch.int8], ids=["f16", "int8"])
def test_a_conversation_decodes_the_same_alone_and_in_a_batch_of_8(native, policy, kv):
    lm = _lm(native, kv, "int4:32")
    prompts = _prompts()
    alone = [_alone(lm, p, policy) for p in prompts]
    assert len({tuple(a) for a in alone}) == len(prompts)  # the rows are told apart
    assert _batched(lm, prompts, policy) == alone
    if native and policy != "h2o":  # h2o scores by attention: its rows take the eager pass
        assert lm.compiled.calls["native"] > 0


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=needs_kernels)], ids=["eager", "native"])
def test_a_mixed_up_batch_index_fails_the_comparison(native):
    lm = _lm(native, torch.float16, "int4:32")
    prompts = _prompts()
    alone = [_alone(lm, p, None) for p in prompts]
    swapped = _batched(lm, prompts, None, order=[1, 0, 2, 3, 4, 5, 6, 7])
    assert swapped[0] != alone[0] and swapped[1] != alone[1] and swapped[2:] == alone[2:]


def test_float_weights_agree_to_rounding_in_a_batch():
    """Float matmuls sum in another order for 8 rows than for one: logits agree to rounding, not bits."""
    lm = _lm(False, None)
    prompts = _prompts()
    started = [_start(lm, p, None) for p in prompts]
    tokens = torch.cat([lg for _, lg in started]).argmax(-1)
    alone = torch.cat([lm.forward(tokens[b].view(1, 1), c, last_only=True)[:, -1]
                       for b, (c, _) in enumerate(started)])
    got = step_batch(lm, tokens, [_start(lm, p, None)[0] for p in prompts])
    assert ((got - alone).norm() / alone.norm()) < 1e-5


def test_a_decode_batch_refuses_what_it_cannot_run():
    from attnlab.errors import AttnlabError
    lm = _lm(False, None)
    caches = [lm.new_cache() for _ in range(2)]
    with pytest.raises(AttnlabError, match="one token per cache"):
        step_batch(lm, torch.tensor([1, 2, 3]), caches)
    with pytest.raises(AttnlabError, match="distinct caches"):
        step_batch(lm, torch.tensor([1, 2]), [caches[0], caches[0]])
    with pytest.raises(AttnlabError, match="distinct caches"):
        step_batch(lm, torch.tensor([1]), [lm.new_cache(batch=2)])


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=needs_kernels)], ids=["eager", "native"])
def test_each_conversation_keeps_its_own_cache_dtype_policy_and_window(native):
    """One batch mixing float32, float16 and int8 caches, full and sink policies, under a sliding window (Mistral):
    every row decodes what it decodes alone."""
    lm = tiny_lm(dim=64, hidden_dim=128, head_dim=32, sliding_window=16)
    if native:
        lm.compile_decode()
    kinds = [(torch.float32, None), (torch.float16, "sink"), (torch.int8, None), (torch.float16, None)]
    prompts = _prompts()[:4]

    def start(b):
        lm.kv_dtype = kinds[b][0]
        return _start(lm, prompts[b], kinds[b][1])

    alone = []
    for b in range(4):
        cache, logits = start(b)
        out = []
        for _ in range(STEPS):
            out.append(int(logits.argmax(-1)))
            logits = lm.forward(torch.tensor([[out[-1]]]), cache, last_only=True)[:, -1]
        alone.append(out)
    started = [start(b) for b in range(4)]
    caches, logits = [c for c, _ in started], torch.cat([lg for _, lg in started])
    got = [[] for _ in range(4)]
    for _ in range(STEPS):
        tokens = logits.argmax(-1)
        for b, t in enumerate(tokens.tolist()):
            got[b].append(t)
        logits = step_batch(lm, tokens, caches)
    assert got == alone
    assert {c.layers[0].k.dtype for c in caches} == {torch.float32, torch.float16, torch.int8}


@needs_kernels
@pytest.mark.parametrize("threads", [2, 3])
def test_a_team_of_threads_decodes_the_batch_as_one_thread_does(threads):
    """Each row's cache cut into one stretch per thread, merged by log-sum-exp, and each linear's rows per thread."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        lm = _lm(True, torch.int8, "int4:32")
        prompts = _prompts()
        alone = [_alone(lm, p, "sink") for p in prompts]
        assert _batched(lm, prompts, "sink") == alone
        assert lm.compiled.threads == threads and lm.compiled.calls["eager"] == 0
    finally:
        torch.set_num_threads(before)
