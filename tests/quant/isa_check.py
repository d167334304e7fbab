"""Run in a process of its own by test_isa.py (`python -m tests.quant.isa_check VARIANT`, with
ATTNLAB_ISA=VARIANT): every matrix kernel of that variant against the reference arithmetic on
ragged shapes, the repacked ones in every layout (float32 / float16 scales, int4 with a stored min or
min = -8 * scale, GGUF K-quant superblocks), and a float16 scale 1 ulp off must fail the same check.
Inputs of 33 rows take the amx variant's tile multiplies for two tiles of 16 and its vector path for the
last row: each row must come out with the bits of that row alone (the vector path's sums and order). The
reference arithmetic: the activations rounded to int8 per 32 (`round_activations`) times the weights, min
terms included (a min over x itself would pass as closeness but loses 4-5x the KL, see kernels_simd.h).
The gated forms (q4x_glu, q8x_glu) must give silu_mul's bits after the plain kernels. Prints 'ok VARIANT'
on success."""
import sys

import numpy as np
import torch

from attnlab.kernels import build, repack
from attnlab.kernels.reference import dequantize_int4, round_activations, unpack4
from attnlab.quant.formats import from_gguf, quantize_int4, quantize_int8


def close(got, ref, bound, what):
    """|got - ref| within float32 summation error: 3e-6 of the sum of |terms| (bound), elementwise."""
    err = (got - ref).abs()
    assert (err <= 3e-6 * bound + 1e-6).all(), f"{what}: max err {err.max().item():.3g}"


def _q4_ref(x, xr, qs, scale, mn, group):
    """The kernels' sums: int8-rounded activations times the codes' part and the mins' part."""
    N, K = qs.shape[0], x.shape[1]
    codes = (unpack4(qs).float().view(N, -1, group) * scale[..., None]).view(N, K)
    mins = dequantize_int4(qs, scale, mn, group) - codes
    return xr @ codes.T + xr @ mins.T, xr.abs() @ codes.abs().T + xr.abs() @ mins.abs().T


def rows_alone(f, x, what):
    """f(x) for a batch of rows gives each row's f(row) bits (tiles and vector path agree exactly)."""
    if x.shape[0] > 16:
        assert torch.equal(f(x), torch.cat([f(x[i:i + 1]) for i in range(x.shape[0])])), f"{what}: rows differ"


def main(variant: str) -> None:
    assert build.load(), "kernels did not build"
    assert build.variant() == variant, (build.variant(), variant)
    g = torch.Generator().manual_seed(0)
    count = 0
    for N in (1, 17, 40, 77):  # 77: five 16-row blocks, four of them read side by side (one thread)
        for K in (32, 64, 576):
            for M in (1, 2, 5, 9, 33):
                x = torch.randn(M, K, generator=g)
                xr = round_activations(x)
                w = torch.randn(N, K, generator=g) * 0.1
                for group in (32, 64, K):
                    if K % group:
                        continue
                    p = quantize_int4(w, group)
                    for fmt in range(4):  # float32 / float16 scales (HALF), a stored min / -8 * scale (SYM)
                        scale = p.scale.half().float() if fmt & repack.HALF else p.scale
                        mn = -8 * scale if fmt & repack.SYM else p.min.half().float() if fmt & repack.HALF else p.min
                        what = f"q4x_mm {N}x{K}/{group} M{M} layout {fmt}"
                        ref, bound = _q4_ref(x, xr, p.qs, scale, mn, group)
                        if fmt == 0:
                            close(torch.ops.attnlab.q4_mm(x, p.qs, scale, mn, group), ref, bound, f"q4_mm {what}")
                        wp, got = repack.pack_q4(p.qs, scale, mn, group)
                        assert got == fmt, (what, got)  # the values decide the layout
                        close(torch.ops.attnlab.q4x_mm(x, wp, N, group, fmt), ref, bound, what)
                        rows_alone(lambda v: torch.ops.attnlab.q4x_mm(v, wp, N, group, fmt), x, what)
                        count += 1
                        if fmt & repack.HALF and N * M >= 32:  # scales 1 float16 ulp off (a wrong conversion)
                            # must fail (with >= 32 outputs: one output may sum to ~0, leaving no error to see)
                            wrong = (scale.half().view(torch.int16) + 1).view(torch.float16).float()
                            bad = repack.pack_q4(p.qs, wrong, -8 * wrong if fmt & repack.SYM else mn, group, fmt)[0]
                            try:
                                close(torch.ops.attnlab.q4x_mm(x, bad, N, group, fmt), ref, bound, what)
                            except AssertionError:
                                count += 1
                            else:
                                raise AssertionError(f"{what}: a 1-ulp float16 scale error went unnoticed")
                for group in (16, 32, K):
                    q8 = quantize_int8(w, group)
                    mn = torch.randn(N, K // group, generator=g) * 0.01
                    for half in (False, True):
                        scale, mh = (q8.scale.half().float(), mn.half().float()) if half else (q8.scale, mn)
                        wq = (q8.q.float().view(N, -1, group) * scale[..., None]).view(N, K)
                        ref, bound = xr @ wq.T, xr.abs() @ wq.abs().T
                        what = f"{N}x{K}/{group} M{M} half {half}"
                        if group % 32 == 0 and not half:
                            close(torch.ops.attnlab.q8_mm(x, q8.q, scale, group), ref, bound, f"q8_mm {what}")
                        wp, fmt = repack.pack_q8(q8.q, scale, group)
                        assert fmt == (repack.HALF if half else 0), (what, fmt)
                        close(torch.ops.attnlab.q8x_mm(x, wp, N, group, False, fmt), ref, bound, f"q8x_mm {what}")
                        rows_alone(lambda v: torch.ops.attnlab.q8x_mm(v, wp, N, group, False, fmt), x, what)
                        mins = mh.repeat_interleave(group, dim=1)
                        wp, fmt = repack.pack_q8(q8.q, scale, group, mh)
                        assert fmt == (repack.HALF if half else 0), (what, fmt)
                        close(torch.ops.attnlab.q8x_mm(x, wp, N, group, True, fmt), ref + xr @ mins.T,
                              bound + xr.abs() @ mins.abs().T, f"q8x_mm+min {what}")
                        rows_alone(lambda v: torch.ops.attnlab.q8x_mm(v, wp, N, group, True, fmt), x, what)
                        count += 2
    count += k_quants(g) + big_outputs(g) + gated(g)
    print(f"ok {variant} ({count} checks)")


def big_outputs(g) -> int:
    """An output of 2 MiB or more, which the amx variant's tiles store around the caches (`kStreamOut`): the
    same values and each row's bits alone, q4 and q8."""
    M, N, K = 33, 16000, 64
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) * 0.1
    xr = round_activations(x)
    p = quantize_int4(w, 32)
    wp, fmt = repack.pack_q4(p.qs, p.scale, p.min, 32)
    close(torch.ops.attnlab.q4x_mm(x, wp, N, 32, fmt), *_q4_ref(x, xr, p.qs, p.scale, p.min, 32), "q4x_mm 2 MiB out")
    rows_alone(lambda v: torch.ops.attnlab.q4x_mm(v, wp, N, 32, fmt), x, "q4x_mm 2 MiB out")
    q8 = quantize_int8(w, 32)
    wp, fmt = repack.pack_q8(q8.q, q8.scale, 32)
    wq = (q8.q.float().view(N, -1, 32) * q8.scale[..., None]).view(N, K)
    close(torch.ops.attnlab.q8x_mm(x, wp, N, 32, False, fmt), xr @ wq.T, xr.abs() @ wq.abs().T, "q8x_mm 2 MiB out")
    rows_alone(lambda v: torch.ops.attnlab.q8x_mm(v, wp, N, 32, False, fmt), x, "q8x_mm 2 MiB out")
    return 2


def gated(g) -> int:
    """q4x_glu / q8x_glu (an MLP's gate and up rows in one call): the bits of silu_mul after q4x_mm / q8x_mm, in
    every layout, three gate/up pairs of blocks, and an output of 2 MiB (stored around the caches)."""
    from tests.quant.test_kquants import random_blocks
    rng, count = np.random.default_rng(1), 0
    cases = []
    for N, K in ((96, 256), (32768, 32)):
        w = torch.randn(N, K, generator=g) * 0.1
        p = quantize_int4(w, 32)
        for fmt in range(4 if N == 96 else 1):
            scale = p.scale.half().float() if fmt & repack.HALF else p.scale
            mn = -8 * scale if fmt & repack.SYM else p.min.half().float() if fmt & repack.HALF else p.min
            cases.append(("q4x", (repack.pack_q4(p.qs, scale, mn, 32)[0], N, 32, fmt)))
    N, K = 96, 256
    w = torch.randn(N, K, generator=g) * 0.1
    for group in (16, 32):
        q8 = quantize_int8(w, group)
        mn = torch.randn(N, K // group, generator=g) * 0.01
        cases.append(("q8x", (repack.pack_q8(q8.q, q8.scale, group)[0], N, group, False, 0)))
        cases.append(("q8x", (repack.pack_q8(q8.q, q8.scale, group, mn)[0], N, group, True, 0)))
    p = from_gguf(random_blocks("Q4_K", N, K, rng), "Q4_K", (N, K))
    cases.append(("q4x", (repack.pack_q4(p.qs, p.scale, p.min, 32, kscale=p.kscale)[0], N, 32, repack.KQ)))
    p = from_gguf(random_blocks("Q6_K", N, K, rng), "Q6_K", (N, K))
    cases.append(("q8x", (repack.pack_q8(p.q, p.scale, 16, kscale=p.kscale)[0], N, 16, False, repack.KQ)))
    for kind, args in cases:
        mm, glu = getattr(torch.ops.attnlab, f"{kind}_mm"), getattr(torch.ops.attnlab, f"{kind}_glu")
        for M in (1, 5, 33):
            x = torch.randn(M, args[0].shape[1] * (256 if args[-1] == repack.KQ else args[2]), generator=g)
            got = glu(x, *args)
            assert torch.equal(got, torch.ops.attnlab.silu_mul(mm(x, *args))), f"{kind}_glu {args[1:]} M{M}"
            count += 1
    return count


def k_quants(g) -> int:
    """GGUF K-quants in their superblock layouts (repack.KQ): the same bits as the float32 layout of the
    same weights in this variant, and the reference's value."""
    from tests.quant.test_kquants import random_blocks
    rng, count = np.random.default_rng(0), 0
    for N in (1, 17, 40):
        for K in (256, 768):
            p = from_gguf(random_blocks("Q4_K", N, K, rng), "Q4_K", (N, K))
            wk, fmt = repack.pack_q4(p.qs, p.scale, p.min, 32, kscale=p.kscale)
            flat = repack.pack_q4(p.qs, p.scale, p.min, 32, fmt=0)[0]
            assert fmt == repack.KQ
            for M in (1, 2, 5, 9, 33):
                x = torch.randn(M, K, generator=g)
                got = torch.ops.attnlab.q4x_mm(x, wk, N, 32, fmt)
                assert torch.equal(got, torch.ops.attnlab.q4x_mm(x, flat, N, 32, 0)), f"q4x_mm KQ {N}x{K} M{M}"
                close(got, *_q4_ref(x, round_activations(x), p.qs, p.scale, p.min, 32), f"q4x_mm KQ {N}x{K} M{M}")
                rows_alone(lambda v: torch.ops.attnlab.q4x_mm(v, wk, N, 32, fmt), x, f"q4x_mm KQ {N}x{K}")
                count += 1
            p = from_gguf(random_blocks("Q6_K", N, K, rng), "Q6_K", (N, K))
            wk, fmt = repack.pack_q8(p.q, p.scale, 16, kscale=p.kscale)
            flat = repack.pack_q8(p.q, p.scale, 16, fmt=0)[0]
            assert fmt == repack.KQ
            w = p.dequantize()
            for M in (1, 2, 5, 9):
                x = torch.randn(M, K, generator=g)
                got, xr = torch.ops.attnlab.q8x_mm(x, wk, N, 16, False, fmt), round_activations(x)
                assert torch.equal(got, torch.ops.attnlab.q8x_mm(x, flat, N, 16, False, 0)), f"q8x_mm KQ {N}x{K} M{M}"
                close(got, xr @ w.T, xr.abs() @ w.abs().T, f"q8x_mm KQ {N}x{K} M{M}")
                count += 1
            ids = torch.arange(N - 1, -1, -1)
            assert torch.equal(torch.ops.attnlab.q8x_rows(wk, ids, K, 16, False, fmt), w[ids]), f"q8x_rows KQ {N}x{K}"
    return count


if __name__ == "__main__":
    main(sys.argv[1])
