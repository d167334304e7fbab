"""The fused single-query attention kernel (attnlab/kernels/attend.cpp) against torch's SDPA."""
import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

from attnlab.kv import make_policy
from attnlab.kernels import ops
from attnlab.kernels.reference import dequantize_int8_blocks, int8_blocks
from tests.conftest import tiny_lm

pytestmark = pytest.mark.skipif(not ops.load(), reason="no C++ kernels (attnlab info says why)")


def reference(q, k, v):
    return F.scaled_dot_product_attention(q, k.float(), v.float(), enable_gqa=True)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n,cut", [(37, 20), (600, 301)])
def test_log_sum_exp_merges_stretches_of_the_cache(threads, n, cut):
    """decode_attention_lse's lse is logsumexp of the scaled scores per query head, and two stretches'
    outputs weighted by e^(lse - max lse) are the whole cache's output (the native step's threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(n)
        q = torch.randn(2, 9, 1, 64, generator=g) * 2
        k, v = (torch.randn(2, 3, n, 64, generator=g).half() for _ in range(2))
        out, lse = torch.ops.attnlab.decode_attention_lse(q, k, v, 0.125)
        scores = torch.einsum("bhd,bhnd->bhn", q[:, :, 0], k.float().repeat_interleave(3, 1)) * 0.125
        torch.testing.assert_close(lse, scores.logsumexp(-1), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out, reference(q, k, v), atol=4e-6, rtol=1e-5)
        parts = [torch.ops.attnlab.decode_attention_lse(q, k[:, :, a:b], v[:, :, a:b], 0.125) for a, b in ((0, cut), (cut, n))]
        w = torch.stack([p[1] for p in parts]).softmax(0)[..., None, None]
        torch.testing.assert_close(sum(w[i] * parts[i][0] for i in range(2)), out, atol=4e-6, rtol=1e-5)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("Hq,Hkv,D,n", [(9, 3, 64, 1), (9, 3, 64, 37), (32, 8, 128, 300), (4, 4, 64, 5),
                                        (14, 2, 64, 129), (7, 1, 72, 17), (8, 2, 40, 1000),
                                        (16, 2, 64, 70)])
def test_decode_attention_equals_sdpa(dtype, Hq, Hkv, D, n):
    """Every grouping (1 to 8 query heads per KV head, in fours, or in threes and a remainder), head sizes that are
    not multiples of 32, lengths with and without a tail of 4 or 8, and strided cache slices."""
    g = torch.Generator().manual_seed(n)
    q = torch.randn(2, Hq, 1, D, generator=g) * 2
    k = (torch.randn(2, Hkv, n + 9, D, generator=g) * 2).to(dtype)[:, :, :n]  # a slice of a larger buffer
    v = torch.randn(2, Hkv, n + 9, D, generator=g).to(dtype)[:, :, :n]
    out = torch.ops.attnlab.decode_attention(q, k, v, 1 / math.sqrt(D))
    # float32 sums in another order than SDPA's: scores of std ~4 differ by ~1e-6
    torch.testing.assert_close(out, reference(q, k, v), atol=4e-6, rtol=1e-5)


@pytest.mark.parametrize("Hq,Hkv,D,n", [(9, 3, 64, 1), (9, 3, 64, 37), (32, 8, 128, 300), (14, 2, 64, 129),
                                        (7, 1, 96, 17), (16, 4, 64, 33)])
def test_decode_attention_int8_equals_sdpa_over_the_dequantised_cache(Hq, Hkv, D, n):
    """An int8 cache (codes + a scale per 32 dimensions, strided slices of larger buffers): the same
    result as SDPA over its dequantised keys and values, and close to the float cache it rounds."""
    g = torch.Generator().manual_seed(n)
    q = torch.randn(2, Hq, 1, D, generator=g) * 2
    k, v = torch.randn(2, Hkv, n + 9, D, generator=g) * 2, torch.randn(2, Hkv, n + 9, D, generator=g)
    (kq, ks), (vq, vs) = int8_blocks(k), int8_blocks(v)
    kq, ks, vq, vs = (t[:, :, :n] for t in (kq, ks, vq, vs))
    out = torch.ops.attnlab.decode_attention(q, kq, vq, 1 / math.sqrt(D), ks, vs)
    ref = reference(q, dequantize_int8_blocks(kq, ks), dequantize_int8_blocks(vq, vs))
    torch.testing.assert_close(out, ref, atol=4e-6, rtol=1e-5)
    exact = reference(q, k[:, :, :n], v[:, :, :n])
    assert 0 < (out - exact).abs().max() < 0.1  # sharp scores (std 4): rounding moves the softmax a little


@pytest.mark.parametrize("threads,n", [(2, 1000), (4, 1100)])
@pytest.mark.parametrize("kind", ["float16", "int8", "peaked"])
def test_decode_attention_split_over_threads_equals_sdpa(threads, n, kind):
    """3 KV heads on 2 or 4 threads: each head's rows are cut into 2 or 4 stretches whose softmaxes merge
    by their maxima and sums. The result is SDPA's, and one thread's; `peaked` puts the winning key in
    the last stretch so the others' weights underflow."""
    g = torch.Generator().manual_seed(threads)
    q = torch.randn(1, 9, 1, 64, generator=g) * 2
    k, v = torch.randn(1, 3, n, 64, generator=g) * 2, torch.randn(1, 3, n, 64, generator=g)
    if kind == "peaked":
        k[:, :, n - 3] = q.view(3, 3, 64).sum(1) * 20
    args = (k.half(), v.half()) if kind == "float16" else (k, v)
    if kind == "int8":
        (kq, ks), (vq, vs) = int8_blocks(k), int8_blocks(v)
        args, k, v = (kq, vq, ks, vs), dequantize_int8_blocks(kq, ks), dequantize_int8_blocks(vq, vs)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = torch.ops.attnlab.decode_attention(q, *args[:2], 0.125, *args[2:])
        torch.set_num_threads(1)
        one = torch.ops.attnlab.decode_attention(q, *args[:2], 0.125, *args[2:])
    finally:
        torch.set_num_threads(before)
    if kind != "int8":
        k, v = args[0].float(), args[1].float()
    torch.testing.assert_close(out, reference(q, k, v), atol=4e-6, rtol=1e-5)
    torch.testing.assert_close(out, one, atol=4e-6, rtol=1e-5)


def test_quantize_kv_equals_int8_blocks_bit_for_bit():
    """The fused rounding of keys/values is `int8_blocks` exactly: every magnitude, an all-zero row, exact
    ties (scale 1: 2.5 -> 2, -3.5 -> -4, half to even), non-contiguous input."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 7, 64, generator=g) * torch.logspace(-6, 3, 7)[None, None, :, None]
    x[0, 0, 0] = 0
    x[0, 0, 1, :32] = torch.tensor([127.0] + [2.5, -3.5, 0.5, -0.5, 1.5] * 6 + [4.5])
    for t in (x, x[:, :, :3].transpose(1, 2)):
        q, s = torch.ops.attnlab.quantize_kv(t)
        q_ref, s_ref = int8_blocks(t)
        assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    assert q_ref.shape == (3, 3, 5, 64) and s_ref.shape == (3, 3, 5, 2)
    assert torch.ops.attnlab.quantize_kv(x)[0][0, 0, 1, :6].tolist() == [127, 2, -4, 0, 0, 2]


@pytest.mark.parametrize("bad", ["no-scales", "one-scale", "scales-to-float", "scale-shape", "head-size"])
def test_decode_attention_int8_rejects_bad_scales(bad):
    q, k, v = torch.randn(1, 4, 1, 64), torch.randn(1, 2, 5, 64), torch.randn(1, 2, 5, 64)
    (kq, ks), (vq, vs) = int8_blocks(k), int8_blocks(v)
    args = {"no-scales": (kq, vq), "one-scale": (kq, vq, ks), "scales-to-float": (k, v, ks, vs),
            "scale-shape": (kq, vq, ks[..., :1], vs[..., :1])}.get(bad)
    if bad == "head-size":
        q, (kq, ks), (vq, vs) = torch.randn(1, 4, 1, 48), int8_blocks(k[..., :48], 16), int8_blocks(v[..., :48], 16)
        args = (kq, vq, ks, vs)
    with pytest.raises(RuntimeError):
        torch.ops.attnlab.decode_attention(q, args[0], args[1], 0.125, *args[2:])


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


@pytest.mark.parametrize("bad", ["bf16", "two-queries", "heads", "inner-stride", "no-kv-heads", "empty-heads"])
def test_decode_attention_rejects_bad_input(bad):
    q, k = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 5, 16)
    v = k.clone()
    if bad in ("no-kv-heads", "empty-heads"):  # a division by zero, a loop over no dimensions: errors instead
        q, k = (q[:, :, :, :0], k[..., :0]) if bad == "empty-heads" else (q, k[:, :0])
        v = k.clone()
    elif bad == "bf16":
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
    lm.kv_dtype = kv_dtype
    with (contextlib.nullcontext() if fused else ops.disabled()):
        cache = lm.new_cache(policy=make_policy("sink", 12, positions="cache", n_sink=2, chunk=8, block=4))
        lm.prefill(ids[:, :8], cache)
        return torch.cat([lm.forward(ids[:, t:t + 1], cache) for t in range(8, ids.shape[1])], 1)


def test_model_decode_through_the_kernel_equals_sdpa():
    """The decode steps of a GQA model with an evicting cache, kernel on and off: same logits;
    a float16 cache stays close to the float32 one."""
    lm = tiny_lm(dim=64, hidden_dim=128)
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    fused, plain = _decode(lm, ids, True), _decode(lm, ids, False)
    torch.testing.assert_close(fused, plain, atol=2e-5, rtol=1e-5)
    half, half_plain = _decode(lm, ids, True, torch.float16), _decode(lm, ids, False, torch.float16)
    # a key the two paths compute 1e-7 apart may round to float16 one step apart, and stays (one such: 3.3e-4)
    torch.testing.assert_close(half, half_plain, atol=5e-4, rtol=1e-4)
    assert (half - fused).norm() / fused.norm() < 5e-3
    assert (half - fused).abs().max() > 0  # the cache really was float16


def test_model_decode_through_an_int8_cache():
    """The same evicting cache in int8 (keys re-rotated and rounded again when compacted): kernel on and
    off give the same logits, which stay close to the float32 cache's."""
    lm = tiny_lm(dim=64, hidden_dim=128, head_dim=32)
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    exact = _decode(lm, ids, True)
    fused, plain = _decode(lm, ids, True, torch.int8), _decode(lm, ids, False, torch.int8)
    torch.testing.assert_close(fused, plain, atol=2e-5, rtol=1e-5)
    assert 0 < (fused - exact).norm() / exact.norm() < 5e-2  # a sharp random model: see the perplexity in README
    assert (fused.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9


def test_kv_dtype_is_validated_and_sizes_the_cache():
    from attnlab.engine import LM
    with pytest.raises(ValueError, match="KV-cache dtype"):
        LM.load("nowhere.gguf", kv_dtype="int3")
    lm = tiny_lm()
    full = lm.new_cache(capacity=64).nbytes()
    lm.kv_dtype = torch.float16
    assert lm.new_cache(capacity=64).nbytes() * 2 == full
    lm.kv_dtype = torch.int8  # one byte a number and a float32 scale per 32: 9/32 of float32
    with pytest.raises(ValueError, match="multiple of 32"):
        lm.new_cache(capacity=64)  # tiny_lm's heads have 16 dimensions
    lm = tiny_lm(head_dim=32)
    full = lm.new_cache(capacity=64).nbytes()
    lm.kv_dtype = torch.int8
    assert lm.new_cache(capacity=64).nbytes() * 32 == full * 9


def _causal_reference(q, k, v):
    """float64 softmax attention, query i over keys 0 .. L - T + i (bottom-right causal)."""
    T, L, G = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    s = q.double() @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~torch.ones(T, L, dtype=torch.bool).tril(L - T), float("-inf"))
    return (s.softmax(-1) @ v).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("B,Hq,Hkv,T,extra,D", [(1, 9, 3, 100, 0, 64), (2, 4, 4, 33, 7, 32), (1, 8, 2, 16, 0, 128),
                                                 (1, 3, 1, 1, 5, 64), (1, 6, 3, 47, 20, 64)])
@pytest.mark.parametrize("threads", [1, 2])
def test_causal_attention_equals_the_masked_reference(dtype, B, Hq, Hkv, T, extra, D, threads):
    """The prefill kernel (causal.cpp) on ragged query blocks, grouped heads, a cache longer than the chunk,
    float16 keys and values, strided views as the model passes them."""
    from attnlab.kernels import build, isa
    if not build.wide():
        pytest.skip("causal_attention is AVX-512 only")
    g = torch.Generator().manual_seed(T + D)
    L = T + extra
    qkv = torch.randn(B, T, Hq + 2 * Hkv, D, generator=g).transpose(1, 2)  # as the model's views: strided
    q = qkv[:, :Hq].contiguous()
    kbuf = torch.randn(B, Hkv, L + 9, D, generator=g).to(dtype)  # a cache's buffer, sliced
    k, v = kbuf[:, :, :L], torch.randn(B, L, Hkv, D, generator=g).to(dtype).transpose(1, 2)
    k[:, :, :, 3] += 30  # large logits: the softmax's max must be subtracted
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = ops.causal_attention(q, k, v)
    finally:
        torch.set_num_threads(before)
    # AMX tiles (head dim a multiple of 64): three bfloat16 products of split operands, ~1e-5 of a score
    tol = 1e-4 if D % 64 == 0 and isa.amx_granted() and build.variant() == "amx" else 2e-5
    torch.testing.assert_close(got, _causal_reference(q, k, v), rtol=tol, atol=tol)
    if extra == 0:
        torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k.float(), v.float(), is_causal=True,
                                                                       enable_gqa=True), rtol=tol, atol=tol)
    with ops.disabled():  # the fallback keeps the same contract
        torch.testing.assert_close(ops.causal_attention(q, k, v), _causal_reference(q, k, v), rtol=2e-5, atol=2e-5)
