"""Row-sparse matvecs for Deja Vu's sparse MLP at batch 1: read only the active neurons' rows, each once.

Decoding one token is memory-bound, so skipping inactive neurons pays only in bytes not read.
Gathering the active rows (`index_select`) and then multiplying reads them twice and writes them
once, which loses to the dense matvec at moderate sparsity; these functions stream each selected
row straight from the weight's storage (fp32, int8 and int4 through the fused kernels of
`attnlab.kernels.ops`, dequantised in registers). Hold gate/up as they are (one neuron = one row)
and the down projection transposed, [N neurons, K model dim], so a neuron is one contiguous row in
both. Bias is ignored (SwiGLU MLPs have none). Without the kernels, or for bf16 and k-means
weights, a torch fallback gives the numbers of dequantise-then-matmul.
"""
from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from attnlab.errors import AttnlabError
from attnlab.kernels import ops
from attnlab.quant.kinds import FLOAT32
from attnlab.quant.linear import QuantLinear


def _args(weight, v: torch.Tensor, idx: torch.Tensor, name: str):
    """v (x: [K], a: [k]) and idx as the kernels take them, or a one-line error."""
    if not isinstance(weight, (nn.Linear, QuantLinear)):
        raise TypeError(f"rows ops take an nn.Linear or a QuantLinear, got {type(weight).__name__}")
    n = weight.in_features if name == "x" else idx.shape[0] if idx.dim() == 1 else -1
    if v.dim() != 1 or v.shape[0] != n:
        raise AttnlabError(f"{name} must be a vector of size {n}, got shape {tuple(v.shape)}")
    if idx.dim() != 1 or idx.dtype.is_floating_point:
        raise AttnlabError(f"idx must be a 1-D integer tensor, got {idx.dtype} {tuple(idx.shape)}")
    return v.float().contiguous(), idx.long().contiguous()


def _kernel(weight):
    """The row ops (`attnlab.quant.kinds.Sparse`) that serve this weight, or None (dequantise the rows)."""
    if isinstance(weight, nn.Linear):
        w = weight.weight
        return FLOAT32 if w.dtype == torch.float32 and w.is_contiguous() else None
    return weight.fmt.sparse if weight.fused and weight.fmt.has_rows(weight.group, weight.has_min) else None


def _rows(weight, idx: torch.Tensor) -> torch.Tensor:
    """The selected rows as float32 [k, K] (the fallback's gathered copy)."""
    if isinstance(weight, nn.Linear):
        return weight.weight.detach().index_select(0, idx).float()
    p = weight.packed
    return replace(p.map_rows(lambda t: t.index_select(0, idx)), shape=(idx.numel(), p.shape[1])).dequantize()


def _operands(weight) -> tuple:
    if isinstance(weight, nn.Linear):
        return (weight.weight.detach(),)
    return weight.row_operands()  # the row layout, whatever the layer holds (repacked blocks)


def rows_matvec(weight: nn.Linear | QuantLinear, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [K] float, idx [k] int -> [k] float32: weight[idx] @ x, each selected row read once (gate/up).

    Under the integer kernels (int8, int4) x is rounded to int8 per 32 values, exactly as in the
    layer's own batch-1 forward, so the result equals `weight(x[None])[0, idx]` bit for bit.
    An index outside [0, N) raises."""
    x, idx = _args(weight, x, idx, "x")
    return bind_rows(weight)[0](x, idx)


def rows_combine(weight: nn.Linear | QuantLinear, a: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """a [k] float, idx [k] int -> [K] float32: sum_j a[j] * weight[idx[j]] (down projection with weight =
    W2 transposed). Each selected row is read once; repeated indices add up; empty idx gives zeros."""
    a, idx = _args(weight, a, idx, "a")
    return bind_rows(weight)[1](a, idx)


def bind_rows(weight: nn.Linear | QuantLinear) -> tuple:
    """(matvec(x, idx), combine(a, idx)) for one weight with its kernel and operands looked up once:
    the decode step calls them 30 times a token, where the checks of `rows_matvec` cost as much as a
    small row op. Inputs must already be contiguous float32 / int64 vectors (the plan's own tensors are)."""
    sparse = _kernel(weight)
    if sparse is not None:
        return ops.bound_rows(sparse, _operands(weight))
    return (lambda x, idx: _rows(weight, idx) @ x), (lambda a, idx: a @ _rows(weight, idx))
