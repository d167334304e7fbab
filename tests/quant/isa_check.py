"""Run in a process of its own by test_isa.py (`python -m tests.quant.isa_check VARIANT`, with
ATTNLAB_ISA=VARIANT): every matrix kernel of that variant against the reference arithmetic on
ragged shapes: the activations rounded to int8 per 32 (`round_activations`) times the weights, min terms
included (a min over x itself would pass as closeness but loses 4-5x the KL, see kernels_simd.h).
Prints 'ok VARIANT' on success."""
import sys

import torch

from attnlab.kernels import build, repack
from attnlab.kernels.reference import dequantize_int4, round_activations, unpack4
from attnlab.quant.formats import quantize_int4, quantize_int8


def close(got, ref, bound, what):
    """|got - ref| within float32 summation error: 3e-6 of the sum of |terms| (bound), elementwise."""
    err = (got - ref).abs()
    assert (err <= 3e-6 * bound + 1e-6).all(), f"{what}: max err {err.max().item():.3g}"


def main(variant: str) -> None:
    assert build.load(), "kernels did not build"
    assert build.variant() == variant, (build.variant(), variant)
    g = torch.Generator().manual_seed(0)
    count = 0
    for N in (1, 17, 40):
        for K in (32, 64, 576):
            for M in (1, 2, 5, 9):
                x = torch.randn(M, K, generator=g)
                xr = round_activations(x)
                w = torch.randn(N, K, generator=g) * 0.1
                for group in (32, 64, K):
                    if K % group:
                        continue
                    p = quantize_int4(w, group)  # codes' part and min's part, as the kernels sum them
                    codes = (unpack4(p.qs).float().view(N, -1, group) * p.scale[..., None]).view(N, K)
                    mins = dequantize_int4(p.qs, p.scale, p.min, group) - codes
                    ref, bound = xr @ codes.T + xr @ mins.T, xr.abs() @ codes.abs().T + xr.abs() @ mins.abs().T
                    close(torch.ops.attnlab.q4_mm(x, p.qs, p.scale, p.min, group), ref, bound, f"q4_mm {N}x{K}/{group} M{M}")
                    wp = repack.pack_q4(p.qs, p.scale, p.min, group)
                    close(torch.ops.attnlab.q4x_mm(x, wp, N, group), ref, bound, f"q4x_mm {N}x{K}/{group} M{M}")
                    count += 2
                for group in (16, 32, K):
                    q8 = quantize_int8(w, group)
                    wq = (q8.q.float().view(N, -1, group) * q8.scale[..., None]).view(N, K)
                    ref, bound = xr @ wq.T, xr.abs() @ wq.abs().T
                    if group % 32 == 0:
                        close(torch.ops.attnlab.q8_mm(x, q8.q, q8.scale, group), ref, bound, f"q8_mm {N}x{K}/{group}")
                    close(torch.ops.attnlab.q8x_mm(x, repack.pack_q8(q8.q, q8.scale, group), N, group, False), ref,
                          bound, f"q8x_mm {N}x{K}/{group} M{M}")
                    mn = torch.randn(N, K // group, generator=g) * 0.01
                    mins = mn.repeat_interleave(group, dim=1)
                    close(torch.ops.attnlab.q8x_mm(x, repack.pack_q8(q8.q, q8.scale, group, mn), N, group, True),
                          ref + xr @ mins.T, bound + xr.abs() @ mins.abs().T, f"q8x_mm+min {N}x{K}/{group} M{M}")
                    count += 3
    print(f"ok {variant} ({count} checks)")


if __name__ == "__main__":
    main(sys.argv[1])
