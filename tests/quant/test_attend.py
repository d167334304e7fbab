"""The fused single-query attention kernel (attnlab/quant/attend.cpp) against torch's SDPA."""
import math

import pytest
import torch
import torch.nn.functional as F

from attnlab.kv import make_policy
from attnlab.quant import kernels
from tests.conftest import tiny_lm

pytestmark = pytest.mark.skipif(not kernels.available(), reason="fused kernels not built (no compiler or AVX2)")


def reference(q, k, v):
    return F.scaled_dot_product_attention(q, k.float(), v.float(), enable_gqa=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("Hq,Hkv,D,n", [(9, 3, 64, 1), (9, 3, 64, 37), (32, 8, 128, 300), (4, 4, 64, 5),
                                        (14, 2, 64, 129), (7, 1, 72, 17), (8, 2, 40, 1000)])
def test_decode_attention_equals_sdpa(dtype, Hq, Hkv, D, n):
    """Every grouping (1 to 7 query heads per KV head, in threes and a remainder), head sizes that are
    not multiples of 32, lengths with and without a tail of 4 or 8, and strided cache slices."""
    g = torch.Generator().manual_seed(n)
    q = torch.randn(2, Hq, 1, D, generator=g) * 2
    k = (torch.randn(2, Hkv, n + 9, D, generator=g) * 2).to(dtype)[:, :, :n]  # a slice of a larger buffer
    v = torch.randn(2, Hkv, n + 9, D, generator=g).to(dtype)[:, :, :n]
    out = torch.ops.attnlab.decode_attention(q, k, v, 1 / math.sqrt(D))
    torch.testing.assert_close(out, reference(q, k, v), atol=2e-6, rtol=1e-5)


def test_decode_attention_keeps_peaked_and_flat_softmax():
    """Scores far apart (one key dominates; the others underflow to 0) and all equal (a plain mean)."""
    q = torch.zeros(1, 2, 1, 8)
    q[0, 0, 0, 0] = 400.0
    k = torch.zeros(1, 1, 50, 8)
    k[0, 0, 17, 0] = 1.0
    v = torch.randn(1, 1, 50, 8)
    out = torch.ops.attnlab.decode_attention(q, k, v, 1.0)
    torch.testing.assert_close(out[0, 0, 0], v[0, 0, 17])
    torch.testing.assert_close(out[0, 1, 0], v[0, 0].mean(0))


@pytest.mark.parametrize("bad", ["bf16", "two-queries", "heads", "inner-stride"])
def test_decode_attention_rejects_bad_input(bad):
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 5, 16)
    v = k.clone()
    if bad == "bf16":
        k, v = k.bfloat16(), v.bfloat16()
    elif bad == "two-queries":
        q = torch.randn(1, 4, 2, 16)
    elif bad == "heads":
        q = torch.randn(1, 3, 1, 16)
    else:
        k = torch.randn(1, 2, 5, 32)[..., ::2]
    with pytest.raises(RuntimeError):
        torch.ops.attnlab.decode_attention(q, k, v, 0.25)


def _decode(lm, ids, fused, kv_dtype=None):
    ok = kernels._STATE["ok"]
    kernels._STATE["ok"] = fused
    try:
        lm.kv_dtype = kv_dtype
        cache = lm.new_cache(policy=make_policy("sink", 12, positions="cache", n_sink=2, chunk=8, block=4))
        lm.prefill(ids[:, :8], cache)
        return torch.cat([lm.forward(ids[:, t:t + 1], cache) for t in range(8, ids.shape[1])], 1)
    finally:
        kernels._STATE["ok"] = ok


def test_model_decode_through_the_kernel_equals_sdpa():
    """The decode steps of a GQA model with an evicting cache, kernel on and off: same logits;
    a float16 cache stays close to the float32 one."""
    lm = tiny_lm(dim=64, hidden_dim=128)
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    fused, plain = _decode(lm, ids, True), _decode(lm, ids, False)
    torch.testing.assert_close(fused, plain, atol=2e-5, rtol=1e-5)
    half, half_plain = _decode(lm, ids, True, torch.float16), _decode(lm, ids, False, torch.float16)
    torch.testing.assert_close(half, half_plain, atol=2e-4, rtol=1e-4)
    assert (half - fused).norm() / fused.norm() < 5e-3
    assert (half - fused).abs().max() > 0  # the cache really was float16


def test_kv_dtype_is_validated_and_halves_the_cache():
    from attnlab.engine import LM
    with pytest.raises(ValueError, match="KV-cache dtype"):
        LM.load("nowhere.gguf", kv_dtype="int3")
    lm = tiny_lm()
    full = lm.new_cache(capacity=64).nbytes()
    lm.kv_dtype = torch.float16
    assert lm.new_cache(capacity=64).nbytes() * 2 == full
