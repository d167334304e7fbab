"""QuantLinear.kernel(): the (op, operands) pair a native step calls equals the layer's own product."""
import pytest
import torch

from attnlab.kernels import ops, repack
from attnlab.quant import QuantLinear, QuantSpec


@pytest.mark.parametrize("spec", ["int8", "int8:32", "int4:32", "int4:64", "kmeans:4"])
@pytest.mark.parametrize("rows", [1, 3])
def test_kernel_op_equals_forward(spec, rows):
    if not ops.load():
        pytest.skip("no C++ kernels on this machine")
    torch.manual_seed(0)
    layer = QuantLinear(QuantSpec.parse(spec).quantize(torch.randn(40, 128)))
    x = torch.randn(rows, 128)
    name, args = layer.kernel()
    y = getattr(torch.ops.attnlab, name)(x.contiguous(), *args)
    assert y.shape == (rows, 40)
    assert torch.equal(y, layer(x))  # the same kernel, so the same bits
    ref = x @ layer.dequantize().T  # and it is x @ W^T (activations rounded to int8: about 1% off)
    assert (y - ref).abs().max() < 0.03 * ref.abs().max()


@pytest.mark.parametrize("spec", ["int8", "int8:32", "int4:32", "int4:64", "kmeans:4"])
@pytest.mark.parametrize("K", [128, 1536])
def test_a_batch_of_rows_gives_each_row_the_bits_it_gets_alone(spec, K):
    """A batched decode step hands the kernels B activation rows (int4 and int8 at group 32 take them four at a
    time per weight read): each output row must be the product that row gets alone, bit for bit."""
    if not ops.load():
        pytest.skip("no C++ kernels on this machine")
    torch.manual_seed(0)
    layer = QuantLinear(QuantSpec.parse(spec).quantize(torch.randn(37, K)))
    name, args = layer.kernel()
    op = getattr(torch.ops.attnlab, name)
    x = torch.randn(11, K)
    alone = torch.cat([op(x[m:m + 1].contiguous(), *args) for m in range(11)])
    for M in (4, 5, 8, 11):
        assert torch.equal(op(x[:M].contiguous(), *args), alone[:M])


def _layers(N: int, K: int) -> dict:
    """Layers in each repacked layout (float32 scales, float16 ones, Q4_0's no-min) and the row layout."""
    from attnlab.quant.formats import Packed
    g = torch.Generator().manual_seed(3)
    qs = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g)
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    s = (torch.rand(N, K // 32, generator=g) * 0.01).half().float()
    m = (-torch.rand(N, K // 32, generator=g) * 0.05).half().float()
    return {"int4:32 f32": QuantSpec.parse("int4:32").quantize(torch.randn(N, K, generator=g)),
            "Q4_0": Packed("int4", (N, K), 32, 4, qs=qs, scale=s, min=-8 * s),
            "Q4_1": Packed("int4", (N, K), 32, 4, qs=qs, scale=s, min=m),
            "Q8_0": Packed("int8", (N, K), 32, 8, q=q, scale=s),
            "Q5_1": Packed("int8", (N, K), 32, 8, q=q, scale=s, min=m)}


@pytest.mark.parametrize("name", ["int4:32 f32", "Q4_0", "Q4_1", "Q8_0", "Q5_1"])
def test_kernel_rows_are_views_that_give_the_same_rows(name):
    """kernel(rows=(r0, r1)): how the native step splits a matvec across threads, in every layout."""
    if not ops.load():
        pytest.skip("no C++ kernels on this machine")
    N, K = 75, 96  # 4 whole blocks of 16 rows and a ragged one
    layer = QuantLinear(_layers(N, K)[name])
    if layer.repacked:
        assert layer.layout == {"int4:32 f32": 0, "Q4_0": repack.HALF | repack.SYM}.get(name, repack.HALF)
    x = torch.randn(2, K, generator=torch.Generator().manual_seed(4))
    op, args = layer.kernel()
    full = getattr(torch.ops.attnlab, op)(x, *args)
    a = layer.row_align
    for r0, r1 in ((0, a), (a, 3 * a), (3 * a, N), (0, N)):
        op, part = layer.kernel(rows=(r0, r1))
        assert torch.equal(getattr(torch.ops.attnlab, op)(x, *part), full[:, r0:r1])
        w = part[0]
        assert w.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr()  # a view, no copy
    with pytest.raises(ValueError, match="multiples"):
        layer.kernel(rows=(1, N) if a > 1 else (0, N + 1))


@pytest.mark.parametrize("name", ["int4:32 f32", "Q4_0", "Q4_1", "Q8_0", "Q5_1"])
def test_embedding_rows_are_the_weights_rows(name):
    """embed_rows (a tied head's lookup; q8x_rows in C++ for repacked int8) gives rows of dequantize()
    in every layout, repeated and unsorted ids included, and rejects a row outside the weight."""
    N, K = 75, 96
    layer = QuantLinear(_layers(N, K)[name])
    ids = torch.tensor([[74, 0, 16, 16], [31, 15, 64, 3]])
    torch.testing.assert_close(layer.embed_rows(ids), layer.dequantize()[ids], rtol=0, atol=0)
    if layer.repacked and layer.kind == "int8" and ops.enabled():
        with pytest.raises(RuntimeError, match="outside"):
            layer.embed_rows(torch.tensor([80]))


@pytest.mark.parametrize("N,K,group", [(75, 96, 32), (16, 64, 64), (33, 128, 16), (5, 256, 256)])
def test_native_repacking_equals_the_torch_layout(N, K, group):
    """repack_q4 / repack_q8 (C++, at load) build byte for byte the blocks of the torch reference, in every
    layout, ragged row counts included; and a forced layout the values cannot take is refused."""
    if not ops.load():
        pytest.skip("no C++ kernels on this machine")
    g = torch.Generator().manual_seed(N)
    qs = torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, generator=g)
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    s, m = torch.rand(N, K // group, generator=g), -torch.rand(N, K // group, generator=g)
    for half in (False, True):
        sc, mn = (s.half().float(), m.half().float()) if half else (s, m)
        cases = [(repack.pack_q8, (q, sc, group)), (repack.pack_q8, (q, sc, group, mn))]
        if group % 32 == 0:
            cases += [(repack.pack_q4, (qs, sc, mn, group)), (repack.pack_q4, (qs, sc, -8 * sc, group))]
        for pack, args in cases:
            got, ref = pack(*args), pack(*args, reference=True)
            assert got[1] == ref[1] == (repack.HALF if half else 0) | (repack.SYM if args[2] is not None
                                                                        and pack is repack.pack_q4 and
                                                                        torch.equal(args[2], -8 * sc) else 0)
            assert torch.equal(got[0], ref[0])
    with pytest.raises(ValueError, match="float16"):
        repack.pack_q8(q, s + 1e-4, group, fmt=repack.HALF)
