"""The weight formats as one table, ggml's `type_traits` way: one entry per format, its functions as data.

Why: a format's rules were spread over five files (the quantizer, QuantLinear's kernel choice and repacking,
Deja Vu's row ops, TEAL's column ops, the loaders), each an if-chain on the format's name, so a new format meant
edits in each. Here each entry carries them all; code elsewhere indexes the table and never compares a format's
name (tests/quant/test_format_table.py greps the library for that). One vocabulary: a format is named as
`Packed.kind` names it ('int8', 'int4', 'kmeans'), a GGUF block type as GGUF does ('Q4_K', 'F16').
Op names are those of `attnlab.kernels.ops` (the C++ op, or its torch fallback), each taking the format's
`operands` in that order, then the group: the one schema every op of a format shares. Shapes: a weight W
[N out, K in].
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from attnlab.errors import AttnlabError
from attnlab.kernels import reference as ref
from attnlab.kernels import repack
from attnlab.quant import formats as fm
from attnlab.quant.formats import Packed


@dataclass(frozen=True)
class Sparse:
    """One layout's sparse ops: Deja Vu's rows of W (rows_mv: [k] = W[idx] @ x; rows_axpy: sum_j a_j W[idx_j]) and
    TEAL's columns of W stored transposed (cols_mv), as C++ op names (None: no such op); gather(operands, idx) ->
    rows idx as float32, the fallbacks' rows; a row holds `width` values per element of operands[0]; bag: the
    fallback's axpy is torch's embedding_bag (float rows, each streamed once)."""
    rows_mv: str | None
    rows_axpy: str | None
    cols_mv: str
    gather: Callable[[tuple, torch.Tensor], torch.Tensor]
    width: int = 1
    bag: bool = False


FLOAT32 = Sparse("f32_rows_mv", "f32_rows_axpy", "f32_cols_mv", ref.rows_float, bag=True)  # an nn.Linear's rows
# TEAL's columns in the weight's own groups (`reference.pack_cols`: 4-bit or 8-bit codes by input channel, lossless)
COLS4 = Sparse(None, None, "qc_cols_mv", ref.rows_by_inputs, width=2)
COLS8 = Sparse(None, None, "qc_cols_mv", ref.rows_by_inputs, width=1)


@dataclass(frozen=True)
class Kind:
    """One weight format.

    quantize(w, group or None, bits) -> Packed; dequantize(p) -> [N, K] float32; parse(numbers of --quant, text) ->
    (bits, group), None where the count of numbers does not fit (`numbers` names them); spec(bits, group, fused) -> the
    --quant text;
    stored(N, K, group) -> {tensor: (shape, dtype; None: a float)} a checkpoint holds; derived(layer) -> buffers the
    kernel reads besides them (not saved). operands / matmul: the row layout's buffers and its matmul op.
    min_optional: a min only where the source had one (GGUF's Q5_1 / Q5_K), named '+min' in the format;
    min_always: always a min. holds / codes8 / retag: `formats.promote` (the formats this one holds exactly,
    int8 codes of a held matrix, the promoted Packed). dequant: the one-pass op dequantising into a buffer.
    embeds: rows readable as a tied embedding; head_follows: under this method the LM head takes the spec's
    format (else int8:32); step_embedding: the row layout's buffers the native step reads a tied embedding from.
    Repacked 16-row blocks (`attnlab.kernels.repack`, None where never): repacked / glu / embed the ops (`glu`:
    silu(gate) * up in the epilogue; `embed`: rows of a tied embedding), taking (wp, *block_args(n, group,
    has_min, layout)); repack_groups(group) the groups they take; needs_repack(group, has_min): no row-layout
    kernel; pack(p, has_min) -> (wp, layout); unpack(wp, N, K, group, has_min, layout, kscale) -> Packed;
    kscales(wp, N, K) the K-quant factors of a KQ layout; nbytes(N, K, group, has_min, layout).
    batched(K, group): the row layout's matmul reads each weight once for four activation rows.
    sparse: the row layout's `Sparse` ops where rows_ok(group, has_min); columns: TEAL's transposed copy's
    --quant; own_columns: TEAL's op on the weight's own groups, by input channel. superblock: the GGUF K-quant the
    blocks may hold."""
    name: str
    bits: int
    quantize: Callable[[torch.Tensor, int | None, int], Packed]
    dequantize: Callable[[Packed], torch.Tensor]
    parse: Callable[[list[int], str], tuple[int, int] | None]
    spec: Callable[[int, int, bool], str]
    stored: Callable[[int, int, int], dict]
    numbers: tuple[str, ...]
    operands: tuple[str, ...]
    matmul: str
    derived: Callable[[object], dict] = lambda layer: {}
    min_optional: bool = False
    min_always: bool = False
    holds: tuple[str, ...] = ()
    codes8: Callable[[Packed], torch.Tensor] | None = None
    retag: Callable | None = None
    dequant: str | None = None
    embeds: bool = False
    head_follows: bool = False
    step_embedding: tuple[str, ...] | None = None
    repacked: str | None = None
    glu: str | None = None
    embed: str | None = None
    repack_groups: Callable[[int], bool] = lambda group: False
    needs_repack: Callable[[int, bool], bool] = lambda group, has_min: False
    pack: Callable | None = None
    unpack: Callable | None = None
    block_args: Callable | None = None
    kscales: Callable | None = None
    nbytes: Callable | None = None
    batched: Callable[[int, int], bool] = lambda K, group: False
    sparse: Sparse | None = None
    rows_ok: Callable[[int, bool], bool] = lambda group, has_min: True
    columns: str | None = None
    own_columns: Sparse | None = None
    superblock: str = ""

    def repackable(self, K: int, group: int) -> bool:
        """Shapes the blocks' kernels take: K of 32k and the format's groups."""
        return self.repacked is not None and K % 32 == 0 and self.repack_groups(group)

    def dequant_operands(self, get: Callable[[str], torch.Tensor | None]) -> tuple:
        """The `dequant` op's tensors (the operands, then an optional min, None where absent) from get(name)."""
        return (*(get(n) for n in self.operands), *((get("min"),) if self.min_optional else ()))

    def has_rows(self, group: int, has_min: bool) -> bool:
        """Whether Deja Vu's row ops serve this weight."""
        return self.sparse is not None and self.rows_ok(group, has_min)


def _parse_group(name: str, bits: int, default: int, ok: Callable[[int], bool], rule: str):
    """--quant NAME[:GROUP] -> (bits, group), the group checked by ok (rule: what it says when not)."""
    def parse(nums: list[int], text: str):
        if len(nums) > 1:
            return None
        group = nums[0] if nums else default
        if not ok(group):
            raise AttnlabError(f"{name} group must be {rule}, got {group}")
        return bits, group
    return parse


def _parse_kmeans(nums: list[int], text: str):
    if len(nums) > 2:
        return None
    bits, group = (nums[0] if nums else 4), (nums[1] if len(nums) > 1 else 0)
    if bits not in (2, 3, 4) or group < 0 or group % 32:
        raise AttnlabError(f"kmeans needs 2-4 bits and a group that is 0 or a multiple of 32, got {text!r}")
    return bits, group


def _unpack_int4(wp, N, K, group, has_min, layout, kscale=None) -> Packed:
    qs, scale, mn = repack.unpack_q4(wp, N, K, group, layout)
    return Packed("int4", (N, K), group, 4, qs=qs, scale=scale, min=mn, kscale=kscale)


def _unpack_int8(wp, N, K, group, has_min, layout, kscale=None) -> Packed:
    q, scale, mn = repack.unpack_q8(wp, N, K, group, has_min, layout)
    return Packed("int8", (N, K), group, 8, q=q, scale=scale, kscale=kscale, min=mn if has_min else None)


def _dequantize_kmeans(p: Packed) -> torch.Tensor:
    N, K = p.shape
    return torch.gather(p.codebook, 2, ref.unpack4(p.qs).view(N, K // p.group, p.group).long()).view(N, K)


def _kmeans_luts(layer) -> dict:
    """Each codebook rounded to int8 with its scale: the operands of `lut4_mm`."""
    scale = layer.codebook.abs().amax(-1).clamp_min(1e-12) / 127
    return {"lut": (layer.codebook / scale[..., None]).round().to(torch.int8), "lut_scale": scale}


KINDS = {k.name: k for k in (
    Kind("int8", 8, lambda w, group, bits: fm.quantize_int8(w, group),
         lambda p: ref.dequantize_int8_blocks(p.q, p.scale, min_=p.min),
         _parse_group("int8", 8, 0, lambda g: g >= 0 and g % 32 == 0, "0 (per row) or a multiple of 32"),
         lambda bits, group, fused: "int8" + (f":{group}" if group else ""),
         lambda N, K, group: {"q": ((N, K), torch.int8), "scale": ((N, K // group), None)}, ("group",),
         ("q", "scale"), "q8_mm", min_optional=True, holds=("int8", "int4"), codes8=lambda p: p.q,
         retag=lambda p, group, scale, mn: Packed("int8", p.shape, group, 8, q=KINDS[p.kind].codes8(p), scale=scale,
                                                  min=mn),
         dequant="dequant_q8", embeds=True, head_follows=True, step_embedding=("q", "scale"),
         repacked="q8x_mm", glu="q8x_glu", embed="q8x_rows",
         repack_groups=lambda group: group in (16, 32) or group % 32 == 0,
         needs_repack=lambda group, has_min: has_min or group % 32 != 0,
         pack=lambda p, has_min: repack.pack_q8(p.q, p.scale, p.group, p.min if has_min else None, kscale=p.kscale),
         unpack=_unpack_int8, block_args=lambda n, group, has_min, layout: (n, group, has_min, layout),
         kscales=repack.kscales_q6k, nbytes=repack.nbytes_q8, batched=lambda K, group: group == 32,
         sparse=Sparse("q8_rows_mv", "q8_rows_axpy", "q8_cols_mv", ref.rows_int8),
         rows_ok=lambda group, has_min: not has_min and group % 32 == 0, columns="int8:32", own_columns=COLS8,
         superblock="Q6_K"),
    Kind("int4", 4, lambda w, group, bits: fm.quantize_int4(w, group or 32),
         lambda p: ref.dequantize_int4(p.qs, p.scale, p.min, p.group),
         _parse_group("int4", 4, 32, lambda g: g >= 32 and g % 32 == 0, "a multiple of 32"),
         lambda bits, group, fused: f"int4:{group}",
         lambda N, K, group: {"qs": ((N, K // 2), torch.uint8), "scale": ((N, K // group), None),
                              "min": ((N, K // group), None)}, ("group",),
         ("qs", "scale", "min"), "q4_mm", min_always=True, holds=("int4",),
         codes8=lambda p: ref.unpack4(p.qs).view(torch.int8),  # codes 0..15 are int8 as they are
         retag=lambda p, group, scale, mn: replace(p, group=group, scale=scale, min=mn, kscale=None),
         dequant="dequant_q4", embeds=True, repacked="q4x_mm", glu="q4x_glu", repack_groups=lambda group: True,
         pack=lambda p, has_min: repack.pack_q4(p.qs, p.scale, p.min, p.group, kscale=p.kscale),
         unpack=_unpack_int4, block_args=lambda n, group, has_min, layout: (n, group, layout),
         kscales=repack.kscales_q4k, nbytes=repack.nbytes_q4, batched=lambda K, group: group == 32 and K % 64 == 0,
         sparse=Sparse("q4_rows_mv", "q4_rows_axpy", "q4_cols_mv", ref.rows_int4, width=2), columns="int4:32",
         own_columns=COLS4, superblock="Q4_K"),
    Kind("kmeans", 4, lambda w, group, bits: fm.quantize_kmeans(w, bits, group), _dequantize_kmeans, _parse_kmeans,
         lambda bits, group, fused: f"kmeans{'' if fused else '-naive'}:{bits}" + (f":{group}" if group else ""),
         lambda N, K, group: {"qs": ((N, K // 2), torch.uint8), "codebook": ((N, K // group, 16), None)},
         ("bits", "group"), ("qs", "lut", "lut_scale"), "lut4_mm", derived=_kmeans_luts),
)}


def kind(name: str) -> Kind:
    if name not in KINDS:
        raise AttnlabError(f"unknown weight format {name!r}; known: {', '.join(KINDS)}")
    return KINDS[name]


# ---------------------------------------------------------------- GGUF block types

@dataclass(frozen=True)
class GGUFType:
    """One GGUF tensor type: `size` values in `nbytes` bytes per block; decode(blocks [nb, nbytes] uint8, N, K) ->
    Packed on the file's own grid, exactly (None: not held exactly, dequantised by the gguf package); dtype: a
    float type's torch dtype."""
    size: int = 1
    nbytes: int = 0
    decode: Callable[[torch.Tensor, int, int], Packed] | None = None
    dtype: torch.dtype | None = None


GGUF = {
    "Q4_0": GGUFType(32, 18, lambda raw, N, K: fm.gguf_q4(raw, N, K, with_min=False)),
    "Q4_1": GGUFType(32, 20, lambda raw, N, K: fm.gguf_q4(raw, N, K, with_min=True)),
    "Q4_K": GGUFType(256, 144, fm.gguf_q4_k),
    "Q5_0": GGUFType(32, 22, lambda raw, N, K: fm.gguf_q5(raw, N, K, with_min=False)),
    "Q5_1": GGUFType(32, 24, lambda raw, N, K: fm.gguf_q5(raw, N, K, with_min=True)),
    "Q5_K": GGUFType(256, 176, fm.gguf_q5_k),
    "Q6_K": GGUFType(256, 210, fm.gguf_q6_k),
    "Q8_0": GGUFType(32, 34, fm.gguf_q8_0),
    "F32": GGUFType(dtype=torch.float32),
    "F16": GGUFType(dtype=torch.float16),
    "BF16": GGUFType(dtype=torch.bfloat16),
}
GGUF_PACKED = tuple(name for name, t in GGUF.items() if t.decode is not None)  # held exactly, on their own grid
