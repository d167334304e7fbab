"""The weight formats as one table: everything that differs between int8, int4 and k-means codes, one entry each.

Why: a format's rules were spread over five files (the quantizer, QuantLinear's kernel choice and repacking, Deja
Vu's row ops, TEAL's column ops), each an if-chain on the kind, so a new format meant edits in each. Now it is
one `Kind` here, plus its C++ ops and their torch fallbacks in `attnlab.kernels.ops` (which every op name below
is, with the same arguments). Shapes: a weight W [N out, K in]; `operands` are the row layout's buffers in the
order the matmul op takes them (then the group size).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from attnlab.errors import AttnlabError
from attnlab.kernels import repack
from attnlab.quant.formats import Packed, quantize_int4, quantize_int8, quantize_kmeans


@dataclass(frozen=True)
class Kind:
    """name: Packed.kind. quantize(w, group or None, bits) -> Packed. operands: the matmul's buffers (row layout).
    matmul: x [M, K] @ W^T on the row layout. repacked / glu: the same (and silu(gate) * up in the epilogue) on 16-row
    blocks, None where the format is never repacked; the blocks' ops take (wp, n, group[, has_min], layout), with
    has_min where `min_flag`. embed: the op reading whole rows from the blocks (a tied embedding), if any.
    rows: Deja Vu's row-op family, where `rows_ok`. columns: TEAL's transposed copy's format; own_columns: TEAL's
    op on the model's own groups of 32 inputs, if any. superblock: the GGUF K-quant the blocks may hold."""
    name: str
    quantize: Callable[[torch.Tensor, int | None, int], Packed]
    operands: tuple[str, ...]
    matmul: str
    repacked: str | None = None
    glu: str | None = None
    min_flag: bool = False
    embed: str | None = None
    rows: str | None = None
    columns: str | None = None
    own_columns: str | None = None
    superblock: str = ""

    def repackable(self, K: int, group: int) -> bool:
        """Shapes the blocks' kernels take: K of 32k, int4 groups of 32k, int8 groups of 16 or 32k."""
        if self.repacked is None or K % 32:
            return False
        return self.name == "int4" or group in (16, 32) or group % 32 == 0

    def batched(self, K: int, group: int) -> bool:
        """Does the row layout's matmul read each weight once for four activation rows (int4 at group 32 with K of
        64k, int8 at group 32)? Then it beats dequantising the weight for a float matmul up to a few hundred rows."""
        return self.name in ("int4", "int8") and group == 32 and (self.name == "int8" or K % 64 == 0)

    def needs_repack(self, group: int, has_min: bool) -> bool:
        """No row-layout kernel: int8 with a min or in groups of 16 (GGUF K-quants)."""
        return self.min_flag and (has_min or group % 32 != 0)

    def rows_ok(self, group: int, has_min: bool) -> bool:
        """The rows kernels' int8 has no min and groups of 32k (not GGUF K-quants' Q5_K / Q6_K)."""
        return self.rows is not None and (not self.min_flag or (not has_min and group % 32 == 0))

    def pack(self, p: Packed, has_min: bool) -> tuple[torch.Tensor, int]:
        """p in 16-row blocks: (wp, layout flags), the flags decided per layer (`attnlab.kernels.repack`)."""
        if self.name == "int4":
            return repack.pack_q4(p.qs, p.scale, p.min, p.group, kscale=p.kscale)
        return repack.pack_q8(p.q, p.scale, p.group, p.min if has_min else None, kscale=p.kscale)

    def unpack(self, wp: torch.Tensor, N: int, K: int, group: int, has_min: bool, layout: int,
               kscale=None) -> Packed:
        """The row layout back from blocks wp (rows N of them)."""
        if self.name == "int4":
            qs, scale, mn = repack.unpack_q4(wp, N, K, group, layout)
            return Packed("int4", (N, K), group, 4, qs=qs, scale=scale, min=mn, kscale=kscale)
        q, scale, mn = repack.unpack_q8(wp, N, K, group, has_min, layout)
        return Packed("int8", (N, K), group, 8, q=q, scale=scale, kscale=kscale, min=mn if has_min else None)

    def block_args(self, n: int, group: int, has_min: bool, layout: int) -> tuple:
        """The blocks' ops' arguments after wp."""
        return (n, group, has_min, layout) if self.min_flag else (n, group, layout)


KINDS = {k.name: k for k in (
    Kind("int8", lambda w, group, bits: quantize_int8(w, group), ("q", "scale"), "q8_mm", "q8x_mm", "q8x_glu",
         min_flag=True, embed="q8x_rows", rows="q8", columns="int8:32", superblock="Q6_K"),
    Kind("int4", lambda w, group, bits: quantize_int4(w, group or 32), ("qs", "scale", "min"), "q4_mm", "q4x_mm",
         "q4x_glu", rows="q4", columns="int4:32", own_columns="q4g", superblock="Q4_K"),
    Kind("kmeans", lambda w, group, bits: quantize_kmeans(w, bits, group), ("qs", "lut", "lut_scale"), "lut4_mm"),
)}


def kind(name: str) -> Kind:
    if name not in KINDS:
        raise AttnlabError(f"unknown weight format {name!r}; known: {', '.join(KINDS)}")
    return KINDS[name]
