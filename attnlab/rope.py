"""Rotary position embeddings, with the scalings that extend a model's context.

One table-backed `Rope` serves every caller: the network rotates queries and keys
with it, and KV-cache policies that re-assign positions (StreamingLLM's `cache`
positions) rotate stored pre-RoPE keys with the same table. Position
Interpolation (Chen et al. 2023) is `scaling={"rope_type": "linear", "factor": s}`:
positions are divided by `s`, so a model trained to L positions sees L*s
tokens inside its trained range.
"""
from __future__ import annotations

import math

import torch


def inv_frequencies(head_dim: int, base: float, scaling: dict | None = None) -> torch.Tensor:
    """[head_dim // 2] float64 inverse frequencies, after any context-extension scaling."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in (None, "default"):
        return inv
    if kind == "linear":  # Position Interpolation: pos / factor == inv_freq / factor
        return inv / float(scaling["factor"])
    if kind == "llama3":  # Llama 3.1: low frequencies scaled, high kept, smooth ramp between
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = ((old_ctx / wavelen) - low) / (high - low)
        mixed = (1 - smooth) * inv / factor + smooth * inv
        out = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        return torch.where(mid, mixed, out)
    raise ValueError(f"unsupported RoPE scaling {kind!r}; supported: default, linear, llama3")


class Rope:
    """cos/sin tables indexed by integer position, grown on demand (streams run past any preset length)."""

    def __init__(self, head_dim: int, base: float, scaling: dict | None = None, length: int = 4096):
        self.head_dim = head_dim
        self.inv_freq = inv_frequencies(head_dim, base, scaling)
        self.cos = self.sin = torch.empty(0)
        self._grow(length)

    def _grow(self, length: int) -> None:
        freqs = torch.outer(torch.arange(length, dtype=torch.float64), self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # [length, head_dim], HF's half-split layout
        self.cos, self.sin = emb.cos().float(), emb.sin().float()

    def tables(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [*pos.shape, head_dim]; negative positions (padding) read position 0."""
        need = int(pos.max()) + 1 if pos.numel() else 0
        if need > self.cos.shape[0]:
            self._grow(max(need, 2 * self.cos.shape[0]))
        pos = pos.clamp_min(0)
        return self.cos[pos].to(dtype), self.sin[pos].to(dtype)

    def rotation(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for `apply`: pos [B, T] -> cos, sin [B, 1, T, D] (broadcast over heads)."""
        cos, sin = self.tables(pos, dtype)
        return cos[:, None], sin[:, None]

    def rotate(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x: [B, H, T, D] rotated at pos: [B, T] (same for all heads) or [B, H, T] (per head)."""
        cos, sin = self.tables(pos, x.dtype)
        if pos.dim() == 2:
            cos, sin = cos[:, None], sin[:, None]
        return apply(x, (cos, sin))


def apply(x: torch.Tensor, rot: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate x [..., T, D] by precomputed (cos, sin) tables broadcastable to it."""
    cos, sin = rot
    return x * cos + rotate_half(x) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)
