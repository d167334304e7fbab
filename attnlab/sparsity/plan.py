"""A sparsity plan: which MLP neurons and attention heads each token uses, plugged into the forward.

`Plan.mlp` and `Plan.heads` are called by the network (see `attnlab.model.llama.Pass`).
Two executions with the same semantics:
- masked (any batch and chunk length; used by prefill and evaluation): compute densely,
  zero what is not chosen. It defines what the sparse model computes.
- sparse (batch 1, one token: decoding): read only the chosen rows. gate/up rows come
  from the fused w13 and the down projection is kept transposed, so one neuron is one
  contiguous row in each and every active row is streamed once (`attnlab.sparsity.rows`).
  The threshold method computes the whole gate and then only the chosen up/down rows.

Heads are chosen per token and masked (their output zeroed before wo); with grouped-query
attention every KV head is still needed by the cache, so skipped heads save only their q
rows and wo columns and head sparsity has no sparse execution here (see the README).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from attnlab.errors import AttnlabError
from attnlab.sparsity.predictors import Predictors

METHODS = ("oracle", "threshold", "predictor", "lowbit")
LOWBIT = "int4:32"  # the lowbit method's copy of gate/up: 1/7 of the fp32 bytes


@dataclass
class Plan:
    """method: oracle | threshold | predictor | lowbit; sparsity: fraction of MLP neurons skipped per token;
    head_sparsity: fraction of query heads skipped (oracle or predictor); predictors: trained
    `Predictors` (also the threshold method's calibration); sparse_exec: single-token steps read
    only the chosen rows (False: always masked, for checking)."""
    method: str = "predictor"
    sparsity: float = 0.5
    head_sparsity: float = 0.0
    predictors: Predictors | None = None
    sparse_exec: bool = True
    down: list = field(default_factory=list, repr=False)  # per layer: down projection, one row per neuron
    compilable = False  # data-dependent row choice: decode steps run eager

    def __post_init__(self):
        if self.method not in METHODS:
            raise AttnlabError(f"unknown sparsity method {self.method!r}; choose from {', '.join(METHODS)}")
        for name in ("sparsity", "head_sparsity"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
                raise AttnlabError(f"{name.replace('_', ' ')} must be in [0, 1), got {v!r}")
        if self.method in ("threshold", "predictor") and self.predictors is None:
            raise AttnlabError(f"the {self.method} method needs trained predictors (attnlab dejavu train)")
        if self.method in ("threshold", "lowbit") and self.head_sparsity:
            raise AttnlabError(f"the {self.method} method chooses MLP neurons only; use oracle or predictor for heads")
        self._prev = None

    def bind(self, model) -> "Plan":
        """Check the plan fits model and build the per-neuron down projections; attach it to model."""
        cfg = model.cfg
        if self.predictors is not None:
            self.predictors.check_model(cfg)
        from attnlab.sparsity.rows import bind_rows
        self.down = [_transposed(layer.mlp.w2, getattr(model, "quant", None)) for layer in model.layers]
        self._up = [bind_rows(layer.mlp.w13)[0] for layer in model.layers]    # gate/up rows -> values
        self._down = [bind_rows(d)[1] for d in self.down]                      # values -> sum of down rows
        if self.method == "lowbit":
            if getattr(model, "quant", None):
                raise AttnlabError("the lowbit method scores with a 4-bit copy of float weights; on quantized "
                                 "weights use the threshold method")
            from attnlab.quant import QuantLinear, QuantSpec
            self.low = [QuantLinear(QuantSpec.parse(LOWBIT).quantize(layer.mlp.w13.weight.detach().float()))
                        for layer in model.layers]
            for low in self.low:  # the same integer arithmetic at every chunk length: prefill chooses as decode does
                low.max_rows = 1 << 62
        if self.predictors is not None:
            self._pred = [self.predictors.layer(i) for i in range(cfg.n_layers)]
        model.sparsity = self
        return self

    def keep(self, n: int, sparsity: float) -> int:
        return max(1, n - math.floor(sparsity * n + 1e-9))

    # ------------------------------------------------------------ called by the network

    def mlp(self, i: int, ffn, x: torch.Tensor, ctx) -> torch.Tensor:
        src = self._prev if self.method == "predictor" and self.predictors.lookahead and i > 0 else x
        self._prev = x
        if self.sparse_exec and x.shape[0] * x.shape[1] == 1 and self.down:
            return self._sparse(i, ffn, x, src, ctx)
        gate, up = ffn.w13(x).split(ffn.hidden, dim=-1)
        act = F.silu(gate) * up
        act = act * self.choose(i, x, gate, act, src)
        ctx.record(i, "mlp_act", act)
        return ffn.w2(act)

    def _lowbit(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """|silu(gate) * up| from the 4-bit copy: the oracle's ranking at a seventh of the bytes."""
        g, u = self.low[i](x).split(self.low[i].out_features // 2, dim=-1)
        return (F.silu(g) * u).abs()

    def choose(self, i: int, x: torch.Tensor, gate: torch.Tensor, act: torch.Tensor,
               src: torch.Tensor | None = None) -> torch.Tensor:
        """Float mask [..., hidden] of the neurons each token keeps (masked execution)."""
        if self.method == "threshold":
            return (F.silu(gate).abs() > self._threshold(i)).to(act.dtype)
        if self.method == "oracle":
            scores = act.abs()
        elif self.method == "lowbit":
            scores = self._lowbit(i, x)
        else:
            scores = self.predictors.mlp_scores(i, src)
        k = self.keep(act.shape[-1], self.sparsity)
        return torch.zeros_like(act).scatter(-1, scores.topk(k, dim=-1).indices, 1.0)

    def _sparse(self, i: int, ffn, x: torch.Tensor, src: torch.Tensor, ctx) -> torch.Tensor:
        x1 = x.reshape(-1).float().contiguous()
        H, rows = ffn.hidden, self._up[i]
        if self.method == "oracle":
            act = ffn.activation(x1)
            idx = act.abs().topk(self.keep(H, self.sparsity), sorted=False).indices
            a = act[idx]
        elif self.method == "threshold":
            sg = F.silu(rows(x1, self._gate_rows(H)))
            idx = (sg.abs() > self._threshold(i)).nonzero().flatten()
            a = sg[idx] * rows(x1, idx + H)
        else:
            k = self.keep(H, self.sparsity)
            scores = self._lowbit(i, x1) if self.method == "lowbit" else _scores(self._pred[i], src.reshape(-1))
            idx = scores.topk(k, sorted=False).indices
            gu = rows(x1, torch.cat([idx, idx + H]))
            a = F.silu(gu[:k]) * gu[k:]
        if ctx.observers:
            ctx.record(i, "mlp_act", torch.zeros(1, 1, H).index_copy(2, idx, a.view(1, 1, -1)).to(x.dtype))
        return self._down[i](a.contiguous(), idx).view(1, 1, -1).to(x.dtype)

    def _threshold(self, i: int) -> float:
        """Layer i's calibrated gate threshold at this sparsity, looked up once (decode calls it every token)."""
        key = (i, self.sparsity)
        cache = self.__dict__.setdefault("_taus", {})
        if key not in cache:
            cache[key] = self.predictors.threshold(i, self.sparsity)
        return cache[key]

    def _gate_rows(self, n: int) -> torch.Tensor:
        if getattr(self, "_gates", None) is None or self._gates.numel() != n:
            self._gates = torch.arange(n)
        return self._gates

    def heads(self, i: int, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [B, Hq, T, D] with the heads a token does not use zeroed; x: the normed attention input."""
        if not self.head_sparsity:
            return out
        H = out.shape[1]
        if self.method == "oracle":
            scores = out.norm(dim=-1)  # [B, Hq, T]
        else:
            scores = self.predictors.head_scores(i, x).transpose(1, 2)
        k = self.keep(H, self.head_sparsity)
        mask = torch.zeros_like(scores).scatter(1, scores.topk(k, dim=1).indices, 1.0)
        return out * mask[..., None].to(out.dtype)

    # ------------------------------------------------------------ cost

    def bytes_per_token(self, model) -> dict:
        """Weight bytes one decode step reads in the MLPs: dense vs this plan (predictor included)."""
        dense = sparse = 0
        for i, layer in enumerate(model.layers):
            ffn = layer.mlp
            w13, w2 = _nbytes(ffn.w13), _nbytes(ffn.w2)
            H = ffn.hidden
            dense += w13 + w2
            k = self.keep(H, self.sparsity)
            row13, row2 = w13 / (2 * H), w2 / H
            if self.method == "oracle":
                sparse += w13 + k * row2
            elif self.method == "threshold":
                sparse += H * row13 + k * (row13 + row2)  # k: the calibrated average
            elif self.method == "lowbit":
                sparse += self.low[i].nbytes + 2 * k * row13 + k * row2
            else:
                sparse += 2 * k * row13 + k * row2 + self.predictors.nbytes
        return {"dense_mlp": dense, "sparse_mlp": int(sparse)}


def _scores(layer: tuple, x: torch.Tensor) -> torch.Tensor:
    """A predictor's neuron scores for one token x [dim] from its prepared tensors (two matvecs)."""
    at, a0, bt, b0 = layer
    return torch.addmv(b0, bt, torch.relu(torch.addmv(a0, at, x)))


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


def parse(spec: str) -> tuple[str, str | None, float, float]:
    """'[method@]PATH[:MLP[:HEADS]]', 'oracle[:MLP[:HEADS]]' or 'lowbit[:MLP]' -> (method, path, sparsity,
    head_sparsity).

    PATH is a folder (or file) written by `attnlab dejavu train`; the method defaults to predictor."""
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
    if head in ("oracle", "lowbit"):
        method, path = head, None
    method = method or "predictor"
    if method not in METHODS:
        raise AttnlabError(f"bad --sparsity {spec!r}: unknown method {method!r} ({', '.join(METHODS)})")
    if not nums:
        nums = [0.5]
    return method, path, nums[0], nums[1] if len(nums) > 1 else 0.0


def plan_from_spec(spec: str, model=None) -> Plan:
    """A bound plan from a --sparsity spec (see `parse`)."""
    method, path, s, hs = parse(spec)
    pred = None
    if path is not None:
        p = Path(path).expanduser()
        try:
            pred = Predictors.load(p)
        except FileNotFoundError as e:
            raise AttnlabError(str(e)) from None
    plan = Plan(method, s, hs, pred)
    return plan.bind(model) if model is not None else plan
