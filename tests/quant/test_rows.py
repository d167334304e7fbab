"""Row-sparse ops (Deja Vu's sparse MLP): every op against its dense reference, kernels and fallback."""
import pytest
import torch
from torch import nn

from attnlab.kernels import ops
from attnlab.quant import QuantLinear, QuantSpec
from attnlab.kernels.reference import round_activations
from attnlab.sparsity.rows import rows_combine, rows_matvec

N = 3072
FORMATS = ["fp32", "bf16", "int8", "int8:32", "int4:32"]
needs_kernels = pytest.mark.skipif(not ops.load(), reason="no C++ kernels (attnlab info says why)")


@pytest.fixture(scope="module", params=[576, 1536])
def weights(request):
    """{format: layer} over one random [N, K] matrix with an outlier, per K."""
    g = torch.Generator().manual_seed(request.param)
    w = torch.randn(N, request.param, generator=g) * 0.05
    w[7, 3] = 0.9
    out = {}
    for fmt in FORMATS:
        if fmt.startswith("int"):
            out[fmt] = QuantLinear(QuantSpec.parse(fmt).quantize(w))
        else:
            lin = nn.Linear(request.param, N, bias=False)
            lin.weight.data = w.to(torch.bfloat16 if fmt == "bf16" else torch.float32)
            out[fmt] = lin
    return out


def dense(layer) -> torch.Tensor:
    """The layer's weight as float32 [N, K], dequantised."""
    return layer.dequantize() if isinstance(layer, QuantLinear) else layer.weight.detach().float()


def pick(k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.arange(N) if k == N else torch.randperm(N, generator=g)[:k]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k", [1, 37, N])
def test_matvec_equals_dense_matvec_at_idx(weights, fmt, k):
    """The integer kernels give the layer's own batch-1 output at idx bit for bit (same rounded
    activations, same per-row code); float rows match F.linear to float rounding."""
    layer, K = weights[fmt], weights[fmt].in_features
    x, idx = torch.randn(K), pick(k, k)
    got = rows_matvec(layer, x, idx)
    assert got.shape == (k,) and got.dtype == torch.float32
    if isinstance(layer, QuantLinear) and ops.enabled() and not layer.repacked:
        assert torch.equal(got, layer(x[None])[0, idx])
    elif isinstance(layer, QuantLinear) and ops.enabled():  # 16-row blocks sum in another order
        torch.testing.assert_close(got, layer(x[None])[0, idx], atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(got, (dense(layer) @ x)[idx], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("k", [1, 37, N])
def test_combine_equals_weighted_sum_of_rows(weights, fmt, k):
    layer, K = weights[fmt], weights[fmt].in_features
    a, idx = torch.randn(k), pick(k, k + 1)
    ref = (a.double() @ dense(layer)[idx].double()).float()
    got = rows_combine(layer, a, idx)
    assert got.shape == (K,)
    torch.testing.assert_close(got, ref, atol=2e-5 * k ** 0.5, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["fp32", "int8:32", "int4:32"])
def test_combine_adds_up_repeated_rows_and_empty_gives_zeros(weights, fmt):
    layer = weights[fmt]
    w = dense(layer)
    got = rows_combine(layer, torch.tensor([1.0, 2.0, -0.5]), torch.tensor([5, 5, 9]))
    torch.testing.assert_close(got, 3 * w[5] - 0.5 * w[9], atol=1e-6, rtol=1e-5)
    assert torch.equal(rows_combine(layer, torch.zeros(0), torch.zeros(0, dtype=torch.long)), torch.zeros(w.shape[1]))
    assert rows_matvec(layer, torch.randn(w.shape[1]), torch.zeros(0, dtype=torch.long)).shape == (0,)


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
def test_fallback_agrees_with_kernels_within_activation_rounding(weights, fmt, monkeypatch):
    """The fallback is dequantise-then-multiply with exact x; the integer kernels differ from it by
    at most |w| . |x - round(x)| per output (int8 activations, one scale per 32 values)."""
    layer, K = weights[fmt], weights[fmt].in_features
    x, a, idx = torch.randn(K), torch.randn(300), pick(300, 3)
    fast_mv, fast_comb = rows_matvec(layer, x, idx), rows_combine(layer, a, idx)
    with ops.disabled():
        slow_mv, slow_comb = rows_matvec(layer, x, idx), rows_combine(layer, a, idx)
    w = dense(layer)[idx]
    torch.testing.assert_close(slow_mv, w @ x, atol=1e-5, rtol=1e-5)
    bound = w.abs() @ (x - round_activations(x)).abs() if fmt.startswith("int") else torch.zeros(300)
    assert ((fast_mv - slow_mv).abs() <= bound + 1e-5).all()
    if fmt.startswith("int"):
        assert (fast_mv - slow_mv).abs().max() > 0  # the kernel path really ran
    torch.testing.assert_close(fast_comb, slow_comb, atol=1e-5, rtol=1e-5)


def test_kmeans_and_naive_layers_fall_back_to_dequantised_rows():
    w = torch.randn(64, 128) * 0.05
    x, a, idx = torch.randn(128), torch.randn(5), torch.tensor([0, 63, 7, 7, 2])
    for spec in ("kmeans:4", "kmeans-naive:3"):
        s = QuantSpec.parse(spec)
        layer = QuantLinear(s.quantize(w), fused=s.fused)
        d = layer.dequantize()
        torch.testing.assert_close(rows_matvec(layer, x, idx), (d @ x)[idx], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rows_combine(layer, a, idx), a @ d[idx], atol=1e-5, rtol=1e-5)


def test_k_quant_layers_and_layers_of_parts_fall_back_to_dequantised_rows():
    """int8 with a min or in groups of 16 (Q5_K, Q6_K; a layer of parts' promoted form) has no rows kernel."""
    from attnlab.quant import Packed
    from attnlab.quant.formats import quantize_int4, quantize_int8
    g = torch.Generator().manual_seed(3)
    x, a, idx = torch.randn(128, generator=g), torch.randn(5, generator=g), torch.tensor([0, 31, 7, 7, 20])
    q6k = quantize_int8(torch.randn(32, 128, generator=g), 16)
    q5k = Packed("int8", (32, 128), 32, 8, q=torch.randint(0, 32, (32, 128), dtype=torch.int8, generator=g),
                 scale=torch.rand(32, 4, generator=g) * 0.01, min=-torch.rand(32, 4, generator=g) * 0.1)
    parts = QuantLinear([quantize_int4(torch.randn(64, 128, generator=g)), q6k])
    for layer in (QuantLinear(q6k), QuantLinear(q5k), parts):
        d = layer.dequantize()
        torch.testing.assert_close(rows_matvec(layer, x, idx), (d @ x)[idx])
        torch.testing.assert_close(rows_combine(layer, a, idx), a @ d[idx])


def test_bias_is_ignored():
    lin = nn.Linear(64, 10)
    x, idx = torch.randn(64), torch.tensor([3, 1])
    torch.testing.assert_close(rows_matvec(lin, x, idx), (lin.weight @ x)[idx].detach(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("use_kernels", [True, False])
def test_user_errors_raise(weights, use_kernels, monkeypatch):
    if not use_kernels:
        monkeypatch.setattr(ops, "_OFF", [True])  # the fallback path for the rest of this test
    layer = weights["int4:32"]
    K = layer.in_features
    with pytest.raises(ValueError, match="vector of size"):
        rows_matvec(layer, torch.randn(K + 1), torch.tensor([0]))
    with pytest.raises(ValueError, match="vector of size"):
        rows_combine(layer, torch.randn(2), torch.tensor([0]))
    with pytest.raises(ValueError, match="integer"):
        rows_matvec(layer, torch.randn(K), torch.tensor([0.0]))
    with pytest.raises((RuntimeError, IndexError)):
        rows_matvec(layer, torch.randn(K), torch.tensor([N]))
    with pytest.raises((RuntimeError, IndexError)):
        rows_combine(layer, torch.randn(1), torch.tensor([-1]))
    with pytest.raises(TypeError):
        rows_matvec(torch.randn(N, K), torch.randn(K), torch.tensor([0]))


@needs_kernels
def test_kernels_check_their_inputs():
    w, x = torch.randn(8, 64), torch.randn(64)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.attnlab.f32_rows_mv(x, w, torch.tensor([8]))
    with pytest.raises(RuntimeError, match="int64"):
        torch.ops.attnlab.f32_rows_mv(x, w, torch.tensor([1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="multiples of 32"):
        torch.ops.attnlab.f32_rows_axpy(torch.ones(1), torch.randn(8, 48), torch.tensor([1]))
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.attnlab.f32_rows_mv(x, torch.randn(64, 8).t(), torch.tensor([1]))
    p = QuantSpec.parse("int4:32").quantize(w)
    with pytest.raises(RuntimeError, match="scales"):
        torch.ops.attnlab.q4_rows_axpy(torch.ones(1), p.qs, p.scale[:4], p.min, 32, torch.tensor([1]))
    with pytest.raises(RuntimeError, match="positive multiples"):  # no columns: an error, not a read past the end
        torch.ops.attnlab.q4_mm(torch.randn(1, 0), p.qs[:, :0], p.scale[:, :0], p.min[:, :0], 32)


@needs_kernels
def test_ops_have_fake_shapes_for_compile():
    """torch.compile traces the ops through their registered fakes: shapes [k] and [K]."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    p = QuantSpec.parse("int4:32").quantize(torch.randn(16, 64))
    with FakeTensorMode() as mode:
        x, idx = mode.from_tensor(torch.randn(64)), mode.from_tensor(torch.tensor([1, 2, 3]))
        qs, s, m = (mode.from_tensor(t) for t in (p.qs, p.scale, p.min))
        assert torch.ops.attnlab.q4_rows_mv(x, qs, s, m, 32, idx).shape == (3,)
        assert torch.ops.attnlab.q4_rows_axpy(mode.from_tensor(torch.ones(3)), qs, s, m, 32, idx).shape == (64,)
        assert torch.ops.attnlab.f32_rows_axpy(mode.from_tensor(torch.ones(3)), mode.from_tensor(torch.randn(16, 64)), idx).shape == (64,)


@needs_kernels
@pytest.mark.parametrize("fmt", ["fp32", "int8:32", "int4:32"])
def test_threads_split_work_without_changing_the_sums(weights, fmt):
    """mv splits the selection and axpy the columns across threads; each output is summed in the
    same order either way, so 1 and 2 threads agree bit for bit."""
    layer, K = weights[fmt], weights[fmt].in_features
    x, a, idx = torch.randn(K), torch.randn(500), pick(500, 5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = rows_matvec(layer, x, idx), rows_combine(layer, a, idx)
        torch.set_num_threads(2)
        two = rows_matvec(layer, x, idx), rows_combine(layer, a, idx)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
