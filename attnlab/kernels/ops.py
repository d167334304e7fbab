"""Every fused op attnlab runs: one typed function each, the C++ kernel when built, else pure torch.

Callers never reach `torch.ops.attnlab` themselves, so which path runs is decided here alone: the
kernels are built and loaded once per process on first use (`build.load`), and `disabled()` pins the
fallback for a block of code (tests compare the two paths that way, in any order).

Matrix ops take activations x [M, K] float32 and a weight's packed operands (N output rows):
  q8_mm (int8 codes q [N, K], scale [N, K/group]), q4_mm (codes qs [N, K/2], scale and min [N, K/group]),
  lut4_mm (k-means codes qs [N, K/2] through int8 codebooks lut [N, K/group, 16], lut_scale [N, K/group]).
  The kernels round x to int8 per 32 values (`reference.round_activations`); the fallback multiplies
  the dequantised matrix in float.
Row ops (Deja Vu's sparse MLP) pick rows idx [k] int64 of a weight given as a layout's operands:
  rows_mv(x [K]) -> [k] = w[idx] @ x; rows_axpy(a [k]) -> [K] = sum_j a_j w[idx_j].
"""
from __future__ import annotations

import math
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from attnlab.kernels import build, repack
from attnlab.kernels.reference import (dequantize_int4, dequantize_int8_blocks, dequantize_lut4, int8_blocks)

_OFF = [False]


def enabled() -> bool:
    """Whether the C++ kernels serve the ops (building them on the first call of the process)."""
    return not _OFF[0] and build.load()


def load() -> bool:
    """Build/load the kernels now (before any torch.compile trace); True if they are available."""
    return build.load()


def repacks() -> bool:
    """Whether int4/int8 layers hold their weights repacked for q4x_mm/q8x_mm (`build.repacks`)."""
    return build.repacks()


@contextmanager
def disabled():
    """Run the block on the pure-torch fallbacks."""
    before, _OFF[0] = _OFF[0], True
    try:
        yield
    finally:
        _OFF[0] = before


# ---------------------------------------------------------------- attention over the KV cache

def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One query per head over a whole cache: q [B, Hq, 1, D] float32; k, v [B, Hkv, L, D] float32 or
    float16, or int8 codes with k_scale, v_scale [B, Hkv, L, D/32]. Returns [B, Hq, 1, D] float32.
    Query head h reads KV head h // (Hq / Hkv); every key and value is read once for its group."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    if enabled():
        extra = () if k_scale is None else (k_scale, v_scale)
        return torch.ops.attnlab.decode_attention(q, k, v, scale, *extra)
    if k_scale is not None:
        k, v = dequantize_int8_blocks(k, k_scale, q.dtype), dequantize_int8_blocks(v, v_scale, q.dtype)
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), scale=scale, enable_gqa=True)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A prompt's chunk over itself and what precedes it: q [B, Hq, T, D] float32, k, v [B, Hkv, L, D] (L >= T,
    float32 or float16), query i seeing keys 0 .. L - T + i (plain causal when L == T), scale 1/sqrt(D).
    Returns [B, Hq, T, D] float32. C++ outside autograd: on AVX-512 variants (head dim 32/64/128) float32, or
    with AMX (head dim a multiple of 64) bfloat16 tiles on operands split hi + lo (~1e-5 of a score); on the others
    each query row as a decode step's attention (any head dim a multiple of 8). Either way a row's bits do not
    depend on the chunk it came in."""
    T, L, D = q.shape[2], k.shape[2], q.shape[3]
    if (_native(q) and k.dtype == v.dtype and k.dtype in (torch.float32, torch.float16)
            and (D in (32, 64, 128) if build.wide() else D % 8 == 0) and all(t.stride(-1) == 1 for t in (q, k, v))):
        if not build.wide() and k.stride() != v.stride():  # the row-by-row form reads k and v by one set of strides
            k, v = k.contiguous(), v.contiguous()
        return torch.ops.attnlab.causal_attention(q, k, v, 1 / math.sqrt(D))
    k, v = k.to(q.dtype), v.to(q.dtype)
    if L == T:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    mask = torch.ones(T, L, dtype=torch.bool, device=q.device).tril(L - T)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys or values [..., D] -> int8 codes [..., D] and float32 scales [..., D/32] (`int8_blocks`)."""
    if enabled():
        return torch.ops.attnlab.quantize_kv(x.float())
    return int8_blocks(x)


# ---------------------------------------------------------------- a forward pass's elementwise glue

def _native(*ts: torch.Tensor) -> bool:
    """Whether a C++ op of a forward pass (glue, prompt attention) serves these tensors: float32 on the CPU,
    outside autograd (the ops have no backward: training keeps torch's)."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in ts)
    return not grad and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in ts) and enabled()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] / rms(x) * weight [D] (float32; the sum of squares in double in C++)."""
    if _native(x, weight):
        return torch.ops.attnlab.rms_norm(x, weight, eps)
    return F.rms_norm(x, weight.shape, weight, eps)


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """h [..., 2 hidden] (gate, then up) -> silu(gate) * up [..., hidden]."""
    if _native(h):
        return torch.ops.attnlab.silu_mul(h)
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---------------------------------------------------------------- quantized matmuls

def dequant_q8(q: torch.Tensor, scale: torch.Tensor, min_: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """int8 codes q [N, K] (scale, min [N, K/group]) dequantised into out [N, K] float32, and returned: one pass,
    no new tensor (a long prompt's float matmul; `dequantize_int8_blocks`' bits)."""
    if enabled():
        return torch.ops.attnlab.dequant_q8(q, scale, min_, out)
    return out.copy_(dequantize_int8_blocks(q, scale, min_=min_))


def dequant_q4(qs: torch.Tensor, scale: torch.Tensor, min_: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """int4 codes qs [N, K/2] (scale, min [N, K/group]) dequantised into out [N, K] float32 (`dequantize_int4`'s bits)."""
    if enabled():
        return torch.ops.attnlab.dequant_q4(qs, scale, min_, out)
    return out.copy_(dequantize_int4(qs, scale, min_, 2 * qs.shape[-1] // scale.shape[-1]))


def q8_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    if enabled():
        return torch.ops.attnlab.q8_mm(x, q, scale, group)
    return x @ dequantize_int8_blocks(q, scale).T


def q4_mm(x: torch.Tensor, qs: torch.Tensor, scale: torch.Tensor, min_: torch.Tensor, group: int) -> torch.Tensor:
    if enabled():
        return torch.ops.attnlab.q4_mm(x, qs, scale, min_, group)
    return x @ dequantize_int4(qs, scale, min_, group).T


def lut4_mm(x: torch.Tensor, qs: torch.Tensor, lut: torch.Tensor, lut_scale: torch.Tensor, group: int) -> torch.Tensor:
    if enabled():
        return torch.ops.attnlab.lut4_mm(x, qs, lut, lut_scale, group)
    return x @ dequantize_lut4(qs, lut, lut_scale, group).T


def q4x_mm(x: torch.Tensor, w: torch.Tensor, n: int, group: int, fmt: int) -> torch.Tensor:
    """q4_mm over weights repacked by `repack.pack_q4` with layout flags fmt (`repack.HALF`, `repack.SYM`)."""
    if enabled():
        return torch.ops.attnlab.q4x_mm(x, w, n, group, fmt)
    return x @ dequantize_int4(*repack.unpack_q4(w, n, x.shape[1], group, fmt), group).T


def q4x_glu(x: torch.Tensor, w: torch.Tensor, n: int, group: int, fmt: int) -> torch.Tensor:
    """silu(gate) * up of q4x_mm's product, w's n rows gate then up: [M, n / 2] in one call."""
    if enabled():
        return torch.ops.attnlab.q4x_glu(x, w, n, group, fmt)
    return silu_mul(q4x_mm(x, w, n, group, fmt))


def q8x_glu(x: torch.Tensor, w: torch.Tensor, n: int, group: int, has_min: bool, fmt: int) -> torch.Tensor:
    """silu(gate) * up of q8x_mm's product, w's n rows gate then up: [M, n / 2] in one call."""
    if enabled():
        return torch.ops.attnlab.q8x_glu(x, w, n, group, has_min, fmt)
    return silu_mul(q8x_mm(x, w, n, group, has_min, fmt))


def q8x_mm(x: torch.Tensor, w: torch.Tensor, n: int, group: int, has_min: bool, fmt: int) -> torch.Tensor:
    """q8_mm (w = q * s [+ m]) over weights repacked by `repack.pack_q8` (flags fmt: `repack.HALF`)."""
    if enabled():
        return torch.ops.attnlab.q8x_mm(x, w, n, group, has_min, fmt)
    q, scale, min_ = repack.unpack_q8(w, n, x.shape[1], group, has_min, fmt)
    return x @ dequantize_int8_blocks(q, scale, min_=min_).T


# ---------------------------------------------------------------- row- and column-sparse ops
# `sparse` is a layout's entry in the table of weight formats (`attnlab.quant.kinds.Sparse`: its C++ ops and the
# fallback's rows), operands the layout's buffers then its group, as the table declares them.

def bound_rows(sparse, operands: tuple) -> tuple:
    """(mv(x, idx), axpy(a, idx)) for one weight with the path and op looked up once, for a loop that
    calls them every token (the checks of a one-shot call cost as much as a small row op)."""
    if enabled():
        mv, axpy = getattr(torch.ops.attnlab, sparse.rows_mv), getattr(torch.ops.attnlab, sparse.rows_axpy)
        return (lambda x, idx: mv(x, *operands, idx)), (lambda a, idx: axpy(a, *operands, idx))
    if sparse.bag:  # a weighted bag of rows: torch streams each row once, no gathered copy
        start = torch.zeros(1, dtype=torch.long)
        axpy = lambda a, idx: F.embedding_bag(idx, operands[0], start, per_sample_weights=a, mode="sum")[0]  # noqa: E731
    else:
        axpy = lambda a, idx: a @ sparse.gather(operands, idx)  # noqa: E731
    return (lambda x, idx: sparse.gather(operands, idx) @ x), axpy


def rows_mv(sparse, x: torch.Tensor, operands: tuple, idx: torch.Tensor) -> torch.Tensor:
    """x [K] float32, idx [k] int64 -> [k]: w[idx] @ x, each selected row read once."""
    return bound_rows(sparse, operands)[0](x, idx)


def rows_axpy(sparse, a: torch.Tensor, operands: tuple, idx: torch.Tensor) -> torch.Tensor:
    """a [k] float32, idx [k] int64 -> [K]: sum_j a_j w[idx_j] (repeated indices add up)."""
    return bound_rows(sparse, operands)[1](a, idx)


# Column-sparse (TEAL): y = W (x thresholded) for one token, on W stored transposed: wt [K inputs, N outputs], one
# input channel per row, in the layout `sparse` names (attnlab/kernels/sparse_cols.cpp). Channels with |x_j| <= tau
# are never read.

def bound_cols(sparse, operands: tuple):
    """cols(x [K] float32, tau) -> [N] float32 for one transposed weight, its op looked up once (the decode
    step calls it four times a layer)."""
    if enabled():
        op = getattr(torch.ops.attnlab, sparse.cols_mv)
        return lambda x, tau: op(x, tau, *operands)
    n = operands[0].shape[1] * sparse.width

    def cols(x, tau):
        idx = (x.abs() > tau).nonzero().flatten()
        return x.index_select(0, idx) @ sparse.gather(operands, idx) if idx.numel() else x.new_zeros(n)
    return cols


def cols_mv(sparse, x: torch.Tensor, tau: float, operands: tuple) -> torch.Tensor:
    """x [K] float32 -> [N]: sum over j with |x_j| > tau of x_j * wt[j] (tau < 0 keeps every channel)."""
    return bound_cols(sparse, operands)(x, tau)
