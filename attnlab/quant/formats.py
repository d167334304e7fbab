"""Weight formats: how a float matrix becomes codes + scales, and back.

Every format works row by row on a weight W [N out, K in], so rows can be
reordered and concatenated (the loaders' q/k permutations, the fused q/k/v and
gate/up projections) without dequantising. 4-bit codes use ggml's block layout
(see kernels.cpp): GGUF Q4_0/Q4_1 tensors map onto `int4` group 32 by copy.

- int8:   symmetric, one scale per row (or group of G).   w = q * s[g]          (Q8_0's rule at G = 32)
- int4:   asymmetric min/max per group of G inputs.      w = c * s[g] + m[g]   (Q4_1's rule)
- kmeans: 2**bits centroids per row (or group), Lloyd.    w = codebook[g][c]
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from attnlab.errors import AttnlabError
from attnlab.kernels.reference import (  # noqa: F401  (the formats' shared rules)
    BLOCK, dequantize_int4, dequantize_int8_blocks, int8_blocks, pack4, round_activations, unpack4)


@dataclass
class Packed:
    """A quantized matrix. kind: 'int8' (q [N, K] int8, scale [N, K/group]), 'int4' (qs [N, K/2], scale
    and min [N, K/group]), 'kmeans' (qs [N, K/2], codebook [N, K/group, 16]); group K = one per row."""
    kind: str
    shape: tuple[int, int]
    group: int = 0
    bits: int = 8
    q: torch.Tensor | None = None
    qs: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    min: torch.Tensor | None = None
    codebook: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k) for k in ("q", "qs", "scale", "min", "codebook") if getattr(self, k) is not None}

    def map_rows(self, fn) -> "Packed":
        """Apply a row operation (permutation, reshape along rows) to every row-indexed component."""
        return replace(self, **{k: fn(v) for k, v in self.tensors().items()})

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32."""
        N, K = self.shape
        if self.kind == "int8":
            return dequantize_int8_blocks(self.q, self.scale)
        if self.kind == "int4":
            return dequantize_int4(self.qs, self.scale, self.min, self.group)
        codes = unpack4(self.qs).view(N, K // self.group, self.group)
        return torch.gather(self.codebook, 2, codes.long()).view(N, K)


def cat_rows(parts: list[Packed]) -> Packed:
    first = parts[0]
    if any(p.kind != first.kind or p.group != first.group or p.shape[1] != first.shape[1] for p in parts):
        raise AttnlabError("cannot concatenate matrices of different formats")
    fields = {k: torch.cat([p.tensors()[k] for p in parts]) for k in first.tensors()}
    return replace(first, shape=(sum(p.shape[0] for p in parts), first.shape[1]), **fields)


def check_shape(w: torch.Tensor, group: int) -> None:
    N, K = w.shape
    if K % BLOCK or K % group:
        raise AttnlabError(f"input size {K} is not a multiple of the group size {group} (and of {BLOCK})")


def quantize_int8(w: torch.Tensor, group: int | None = None) -> Packed:
    N, K = w.shape
    group = group or K
    check_shape(w, group)
    q, scale = int8_blocks(w, group)
    return Packed("int8", (N, K), group, 8, q=q, scale=scale)


def quantize_int4(w: torch.Tensor, group: int = 32) -> Packed:
    check_shape(w, group)
    N, K = w.shape
    g = w.float().view(N, K // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    codes = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15)
    return Packed("int4", (N, K), group, 4, qs=pack4(codes.view(N, K)), scale=scale, min=lo)


def quantize_kmeans(w: torch.Tensor, bits: int = 4, group: int | None = None, iters: int = 12,
                    rows_per_chunk: int = 2048) -> Packed:
    """1-D k-means (Lloyd, quantile init) of each row's (or group's) values into 2**bits centroids."""
    if bits not in (2, 3, 4):
        raise AttnlabError(f"k-means codebooks support 2-4 bits, got {bits}")
    N, K = w.shape
    group = group or K
    check_shape(w, group)
    C = 2 ** bits
    vals = w.float().reshape(-1, group).contiguous()  # one codebook per row of vals
    codes = torch.empty(vals.shape, dtype=torch.uint8)
    books = torch.empty(vals.shape[0], 16)
    qs = torch.linspace(0, 1, 2 * C + 1)[1::2]
    for s in range(0, vals.shape[0], rows_per_chunk):
        v = vals[s:s + rows_per_chunk]
        cent = v.sort(1).values[:, (qs * (v.shape[1] - 1)).round().long()].contiguous()  # [R, C] quantiles
        for _ in range(iters):  # 1-D: the nearest centroid is found between sorted midpoints
            assign = torch.searchsorted(((cent[:, 1:] + cent[:, :-1]) / 2).contiguous(), v)
            total = torch.zeros_like(cent).scatter_add_(1, assign, v)
            count = torch.zeros_like(cent).scatter_add_(1, assign, torch.ones_like(v))
            cent = torch.where(count > 0, total / count.clamp_min(1), cent).sort(-1).values
        codes[s:s + rows_per_chunk] = torch.searchsorted(((cent[:, 1:] + cent[:, :-1]) / 2).contiguous(), v).to(torch.uint8)
        books[s:s + rows_per_chunk] = torch.cat([cent, cent[:, -1:].expand(-1, 16 - C)], 1)  # unused slots padded
    return Packed("kmeans", (N, K), group, bits, qs=pack4(codes.view(N, K)),
                  codebook=books.view(N, K // group, 16))


def from_gguf_q4(blocks, kind: str, shape: tuple[int, int]) -> Packed:
    """GGUF Q4_0 / Q4_1 raw blocks [N, K/32, bytes] (uint8) -> int4 group 32, without dequantising.

    Q4_0 block: fp16 d, 16 bytes of codes; w = (c - 8) d.  Q4_1: fp16 d, fp16 m, codes; w = c d + m.
    """
    raw = torch.as_tensor(blocks).view(torch.uint8)
    N, K = shape
    raw = raw.reshape(N, K // BLOCK, -1)
    head = 2 if kind == "Q4_0" else 4
    d = raw[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    m = -8 * d if kind == "Q4_0" else raw[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
    qs = raw[..., head:].reshape(N, K // 2).contiguous()
    return Packed("int4", (N, K), BLOCK, 4, qs=qs, scale=d, min=m)


def from_gguf_q8_0(blocks, shape: tuple[int, int]) -> Packed:
    """GGUF Q8_0 (fp16 scale per 32, int8 codes) -> int8 group 32, by copy (lossless)."""
    raw = torch.as_tensor(blocks).view(torch.uint8)
    N, K = shape
    raw = raw.reshape(N, K // BLOCK, 2 + BLOCK)
    d = raw[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()   # [N, K/32]
    q = raw[..., 2:].contiguous().view(torch.int8).reshape(N, K)
    return Packed("int8", (N, K), BLOCK, 8, q=q, scale=d)

