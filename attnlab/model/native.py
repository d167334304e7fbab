"""The single-token decode step in one native call: `attnlab::DecodeStep` (`attnlab/kernels/step.cpp`).

Why native and not compiled: a decode step is ~150 kernel calls, and what surrounds them (Python,
dispatch, a compiled graph's ~500-tensor input list and dynamo's guards) is serial work that a
second thread cannot share. `torch.compile` also cost 83-100 s on first use in every process whose
inductor cache was gone, and skipping its guards took a recorder tied to one torch version's
internals. The native step is plain C++ compiled into the kernels' extension: its only artefact is
that per-machine build (`attnlab.kernels.build`), so a second process builds nothing and the step
is ready the moment the model is loaded (walking the modules once, milliseconds).

`NativeStep(model)` reads, once, every tensor a step needs and each linear layer's kernel call
(`QuantLinear.kernel()`: op name + packed operands, whatever layout the kernels chose; a float
`nn.Linear` is a matmul). It holds the network's tensors, not its modules: swap a module after
building the step and build it again (`LM.compile_decode()`). Its thread count is the engine's (`LM.threads`,
set once at load), not torch's global one: with more than one, the step runs as one team of threads (each linear
cut into a slice of rows per thread, or per thread and part for a layer whose parts keep different formats, see
step.cpp). A call covers one token for each of B conversations
(`batch`: each its own cache, bound per row; the linear layers read each weight once for all B), no padding,
float32 / float16 / int8 caches, a sliding window over a cache that never evicted, and Quest's page
selection (`quest=`: each row selects its own pages from its cache's page summaries, bound with the cache,
and keeps them up to date for the key it writes; see step.cpp and quest.cpp); anything else returns None and the engine's step runs the eager network instead (so do sparsity
plans, observers and policies that score by attention: the engine never sends those here).
"""
from __future__ import annotations

import torch
from torch import nn

from attnlab.kernels import ops
from attnlab.model.llama import Attention, Block, FeedForward, RMSNorm, Transformer
from attnlab.quant.linear import QuantEmbedding, QuantLinear

KV_DTYPES = (torch.float32, torch.float16, torch.int8)


def kernel_call(layer: nn.Module, rows: tuple[int, int] | None = None) -> tuple[str, tuple, torch.Tensor | None] | str:
    """(op name, operands after x, bias) of a linear layer ('' = a float weight), over output rows
    rows=(r0, r1) if given, or why the step cannot run it."""
    if type(layer) is nn.Linear:
        if layer.weight.dtype != torch.float32:
            return f"a {layer.weight.dtype} linear layer"
        w = layer.weight.detach()
        return "", ((w if rows is None else w[rows[0]:rows[1]]).contiguous(),), layer.bias
    if type(layer) is not QuantLinear:
        return f"a {type(layer).__name__} layer"
    if not layer.fused:
        return "unfused (naive) quantized layers"
    op, args = layer.kernel(rows)
    return op, tuple(args), layer.bias


def _spans(layer: nn.Module) -> list[tuple[int, int, int]]:
    """(r0, r1, row_align) of the row ranges one kernel call can serve (`QuantLinear.spans`: each part of a
    layer whose parts keep different formats); a float layer is one range of single rows."""
    return layer.spans if type(layer) is QuantLinear else [(0, getattr(layer, "out_features", 0), 1)]


def _slices(layer: nn.Module, threads: int) -> list[tuple[int, int, int]]:
    """(thread, r0, r1): each span of a linear layer cut into at most `threads` near-equal slices on its
    kernel's row blocks, slice t to thread t (every thread a share of every part), in row order."""
    out = []
    for s0, s1, align in _spans(layer):
        out += [(t, s0 + a, s0 + b) for t, (a, b) in enumerate(_cuts(s1 - s0, align, threads))]
    return out


def _operands(op: str, args) -> tuple[list, list, list]:
    """An op's operands after x as the step passes them: (tensors, ints (bools included), floats), each in order."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    ints = [int(a) for a in args if isinstance(a, int)]
    floats = [float(a) for a in args if isinstance(a, float)]
    if len(tensors) + len(ints) + len(floats) != len(args):
        raise ValueError(f"{op}: operands the native step cannot pass")
    return tensors, ints, floats


def _cuts(n: int, align: int, threads: int) -> list[tuple[int, int]]:
    """[0, n) in at most `threads` near-equal pieces starting on multiples of align (piece t for thread t)."""
    blocks = -(-n // align)
    cuts = [min(n, round(blocks * i / threads) * align) for i in range(threads + 1)]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def unsupported(model: nn.Module) -> str | None:
    """Why the native step cannot run this network (None: it can)."""
    if not ops.enabled():
        return "the C++ kernels are not available"
    if type(model) is not Transformer:
        return f"a {type(model).__name__} network"
    cfg = model.cfg
    if model.norm.weight.dtype != torch.float32:
        return f"{model.norm.weight.dtype} weights (float32 activations only)"
    if cfg.head_dim % 8:
        return f"head size {cfg.head_dim} (a multiple of 8 needed)"
    if not (type(model.embed) is QuantEmbedding or type(model.embed) is nn.Embedding
            and model.embed.weight.dtype == torch.float32):
        return f"a {type(model.embed).__name__} embedding"
    norms = [model.norm] + [n for b in model.layers for n in (b.attn_norm, b.mlp_norm)]
    if any(type(n) is not RMSNorm or n.eps != model.norm.eps for n in norms):
        return "norms other than one RMSNorm"
    for b in model.layers:
        if (type(b), type(b.attn), type(b.mlp)) != (Block, Attention, FeedForward):
            return "a modified block"
    for layer in _linears(model):
        for r0, r1, _ in _spans(layer):
            why = kernel_call(layer, (r0, r1))
            if isinstance(why, str):
                return why
    return None


def _linears(model: Transformer) -> list[nn.Module]:
    return [m for b in model.layers for m in (b.attn.wqkv, b.attn.wo, b.mlp.w13, b.mlp.w2)] + [model.lm_head]


class NativeStep:
    """A network's decode step as one `attnlab::DecodeStep`; call it with the engine's step and cache layers.

    calls counts steps run natively ("native") and those handed back to eager ("eager")."""

    def __init__(self, model: Transformer, threads: int = 1, sparsity=None):
        why = unsupported(model)
        if why:
            raise ValueError(why)
        self.model, self.sparsity = model, sparsity  # a plan with `step_columns` (TEAL): its projections by column
        self.calls = {"native": 0, "eager": 0}
        self._build(threads)

    def _build(self, threads: int) -> None:
        """The C++ step for a team of `threads`: each linear layer cut into one slice of rows per thread
        (per thread and part where its parts keep different formats)."""
        model, cfg = self.model, self.model.cfg
        self.team = bool(torch.classes.attnlab.DecodeStep.openmp())  # can the step run more than one thread
        if not self.team:
            threads = 1
        self.threads = threads
        self.step = torch.classes.attnlab.DecodeStep(cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                                                     cfg.hidden_dim, float(model.norm.eps), threads)
        self.embed = None  # the lookup called from Python (a tied head in repacked blocks: `embed_rows`)
        if type(model.embed) is QuantEmbedding:
            table = model.embed.head[0].step_embedding()
            if table is not None:
                self.step.set_embedding(*table)
            else:
                self.embed = model.embed
        else:
            self.step.set_embedding(model.embed.weight.detach().contiguous(), None, 0)
        for b in model.layers:
            self.step.add_norm(b.attn_norm.weight.detach())
            self.step.add_norm(b.mlp_norm.weight.detach())
        self.step.add_norm(model.norm.weight.detach())
        for n, layer in enumerate(_linears(model)):
            if self.sparsity is not None and n < 4 * cfg.n_layers:
                self._add_columns(*self.sparsity.step_columns(n // 4, n % 4), threads)
                continue
            for thread, r0, r1 in _slices(layer, threads):
                op, args, bias = kernel_call(layer, (r0, r1))
                bias = None if bias is None else bias.detach()[r0:r1].float()
                self.step.add_linear(op, *_operands(op, args), bias, r0, r1 - r0, thread)
        self._bound: list[tuple] = []  # per row: what its binding holds (`_held`)
        self._quest = (0, 0, 0)  # the step's Quest setting (budget, dense layers, channels)

    def _add_columns(self, cols, tau: float, threads: int) -> None:
        """A projection by input channel (`attnlab.sparsity.columns`): its column-sparse op per piece, thresholded at
        tau, each piece cut into one slice of outputs per thread where its layout allows (else thread 0 runs it)."""
        for piece in cols.pieces:
            n = piece.r1 - piece.r0
            for thread, (a, b) in enumerate([(0, n)] if piece.align is None else _cuts(n, piece.align, threads)):
                tensors, ints, _ = _operands(piece.sparse.cols_mv, piece.slice(a, b))
                bias = None if cols.bias is None else cols.bias[piece.r0 + a:piece.r0 + b]
                self.step.add_linear(piece.sparse.cols_mv, tensors, ints, [tau], bias, piece.r0 + a, b - a, thread)

    def __call__(self, ids: torch.Tensor, step, kvs: list, quest=None) -> torch.Tensor | None:
        """Logits [1, 1, vocab] of one token at the cache's step (`KVCache.begin`), or None where not covered."""
        return self.batch(ids, [step], [kvs], quest)

    def batch(self, ids: torch.Tensor, steps: list, kvs: list[list], quest=None,
              firsts: list[int] | None = None, outs: list[int] | None = None) -> torch.Tensor | None:
        """Logits [len(outs), 1, vocab] (outs: ascending rows, default all) of B tokens ids [B, 1], token b at
        steps[b] of the cache whose layers are kvs[b] (a batch-1 cache; several rows of one cache are its
        consecutive slots in order: a verification row's tokens), or None where any row is not covered.
        quest: a `QuestSpec` (None: full attention); rows whose caches keep page summaries select pages.
        firsts: each row's `first`, where the caller already asked (the engine, choosing its native rows)."""
        if firsts is None:
            firsts = [self.first(step, layers, quest) for step, layers in zip(steps, kvs)]
        if any(f is None for f in firsts):
            self.calls["eager"] += 1
            return None
        if ids.shape != (len(steps), 1):
            raise ValueError(f"one token per row: ids {tuple(ids.shape)} for {len(steps)} rows")
        setting = (quest.budget, quest.dense, quest.channels) if quest is not None else (0, 0, 0)
        if setting != self._quest:
            self.step.set_quest(*setting)
            self._quest = setting
        place: dict[int, int] = {}  # a row's sequence id: its cache's place among the distinct ones, each bound once
        seqs = [place.setdefault(id(layers[0]), len(place)) for layers in kvs]
        for s, layers in enumerate({id(layers[0]): layers for layers in kvs}.values()):
            if quest is not None and quest.channels and layers[0].page:
                for layer in layers:
                    layer.keep_channel_keys()
            if s >= len(self._bound) or any(x is not y for x, y in zip(self._bound[s], self._held(layers))):
                self._bind(s, layers)
        rots = torch.cat([(s.rot if not s.rot.is_complex() else torch.view_as_real(s.rot)).reshape(1, -1)
                          for s in steps])
        self.calls["native"] += 1
        x = None if self.embed is None else self.embed(ids).reshape(len(steps), -1).contiguous()
        return self.step.run_batch(ids.view(-1).tolist(), [s.start for s in steps], [int(s.pos) for s in steps],
                                   firsts, rots.contiguous(), x, seqs, list(range(len(steps))) if outs is None else outs)

    @staticmethod
    def first(step, layers: list, quest=None) -> int | None:
        """The first slot a step over this cache attends to (a sliding window's start), or None where the native
        step does not cover it (padding, another dtype, a batch in one cache, an evicted windowed cache, Quest
        over a window that slid)."""
        kv0 = layers[0]
        if kv0.padded or kv0.k.dtype not in KV_DTYPES or kv0.k.shape[0] != 1 or step.pos.shape != (1, 1):
            return None
        if kv0.window is None:
            return kv0.first  # slots before it were evicted (`LayerKV.slide`)
        if step.start + 1 <= kv0.window:
            return 0
        if quest is not None and kv0.page:
            return None
        # the window is the last slots only if none was evicted
        return step.start + 1 - kv0.window if all(layer.natural for layer in layers) else None

    def _bind(self, row: int, kvs: list) -> None:
        """Hand conversation `row`'s cache buffers to the step (a new cache, or one whose buffers grew)."""
        int8 = kvs[0].k_scale is not None
        self.step.bind_rows(row, [layer.k for layer in kvs], [layer.v for layer in kvs],
                            [layer.k_scale for layer in kvs] if int8 else [],
                            [layer.v_scale for layer in kvs] if int8 else [], [layer.pos for layer in kvs])
        if kvs[0].page:
            channels = kvs[0].keys_t is not None
            self.step.bind_pages(row, kvs[0].page, [layer.pages_lo for layer in kvs], [layer.pages_hi for layer in kvs],
                                 [layer.keys_t for layer in kvs] if channels else [],
                                 [layer.keys_s for layer in kvs] if channels else [])
        self._bound[row:row + 1] = [self._held(kvs)]

    @staticmethod
    def _held(kvs: list) -> tuple:
        """What a binding holds: a row is bound again when one of these is another tensor (a cache grew, keys_t
        appeared)."""
        return kvs[0].k, kvs[-1].k, kvs[0].keys_t
