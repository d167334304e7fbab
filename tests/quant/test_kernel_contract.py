"""QuantLinear.kernel(): the (op, operands) pair a native step calls equals the layer's own product."""
import pytest
import torch

from attnlab.kernels import ops
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
