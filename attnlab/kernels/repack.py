"""Weights repacked into 16-row blocks for the `q4x_mm` / `q8x_mm` kernels (layout: repacked_layout.h), and back.

Why: one 512-bit load then feeds 16 output rows (4 inputs of each per 32-bit lane), the shape
`vpdpbusd` wants. The repacked tensor replaces the row layout (one copy of the weights in memory);
`unpack_*` rebuild the row layout when someone asks for it (dequantise, save, Deja Vu's row ops).
Rows are padded to a multiple of 16 with zero codes and scales; the kernels write only the first N.

Layout flags, one int per layer (decided here at pack time, passed to the kernels): HALF stores scales
and mins as float16 where every value of the layer is exactly a float16 (a GGUF file's own scales), so
nothing changes numerically; SYM (int4) stores no min where min == -8 * scale for the whole layer (Q4_0).
A decode matvec reads every byte once, so bytes are its time: Q4_0 18 bytes per 32 weights (was 24).
KQ (alone) keeps a GGUF K-quant's factorised scales (`reference.KScales`) per 256-input superblock instead of
one float32 product per group: Q4_K in q4x 4.625 bits per weight (was 6), Q6_K in q8x 6.5625 (was 10).
"""
from __future__ import annotations

import torch

from attnlab.kernels.reference import KScales, pack4, unpack4

ROWS = 16
HALF, SYM, KQ = 1, 2, 4  # the layout flags (repacked_layout.h)
SUPER = 256  # inputs per K-quant superblock


def exact_half(*ts: torch.Tensor | None) -> bool:
    """Whether every value of the tensors is exactly a float16 (NaN and overflow are not)."""
    return all(t is None or bool((t.float().half().float() == t.float()).all()) for t in ts)


def q4_layout(scale: torch.Tensor, min_: torch.Tensor) -> int:
    """The flags an int4 layer packs with: HALF if scale and min are float16 values, SYM if min == -8 * scale."""
    sym = bool((min_.float() == -8 * scale.float()).all())
    return (HALF if exact_half(scale, None if sym else min_) else 0) | (SYM if sym else 0)


def q8_layout(scale: torch.Tensor, min_: torch.Tensor | None = None) -> int:
    """The flags an int8 layer packs with: HALF if scale (and min) are float16 values."""
    return HALF if exact_half(scale, min_) else 0


def _native(reference: bool) -> bool:
    """Repack in C++ (one pass, `repack_load.cpp`; in torch the permutes took ~70% of a 1B load): the torch
    forms in `pack_*` are the layout's reference (`reference=True`, for tests) and a kernel-less fallback."""
    from attnlab.kernels import ops
    return not reference and ops.enabled()


def _blocks(t: torch.Tensor, nb: int) -> torch.Tensor:
    """[N, ...] -> [nb*16, ...] zero-padded."""
    pad = nb * ROWS - t.shape[0]
    return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def _floats(t: torch.Tensor, nb: int, half: bool) -> torch.Tensor:
    """Per-group floats [N, G] -> bytes [nb, G, 32 or 64] (16 rows' values side by side per group)."""
    G, dt = t.shape[1], torch.float16 if half else torch.float32
    if half and not exact_half(t):
        raise ValueError("float16 scales asked for values that are not float16")
    return _blocks(t.float().to(dt), nb).view(nb, ROWS, G).transpose(1, 2).contiguous().view(torch.uint8).view(nb, G, -1)


def _unfloats(b: torch.Tensor, N: int, half: bool) -> torch.Tensor:
    nb, G = b.shape[:2]
    f = b.contiguous().view(torch.float16 if half else torch.float32).float()
    return f.view(nb, G, ROWS).transpose(1, 2).reshape(nb * ROWS, G)[:N].contiguous()


def _bytes(t: torch.Tensor, nb: int, S: int) -> torch.Tensor:
    """Per-group bytes (uint8 or int8) [N, G] -> [nb, S, G/S * 16]: per superblock, group by group, 16 rows' bytes."""
    G = t.shape[1]
    return _blocks(t.view(torch.uint8), nb).view(nb, ROWS, S, G // S).permute(0, 2, 3, 1).reshape(nb, S, -1)


def _unbytes(b: torch.Tensor, N: int) -> torch.Tensor:
    """_bytes' inverse: [nb, S, n * 16] -> [N, S * n] uint8."""
    nb, S = b.shape[:2]
    return b.reshape(nb, S, -1, ROWS).permute(0, 3, 1, 2).reshape(nb * ROWS, -1)[:N]


def _check_kq(kscale, scale: torch.Tensor, min_: torch.Tensor | None, group: int, K: int) -> None:
    """KQ needs the K-quant factors of exactly these scales (and mins), groups of 32 (Q4_K) or 16 (Q6_K)."""
    if kscale is None or K % SUPER or group != (32 if kscale.m is not None else 16):
        raise ValueError(f"KQ layout asked without K-quant factors of groups of {group} on {K} inputs")

    def product(f, s):  # the loader's float32 product of each group's factors
        return f.float().repeat_interleave(SUPER // group, 1) * s.float()
    if not torch.equal(product(kscale.d, kscale.sc), scale.float()) or (
            kscale.m is not None and not torch.equal(-product(kscale.dmin, kscale.m), min_.float())):
        raise ValueError("KQ layout asked with factors whose products are not the scales (and mins)")


def kscales_q4k(w: torch.Tensor, N: int, K: int) -> KScales:
    """Q4_K's factors in a KQ-packed int4 weight: after 2048 code bytes, sc[8][16], m[8][16], d[16], dmin[16]."""
    b = w[:, :, 2048:]
    return KScales(_unbytes(b[:, :, :128], N), _unfloats(b[:, :, 256:288], N, True).half(),
                   _unbytes(b[:, :, 128:256], N), _unfloats(b[:, :, 288:320], N, True).half())


def kscales_q6k(w: torch.Tensor, N: int, K: int) -> KScales:
    """Q6_K's factors in a KQ-packed int8 weight: after 3072 code bytes, int8 sc[16][16], d[16]."""
    b = w[:, :, 3072:]
    return KScales(_unbytes(b[:, :, :256], N).view(torch.int8), _unfloats(b[:, :, 256:288], N, True).half())


def _q4_codes(qs: torch.Tensor, nb: int, G: int, per: int) -> torch.Tensor:
    """pack4's codes [N, K/2] -> the q4 chunks [nb, G, per * 256] (layout: repacked_layout.h)."""
    c = _blocks(unpack4(qs), nb).view(nb, ROWS, G, per, 2, 4, 4).permute(0, 2, 3, 4, 5, 1, 6)  # nb G per half j r t
    return (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).reshape(nb, G, per * 256)


def _q4_uncodes(b: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """_q4_codes' inverse from the code bytes [nb, G, per * 256] -> pack4's [N, K/2]."""
    nb, G, per = b.shape[0], b.shape[1], b.shape[2] // 256
    b = b.reshape(nb, G, per, 4, ROWS, 4)  # nb G per j r t
    c = torch.stack([b & 15, b >> 4], dim=3)  # nb G per half j r t
    return pack4(c.permute(0, 5, 1, 2, 3, 4, 6).reshape(nb * ROWS, K)[:N])


def _pack_q4k(qs: torch.Tensor, ks, nb: int, reference: bool) -> torch.Tensor:
    """Q4_K's superblocks: per 16 rows and 256 inputs, 8 q4 sub-blocks of codes (2048 bytes), uint8 sc[8][16]
    and m[8][16], float16 d[16] and dmin[16]: 2368 bytes."""
    K = qs.shape[1] * 2
    S = K // SUPER
    if _native(reference):
        return torch.ops.attnlab.repack_q4k(qs.contiguous(), ks.sc.contiguous(), ks.m.contiguous(),
                                            ks.d.float().contiguous(), ks.dmin.float().contiguous())
    codes = _q4_codes(qs, nb, K // 32, 1).view(nb, S, 8 * 256)
    return torch.cat([codes, _bytes(ks.sc, nb, S), _bytes(ks.m, nb, S), _floats(ks.d, nb, True),
                      _floats(ks.dmin, nb, True)], dim=2)


def pack_q4(qs: torch.Tensor, scale: torch.Tensor, min_: torch.Tensor, group: int,
            fmt: int | None = None, reference: bool = False, kscale=None) -> tuple[torch.Tensor, int]:
    """int4 codes [N, K/2] (pack4's nibbles), scale and min [N, K/group] -> (uint8 [ceil(N/16), K/group,
    group*8 + 32 or 64 per float row], flags); fmt forces the flags (default `q4_layout`, or KQ with Q4_K's
    factors kscale: uint8 [ceil(N/16), K/256, 2368])."""
    N, K = qs.shape[0], qs.shape[1] * 2
    nb, G, per = -(-N // ROWS), K // group, group // 32
    if fmt is None and kscale is not None and kscale.m is not None and group == 32 and K % SUPER == 0:
        fmt = KQ
    if fmt == KQ:
        _check_kq(kscale, scale, min_, group, K)
        return _pack_q4k(qs, kscale, nb, reference), KQ
    if fmt is None:
        fmt = q4_layout(scale, min_)
    elif fmt & SYM and not bool((min_.float() == -8 * scale.float()).all()):
        raise ValueError("SYM layout asked for mins that are not -8 * scale")
    elif fmt & HALF and not exact_half(scale, None if fmt & SYM else min_):
        raise ValueError("float16 scales asked for values that are not float16")
    if _native(reference):
        return torch.ops.attnlab.repack_q4(qs.contiguous(), scale.float().contiguous(), min_.float().contiguous(),
                                           group, fmt), fmt
    half = bool(fmt & HALF)
    parts = [_q4_codes(qs, nb, G, per), _floats(scale, nb, half)] + ([] if fmt & SYM else [_floats(min_, nb, half)])
    return torch.cat(parts, dim=2), fmt


def unpack_q4(w: torch.Tensor, N: int, K: int, group: int, fmt: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack_q4's inverse: (qs [N, K/2], scale, min [N, K/group] float32); KQ's factors: `kscales`."""
    nb, G, per = w.shape[0], K // group, group // 32
    if fmt == KQ:  # the products, as formats.from_gguf makes them
        ks = kscales_q4k(w, N, K)
        d, dmin = (t.float().repeat_interleave(SUPER // group, 1) for t in (ks.d, ks.dmin))
        return _q4_uncodes(w[:, :, :2048].reshape(nb, G, 256), N, K), d * ks.sc.float(), -(dmin * ks.m.float())
    off, size, half = per * 256, 32 if fmt & HALF else 64, bool(fmt & HALF)
    scale = _unfloats(w[:, :, off:off + size], N, half)
    mn = -8 * scale if fmt & SYM else _unfloats(w[:, :, off + size:off + 2 * size], N, half)
    return _q4_uncodes(w[:, :, :off], N, K), scale, mn


def _pack_q6k(q: torch.Tensor, ks, nb: int, reference: bool) -> torch.Tensor:
    """Q6_K's superblocks: per 16 rows and 256 inputs, 8 x (codes q + 32 in 0..63: the low 4 bits as q4
    chunks, 256 bytes, then bits 4-5 of chunk pair (2p, 2p + 1), 64 bytes each: lane r's byte t holds those
    of inputs 8p + t, 16 + 8p + t, 8p + 4 + t, 20 + 8p + t in bits 0-1, 2-3, 4-5, 6-7), int8 sc[16][16]
    (one per 16 inputs), float16 d[16]: 3360 bytes, the file's 6.5625 bits per weight."""
    N, K = q.shape
    S = K // SUPER
    if _native(reference):
        return torch.ops.attnlab.repack_q6k(q.contiguous(), ks.sc.contiguous(), ks.d.float().contiguous())
    c = _blocks((q.to(torch.int16) + 32).to(torch.uint8), nb).view(nb, ROWS, S, 8, 2, 2, 2, 4)  # r S u half p jj t
    lo, hi = c & 15, c >> 4
    low = (lo[:, :, :, :, 0] | (lo[:, :, :, :, 1] << 4)).permute(0, 2, 3, 4, 5, 1, 6).reshape(nb, S, 8, 256)
    high = (hi[:, :, :, :, 0, :, 0] | (hi[:, :, :, :, 1, :, 0] << 2) | (hi[:, :, :, :, 0, :, 1] << 4)
            | (hi[:, :, :, :, 1, :, 1] << 6)).permute(0, 2, 3, 4, 1, 5).reshape(nb, S, 8, 128)  # nb S u p r t
    codes = torch.cat([low, high], dim=3).reshape(nb, S, 8 * 384)
    return torch.cat([codes, _bytes(ks.sc, nb, S), _floats(ks.d, nb, True)], dim=2)


def _q6_fits(q: torch.Tensor, kscale, group: int, min_) -> bool:
    """Whether int8 codes take the KQ layout: Q6_K's factors, no min, codes within -32..31."""
    return (kscale is not None and kscale.m is None and group == 16 and min_ is None and q.shape[1] % SUPER == 0
            and int(q.min()) >= -32 and int(q.max()) <= 31)


def pack_q8(q: torch.Tensor, scale: torch.Tensor, group: int, min_: torch.Tensor | None = None,
            fmt: int | None = None, reference: bool = False, kscale=None) -> tuple[torch.Tensor, int]:
    """int8 codes [N, K], scale (and min) [N, K/group] -> (uint8 [ceil(N/16), K/group, group*16 + 32 or 64
    per float row], flags); fmt forces the flags (default `q8_layout`, or KQ with Q6_K's factors kscale:
    uint8 [ceil(N/16), K/256, 3360])."""
    N, K = q.shape
    nb, G = -(-N // ROWS), K // group
    fits = (fmt is None or fmt == KQ) and _q6_fits(q, kscale, group, min_)  # one pass over the codes
    if fmt is None and fits:
        fmt = KQ
    if fmt == KQ:
        _check_kq(kscale, scale, None, group, K)
        if not fits:
            raise ValueError("KQ layout asked for int8 codes that are not Q6_K's (-32..31, groups of 16, no min)")
        return _pack_q6k(q, kscale, nb, reference), KQ
    if fmt is None:
        fmt = q8_layout(scale, min_)
    elif fmt & SYM:
        raise ValueError("int8 blocks have no SYM layout")
    elif fmt & HALF and not exact_half(scale, min_):
        raise ValueError("float16 scales asked for values that are not float16")
    if _native(reference):
        return torch.ops.attnlab.repack_q8(q.contiguous(), scale.float().contiguous(),
                                           None if min_ is None else min_.float().contiguous(), group, fmt), fmt
    u = (_blocks(q, nb).to(torch.int16) + 128).to(torch.uint8)
    codes = u.view(nb, ROWS, G, group // 4, 4).permute(0, 2, 3, 1, 4).reshape(nb, G, group * 16)
    half = bool(fmt & HALF)
    parts = [codes, _floats(scale, nb, half)] + ([] if min_ is None else [_floats(min_, nb, half)])
    return torch.cat(parts, dim=2), fmt


def unpack_q8(w: torch.Tensor, N: int, K: int, group: int, has_min: bool, fmt: int):
    """pack_q8's inverse: (q [N, K] int8, scale [N, K/group] float32, min or None); KQ's factors: `kscales`."""
    nb, G = w.shape[0], K // group
    if fmt == KQ:
        S = K // SUPER
        b = w[:, :, :3072].reshape(nb, S, 8, 384)
        low, high = b[..., :256].reshape(nb, S, 8, 4, ROWS, 4), b[..., 256:].reshape(nb, S, 8, 2, ROWS, 4)  # j / p r t
        lo = torch.stack([low & 15, low >> 4], dim=3)  # nb S u half j r t
        hi = torch.stack([(high >> s) & 3 for s in (0, 2, 4, 6)], dim=3).view(nb, S, 8, 2, 2, 2, ROWS, 4)  # jj half p
        c = lo.view(nb, S, 8, 2, 2, 2, ROWS, 4) | (hi.permute(0, 1, 2, 4, 5, 3, 6, 7) << 4)  # nb S u half p jj r t
        q = (c.permute(0, 6, 1, 2, 3, 4, 5, 7).reshape(nb * ROWS, K)[:N].to(torch.int16) - 32).to(torch.int8)
        ks = kscales_q6k(w, N, K)
        return q, ks.d.float().repeat_interleave(SUPER // group, 1) * ks.sc.float(), None
    u = w[:, :, :group * 16].reshape(nb, G, group // 4, ROWS, 4).permute(0, 3, 1, 2, 4).reshape(nb * ROWS, K)[:N]
    q = (u.to(torch.int16) - 128).to(torch.int8)
    off, size, half = group * 16, 32 if fmt & HALF else 64, bool(fmt & HALF)
    mn = _unfloats(w[:, :, off + size:off + 2 * size], N, half) if has_min else None
    return q, _unfloats(w[:, :, off:off + size], N, half), mn


def nbytes_q4(N: int, K: int, group: int, has_min: bool, fmt: int) -> int:
    """Bytes of an N x K int4 weight in this layout, rows unpadded: codes + per-group scales (and mins)."""
    if fmt == KQ:  # per 256 inputs: 128 code bytes, 16 of sc and m, 4 of d and dmin
        return N * K // SUPER * 148
    return N * K // 2 + N * (K // group) * (1 if fmt & SYM else 2) * (2 if fmt & HALF else 4)


def nbytes_q8(N: int, K: int, group: int, has_min: bool, fmt: int) -> int:
    """Bytes of an N x K int8 weight in this layout, rows unpadded: codes + per-group scales (and mins)."""
    if fmt == KQ:  # per 256 inputs: 192 code bytes, 16 of sc, 2 of d
        return N * K // SUPER * 210
    return N * K + N * (K // group) * (2 if has_min else 1) * (2 if fmt & HALF else 4)
