"""The Llama-family network in plain PyTorch: Llama 2/3, Mistral, Qwen2, SmolLM2.

RMSNorm, RoPE, grouped-query attention (optional q/k/v bias), SwiGLU MLP, tied
or untied head. The q/k/v and gate/up projections are fused into one matmul
each: at batch 1 decoding is memory-bound, and fewer, larger reads are faster.
RoPE rotates adjacent pairs of q/k dimensions (one complex multiply, see
`attnlab.rope.apply`); loaders interleave Hugging Face's half-split q/k rows to match.
Attention goes through a `LayerKV` when one is given, so the cache (and any
eviction policy on it) sees every step; a policy that needs the attention
probabilities (H2O) gets them from the same pass.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from attnlab.rope import Rope, apply as rope_apply


@dataclass
class ModelConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    head_dim: int = 0
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    rope_scaling: dict | None = None
    context_length: int = 2048
    qkv_bias: bool = False
    tie_embeddings: bool = False
    arch: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not self.head_dim:
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")

    @property
    def n_params(self) -> int:
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        block = attn + 3 * self.dim * self.hidden_dim + 2 * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.n_layers * block + self.vocab_size * self.dim + head + self.dim


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()  # low precision: normalise in fp32 as the reference does
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, need_probs: bool = False):
    """Grouped-query attention without copying K/V per query head.

    q: [B, Hq, T, D]; k, v: [B, Hkv, L, D]; mask: None (all), "causal" (L == T) or bool [B, Hkv|1, T, L].
    The G = Hq/Hkv query heads of a group are folded into the query axis, so every head of a
    group reads the same K/V. Returns out [B, Hq, T, D] and, if need_probs, the attention
    probabilities of every query head: [B, Hq, T, L] (float32; query head h reads KV head h // G).
    """
    B, Hq, T, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = Hq // Hkv
    if mask == "causal" and not need_probs:
        return F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=True), None
    if isinstance(mask, str):
        mask = torch.ones(T, L, dtype=torch.bool).tril(L - T)[None, None]
    qg = q.reshape(B, Hkv, G * T, D)
    m = mask
    if isinstance(m, torch.Tensor) and G > 1:
        m = m[:, :, None].expand(B, m.shape[1], G, T, L).reshape(B, m.shape[1], G * T, L)
    if not need_probs:
        return F.scaled_dot_product_attention(qg, k, v, attn_mask=m).reshape(B, Hq, T, D), None
    scores = (qg @ k.transpose(-1, -2)).float() / math.sqrt(D)
    if m is not None:
        scores = scores.masked_fill(~m, float("-inf"))
    probs = scores.softmax(-1)
    out = (probs.to(v.dtype) @ v).reshape(B, Hq, T, D)
    return out, probs.reshape(B, Hq, T, L)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.n_kv, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.wo = nn.Linear(self.q_size, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rot: torch.Tensor, kv=None, step=None, policy=None) -> torch.Tensor:
        """x: [B, T, dim]; rot: RoPE tables of the chunk's positions; kv: this layer's LayerKV or None."""
        B, T, _ = x.shape
        qkv = self.wqkv(x).view(B, T, self.n_heads + 2 * self.n_kv, self.head_dim).transpose(1, 2)
        qk, v = qkv.split([self.n_heads + self.n_kv, self.n_kv], dim=1)  # [B, H, T, D] views
        q, k = rope_apply(qk, rot).split([self.n_heads, self.n_kv], dim=1)  # q and k in one pass
        k, v, mask = (k, v, "causal") if kv is None else kv.update(k, v, step)
        need = policy is not None and policy.needs_probs
        out, probs = attend(q, k, v, mask, need_probs=need)
        if need:
            policy.observe(kv, probs)
        return self.wo(out.transpose(1, 2).reshape(B, T, self.q_size))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.hidden = cfg.hidden_dim
        self.w13 = nn.Linear(cfg.dim, 2 * cfg.hidden_dim, bias=False)  # gate rows, then up rows
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).split(self.hidden, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = FeedForward(cfg)

    def forward(self, x, rot, kv=None, step=None, policy=None):
        x = x + self.attn(self.attn_norm(x), rot, kv, step, policy)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rope = Rope(cfg.head_dim, cfg.rope_base, cfg.rope_scaling, length=min(cfg.context_length, 8192))

    def forward(self, ids: torch.Tensor, pos: torch.Tensor | None = None, cache=None,
                last_only: bool = False) -> torch.Tensor:
        """ids: [B, T] -> logits [B, T, vocab] (or [B, 1, vocab] if last_only).

        Without a cache this is one full causal forward from position 0. With a KVCache the
        chunk is appended to it (positions continue from what the cache has seen); the cache's
        bookkeeping (positions, eviction) runs around `run`, so `run` is tensor work only and
        a single-token step can go through its compiled form (see `compile_decode`).
        """
        if cache is None:
            pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1) if pos is None else pos
            return self.run(ids, self.rope.rotation(pos), None, None, None, last_only)
        T = ids.shape[1]
        policy = cache.policy
        fast = self.compiled is not None and T == 1 and not (policy is not None and policy.needs_probs)
        step = cache.begin(T, self.rope, real=fast)
        fast = fast and not step.padded
        logits = (self.compiled if fast else self.run)(ids, step.rot, step, cache.layers, policy, last_only)
        cache.advance(T)
        return logits

    def run(self, ids, rot, step, kvs, policy, last_only: bool = False) -> torch.Tensor:
        """The layers and the head: ids [B, T], rot (RoPE tables), the step and per-layer caches (or None)."""
        x = self.embed(ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, rot, kvs[i] if kvs is not None else None, step, policy)
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.norm(x)).float()

    compiled = None

    def compile_decode(self, **options) -> None:
        """Compile `run` for single-token decode steps (eager stays the reference and the fallback).

        The cache length is a dynamic size (one graph for every length), the KV buffers are
        written in place, and RoPE uses real cos/sin tables (inductor has no complex kernels).
        """
        self.compiled = torch.compile(self.run, dynamic=None, **options)
