"""The number formats the kernels compute in, as plain torch: their reference and their fallback.

Why here: the int8 block rounding is shared by int8 weights (`attnlab.quant.formats`), the activations
of the integer matmuls and the int8 KV cache (`attnlab.kv.slots`); the 4-bit nibble layout is what the
C++ kernels read. Keeping the definitions beside the kernels lets `quant/` and `kv/` use them without
importing each other.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # values per int8 scale, and weights per 16-byte block of 4-bit codes


def pack4(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] in 0..15 -> [N, K/2] uint8 (byte j of a block: code j low, code j+16 high)."""
    N, K = codes.shape
    b = codes.to(torch.uint8).view(N, K // BLOCK, 2, BLOCK // 2)
    return (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(N, K // 2)


def unpack4(qs: torch.Tensor) -> torch.Tensor:
    """[N, K/2] uint8 -> codes [N, K] uint8."""
    N = qs.shape[0]
    b = qs.view(N, -1, BLOCK // 2)
    return torch.stack([b & 15, b >> 4], dim=2).reshape(N, -1)


def int8_blocks(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> int8 codes [..., K] and float32 scales [..., K/group], x ~ q * scale (symmetric).
    The rule of `int8` weights and of the int8 KV cache (`attnlab.kv.slots`)."""
    g = x.float().unflatten(-1, (-1, group))
    scale = g.abs().amax(-1).clamp_min(1e-12) / 127
    q = (g / scale[..., None]).round().clamp(-127, 127).to(torch.int8)
    return q.flatten(-2), scale


def dequantize_int8_blocks(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                           min_: torch.Tensor | None = None) -> torch.Tensor:
    """int8_blocks' inverse: codes [..., K], scales [..., K/group] -> [..., K]: w = q * s (+ m[g] with min_,
    the rule GGUF's Q5_1 / Q5_K blocks keep, their 5-bit codes held as int8)."""
    w = q.to(dtype).unflatten(-1, (scale.shape[-1], -1)) * scale[..., None].to(dtype)
    return (w if min_ is None else w + min_[..., None].to(dtype)).flatten(-2)


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """What the integer kernels (int8, int4) multiply instead of x [M, K]: x rounded to int8 with one
    scale per 32 values (llama.cpp's Q8 activations), returned dequantised. For tests and docs."""
    b = x.float().reshape(-1, BLOCK)
    amax = b.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return ((b * inv).round() * (amax / 127)).view(x.shape)


def dequantize_int4(qs: torch.Tensor, scale: torch.Tensor, min_: torch.Tensor, group: int) -> torch.Tensor:
    """int4 codes [N, K/2] with scale and min [N, K/group] -> [N, K] float32: w = c * s + m (Q4_1's rule)."""
    N = qs.shape[0]
    codes = unpack4(qs).view(N, -1, group)
    return (codes.float() * scale[..., None] + min_[..., None]).view(N, -1)


def dequantize_lut4(qs: torch.Tensor, lut: torch.Tensor, lut_scale: torch.Tensor, group: int) -> torch.Tensor:
    """k-means codes [N, K/2] through per-group int8 codebooks lut [N, K/group, 16] (scale [N, K/group])."""
    N = qs.shape[0]
    codes = unpack4(qs).view(N, -1, group).long()
    return (torch.gather(lut.float(), 2, codes) * lut_scale[..., None]).view(N, -1)


@dataclass
class KScales:
    """A GGUF K-quant's scales as the file factorises them, per row: sub-block scales sc (Q4_K: uint8 0..63
    per 32 weights, with mins m; Q6_K: int8 per 16) times float16 d (and dmin) per 256-weight superblock.
    Packed.scale = d * sc and min = -(dmin * m) in float32 are the products; these factors let the repacked
    layout keep the file's 4.5 / 6.56 bits per weight (`repack.KQ`) instead of a float32 per group."""
    sc: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None
    dmin: torch.Tensor | None = None

    def map_rows(self, fn) -> "KScales":
        return KScales(*(None if t is None else fn(t) for t in (self.sc, self.d, self.m, self.dmin)))


# ---------------------------------------------------------------- rows gathered as floats (the sparse ops' fallbacks)
# operands as the row and column ops take them (`attnlab.quant.kinds.Sparse`): a layout's buffers, then its group

def rows_float(operands: tuple, idx: torch.Tensor) -> torch.Tensor:
    """Rows idx of a float matrix (w,) as float32 [k, K]."""
    return operands[0].index_select(0, idx).float()


def rows_int8(operands: tuple, idx: torch.Tensor) -> torch.Tensor:
    """Rows idx of int8 codes (q, scale, group) dequantised, float32 [k, K]."""
    return dequantize_int8_blocks(*(t.index_select(0, idx) for t in operands[:-1]))


def rows_int4(operands: tuple, idx: torch.Tensor) -> torch.Tensor:
    """Rows idx of int4 codes (qs, scale, min, group) dequantised, float32 [k, K]."""
    return dequantize_int4(*(t.index_select(0, idx) for t in operands[:-1]), operands[-1])


# TEAL's column layout (`qc_cols_mv` in sparse_cols.cpp): a weight W [N, K] by input channel, in its own groups, so
# one channel's codes for every output are one row [K, ...] the op skips whole. Codes are permuted within blocks so
# that four channels' blocks, byte-interleaved by two rounds of unpack, meet VNNI's dot product in output order:
# 4-bit blocks of 128 outputs in 64 bytes (byte p: low nibble output o(p), high nibble 64 + o(p), o(p) = 16 (p % 16
# div 4) + 4 (p div 16) + p % 4), a last block of 64 outputs in 32 bytes (low 8 (p % 16 div 4) + 4 (p div 16) + p % 4,
# high 32 + that); 8-bit blocks of 64 outputs in 64 bytes (byte p: output o(p), code + 128).

def _col_order(N: int, bits: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The output each byte of a column row holds: (low [bytes], high [bytes] or None for 8-bit)."""
    p = torch.arange(64)
    o = 16 * (p % 16 // 4) + 4 * (p // 16) + p % 4
    if bits == 8:
        return (torch.arange(0, N, 64)[:, None] + o).flatten(), None
    full = N // 128 * 128
    base = torch.arange(0, full, 128)[:, None]
    lo, hi = [(base + o).flatten()], [(base + 64 + o).flatten()]
    if full < N:
        t = 8 * (p[:32] % 16 // 4) + 4 * (p[:32] // 16) + p[:32] % 4
        lo.append(full + t), hi.append(full + 32 + t)
    return torch.cat(lo), torch.cat(hi)


def pack_cols(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [N, K] (0..15 for 4-bit, int8 for 8-bit) -> the column rows [K, N * bits / 8] uint8 (N a multiple of 64)."""
    ct = codes.T.contiguous()
    lo, hi = _col_order(codes.shape[0], bits)
    if hi is None:
        return (ct[:, lo].int() + 128).to(torch.uint8)
    return (ct[:, lo] | (ct[:, hi] << 4)).to(torch.uint8)


def unpack_cols(rows: torch.Tensor, bits: int) -> torch.Tensor:
    """Column rows [k, N * bits / 8] -> codes [k, N] (float32: 0..15, or the int8 values)."""
    N = rows.shape[1] * 8 // bits
    lo, hi = _col_order(N, bits)
    out = torch.empty(rows.shape[0], N)
    if hi is None:
        out[:, lo] = rows.float() - 128
    else:
        out[:, lo], out[:, hi] = (rows & 15).float(), (rows >> 4).float()
    return out


def rows_by_inputs(operands: tuple, idx: torch.Tensor) -> torch.Tensor:
    """Rows idx (input channels) of a weight in the column layout: (codes [K, N * bits / 8], scale and min [K / group,
    N] (min empty: none), bits, group) -> float32 [k, N]."""
    codes, scale, mn, bits, group = operands
    w = unpack_cols(codes.index_select(0, idx), bits) * scale.index_select(0, idx // group).float()
    return w + mn.index_select(0, idx // group).float() if mn.numel() else w
