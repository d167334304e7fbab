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
        self.cis = torch.empty(0, dtype=torch.complex64)
        self._grow(length)

    def _grow(self, length: int) -> None:
        freqs = torch.outer(torch.arange(length, dtype=torch.float64), self.inv_freq)  # [length, head_dim / 2]
        self.cis = torch.polar(torch.ones_like(freqs), freqs).to(torch.complex64)

    def tables(self, pos: torch.Tensor) -> torch.Tensor:
        """Unit complex rotations [*pos.shape, head_dim / 2]; negative positions (padding) read position 0."""
        need = int(pos.max()) + 1 if pos.numel() else 0
        if need > self.cis.shape[0]:
            self._grow(max(need, 2 * self.cis.shape[0]))
        return self.cis[pos.clamp_min(0)]

    def rotation(self, pos: torch.Tensor, real: bool = False) -> torch.Tensor:
        """The table for `apply`: pos [B, T] -> [B, 1, T, head_dim / 2] complex (broadcast over heads),
        or [B, 1, T, head_dim / 2, 2] (cos, sin) if real (for torch.compile, which has no complex kernels)."""
        rot = self.tables(pos)[:, None]
        return torch.view_as_real(rot) if real else rot

    def rotate(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x: [B, H, T, D] rotated at pos: [B, T] (same for all heads) or [B, H, T] (per head)."""
        rot = self.tables(pos)
        return apply(x, rot[:, None] if pos.dim() == 2 else rot)


def apply(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., T, D] by a complex table broadcastable to [..., T, D / 2] (or its real form).

    Rotated pairs are adjacent dimensions (2i, 2i+1), so a rotation is one complex multiply
    (about 10x faster on CPU than the half-split cos/sin form, which matters when the
    `cache` position convention re-rotates every cached key at every step). Checkpoints in
    the half-split (Hugging Face) layout get their q/k rows interleaved once at load time.
    """
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    if not rot.is_complex():  # (cos, sin) pairs: the same rotation written with real arithmetic
        x0, x1, c, s = pairs[..., 0], pairs[..., 1], rot[..., 0], rot[..., 1]
        return torch.stack([x0 * c - x1 * s, x0 * s + x1 * c], -1).flatten(-2).to(x.dtype)
    return torch.view_as_real(torch.view_as_complex(pairs) * rot).flatten(-2).to(x.dtype)


def interleave_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """q/k projection rows (or biases) from the half-split layout, pairs (i, i + D/2), to the
    interleaved one, pairs (2i, 2i + 1), per head. Dot products q . k are unchanged."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
