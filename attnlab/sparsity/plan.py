"""A sparsity plan: which MLP neurons and attention heads each token uses, plugged into the forward.

Each way of choosing is one small class with one `scores` method (higher = keep), like the KV
policies; the shared base turns scores into a choice and runs it (`Plan.mlp` and `Plan.heads`
are called by the network, see `attnlab.model.llama.Pass`). Two executions, one semantics:
- masked (any batch and chunk length; used by prefill and evaluation): compute densely,
  zero what is not chosen. It defines what the sparse model computes.
- sparse (batch 1, one token: decoding): read only the chosen rows. gate/up rows come
  from the fused w13 and the down projection is kept transposed, so one neuron is one
  contiguous row in each and every active row is streamed once (`attnlab.sparsity.rows`).

A plan is passed to the engine per call (`LM.with_sparsity`), never attached to the network.
Heads are chosen per token and masked (their output zeroed before wo); with grouped-query
attention every KV head is still needed by the cache, so skipped heads save only their q
rows and wo columns and head sparsity has no sparse execution here (see docs/dejavu.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from attnlab.errors import AttnlabError
from attnlab.sparsity.predictors import Predictors

LOWBIT = "int4:32"  # the lowbit method's copy of gate/up: 1/7 of the fp32 bytes


@dataclass
class Plan:
    """sparsity: fraction of MLP neurons skipped per token; head_sparsity: fraction of query heads skipped;
    predictors: trained `Predictors` (also the threshold method's calibration); sparse_exec: single-token
    steps read only the chosen rows (False: always masked, for checking)."""
    sparsity: float = 0.5
    head_sparsity: float = 0.0
    predictors: Predictors | None = None
    sparse_exec: bool = True
    down: list = field(default_factory=list, repr=False)  # per layer: down projection, one row per neuron
    method: ClassVar[str] = "base"
    needs_predictors: ClassVar[bool] = False
    chooses_heads: ClassVar[bool] = True

    def __post_init__(self):
        for name in ("sparsity", "head_sparsity"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
                raise AttnlabError(f"{name.replace('_', ' ')} must be in [0, 1), got {v!r}")
        if self.needs_predictors and self.predictors is None:
            raise AttnlabError(f"the {self.method} method needs trained predictors (attnlab dejavu train)")
        if self.head_sparsity and not self.chooses_heads:
            raise AttnlabError(f"the {self.method} method chooses MLP neurons only; use oracle or predictor for heads")
        self._prev = None

    def native_step(self) -> bool:
        """Whether the engine's native step may run this plan's decode rows (TEAL's columns; Deja Vu's rows: no)."""
        return False

    # ------------------------------------------------------------ what a method defines

    def scores(self, i: int, ffn, x: torch.Tensor, src: torch.Tensor, act: torch.Tensor | None = None) -> torch.Tensor:
        """[..., hidden]: how much each of layer i's neurons matters for the token(s) x [..., dim] (src: the
        predictor's input; act: silu(gate) * up when the masked path has it already)."""
        raise NotImplementedError

    def head_scores(self, i: int, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """[B, Hq, T]: how much each query head matters; x the normed attention input, out [B, Hq, T, D]."""
        raise NotImplementedError

    def prepare(self, model) -> None:
        """Per-model state the method needs (built once by `bind`)."""

    # ------------------------------------------------------------ shared mechanics

    def bind(self, model) -> "Plan":
        """Check the plan fits model and build the per-neuron down projections; returns the plan."""
        if self.predictors is not None:
            self.predictors.check_model(model.cfg)
        from attnlab.sparsity.rows import bind_rows
        self.down = [_transposed(layer.mlp.w2, model.quant) for layer in model.layers]
        self._up = [bind_rows(layer.mlp.w13)[0] for layer in model.layers]    # gate/up rows -> values
        self._down = [bind_rows(d)[1] for d in self.down]                      # values -> sum of down rows
        self.prepare(model)
        return self

    def keep(self, n: int, sparsity: float) -> int:
        return max(1, n - math.floor(sparsity * n + 1e-9))

    def mlp(self, i: int, ffn, x: torch.Tensor, ctx) -> torch.Tensor:
        src = self._source(i, x)
        if self.sparse_exec and x.shape[0] * x.shape[1] == 1 and self.down:
            x1 = x.reshape(-1).float().contiguous()
            idx, a = self.select(i, ffn, x1, src.reshape(-1))
            if ctx.observers:
                ctx.record(i, "mlp_act", torch.zeros(1, 1, ffn.hidden).index_copy(2, idx, a.view(1, 1, -1)).to(x.dtype))
            return self._down[i](a.contiguous(), idx).view(1, 1, -1).to(x.dtype)
        gate, up = ffn.w13(x).split(ffn.hidden, dim=-1)
        act = F.silu(gate) * up
        act = act * self.choose(i, ffn, x, gate, act, src)
        ctx.record(i, "mlp_act", act)
        return ffn.w2(act)

    def _source(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return x

    def choose(self, i: int, ffn, x: torch.Tensor, gate: torch.Tensor, act: torch.Tensor,
               src: torch.Tensor) -> torch.Tensor:
        """Float mask [..., hidden] of the neurons each token keeps (masked execution): the top-k scores."""
        k = self.keep(act.shape[-1], self.sparsity)
        return torch.zeros_like(act).scatter(-1, self.scores(i, ffn, x, src, act).topk(k, dim=-1).indices, 1.0)

    def select(self, i: int, ffn, x1: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sparse execution for one token x1 [dim]: (idx [k] of the neurons run, their values [k])."""
        H = ffn.hidden
        k = self.keep(H, self.sparsity)
        idx = self.scores(i, ffn, x1, src).topk(k, sorted=False).indices
        gu = self._up[i](x1, torch.cat([idx, idx + H]))
        return idx, F.silu(gu[:k]) * gu[k:]

    def project(self, i: int, name: str, linear, x: torch.Tensor) -> torch.Tensor:
        """Attention's projection `name` (wqkv, wo) of layer i applied to x: dense here; TEAL thresholds x."""
        return linear(x)

    def heads(self, i: int, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [B, Hq, T, D] with the heads a token does not use zeroed; x: the normed attention input."""
        if not self.head_sparsity:
            return out
        scores = self.head_scores(i, x, out)
        k = self.keep(out.shape[1], self.head_sparsity)
        mask = torch.zeros_like(scores).scatter(1, scores.topk(k, dim=1).indices, 1.0)
        return out * mask[..., None].to(out.dtype)

    def mlp_bytes(self, i: int, row13: float, row2: float, H: int) -> float:
        """Weight bytes layer i's MLP reads per decode step (rows of w13 are row13 bytes, of w2^T row2)."""
        k = self.keep(H, self.sparsity)
        return 2 * k * row13 + k * row2

    def bytes_per_token(self, model) -> dict:
        """Weight bytes one decode step reads in the MLPs: dense vs this plan (its selection included)."""
        dense = sparse = 0
        for i, layer in enumerate(model.layers):
            ffn = layer.mlp
            w13, w2 = _nbytes(ffn.w13), _nbytes(ffn.w2)
            dense += w13 + w2
            sparse += self.mlp_bytes(i, w13 / (2 * ffn.hidden), w2 / ffn.hidden, ffn.hidden)
        return {"dense_mlp": dense, "sparse_mlp": int(sparse)}


@dataclass
class Oracle(Plan):
    """The true top-k of |silu(gate) * up|: reads every weight, so it is the quality ceiling, not a speedup."""
    method: ClassVar[str] = "oracle"

    def scores(self, i, ffn, x, src, act=None):
        return (ffn.activation(x) if act is None else act).abs()

    def head_scores(self, i, x, out):
        return out.norm(dim=-1)

    def select(self, i, ffn, x1, src):
        act = ffn.activation(x1)
        idx = act.abs().topk(self.keep(ffn.hidden, self.sparsity), sorted=False).indices
        return idx, act[idx]

    def mlp_bytes(self, i, row13, row2, H):
        return 2 * H * row13 + self.keep(H, self.sparsity) * row2


@dataclass
class Threshold(Plan):
    """Compute the gate exactly; skip the up/down rows whose |silu(gate)| is under layer i's threshold,
    calibrated on training text as the quantile that skips `sparsity` of the neurons."""
    method: ClassVar[str] = "threshold"
    needs_predictors: ClassVar[bool] = True
    chooses_heads: ClassVar[bool] = False

    def scores(self, i, ffn, x, src, act=None):
        gate = ffn.w13(x)[..., :ffn.hidden]
        return F.silu(gate).abs()

    def choose(self, i, ffn, x, gate, act, src):
        return (F.silu(gate).abs() > self._threshold(i)).to(act.dtype)

    def select(self, i, ffn, x1, src):
        H = ffn.hidden
        sg = F.silu(self._up[i](x1, self._gate_rows(H)))
        idx = (sg.abs() > self._threshold(i)).nonzero().flatten()
        return idx, sg[idx] * self._up[i](x1, idx + H)

    def _threshold(self, i: int) -> float:
        """Layer i's calibrated gate threshold at this sparsity, looked up once (decode calls it every token)."""
        taus = self.__dict__.setdefault("_taus", {})
        if i not in taus:
            taus[i] = self.predictors.threshold(i, self.sparsity)
        return taus[i]

    def _gate_rows(self, n: int) -> torch.Tensor:
        if getattr(self, "_gates", None) is None or self._gates.numel() != n:
            self._gates = torch.arange(n)
        return self._gates

    def mlp_bytes(self, i, row13, row2, H):
        k = self.keep(H, self.sparsity)  # the calibrated average
        return H * row13 + k * (row13 + row2)


@dataclass
class Predictor(Plan):
    """Deja Vu's low-rank predictor per layer, relu(x A) B; with look-ahead predictors layer i's set
    comes from layer i-1's input (so it could be fetched while layer i-1 runs)."""
    method: ClassVar[str] = "predictor"
    needs_predictors: ClassVar[bool] = True

    def prepare(self, model):
        self._pred = [self.predictors.layer(i) for i in range(model.cfg.n_layers)]

    def _source(self, i, x):
        src = self._prev if self.predictors.lookahead and i > 0 else x
        self._prev = x
        return src

    def scores(self, i, ffn, x, src, act=None):
        if src.dim() == 1:
            at, a0, bt, b0 = self._pred[i]  # two matvecs on prepared tensors
            return torch.addmv(b0, bt, torch.relu(torch.addmv(a0, at, src)))
        return self.predictors.mlp_scores(i, src)

    def head_scores(self, i, x, out):
        return self.predictors.head_scores(i, x).transpose(1, 2)

    def mlp_bytes(self, i, row13, row2, H):
        return super().mlp_bytes(i, row13, row2, H) + self.predictors.nbytes  # nbytes: one layer's predictor


@dataclass
class Lowbit(Plan):
    """Rank by |silu(g) * u| computed from a 4-bit copy of gate/up (a seventh of their fp32 bytes):
    the oracle's ranking, nearly, without reading the full-precision rows it will skip."""
    method: ClassVar[str] = "lowbit"
    chooses_heads: ClassVar[bool] = False

    def prepare(self, model):
        if model.quant:
            raise AttnlabError("the lowbit method scores with a 4-bit copy of float weights; on quantized "
                               "weights use the threshold method")
        from attnlab.quant import QuantLinear, QuantSpec
        self.low = [QuantLinear(QuantSpec.parse(LOWBIT).quantize(layer.mlp.w13.weight.detach().float()))
                    for layer in model.layers]
        for low in self.low:  # the same integer arithmetic at every chunk length: prefill chooses as decode does
            low.max_rows = 1 << 62

    def scores(self, i, ffn, x, src, act=None):
        g, u = self.low[i](x).split(self.low[i].out_features // 2, dim=-1)
        return (F.silu(g) * u).abs()

    def mlp_bytes(self, i, row13, row2, H):
        return self.low[i].nbytes + super().mlp_bytes(i, row13, row2, H)


METHODS: dict[str, type[Plan]] = {p.method: p for p in (Oracle, Threshold, Predictor, Lowbit)}  # Deja Vu's


def methods() -> dict[str, type[Plan]]:
    """Every method: Deja Vu's (MLP neurons, heads) and TEAL (every projection's input, `attnlab.sparsity.teal`)."""
    from attnlab.sparsity.teal import Teal
    return {**METHODS, Teal.method: Teal}


def make_plan(method: str, sparsity: float = 0.5, head_sparsity: float = 0.0, predictors=None,
              sparse_exec: bool = True) -> Plan:
    """An unbound plan of the named method (oracle, threshold, predictor, lowbit, teal; for teal, predictors
    is its `Calibration`, or None: the model's cached one)."""
    cls = methods().get(method)
    if cls is None:
        raise AttnlabError(f"unknown sparsity method {method!r}; choose from {', '.join(methods())}")
    return cls(sparsity, head_sparsity, predictors, sparse_exec)


def _nbytes(linear) -> int:
    return linear.nbytes if hasattr(linear, "nbytes") else linear.weight.numel() * linear.weight.element_size()


def _transposed(w2, quant: str | None):
    """The down projection as [hidden, dim] rows (one per neuron), in the model's weight format."""
    if hasattr(w2, "dequantize"):
        from attnlab.quant import QuantLinear, QuantSpec
        return QuantLinear(QuantSpec.parse(quant).quantize(w2.dequantize().float().T.contiguous()))
    t = nn.Linear(w2.out_features, w2.in_features, bias=False, dtype=w2.weight.dtype)
    t.weight = nn.Parameter(w2.weight.detach().T.contiguous(), requires_grad=False)
    return t


class SparsitySpec(NamedTuple):
    """A parsed --sparsity value."""
    method: str
    path: str | None
    sparsity: float
    head_sparsity: float


def parse(spec: "str | SparsitySpec") -> SparsitySpec:
    """'[method@]PATH[:MLP[:HEADS]]', 'oracle[:MLP[:HEADS]]', 'lowbit[:MLP]', 'teal[:S]' or 'teal@PATH[:S]' ->
    (method, path, sparsity, head_sparsity); a parsed spec is returned as it is.

    PATH is a folder (or file) written by `attnlab dejavu train` (or `calibrate`, for teal); the method
    defaults to predictor. teal's S is the model-wide sparsity of every projection's input."""
    if isinstance(spec, SparsitySpec):
        return spec
    text = str(spec).strip()
    parts = text.split(":")
    nums = []
    while len(parts) > 1 and len(nums) < 2:
        try:
            nums.insert(0, float(parts[-1]))
        except ValueError:
            break
        parts.pop()
    head = ":".join(parts)
    method, _, path = head.rpartition("@") if "@" in head else ("", "", head)
    if head in ("oracle", "lowbit", "teal"):
        method, path = head, None
    method = method or "predictor"
    if method not in methods():
        raise AttnlabError(f"bad --sparsity {spec!r}: unknown method {method!r} ({', '.join(methods())})")
    if method == "teal" and len(nums) > 1:
        raise AttnlabError(f"bad --sparsity {spec!r}: teal takes one sparsity (every projection's input)")
    if not nums:
        nums = [0.5]
    return SparsitySpec(method, path, nums[0], nums[1] if len(nums) > 1 else 0.0)


def plan_from_spec(spec: "str | SparsitySpec", model=None) -> Plan:
    """A plan from a --sparsity spec (see `parse`), bound to model when given (teal without a PATH: the model's
    cached calibration, which `attnlab dejavu calibrate` makes)."""
    method, path, s, hs = parse(spec)
    pred = None
    if method == "teal":
        from attnlab.sparsity import teal
        pred = teal.Calibration.load(path) if path is not None else teal.cached(model) if model else None
    elif path is not None:
        p = Path(path).expanduser()
        try:
            pred = Predictors.load(p)
        except FileNotFoundError as e:
            raise AttnlabError(str(e)) from None
    plan = make_plan(method, s, hs, pred)
    return plan.bind(model) if model is not None else plan
