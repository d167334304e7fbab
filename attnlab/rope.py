"""Rotary position embeddings, with the scalings that extend a model's context.

One table-backed `Rope` serves every caller: the network rotates queries and keys
with it, and KV-cache policies that re-assign positions (StreamingLLM's `cache`
positions) rotate stored pre-RoPE keys with the same table.

Context extension is a registry, `SCALINGS`: name -> (inverse frequencies, attention
factor), with the formulas of `transformers.modeling_rope_utils` (tests check parity):
- ``linear``: Position Interpolation (Chen et al. 2023), positions divided by `factor`.
- ``ntk``: NTK-aware base change, base * factor^(d / (d - 2)): high frequencies kept.
- ``dynamic``: dynamic NTK, the base change sized to the current sequence length.
- ``yarn``: YaRN (Peng et al. 2023), per-frequency ramp between interpolation and
  extrapolation, plus an attention factor 0.1 ln(factor) + 1.
- ``llama3``: Llama 3.1's wavelength-banded variant.
- ``freq_factors``: per-frequency divisors, the `rope_freqs` tensor of llama.cpp GGUFs.
The attention factor scales the tables' magnitude, so q and k both carry it and the
logits scale by its square, exactly as transformers scales cos and sin.
"""
from __future__ import annotations

import math

import torch

from attnlab.errors import AttnlabError


def _default(inv, d, base, s, seq_len):
    return inv, 1.0


def _linear(inv, d, base, s, seq_len):  # pos / factor == inv_freq / factor
    return inv / float(s["factor"]), 1.0


def _ntk(inv, d, base, s, seq_len):
    return _base_inv(d, base * float(s["factor"]) ** (d / (d - 2))), 1.0


def _dynamic(inv, d, base, s, seq_len):
    orig = int(s["original_max_position_embeddings"])
    seq_len = max(seq_len or orig, orig)
    factor = float(s["factor"])
    return _base_inv(d, base * ((factor * seq_len / orig) - (factor - 1)) ** (d / (d - 2))), 1.0


def _yarn(inv, d, base, s, seq_len):
    factor, orig = float(s["factor"]), int(s["original_max_position_embeddings"])

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = s.get("attention_factor")
    if attn is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def dim_for(rotations):  # the dimension whose wavelength fits `rotations` times in orig
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_for(beta_fast), dim_for(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(d // 2, dtype=torch.float64, device="cpu") - low) / (high - low)).clamp(0, 1)
    return inv / factor * ramp + inv * (1 - ramp), float(attn)


def _llama3(inv, d, base, s, seq_len):  # low frequencies scaled, high kept, smooth ramp between
    factor = float(s["factor"])
    low, high = float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old_ctx = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    smooth = ((old_ctx / wavelen) - low) / (high - low)
    mixed = (1 - smooth) * inv / factor + smooth * inv
    out = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    return torch.where(mid, mixed, out), 1.0


def _freq_factors(inv, d, base, s, seq_len):  # llama.cpp: theta_i = pos * inv_i / rope_freqs[i]
    factors = torch.tensor(s["factors"], dtype=torch.float64, device="cpu")
    if factors.shape != inv.shape:
        raise AttnlabError(f"rope_freqs has {factors.numel()} entries, expected {inv.numel()}")
    return inv / factors, 1.0


SCALINGS = {"default": _default, "linear": _linear, "ntk": _ntk, "dynamic": _dynamic, "yarn": _yarn,
            "llama3": _llama3, "freq_factors": _freq_factors}
NEEDS_ORIGINAL = ("dynamic", "yarn", "llama3")  # types that read original_max_position_embeddings


def _base_inv(head_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim))


def scaling_type(scaling: dict | None) -> str:
    """The registry name of a scaling dict (Hugging Face spells it `rope_type` or `type`)."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type")) or "default"
    if kind not in SCALINGS:
        raise AttnlabError(f"unsupported RoPE scaling {kind!r}; supported: {', '.join(SCALINGS)}")
    return kind


def rope_parameters(head_dim: int, base: float, scaling: dict | None = None,
                    seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """-> ([head_dim // 2] float64 inverse frequencies, attention factor) after any scaling.

    seq_len only matters for `dynamic`, whose base grows with the sequence.
    """
    kind = scaling_type(scaling)
    if kind != "default" and kind != "freq_factors" and float(scaling.get("factor", 0) or 0) <= 0:
        raise AttnlabError(f"RoPE scaling {kind!r} needs a positive factor, got {scaling.get('factor')!r}")
    if kind in NEEDS_ORIGINAL and not scaling.get("original_max_position_embeddings"):
        raise AttnlabError(f"RoPE scaling {kind!r} needs original_max_position_embeddings")
    return SCALINGS[kind](_base_inv(head_dim, base), head_dim, base, scaling or {}, seq_len)


def inv_frequencies(head_dim: int, base: float, scaling: dict | None = None) -> torch.Tensor:
    """[head_dim // 2] float64 inverse frequencies, after any context-extension scaling."""
    return rope_parameters(head_dim, base, scaling)[0]


def parse_rope(spec: str, context_length: int) -> dict | None:
    """A user's `--rope` value -> a scaling dict: "none", "linear:4" / "pi:4", "ntk:2", "dynamic:2",
    "yarn:4", "llama3:8". The model's trained context becomes original_max_position_embeddings."""
    name, _, factor = spec.partition(":")
    name = {"pi": "linear"}.get(name.strip().lower(), name.strip().lower())
    if name in ("none", "default"):
        return None
    if name not in SCALINGS or name == "freq_factors":
        choices = "none, " + ", ".join(k for k in SCALINGS if k not in ("default", "freq_factors"))
        raise AttnlabError(f"unknown RoPE scaling {spec!r}; use NAME:FACTOR with NAME one of {choices}")
    try:
        f = float(factor)
    except ValueError:
        raise AttnlabError(f"RoPE scaling {spec!r} needs a numeric factor, e.g. {name}:4") from None
    if not f > 0:
        raise AttnlabError(f"RoPE scaling factor must be > 0, got {spec!r}")
    out = {"rope_type": name, "factor": f, "original_max_position_embeddings": int(context_length)}
    if name == "llama3":
        out.update(low_freq_factor=1.0, high_freq_factor=4.0)
    return out


class Rope:
    """Complex tables indexed by integer position, grown on demand (streams run past any preset
    length). Built lazily on the CPU, so a network created on the meta device owns a real Rope."""

    def __init__(self, head_dim: int, base: float, scaling: dict | None = None, length: int = 0):
        self.head_dim, self.base, self.scaling = head_dim, base, scaling
        self.dynamic = scaling_type(scaling) == "dynamic"
        self.inv_freq, self.attention_factor = rope_parameters(head_dim, base, scaling)
        self.original = int((scaling or {}).get("original_max_position_embeddings") or 0)
        self.seq_len = self.original  # dynamic: the length the current frequencies were sized for
        self.cis = torch.empty(0, dtype=torch.complex64, device="cpu")
        if length:
            self._grow(length)

    def _grow(self, length: int) -> None:
        freqs = torch.outer(torch.arange(length, dtype=torch.float64, device="cpu"), self.inv_freq)
        mag = torch.full_like(freqs, self.attention_factor)
        self.cis = torch.polar(mag, freqs).to(torch.complex64)  # [length, head_dim / 2]

    def _resize_dynamic(self, need: int) -> None:
        """transformers' rule: recompute when the sequence outgrows the last size, reset below the original."""
        if need > self.seq_len or (need < self.original < self.seq_len):
            self.seq_len = max(need, self.original)
            self.inv_freq, self.attention_factor = rope_parameters(self.head_dim, self.base, self.scaling, self.seq_len)
            self._grow(max(need, self.cis.shape[0]))

    def tables(self, pos: torch.Tensor) -> torch.Tensor:
        """Complex rotations of magnitude attention_factor [*pos.shape, head_dim / 2];
        negative positions (padding) read position 0."""
        need = int(pos.max()) + 1 if pos.numel() else 0
        if self.dynamic:
            self._resize_dynamic(need)
        if need > self.cis.shape[0]:
            self._grow(max(need, 2 * self.cis.shape[0]))
        return self.cis[pos.clamp_min(0)]

    def turn(self, by: int) -> torch.Tensor:
        """The unit rotation [head_dim / 2] that moves a rotated key `by` positions on (either sign); the last
        one is kept, as every layer of a cache turns its keys by the same amount in one step."""
        if getattr(self, "_turn", (None,))[0] != (by, self.cis.shape[0], self.seq_len):
            cis = self.tables(torch.tensor(abs(by))) / self.attention_factor
            self._turn = ((by, self.cis.shape[0], self.seq_len), cis.conj() if by < 0 else cis)
        return self._turn[1]

    def rotation(self, pos: torch.Tensor, real: bool = False) -> torch.Tensor:
        """The table for `apply`: pos [B, T] -> [B, 1, T, head_dim / 2] complex (broadcast over heads),
        or [B, 1, T, head_dim / 2, 2] (cos, sin) if real (what the native decode step reads)."""
        rot = self.tables(pos)[:, None]
        return torch.view_as_real(rot) if real else rot

    def rotate(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x: [B, H, T, D] rotated at pos: [B, T] (same for all heads) or [B, H, T] (per head)."""
        rot = self.tables(pos)
        return apply(x, rot[:, None] if pos.dim() == 2 else rot)


def apply(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., T, D] by a complex table broadcastable to [..., T, D / 2] (or its real form).

    Rotated pairs are adjacent dimensions (2i, 2i+1), so a rotation is one complex multiply
    (about 10x faster on CPU than the half-split cos/sin form, which matters when an eviction
    in the `cache` position convention turns cached keys). Checkpoints in
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
