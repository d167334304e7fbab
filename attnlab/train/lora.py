"""LoRA (Hu et al. 2021): fine-tune a frozen network through low-rank updates W + (alpha/r) B A.

Why here: `attnlab extend` fine-tunes a pretrained model at a longer context, and a full
fine-tune needs weights, gradients and two AdamW moments in fp32 (16 bytes per parameter);
adapters train r (in + out) parameters per matrix instead. B starts at zero, so the adapted
network starts as the pretrained one; `merge` folds the updates into plain weights, so what is
saved is an ordinary checkpoint that any loader (and transformers) reads.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from attnlab.errors import AttnlabError

TARGETS = ("attn.wqkv", "attn.wo", "mlp.w13", "mlp.w2")


class LoRALinear(nn.Module):
    """y = base(x) + scale * (x A^T) B^T, base frozen."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator | None = None):
        super().__init__()
        self.base, self.scale = base.requires_grad_(False), alpha / rank
        self.A = nn.Parameter(torch.randn(rank, base.in_features, generator=generator) / math.sqrt(base.in_features))
        self.B = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.A.t() @ self.B.t()) * self.scale

    def merged(self) -> nn.Linear:
        with torch.no_grad():
            self.base.weight += self.scale * (self.B @ self.A)
        return self.base


def _slots(model: nn.Module):
    """(parent module, attribute) of every projection LoRA adapts."""
    for layer in model.layers:
        for name in TARGETS:
            block, attr = name.split(".")
            yield layer.get_submodule(block), attr


def add_lora(model: nn.Module, rank: int, alpha: float | None = None, seed: int = 0) -> nn.Module:
    """Freeze `model` and wrap every layer's projections (TARGETS) with rank-`rank` adapters (alpha
    default 2 x rank; A drawn from `seed`, so a run is reproducible); only the adapters train.
    In place; returns the model."""
    if rank < 1:
        raise AttnlabError(f"LoRA rank must be >= 1, got {rank}")
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    for parent, attr in _slots(model):
        setattr(parent, attr, LoRALinear(getattr(parent, attr), rank, alpha or 2.0 * rank, generator))
    return model


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its weight and remove the wrappers. In place; returns the model."""
    for parent, attr in _slots(model):
        module = getattr(parent, attr)
        if isinstance(module, LoRALinear):
            setattr(parent, attr, module.merged())
    return model
