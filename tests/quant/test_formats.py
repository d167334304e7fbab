"""Quantized formats: round-trip bounds, fused kernels against dequantise-then-matmul."""
import pytest
import torch

from attnlab.kernels import ops
from attnlab.quant import QuantLinear, QuantSpec
from attnlab.quant.formats import pack4, quantize_int4, quantize_int8, quantize_kmeans, round_activations, unpack4

SPECS = ["int8", "int8:32", "int4:32", "int4:64", "int4:128", "kmeans:4", "kmeans:3", "kmeans:4:64", "kmeans-naive:4"]


@pytest.fixture(scope="module")
def w():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=g) * 0.05
    w[3, 7] = 0.9  # an outlier, as real checkpoints have
    return w


def test_pack4_roundtrip():
    codes = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    assert torch.equal(unpack4(pack4(codes)), codes)
    assert pack4(codes).shape == (5, 32)


@pytest.mark.parametrize("group", [None, 32])
def test_int8_error_at_most_half_a_step(w, group):
    p = quantize_int8(w, group)
    err = (p.dequantize() - w).abs().view(96, -1, p.group)
    assert (err <= p.scale[..., None] / 2 + 1e-7).all()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_error_at_most_half_a_step_per_group(w, group):
    p = quantize_int4(w, group)
    err = (p.dequantize() - w).abs().view(96, -1, group)
    assert (err <= p.scale[..., None] / 2 + 1e-6).all()
    assert p.nbytes < w.numel() * 4 / 5  # 4-bit codes plus two floats per group


@pytest.mark.parametrize("bits", [3, 4])
def test_kmeans_assigns_the_nearest_centroid_and_beats_uniform(w, bits):
    p = quantize_kmeans(w, bits)
    book = p.codebook[:, 0, :2 ** bits]                      # [N, C] per-row codebooks
    nearest = (w[:, :, None] - book[:, None, :]).abs().min(-1).values
    assert torch.allclose((p.dequantize() - w).abs(), nearest, atol=1e-6)
    uniform = quantize_int4(w, 256) if bits == 4 else None    # same bits, evenly spaced levels per row
    if uniform is not None:
        assert (p.dequantize() - w).norm() < (uniform.dequantize() - w).norm()


def _integer_reference(layer, x, bias):
    """The integer kernels' arithmetic in float: int8-rounded activations times the weight, the int4
    minimum included (its term sums the rounded activations, as llama.cpp's Q8_1 does)."""
    p = layer.packed
    if p.kind == "int8":
        return torch.nn.functional.linear(round_activations(x), p.dequantize(), bias)
    if p.kind == "kmeans":  # centroids as the kernel holds them: int8 times a scale per codebook
        codes = unpack4(p.qs).long().view(*p.shape[:1], -1, p.group)
        book = layer.lut.float() * layer.lut_scale[..., None]
        return torch.nn.functional.linear(round_activations(x), torch.gather(book, 2, codes).view(p.shape), bias)
    codes = unpack4(p.qs).float().view(*p.shape[:1], -1, p.group)
    scaled = (codes * p.scale[..., None]).view(p.shape)
    mins = p.min[..., None].expand(-1, -1, p.group).reshape(p.shape)
    return torch.nn.functional.linear(round_activations(x), scaled + mins, bias)  # the min over rounded x too


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("rows", [1, 3, 16, 160])
def test_layer_equals_dequantised_matmul(w, spec, rows):
    """Every path against dequantise-then-float-matmul: exact with float activations (the naive
    path, and every row-layout format past its `fused_rows()`), within activation (and centroid)
    rounding for the integer kernels, whose own arithmetic is checked against a float emulation."""
    s = QuantSpec.parse(spec)
    bias = torch.randn(96)
    layer = QuantLinear(s.quantize(w), bias, fused=s.fused)
    x = torch.randn(2, rows, 256)
    ref = torch.nn.functional.linear(x, layer.dequantize(), bias)
    got = layer(x)
    # repacked layers (AVX-512 VNNI) run the integer kernel at every M
    integer = s.fused and (2 * rows <= layer.fused_rows() or layer.repacked) and ops.enabled()
    if integer:
        torch.testing.assert_close(got, _integer_reference(layer, x, bias), atol=1e-4, rtol=1e-5)
        assert (got - ref).norm() / (ref - bias).norm() < 3e-2  # int8 activations: about 1% on random data
    else:
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)


def test_fused_kernels_are_built():
    """CI machines have a compiler and AVX2: the fused path must really be there, not the fallback."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("no AVX2 on this CPU")
    assert ops.load() and ops.enabled()


@pytest.mark.parametrize("text,expected", [("int8", "int8"), ("int8:32", "int8:32"), ("int4", "int4:32"), ("INT4:64", "int4:64"),
                                           ("kmeans", "kmeans:4"), ("kmeans:3", "kmeans:3"),
                                           ("kmeans-naive:4:64", "kmeans-naive:4:64")])
def test_spec_parse(text, expected):
    assert str(QuantSpec.parse(text)) == expected


@pytest.mark.parametrize("bad", ["int3", "int4:48", "int4:0", "kmeans:5", "kmeans:4:10", "int8:2", "int8:32:1", "int4:x", ""])
def test_spec_rejects(bad):
    with pytest.raises(ValueError):
        QuantSpec.parse(bad)
