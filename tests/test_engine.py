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


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_chunks_after_the_first_take_the_causal_kernel(kv_dtype, monkeypatch):
    """A natural cache hands every chunk "causal" (query i sees slots up to n - T + i), so later chunks run the
    same causal kernel as the first (head dim 64: the C++ one where built); logits equal one full pass."""
    from attnlab.kernels import ops
    lm = tiny_lm(dim=256, n_heads=4, n_kv_heads=2)
    ids = torch.randint(0, 97, (1, 45), generator=torch.Generator().manual_seed(5))
    full = lm.logits(ids)
    seen, real = [], ops.causal_attention
    monkeypatch.setattr(ops, "causal_attention", lambda q, k, v: seen.append((q.shape[2], k.shape[2])) or real(q, k, v))
    lm.kv_dtype = getattr(torch, kv_dtype)
    cache = lm.new_cache()
    out = lm.prefill(ids, cache, chunk=16, all_logits=True)
    assert (16, 32) in seen and (13, 45) in seen  # later chunks: keys past the chunk
    if kv_dtype == "float32":
        torch.testing.assert_close(out, full, atol=2e-4, rtol=2e-4)
    monkeypatch.setattr(ops, "causal_attention", lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
        q, k.float(), v.float(), attn_mask=torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(k.shape[2] - q.shape[2]),
        enable_gqa=True))  # the same pass on torch's attention
    ref = lm.prefill(ids, lm.new_cache(), chunk=16, all_logits=True)
    # this model's attention logits run to the hundreds: AMX's split products (~1e-5 of a score) move its
    # logits by up to ~3e-3; a wrong mask moves them by O(1)
    torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)


_CHUNKS = r"""
import json, sys, torch
from attnlab.batch import Batch, Row
from attnlab.kernels import build, ops
from attnlab.quant import quantize_model
from tests.conftest import tiny_lm
lm = tiny_lm(dim=128, n_heads=4, n_kv_heads=2, head_dim=32)
lm.kv_dtype = torch.float16
quantize_model(lm.model, "int4:32")
for m in lm.model.modules():  # weights not repacked (AVX2) multiply past max_rows by the dequantised matrix, another
    if hasattr(m, "max_rows"):  # arithmetic: the whole prompt stays on the integer kernel here, as the chunks do
        m.max_rows = 64
ids = torch.randint(0, 97, (1, 37), generator=torch.Generator().manual_seed(3))
def fed(size):
    cache = lm.new_cache(capacity=64)
    return torch.cat([lm.step(Batch([Row(ids[:, s:s + size], cache, prompt=True, logits="all")]))[0]
                      for s in range(0, 37, size)], 1)
whole, eights, ones = fed(37), fed(8), fed(1)
real = ops.causal_attention
ops.causal_attention = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
    q, k.float(), v.float(), attn_mask=torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(k.shape[2] - q.shape[2]),
    enable_gqa=True)
ref = fed(37)
print(json.dumps({"isa": build.variant(), "eights": torch.equal(whole, eights), "ones": torch.equal(whole, ones),
                  "off": (whole - ref).abs().max().item(), "scale": ref.abs().max().item()}))
"""


@pytest.mark.parametrize("isa", [None, "avx2"], ids=["this-cpu", "avx2"])
def test_a_prompts_bits_do_not_depend_on_its_chunks(isa):
    """Issue 55's batch invariance at its root: a prompt fed whole, 8 tokens or 1 token at a time gives the same
    logits bit for bit (each query row's attention computed alike whatever chunk it came in: the AVX-512 causal
    kernel, or row by row as a decode step without AVX-512; torch's attention, used before on AVX2, differed by
    0.9 in a logit), and those are torch's attention's to rounding."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    from attnlab.kernels import build, isa as isas
    if not build.load():
        pytest.skip("no C++ kernels")
    if isa is not None and (isa not in isas.supported() or isa not in build.built()):
        pytest.skip(f"no {isa} variant built for this CPU")
    env = {**os.environ, **({"ATTNLAB_ISA": isa} if isa else {})}
    got = subprocess.run([sys.executable, "-c", _CHUNKS], env=env, capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).parent.parent)
    assert got.returncode == 0, got.stderr[-2000:]
    out = json.loads(got.stdout.strip().splitlines()[-1])
    assert isa is None or out["isa"] == isa
    assert out["eights"] and out["ones"], out
    assert out["off"] < 1e-2 * out["scale"], out  # AMX's split bfloat16 products move logits by ~0.5% here


def test_cache_positions_equal_original_without_eviction(tiny):
    ids = torch.randint(0, 97, (1, 30), generator=torch.Generator().manual_seed(2))
    ref = tiny.logits(ids)
    cache = tiny.new_cache(positions="cache")
    out = tiny.prefill(ids, cache, chunk=9, all_logits=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_bounded_cache_refuses_overflow(tiny):
    from attnlab.kv import CacheFullError
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


def test_top_token_is_torch_argmax():
    """The fast greedy pick (numpy on float32) agrees with Tensor.argmax, ties and NaN included, on views too."""
    from attnlab.sampling import top_token
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 49152, generator=g)
    x[1, 7] = x[1, 9000] = 100.0   # a tie: the first
    x[2, 5] = float("nan")          # NaN counts as the largest
    x[3, :] = float("-inf")
    for t in (x, x[:, 1:], x.t().contiguous().t(), x[0], x.half(), x.double()):
        assert torch.equal(top_token(t), t.argmax(-1))
    assert top_token(x).tolist() == x.argmax(-1).tolist() and top_token(x)[1] == 7 and top_token(x)[2] == 5


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
