"""A linear layer whose weight stays quantized, and the swap that puts it into a network.

At batch 1 the layer multiplies straight from the codes (a fused kernel, see `attnlab.kernels`); past
`FUSED_MAX_ROWS` rows (`BATCHED_MAX_ROWS` where the kernel reads each weight once for four rows) it dequantises
the weight per call into a reused buffer and runs a float matmul, except where the weights are repacked into
16-row blocks (`attnlab.kernels.repack`): there the integer kernel serves every M. `fused=False` keeps the talk's
cautionary baseline: look the weights up, then matmul, at every call.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from attnlab.errors import AttnlabError
from attnlab.kernels import ops, repack
from attnlab.quant.formats import Packed, cat_rows, common_format
from attnlab.quant.kinds import KINDS

FUSED_MAX_ROWS = 8
# Measured per layer, integer kernel against dequantise + float matmul, 1 thread (AVX2): Qwen2.5-0.5B's int8 w13
# [9728, 896] 5.3 / 52.2 ms at 16 rows, 74.5 / 102.5 at 256, 159 / 146 at 512; SmolLM2's int4 w13 11.8 / 13.4 at 256.
BATCHED_MAX_ROWS = 256
SCRATCH_MAX = 1 << 24  # floats (64 MiB): larger weights (a vocabulary's head) get a new tensor per call
METHODS, _SCRATCH = tuple(KINDS), threading.local()


def _scratch(n: int) -> torch.Tensor:
    """n floats of this thread's dequantisation buffer, reused by every layer (grown, never shrunk)."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < n:
        with torch.inference_mode(False):  # a normal tensor: written in place in and out of inference mode
            buf = _SCRATCH.buf = torch.empty(n)
    return buf[:n]


@dataclass(frozen=True)
class QuantSpec:
    """What `--quant` says: method, bits, group (0 = per row), fused or naive, the head's format."""
    method: str
    bits: int = 8
    group: int = 0
    fused: bool = True
    head: str = "int8:32"

    @classmethod
    def parse(cls, text: "str | QuantSpec") -> "QuantSpec":
        """'int8[:G]' | 'int4[:G]' | 'kmeans[:BITS[:G]]' | 'kmeans-naive[:BITS[:G]]' (G in weights; 0 = per row).

        The LM head is int8 group 32 under every method (an int4 head costs ~8% perplexity; the
        embedded GGUF's Q8_0 head maps onto it by copy); under int8 it follows the spec."""
        if isinstance(text, QuantSpec):
            return text
        parts = str(text).strip().lower().split(":")
        name, nums = parts[0], parts[1:]
        fused = not name.endswith("-naive")
        method = name.removesuffix("-naive")
        try:
            nums = [int(n) for n in nums]
        except ValueError:
            raise AttnlabError(f"bad --quant {text!r}: numbers expected after ':'") from None
        got = KINDS[method].parse(nums, text) if method in KINDS else None
        if got is None:
            raise AttnlabError(f"unknown --quant {text!r}; use int8, int4[:GROUP], kmeans[:BITS[:GROUP]] "
                               "or kmeans-naive[:BITS[:GROUP]]")
        return cls(method, *got, fused)

    def __str__(self) -> str:
        return KINDS[self.method].spec(self.bits, self.group, self.fused)

    @staticmethod
    def text(method: str, bits: int | None, group: int | None) -> str:
        """`attnlab quantize`'s --method, --bits and --group as one --quant text (bits where the format takes them)."""
        fmt = KINDS.get(method.removesuffix("-naive"))
        if fmt is None or (bits is None and group is None):
            return method
        given = {"bits": str(bits), "group": None if group is None else str(group)}
        return ":".join([method] + [given[n] for n in fmt.numbers if given[n] is not None])

    def quantize(self, w: torch.Tensor) -> Packed:
        return KINDS[self.method].quantize(w, self.group or None, self.bits)


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W kept as a `Packed` matrix; x [..., K] -> [..., N] in x's dtype.

    packed may be a list of row blocks (the fused q/k/v, gate/up): consecutive ones of one format are
    concatenated (`cat_rows`), and where formats still differ (a Q4_K_M file's Q4_K q, k beside a Q6_K v)
    each keeps its own as a part, a QuantLinear in `parts` with its own buffers and kernel, rather than
    all being promoted to the format that holds every one (int8 groups of 16 with a min: ~12 bits a
    weight for 4.5-bit q and k). Such a layer presents the promoted format as its own (kind, group,
    `packed`, `row_operands`, the state dict: rebuilt on demand, paid only by their users); its forward,
    `nbytes` and the native step (`spans`, `kernel(rows)`) work per part."""

    max_rows: int | None = None  # longer inputs are multiplied by the dequantised matrix; None: by the format

    def __init__(self, packed: Packed | list[Packed], bias: torch.Tensor | None = None, fused: bool = True):
        super().__init__()
        self.parts = None
        if isinstance(packed, list):
            runs = _runs(packed)
            if len(runs) > 1:
                self._init_parts(runs, bias, fused)
                return
            packed = runs[0]
        self.kind, self.group, self.bits, self.fused = packed.kind, packed.group, packed.bits, fused
        if fused:
            ops.load()  # load now, never inside a torch.compile trace
        self.out_features, self.in_features = packed.shape
        self.has_min = self.fmt.min_optional and getattr(packed, "min", None) is not None
        self.repacked = (fused and self.fmt.repackable(self.in_features, self.group) and ops.load()
                         and (ops.repacks() or self.fmt.needs_repack(self.group, self.has_min)))
        if self.repacked:  # one copy: the 16-row blocks replace the row layout (`packed` rebuilds it)
            wp, self.layout = self.fmt.pack(packed, self.has_min)  # layout flags decided per layer
            self.register_buffer("wp", wp)
        else:
            for name, t in packed.tensors().items():
                self.register_buffer(name, t.contiguous())
        for name, t in self.fmt.derived(self).items():  # what the kernel reads besides the codes (not saved)
            self.register_buffer(name, t, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    def _init_parts(self, runs: list[Packed], bias: torch.Tensor | None, fused: bool) -> None:
        self.kind, self.group, has_min = common_format(runs)
        self.bits, self.fused, self.repacked = self.fmt.bits, fused, False
        self.has_min = self.fmt.min_optional and has_min
        self.out_features, self.in_features = sum(p.shape[0] for p in runs), runs[0].shape[1]
        self.parts = nn.ModuleList(QuantLinear(p, fused=fused) for p in runs)
        self.register_state_dict_post_hook(_drop_parts)  # saved in the promoted form (`_save_to_state_dict`)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)

    @property
    def fmt(self):
        """The format's entry in the table of weight formats (`attnlab.quant.kinds`)."""
        return KINDS[self.kind]

    @property
    def packed(self) -> Packed:
        """The weight in the row layout (rebuilt from the 16-row blocks when repacked: a new copy)."""
        N, K = self.out_features, self.in_features
        if self.parts is not None:
            return cat_rows([p.packed for p in self.parts])
        if getattr(self, "repacked", False):
            ks = self.fmt.kscales(self.wp, N, K) if self.layout == repack.KQ else None
            return self.fmt.unpack(self.wp, N, K, self.group, self.has_min, self.layout, ks)
        names = ("q", "qs", "scale", "min", "codebook")
        return Packed(self.kind, (N, K), self.group, self.bits,
                      **{n: getattr(self, n) for n in names if hasattr(self, n)})

    def dequantize(self) -> torch.Tensor:
        if self.parts is not None:  # the promoted form's values exactly (`promote` rounds nothing)
            return torch.cat([p.dequantize() for p in self.parts])
        return self.packed.dequantize()

    def row_operands(self) -> tuple:
        """The row layout's operands of the rows ops (`ops.bound_rows`): (q, scale, group) for int8,
        (qs, scale, min, group) for int4. Repacked weights, and a layer of parts (in the promoted format),
        rebuild it once and keep it (a second copy, paid only by Deja Vu's row-sparse MLP)."""
        if not self.repacked and self.parts is None:
            return (*(getattr(self, n) for n in self.fmt.operands), self.group)
        if getattr(self, "_rows", None) is None:
            p = self.packed
            self._rows = (*(getattr(p, n) for n in self.fmt.operands), self.group)
        return self._rows

    def step_embedding(self) -> tuple | None:
        """(buffers..., group) the native step reads a tied embedding from (the row layout of a format whose
        `step_embedding` names them, no min), or None: the lookup stays `embed_rows`."""
        if self.parts is not None or self.repacked or self.has_min or self.fmt.step_embedding is None:
            return None
        return (*(getattr(self, n) for n in self.fmt.step_embedding), self.group)

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids of W dequantised, [*ids.shape, K]: a tied embedding's lookup. Repacked int8 weights
        read the rows from their blocks in C++ (`q8x_rows`: a decode step's lookup was ~0.2 ms of Python
        unpacking); int4 ones unpack only the 16-row blocks that hold the rows asked for."""
        flat = ids.reshape(-1)
        if self.parts is not None:  # each id's row from the part that holds it
            out = torch.empty(flat.numel(), self.in_features)
            for (r0, r1, _), part in zip(self.spans, self.parts):
                at = ((flat >= r0) & (flat < r1)).nonzero().view(-1)
                out[at] = part.embed_rows(flat[at] - r0)
            return out.view(*ids.shape, -1)
        if not self.repacked:
            return self.packed.map_rows(lambda t: t[flat]).dequantize().view(*ids.shape, -1)
        R, n, K, g = repack.ROWS, flat.numel(), self.in_features, self.group
        if self.fmt.embed and ops.enabled():  # the rows straight from the blocks, in C++
            op = getattr(torch.ops.attnlab, self.fmt.embed)
            return op(self.wp, flat, K, g, self.has_min, self.layout).view(*ids.shape, K)
        p = self.fmt.unpack(self.wp[flat // R], n * R, K, g, self.has_min, self.layout)
        pick = torch.arange(n) * R + flat % R
        return p.map_rows(lambda t: t[pick]).dequantize().view(*ids.shape, -1)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """Saved in the row layout whatever the layout in memory (checkpoints do not depend on the CPU);
        a layer of parts in the promoted format (what `packed` gives: one format per saved layer, as
        `attnlab.quant.store` writes them; it loads back as a single-format layer of the same values)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.parts is not None or getattr(self, "repacked", False):
            destination.pop(prefix + "wp", None)
            for name, t in self.packed.tensors().items():
                destination[prefix + name] = t

    @property
    def nbytes(self) -> int:
        """Bytes of the weight as held (repacked: the layout's scale bytes, rows unpadded)."""
        if self.parts is not None:
            return sum(p.nbytes for p in self.parts)
        if not self.repacked:
            return self.packed.nbytes
        return self.fmt.nbytes(self.out_features, self.in_features, self.group, self.has_min, self.layout)

    @property
    def row_align(self) -> int:
        """Output rows come in blocks of this many: where `kernel(rows=...)` may cut the matrix (a layer
        of parts: within each part, counted from its first row; see `spans`)."""
        if self.parts is not None:
            return max(p.row_align for p in self.parts)
        return repack.ROWS if self.repacked else 1

    @property
    def spans(self) -> list[tuple[int, int, int]]:
        """(r0, r1, row_align) of the row ranges one `kernel(rows=...)` call can serve: the whole matrix,
        or each part of a layer of parts."""
        if self.parts is None:
            return [(0, self.out_features, self.row_align)]
        out, r0 = [], 0
        for p in self.parts:
            out.append((r0, r0 + p.out_features, p.row_align))
            r0 += p.out_features
        return out

    def kernel(self, rows: tuple[int, int] | None = None) -> tuple[str, tuple]:
        """(op name, operands): `getattr(torch.ops.attnlab, name)(x, *operands)` is x @ W^T for x [M, K]
        float32 contiguous, M small (decode), no bias. The one place that knows the weight's layout, so
        a native step (or anyone else) calls the fused kernel without reading buffers itself.

        rows=(r0, r1): the operands of output rows r0..r1 only, as views (r0 and r1 multiples of
        `row_align`, or r1 = N): how a caller splits one matvec across threads. A layer of parts has a
        kernel per part: rows must lie in one part (`spans`), on that part's row blocks."""
        N = self.out_features
        if self.parts is not None:
            for (s0, s1, _), part in zip(self.spans, self.parts):
                if rows and s0 <= rows[0] < rows[1] <= s1:
                    return part.kernel((rows[0] - s0, rows[1] - s0))
            raise ValueError(f"rows {rows} of a layer of parts {[s[:2] for s in self.spans]}: "
                             "a kernel call covers rows of one part")
        r0, r1 = rows or (0, N)
        a = self.row_align
        if not (0 <= r0 < r1 <= N and r0 % a == 0 and (r1 % a == 0 or r1 == N)):
            raise ValueError(f"rows {rows} of {N}: need 0 <= r0 < r1 <= {N} on multiples of {a}")
        if self.repacked:
            wp = self.wp[r0 // a:(r1 + a - 1) // a]
            return self.fmt.repacked, (wp, *self.fmt.block_args(r1 - r0, self.group, self.has_min, self.layout))
        return self.fmt.matmul, (*(getattr(self, n)[r0:r1] for n in self.fmt.operands), self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).float()
        if self.parts is not None:  # each part's own product (its kernel, or its dequantised rows)
            y = torch.cat([p(x2) for p in self.parts], 1)
            if self.bias is not None:
                y = y + self.bias
            return y.view(*shape[:-1], self.out_features).to(x.dtype)
        # repacked blocks: the integer kernel at any M (prefill too: faster than dequantise + float matmul)
        if self.fused and (x2.shape[0] <= self.fused_rows() or self.repacked) and ops.enabled():
            name, args = self.kernel()
            y = getattr(ops, name)(x2.contiguous(), *args)
            if self.bias is not None:
                y = y + self.bias
        else:
            y = F.linear(x2, self._float_weight(x2.requires_grad), self.bias)
        return y.view(*shape[:-1], self.out_features).to(x.dtype)

    def _float_weight(self, keep: bool) -> torch.Tensor:
        """The dequantised matrix for a float matmul: int8 / int4 rows in one pass into this thread's buffer
        (`ops.dequant_q8` / `dequant_q4`); keep (autograd reads it later), naive, other formats: `dequantize()`."""
        N, K = self.out_features, self.in_features
        if (keep or not self.fused or self.repacked or self.fmt.dequant is None or N * K > SCRATCH_MAX
                or self.scale.dtype != torch.float32):
            return self.dequantize()
        out = _scratch(N * K).view(N, K)
        return getattr(ops, self.fmt.dequant)(*self.fmt.dequant_operands(lambda n: getattr(self, n, None)), out)

    def fused_rows(self) -> int:
        """The most rows the integer kernel multiplies; past them, the dequantised matrix (see the module's notes)."""
        if self.max_rows is not None:
            return self.max_rows
        return BATCHED_MAX_ROWS if self.fmt.batched(self.in_features, self.group) else FUSED_MAX_ROWS

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this layer's output, its rows gate then up (an MLP's w13): `ops.silu_mul(self(x))`,
        for a prompt's rows on repacked weights in one kernel call (`q4x_glu` / `q8x_glu`: the same bits, without
        the [rows, 2 hidden] product's trip through memory). A matvec keeps the plain kernel (its weight streams)."""
        rows = x.numel() // self.in_features
        if (self.repacked and self.parts is None and self.bias is None and rows >= 16 and self.out_features % 32 == 0
                and ops.enabled()):
            _, args = self.kernel()
            y = getattr(ops, self.fmt.glu)(x.reshape(rows, -1).float().contiguous(), *args)
            return y.view(*x.shape[:-1], self.out_features // 2).to(x.dtype)
        return ops.silu_mul(self(x))

    def extra_repr(self) -> str:
        if self.parts is not None:
            return f"{self.in_features} -> {self.out_features}, parts (promoted: {self.kind}:{self.group}" + (
                "+min" if self.has_min else "") + f"), fused={self.fused}"
        g = f", group={self.group}" if self.group else ""
        r = "" if not self.repacked else ", repacked" + (", fp16 scales" if self.layout & repack.HALF else "") + (
            ", min -8*scale" if self.layout & repack.SYM else "") + (
            f", {self.fmt.superblock} superblocks" if self.layout == repack.KQ else "")
        return f"{self.in_features} -> {self.out_features}, {self.kind}{g}, bits={self.bits}, fused={self.fused}{r}"


def _runs(packed: list[Packed]) -> list[Packed]:
    """Row blocks -> one Packed per run of consecutive blocks of one format (`cat_rows`)."""
    if any(p.shape[1] != packed[0].shape[1] for p in packed):
        raise AttnlabError("cannot concatenate matrices of different widths")
    runs: list[list[Packed]] = []
    for p in packed:
        if runs and runs[-1][-1].format == p.format:
            runs[-1].append(p)
        else:
            runs.append([p])
    return [run[0] if len(run) == 1 else cat_rows(run) for run in runs]


def _drop_parts(module, state, prefix, local_metadata) -> None:
    """State-dict hook of a layer of parts: the parts' own entries go (the layer saved its promoted form)."""
    for key in [k for k in state if k.startswith(prefix + "parts.")]:
        del state[key]


class QuantEmbedding(nn.Module):
    """Token lookup from a (tied) int8 head: one row dequantised per token, no float table kept."""


    def __init__(self, head: QuantLinear):
        super().__init__()
        if not head.fmt.embeds:
            raise AttnlabError(f"QuantEmbedding reads a head of {', '.join(k for k, f in KINDS.items() if f.embeds)}, "
                               f"not {head.kind}")
        self.head = [head]  # a plain list: the head's buffers belong to the head, not saved twice

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head[0].embed_rows(ids)


def linear_names(model) -> list[str]:
    """Dotted names of the network's linear layers, LM head last."""
    names = []
    for i, _ in enumerate(model.layers):
        names += [f"layers.{i}.attn.wqkv", f"layers.{i}.attn.wo", f"layers.{i}.mlp.w13", f"layers.{i}.mlp.w2"]
    return names + ["lm_head"]


def _set(model, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def quantize_model(model, spec: QuantSpec | str, packed: dict[str, Packed] | None = None) -> None:
    """Swap every linear layer of model for a QuantLinear in place (the head in spec.head's format).

    packed: matrices already in a quantized format (GGUF blocks loaded directly), by layer name.
    A tied embedding then reads its rows from the int8 head.
    """
    spec = QuantSpec.parse(spec)
    packed = packed or {}
    for name in linear_names(model):
        old = model.get_submodule(name)
        if isinstance(old, QuantLinear):
            continue
        fmt = spec if name != "lm_head" or KINDS[spec.method].head_follows else QuantSpec.parse(spec.head)
        p = packed.get(name)
        if p is None or p.format != f"{fmt.method}:{fmt.group or p.shape[1]}":  # a min the spec cannot say: requantised
            p = fmt.quantize(p.dequantize() if p is not None else old.weight.data)
        _set(model, name, QuantLinear(p, getattr(old, "bias", None), fused=spec.fused))
    if model.cfg.tie_embeddings:
        model.embed = QuantEmbedding(model.lm_head)
    model.quant = str(spec)


def model_bytes(model) -> int:
    """Bytes of every weight the network holds (float parameters + quantized buffers, shared ones once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total
