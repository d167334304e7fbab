"""The forward pass's elementwise glue in C++ (`ops.rms_norm`, `ops.silu_mul`) against torch's on ragged
shapes, and autograd keeping torch's (the ops have no backward)."""
import pytest
import torch
import torch.nn.functional as F

from attnlab.kernels import ops


@pytest.fixture(autouse=True)
def kernels():
    if not ops.load():
        pytest.skip("no C++ kernels on this machine")


@pytest.mark.parametrize("shape", [(1, 8), (3, 13), (2, 5, 576), (40, 1)])
def test_rms_norm_equals_torch(shape):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(*shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
    got = ops.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(got, F.rms_norm(x, w.shape, w, 1e-5), rtol=2e-6, atol=1e-6)
    # against a float64 reference the double sum of squares is the closer one
    ref = (x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * w.double()).float()
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ops.rms_norm(x.transpose(0, -1).contiguous().transpose(0, -1), w, 1e-5), got)


@pytest.mark.parametrize("shape", [(1, 16), (3, 26), (2, 5, 3072), (7, 2)])
def test_silu_mul_equals_torch(shape):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(*shape, generator=g) * 6
    h.view(-1)[0] = -100.0  # exp's flush range
    gate, up = h.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(h), F.silu(gate) * up, rtol=3e-6, atol=1e-6)
    with ops.disabled():
        torch.testing.assert_close(ops.silu_mul(h), F.silu(gate) * up, rtol=0, atol=0)


def test_autograd_keeps_torch():
    w = torch.randn(8, requires_grad=True)
    x = torch.randn(3, 8)
    ops.rms_norm(x, w, 1e-6).sum().backward()
    assert w.grad is not None and w.grad.abs().sum() > 0
    h = torch.randn(3, 8, requires_grad=True)
    ops.silu_mul(h).sum().backward()
    assert h.grad.shape == h.shape
    with torch.no_grad():  # no graph: the C++ op serves a parameter too
        torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), F.rms_norm(x, w.shape, w, 1e-6), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("spec", ["int4:32", "int8:32"])
def test_a_quantized_mlp_gates_in_the_matmul(spec, monkeypatch):
    """A prompt's MLP input side on repacked weights is one call (`q4x_glu` / `q8x_glu`) with the bits of
    silu_mul after the plain product; a decode step's single row keeps the plain kernel."""
    from attnlab.model.llama import FeedForward, ModelConfig
    from attnlab.quant import QuantSpec
    from attnlab.quant.linear import QuantLinear

    g = torch.Generator().manual_seed(3)
    cfg = ModelConfig(vocab_size=32, dim=64, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=48)
    mlp = FeedForward(cfg)
    monkeypatch.setenv("ATTNLAB_REPACK", "1")
    mlp.w13 = QuantLinear(QuantSpec.parse(spec).quantize(torch.randn(96, 64, generator=g) * 0.1))
    assert mlp.w13.repacked
    calls = []
    for name in ("q4x_glu", "q8x_glu"):
        real = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    for T in (1, 33):
        x = torch.randn(2, T, 64, generator=g)
        assert torch.equal(mlp.activation(x), ops.silu_mul(mlp.w13(x)))
        assert len(calls) == (T >= 16)
        calls.clear()


@pytest.mark.parametrize("kind,group,with_min", [("int8", 32, False), ("int8", 16, True), ("int8", 0, False),
                                                 ("int4", 32, True), ("int4", 64, True)])
def test_dequantising_into_a_buffer_keeps_dequantize_bits(kind, group, with_min):
    """`ops.dequant_q8` / `dequant_q4` write what `Packed.dequantize()` returns, bit for bit (a multiply, then the
    min added: no fused multiply-add), over whatever the buffer held; the fallback too."""
    from attnlab.quant.formats import Packed

    g = torch.Generator().manual_seed(4)
    N, K = 37, 192
    G = K // (group or K)
    scale, min_ = torch.rand(N, G, generator=g) * 0.03 + 1e-4, torch.randn(N, G, generator=g) * 0.1
    if kind == "int8":
        q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
        p = Packed("int8", (N, K), group or K, 8, q=q, scale=scale, min=min_ if with_min else None)
        run = lambda out: ops.dequant_q8(q, scale, p.min, out)  # noqa: E731
    else:
        qs = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
        p = Packed("int4", (N, K), group, 4, qs=qs, scale=scale, min=min_)
        run = lambda out: ops.dequant_q4(qs, scale, min_, out)  # noqa: E731
    want = p.dequantize()
    out = torch.full((N, K), float("nan"))
    assert run(out) is out and torch.equal(out, want)
    with ops.disabled():
        assert torch.equal(run(torch.zeros(N, K)), want)


@pytest.mark.parametrize("spec", ["int8:32", "int4:32"])
def test_a_long_input_multiplies_the_layers_own_weight(spec, monkeypatch):
    """Past the integer kernels' rows a layer multiplies its dequantised weight from a buffer every layer of the
    thread reuses: each layer's product is still x W^T of its own W (two layers in turn, the first again), and
    autograd gets a weight of its own (a later layer's dequantisation does not overwrite it). The row layout:
    repacked weights (AVX-512 VNNI) take the integer kernel at any M."""
    from attnlab.quant import QuantSpec
    from attnlab.quant.linear import QuantLinear

    monkeypatch.setenv("ATTNLAB_REPACK", "0")

    g = torch.Generator().manual_seed(5)
    a, b = (QuantLinear(QuantSpec.parse(spec).quantize(torch.randn(n, 64, generator=g) * 0.1)) for n in (96, 160))
    x = torch.randn(300, 64, generator=g)
    assert x.shape[0] > a.fused_rows()
    ya = a(x)
    assert torch.equal(ya, F.linear(x, a.dequantize()))
    assert torch.equal(b(x), F.linear(x, b.dequantize()))
    assert torch.equal(a(x), ya)
    xg = x.clone().requires_grad_()
    y = a(xg)
    b(x)  # the shared buffer now holds b's weight
    y.sum().backward()
    torch.testing.assert_close(xg.grad, torch.ones(300, 96) @ a.dequantize(), rtol=1e-6, atol=1e-6)


def test_the_buffer_serves_inference_mode_and_outside_it(monkeypatch):
    """A thread's buffer made under torch.inference_mode is written again outside it (and by the fallback)."""
    import threading

    from attnlab.quant import QuantSpec
    from attnlab.quant.linear import QuantLinear

    monkeypatch.setenv("ATTNLAB_REPACK", "0")  # the row layout (see above)
    layer = QuantLinear(QuantSpec.parse("int8:32").quantize(torch.randn(64, 64) * 0.1))
    x, want, got = torch.randn(300, 64), None, []

    def run():
        with torch.inference_mode():
            got.append(layer(x).clone())
        with ops.disabled():
            got.append(layer(x))
        got.append(layer(x))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    want = F.linear(x, layer.dequantize())
    assert len(got) == 3 and all(torch.equal(y, want) for y in got)
