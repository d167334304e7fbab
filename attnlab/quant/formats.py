"""Weight formats: how a float matrix becomes codes + scales, and back.

Every format works row by row on a weight W [N out, K in], so rows can be
reordered and concatenated (the loaders' q/k permutations, the fused q/k/v and
gate/up projections) without dequantising. 4-bit codes use ggml's block layout
(see kernels.cpp): GGUF Q4_0/Q4_1 tensors map onto `int4` group 32 by copy.

- int8:   symmetric, one scale per row (or group of G).   w = q * s[g] (+ m[g])  (Q8_0's rule at G = 32;
          the min is there only for GGUF blocks that carry one: Q5_1, Q5_K)
- int4:   asymmetric min/max per group of G inputs.      w = c * s[g] + m[g]   (Q4_1's rule)
- kmeans: 2**bits centroids per row (or group), Lloyd.    w = codebook[g][c]
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from attnlab.errors import AttnlabError
from attnlab.kernels.reference import (  # noqa: F401  (the formats' shared rules)
    BLOCK, KScales, dequantize_int4, dequantize_int8_blocks, int8_blocks, pack4, round_activations, unpack4)


@dataclass
class Packed:
    """A quantized matrix. kind: 'int8' (q [N, K] int8, scale and optional min [N, K/group]), 'int4' (qs [N, K/2],
    scale and min [N, K/group]), 'kmeans' (qs [N, K/2], codebook [N, K/group, 16]); group K = one per row.
    kscale: the scales' K-quant factors where the GGUF file had them (not saved: checkpoints hold the products)."""
    kind: str
    shape: tuple[int, int]
    group: int = 0
    bits: int = 8
    q: torch.Tensor | None = None
    qs: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    min: torch.Tensor | None = None
    codebook: torch.Tensor | None = None
    kscale: KScales | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k) for k in ("q", "qs", "scale", "min", "codebook") if getattr(self, k) is not None}

    def map_rows(self, fn) -> "Packed":
        """Apply a row operation (permutation, reshape along rows) to every row-indexed component."""
        return replace(self, **{k: fn(v) for k, v in self.tensors().items()},
                       kscale=None if self.kscale is None else self.kscale.map_rows(fn))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def dequantize(self) -> torch.Tensor:
        """[N, K] float32."""
        return _table()[self.kind].dequantize(self)

    @property
    def format(self) -> str:
        """'int4:32', 'int8:16', 'int8:32+min', ...: what `promote` and error messages compare."""
        return f"{self.kind}:{self.group}" + ("+min" if _table()[self.kind].min_optional and self.min is not None else "")


def promote(p: Packed, kind: str, group: int, with_min: bool) -> Packed:
    """p in a format that holds it exactly: int4 codes as int8 (with their min), a group split into
    `group`-sized ones (scales repeated), a zero min added. Nothing is rounded."""
    src, dst = _table()[p.kind], _table()[kind]
    if p.kind not in dst.holds or p.group % group:
        raise AttnlabError(f"a {p.format} matrix does not fit {kind}:{group} exactly")
    if (p.kind, p.group, p.min is not None or src.min_always) == (kind, group, with_min):
        return p
    rep = p.group // group
    scale = p.scale.repeat_interleave(rep, 1)
    mn = None if not with_min else (torch.zeros_like(p.scale) if p.min is None else p.min).repeat_interleave(rep, 1)
    return dst.retag(p, group, scale, mn)


def common_format(parts: list[Packed]) -> tuple[str, int, bool]:
    """(kind, group, with_min): the smallest format every one of parts fits exactly (`promote`)."""
    table = _table()
    alone = next((p for p in parts if not table[p.kind].holds), None)  # a format no other holds (k-means)
    if alone is not None and any(p.format != parts[0].format for p in parts):
        raise AttnlabError(f"cannot concatenate {alone.kind} matrices of different formats")
    kinds = {p.kind for p in parts}
    fits = [k for k in table.values() if kinds <= set(k.holds)]  # int4 codes fit int8, never the reverse
    kind = min(fits, key=lambda k: k.bits).name
    return kind, min(p.group for p in parts), any(p.min is not None for p in parts)


def cat_rows(parts: list[Packed]) -> Packed:
    """Rows of several matrices as one (the fused q/k/v and gate/up); mixed formats (a Q4_K_M file's Q4_K
    q beside a Q6_K v) meet in the smallest format all fit exactly (`promote`), never dequantised. The K-quant
    factors stay if every part has them in the same format, else they are dropped (the products stay)."""
    first = parts[0]
    if any(p.shape[1] != first.shape[1] for p in parts):
        raise AttnlabError("cannot concatenate matrices of different widths")
    if any(p.format != first.format for p in parts):
        fmt = common_format(parts)
        parts = [promote(p, *fmt) for p in parts]
        first = parts[0]
    fields = {k: torch.cat([p.tensors()[k] for p in parts]) for k in first.tensors()}
    ks = [p.kscale for p in parts]
    kscale = None
    if all(k is not None for k in ks):
        kscale = KScales(*(None if getattr(ks[0], n) is None else torch.cat([getattr(k, n) for k in ks])
                           for n in ("sc", "d", "m", "dmin")))
    return replace(first, shape=(sum(p.shape[0] for p in parts), first.shape[1]), kscale=kscale, **fields)


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


# ---------------------------------------------------------------- GGUF blocks, by copy

# The block types themselves (sizes, which decoder) are the table's: `attnlab.quant.kinds.GGUF`.


def _table():
    """The table of weight formats (`attnlab.quant.kinds`: it imports this module, so looked up at call time)."""
    from attnlab.quant.kinds import KINDS
    return KINDS


def __getattr__(name: str):
    """GGUF_PACKED and _BLOCK_BYTES, as before the table held them: derived from `kinds.GGUF`."""
    from attnlab.quant import kinds
    if name == "GGUF_PACKED":
        return kinds.GGUF_PACKED
    if name == "_BLOCK_BYTES":
        return {n: (kinds.GGUF[n].size, kinds.GGUF[n].nbytes) for n in kinds.GGUF_PACKED}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _f16(raw: torch.Tensor, at: int, keep: bool = False) -> torch.Tensor:
    """The fp16 at byte `at` of every block [nb, bytes] -> float32 [nb] (float16 with keep)."""
    h = raw.view(torch.int16)[:, at // 2].view(torch.float16)  # every block size and `at` are even
    return h.clone() if keep else h.float()


def _shifted(b: torch.Tensor, shifts: list[int], mask: int) -> torch.Tensor:
    """b [nb, n, w] uint8 -> [nb, n, len(shifts), w]: (b >> s) & mask for each shift."""
    return (b[:, :, None, :] >> torch.tensor(shifts, dtype=torch.uint8)[:, None]) & mask


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes of eight 6-bit scales and mins [nb, 12] -> uint8 scales, mins [nb, 8] (ggml's layout)."""
    d, m, md = s.view(-1, 3, 4).unbind(1)
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], 1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], 1)
    return sc, mn


def _fifth_bit(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0 / Q5_1: 4 bytes of high bits [nb, 4] -> [nb, 32] (bit j of the little-endian word is value j's)."""
    return ((qh[:, :, None] >> torch.arange(8, dtype=torch.uint8)) & 1).reshape(-1, 32)


def _low_high(qs: torch.Tensor) -> torch.Tensor:
    """ggml's 32-value nibble block [nb, 16] (value j low nibble, j + 16 high) -> codes [nb, 32]."""
    return torch.cat([qs & 15, qs >> 4], 1)


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K's 128 code bytes [nb, 128] (chunk c of 32 bytes: sub-block 2c in the low nibbles, 2c+1 in the
    high) -> pack4's layout [nb, 128] (per sub-block, byte j: value j low, value j + 16 high), nibble to
    nibble: half the bytes of unpacking to codes and packing again, the bulk of a Q4_K_M load."""
    b = qs.reshape(-1, 4, 2, 16)  # chunk, values 0-15 / 16-31 of both sub-blocks, j
    lo, hi = b[:, :, 0], b[:, :, 1]
    return torch.stack([(lo & 15) | (hi << 4), (lo >> 4) | (hi & 0xF0)], 2).reshape(-1, 128)


def from_gguf(raw, kind: str, shape: tuple[int, int]) -> Packed:
    """GGUF raw blocks (uint8, any shape holding the tensor's bytes) of a `GGUF_PACKED` type -> Packed, exactly.

    The value each format keeps is the file's, bit for bit after dequantisation (w = d*sc*q - dmin*m for
    Q4_K/Q5_K in groups of 32, d*sc*(q-32) for Q6_K in groups of 16). Vectorised over all blocks.
    Q4_K and Q6_K also keep the factors of those products (`KScales`) for the superblock layouts.
    """
    from attnlab.quant.kinds import GGUF
    N, K = shape
    t = GGUF[kind]
    return t.decode(torch.as_tensor(raw).view(torch.uint8).reshape(N * K // t.size, t.nbytes), N, K)


def gguf_q8_0(raw: torch.Tensor, N: int, K: int) -> Packed:
    return Packed("int8", (N, K), BLOCK, 8, q=raw[:, 2:].contiguous().view(torch.int8).reshape(N, K),
                  scale=_f16(raw, 0).view(N, K // BLOCK))


def gguf_q4(raw: torch.Tensor, N: int, K: int, with_min: bool) -> Packed:
    """Q4_1 (with_min), Q4_0 (min -8 * d): ggml's nibble layout is the kernels', copied as it is."""
    d = _f16(raw, 0)
    m = _f16(raw, 2) if with_min else -8 * d
    qs = raw[:, 4 if with_min else 2:].reshape(N, K // 2).contiguous()
    return Packed("int4", (N, K), BLOCK, 4, qs=qs, scale=d.view(N, -1), min=m.view(N, -1))


def gguf_q5(raw: torch.Tensor, N: int, K: int, with_min: bool) -> Packed:
    """Q5_1 (with_min), Q5_0 (codes - 16): 5-bit codes held as int8."""
    head = 4 if with_min else 2
    q = (_low_high(raw[:, head + 4:]) | (_fifth_bit(raw[:, head:head + 4]) << 4)).view(torch.int8)
    m = _f16(raw, 2).view(N, -1) if with_min else None
    return Packed("int8", (N, K), BLOCK, 8, q=(q if m is not None else q - 16).reshape(N, K),
                  scale=_f16(raw, 0).view(N, -1), min=m)


def _native_decode() -> bool:
    """The K-quant blocks decoded by the C++ kernels (`gguf_q4k_codes`, `gguf_q6k_codes`: one pass, the bytes of
    the torch forms below, which were most of a Q4_K_M file's load) where they are built."""
    from attnlab.kernels import ops
    return ops.enabled()


def gguf_q6_k(raw: torch.Tensor, N: int, K: int) -> Packed:
    if _native_decode():
        q = torch.ops.attnlab.gguf_q6k_codes(raw.contiguous())
    else:
        ql = _shifted(raw[:, :128].reshape(-1, 2, 64), [0, 4], 15).reshape(-1, 8, 32)
        qh = _shifted(raw[:, 128:192].reshape(-1, 2, 32), [0, 2, 4, 6], 3).reshape(-1, 8, 32)
        q = (ql | (qh << 4)).view(torch.int8) - 32
    sc = raw[:, 192:208].view(torch.int8)
    scale = _f16(raw, 208)[:, None] * sc.float()
    return Packed("int8", (N, K), 16, 8, q=q.reshape(N, K), scale=scale.view(N, K // 16),
                  kscale=KScales(sc.reshape(N, K // 16), _f16(raw, 208, keep=True).view(N, K // 256)))


def _k_head(raw: torch.Tensor, N: int, scales: torch.Tensor | None = None):
    """Q4_K / Q5_K's d, dmin, 6-bit sc and m (decoded already where `scales` [nb, 16] is given), and the float32
    scale and min they make."""
    d, dmin = _f16(raw, 0)[:, None], _f16(raw, 2)[:, None]
    sc, mn = _k_scales(raw[:, 4:16]) if scales is None else (scales[:, :8], scales[:, 8:])
    return sc, mn, (d * sc.float()).view(N, -1), (-(dmin * mn.float())).view(N, -1)


def gguf_q4_k(raw: torch.Tensor, N: int, K: int) -> Packed:
    if _native_decode():
        codes, scales = torch.ops.attnlab.gguf_q4k_codes(raw.contiguous())
    else:
        codes, scales = _k_nibbles(raw[:, -128:]), None
    sc, mn, scale, min_ = _k_head(raw, N, scales)
    ks = KScales(sc.reshape(N, K // 32), _f16(raw, 0, keep=True).view(N, -1), mn.reshape(N, K // 32),
                 _f16(raw, 2, keep=True).view(N, -1))
    return Packed("int4", (N, K), BLOCK, 4, qs=codes.reshape(N, K // 2), scale=scale, min=min_, kscale=ks)


def gguf_q5_k(raw: torch.Tensor, N: int, K: int) -> Packed:
    _, _, scale, min_ = _k_head(raw, N)
    ql = _shifted(raw[:, -128:].reshape(-1, 4, 32), [0, 4], 15).reshape(-1, 8, 32)  # sub-block 2c: low, 2c+1: high
    qh = _shifted(raw[:, 16:48].reshape(-1, 1, 32), list(range(8)), 1).reshape(-1, 8, 32)  # bit s of byte j
    return Packed("int8", (N, K), BLOCK, 8, q=(ql | (qh << 4)).view(torch.int8).reshape(N, K), scale=scale, min=min_)
