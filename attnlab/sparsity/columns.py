"""TEAL's weights by input channel: the one copy the column-sparse op (`attnlab/kernels/sparse_cols.cpp`) reads.

A decode step that drops the input channels whose |x_j| <= tau must not read their weights, so each projection is
stored by input channel (one channel's codes for every output in one row). Quantized weights keep their own codes and
groups (`reference.pack_cols`: int4 of Q4_0/Q4_1/Q4_K and `--quant int4`, int8 of Q8_0/Q6_K/Q5_x and `--quant int8`),
so the layout is lossless and the op computes what the dense kernel computes on the zeroed input (activations rounded
to int8 per 32 channels, as the dense kernels round them). Float weights are stored transposed. Other weights (another
group size, k-means) are requantised along the outputs (`Kind.columns`: a second rounding, see docs/dejavu.md).
A layer of parts (a Q4_K q/k beside a Q6_K v) keeps one piece per part, each in its own format.
"""
from __future__ import annotations

import torch

from attnlab.errors import AttnlabError
from attnlab.kernels import ops
from attnlab.kernels.reference import pack_cols, unpack4
from attnlab.quant.kinds import FLOAT32, KINDS

REQUANTISE = False  # True: int4/int8 requantised along the outputs instead (measured: +21.6% perplexity, SmolLM2)


class Piece:
    """Output rows [r0, r1) of a projection in one column format: its op (`Sparse`), operands (after x and tau), the
    bytes it holds, `align`: the outputs a slice of it must start on (None: not sliceable), and (requantised copies)
    the Packed weight whose dequantisation the masked path multiplies."""

    def __init__(self, sparse, operands: tuple, r0: int, r1: int, align: int | None, packed=None):
        self.sparse, self.operands, self.r0, self.r1, self.align, self.packed = sparse, operands, r0, r1, align, packed
        self.nbytes = sum(t.numel() * t.element_size() for t in operands if isinstance(t, torch.Tensor))
        self.mv = ops.bound_cols(sparse, operands)

    def slice(self, a: int, b: int) -> tuple:
        """The operands of outputs [a, b) of this piece (views; a, b on `align`, or the whole piece)."""
        if (a, b) == (0, self.r1 - self.r0):
            return self.operands
        codes, scale, mn, bits, group = self.operands
        return (codes[:, a * bits // 8:b * bits // 8], scale[:, a:b], mn[:, a:b] if mn.numel() else mn, bits, group)


class Columns:
    """One projection by input channel: mv(x [K], tau) -> [N], its bias, the bytes held, and (requantised copies only)
    dense() -> the dequantised [N, K] weight the masked path multiplies, so prefill-sparse and evaluation compute what
    decoding does."""

    def __init__(self, pieces: list[Piece], bias):
        self.pieces, self.bias = pieces, bias
        self.nbytes = sum(p.nbytes for p in pieces)
        self._w = None
        self.dense = self._dense if any(p.packed is not None for p in pieces) else None

    def mv(self, x: torch.Tensor, tau: float) -> torch.Tensor:
        if len(self.pieces) == 1:
            return self.pieces[0].mv(x, tau)
        return torch.cat([p.mv(x, tau) for p in self.pieces], -1)

    def _dense(self) -> torch.Tensor:
        if self._w is None:
            self._w = torch.cat([p.packed.dequantize() for p in self.pieces]).contiguous()
        return self._w


def _scales(*ts: torch.Tensor | None) -> list[torch.Tensor]:
    """[N, groups] scales (and mins) as [groups, N]: float16 where that holds every value exactly (a GGUF's Q4_0/Q4_1/
    Q8_0 scales: half the bytes, the same numbers), else float32; an absent min is an empty tensor."""
    out = [t.float().T.contiguous() for t in ts if t is not None]
    if all(torch.equal(t.half().float(), t) for t in out):
        out = [t.half() for t in out]
    return out + [torch.empty(0, dtype=out[0].dtype)] * (len(ts) - len(out))


def _own(p, r0: int) -> Piece | None:
    """A Packed int4/int8 weight [N, K] by input channel in its own groups, or None where the layout cannot hold it."""
    N, K = p.shape
    own = KINDS[p.kind].own_columns
    group = p.group or K  # int8 group 0: one scale per row
    if own is None or REQUANTISE or N % 64 or K % 32 or not (group % 32 == 0 or group == 16):
        return None
    codes = pack_cols(unpack4(p.qs) if own.width == 2 else p.q, 8 // own.width)
    scale, mn = _scales(p.scale, getattr(p, "min", None))
    return Piece(own, (codes, scale, mn, 8 // own.width, group), r0, r0 + N, 128 if own.width == 2 else 64)


def _requantised(p, r0: int) -> Piece:
    """int8 / int4 of other groups requantised along the output dimension (groups of 32 outputs of one channel)."""
    from attnlab.quant import QuantSpec
    fmt = KINDS[p.kind].columns
    if fmt is None:
        raise AttnlabError(f"teal runs on float, int8 and int4 weights, not {p.kind}")
    packed = QuantSpec.parse(fmt).quantize(p.dequantize().float().T.contiguous())
    copy = KINDS[packed.kind]  # the column ops take the row layout's operands
    operands = tuple(packed.tensors()[n].contiguous() for n in copy.operands) + (32,)
    return Piece(copy.sparse, operands, r0, r0 + p.shape[0], None, _Transposed(packed))


class _Transposed:
    """A requantised [K, N] copy seen as the [N, K] weight it stands for."""

    def __init__(self, packed):
        self.p = packed

    def dequantize(self) -> torch.Tensor:
        return self.p.dequantize().T


def columns(linear) -> Columns:
    """A linear layer ([N, K]) by input channel (see the module's notes), each part of a layer of parts its own piece."""
    bias = getattr(linear, "bias", None)
    bias = None if bias is None else bias.detach().float()
    if not hasattr(linear, "dequantize"):
        wt = linear.weight.detach().float().T.contiguous()
        return Columns([Piece(FLOAT32, (wt,), 0, wt.shape[1], None)], bias)
    parts = linear.parts if getattr(linear, "parts", None) is not None else [linear]
    pieces, r0 = [], 0
    for part in parts:
        p = part.packed  # the row layout, whatever layout the kernels hold
        pieces.append(_own(p, r0) or _requantised(p, r0))
        r0 += p.shape[0]
    return Columns(pieces, bias)
