"""Weights repacked into 16-row blocks for the `q4x_mm` / `q8x_mm` kernels (layout: repacked.cpp), and back.

Why: one 512-bit load then feeds 16 output rows (4 inputs of each per 32-bit lane), the shape
`vpdpbusd` wants. The repacked tensor replaces the row layout (one copy of the weights in memory);
`unpack_*` rebuild the row layout when someone asks for it (dequantise, save, Deja Vu's row ops).
Rows are padded to a multiple of 16 with zero codes and scales; the kernels write only the first N.
"""
from __future__ import annotations

import torch

from attnlab.kernels.reference import pack4, unpack4

ROWS = 16


def _blocks(t: torch.Tensor, nb: int) -> torch.Tensor:
    """[N, ...] -> [nb*16, ...] zero-padded."""
    pad = nb * ROWS - t.shape[0]
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def _floats(t: torch.Tensor, nb: int) -> torch.Tensor:
    """Per-group floats [N, G] -> bytes [nb, G, 64] (16 rows' values side by side per group)."""
    G = t.shape[1]
    return _blocks(t.float(), nb).view(nb, ROWS, G).transpose(1, 2).contiguous().view(torch.uint8).view(nb, G, 64)


def _unfloats(b: torch.Tensor, N: int) -> torch.Tensor:
    nb, G = b.shape[:2]
    return b.contiguous().view(torch.float32).view(nb, G, ROWS).transpose(1, 2).reshape(nb * ROWS, G)[:N].contiguous()


def pack_q4(qs: torch.Tensor, scale: torch.Tensor, min_: torch.Tensor, group: int) -> torch.Tensor:
    """int4 codes [N, K/2] (pack4's nibbles), scale and min [N, K/group] -> uint8 [ceil(N/16), K/group, group*8 + 128]."""
    N, K = qs.shape[0], qs.shape[1] * 2
    nb, G, per = -(-N // ROWS), K // group, group // 32
    c = _blocks(unpack4(qs), nb).view(nb, ROWS, G, per, 2, 4, 4).permute(0, 2, 3, 4, 5, 1, 6)  # nb G per half j r t
    codes = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).reshape(nb, G, per * 256)
    return torch.cat([codes, _floats(scale, nb), _floats(min_, nb)], dim=2)


def unpack_q4(w: torch.Tensor, N: int, K: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack_q4's inverse: (qs [N, K/2], scale, min [N, K/group])."""
    nb, G, per = w.shape[0], K // group, group // 32
    b = w[:, :, :per * 256].reshape(nb, G, per, 4, ROWS, 4)  # nb G per j r t
    c = torch.stack([b & 15, b >> 4], dim=3)  # nb G per half j r t
    codes = c.permute(0, 5, 1, 2, 3, 4, 6).reshape(nb * ROWS, K)[:N]
    off = per * 256
    return pack4(codes), _unfloats(w[:, :, off:off + 64], N), _unfloats(w[:, :, off + 64:off + 128], N)


def pack_q8(q: torch.Tensor, scale: torch.Tensor, group: int, min_: torch.Tensor | None = None) -> torch.Tensor:
    """int8 codes [N, K], scale (and min) [N, K/group] -> uint8 [ceil(N/16), K/group, group*16 + 64 (+64)]."""
    N, K = q.shape
    nb, G = -(-N // ROWS), K // group
    u = (_blocks(q, nb).to(torch.int16) + 128).to(torch.uint8)
    codes = u.view(nb, ROWS, G, group // 4, 4).permute(0, 2, 3, 1, 4).reshape(nb, G, group * 16)
    parts = [codes, _floats(scale, nb)] + ([] if min_ is None else [_floats(min_, nb)])
    return torch.cat(parts, dim=2)


def unpack_q8(w: torch.Tensor, N: int, K: int, group: int, has_min: bool):
    """pack_q8's inverse: (q [N, K] int8, scale [N, K/group], min or None)."""
    nb, G = w.shape[0], K // group
    u = w[:, :, :group * 16].reshape(nb, G, group // 4, ROWS, 4).permute(0, 3, 1, 2, 4).reshape(nb * ROWS, K)[:N]
    q = (u.to(torch.int16) - 128).to(torch.int8)
    off = group * 16
    mn = _unfloats(w[:, :, off + 64:off + 128], N) if has_min else None
    return q, _unfloats(w[:, :, off:off + 64], N), mn
