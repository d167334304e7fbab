"""The Llama-family network in plain PyTorch: Llama 2/3, Mistral, Qwen2, SmolLM2.

RMSNorm, RoPE, grouped-query attention (optional q/k/v bias), SwiGLU MLP, tied
or untied head. The q/k/v and gate/up projections are fused into one matmul
each: at batch 1 decoding is memory-bound, and fewer, larger reads are faster.
RoPE rotates adjacent pairs of q/k dimensions (one complex multiply, see
`attnlab.rope.apply`); loaders interleave Hugging Face's half-split q/k rows to match.
Everything a pass carries beside the activations (RoPE tables, the cache's slots for
this step, an analysis mask, observers, a sparsity plan) travels in one `Pass` object,
so KV policies, recorders and Deja Vu sparsity plug into this one forward instead of
re-implementing the layer loop. The network is pure: it never runs the cache's
bookkeeping, calls a policy or chooses how it is executed; the engine's step does
(`attnlab.engine.LM.step`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from attnlab.errors import AttnlabError
from attnlab.kernels import ops
from attnlab.kernels.reference import dequantize_int8_blocks
from attnlab.model.quest import read_pages, spread
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
    sliding_window: int | None = None  # Mistral: each query sees only the last W positions
    qkv_bias: bool = False
    tie_embeddings: bool = False
    arch: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self):
        if not self.head_dim:
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise AttnlabError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")

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
            return ops.rms_norm(x, self.weight, self.eps)
        xf = x.float()  # low precision: normalise in fp32 as the reference does
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, need_probs: bool = False,
           window: int | None = None):
    """Grouped-query attention without copying K/V per query head.

    q: [B, Hq, T, D]; k, v: [B, Hkv, L, D], or (int8 codes, scales) pairs from an int8 cache;
    mask: None (all), "causal" (query i sees keys 0 .. L - T + i) or bool [B, Hkv|1, T, L].
    window: a sliding window (Mistral) narrowing a "causal" mask to the last `window` keys;
    tensor masks from a cache already carry it (see `attnlab.kv.slots.LayerKV`).
    The G = Hq/Hkv query heads of a group are folded into the query axis, so every head of a
    group reads the same K/V. Returns out [B, Hq, T, D] and, if need_probs, the attention
    probabilities of every query head: [B, Hq, T, L] (float32; query head h reads KV head h // G).
    A decode step (one query over a whole cache) goes through `ops.decode_attention`: one pass
    over the cache's bytes, float32, float16 or int8 (see `attnlab/kernels/attend.cpp`).
    """
    B, Hq, T, D = q.shape
    if T == 1 and mask is None and not need_probs and q.dtype == torch.float32 and D % 8 == 0:
        if isinstance(k, tuple):  # an int8 cache
            return ops.decode_attention(q, k[0], v[0], 1 / math.sqrt(D), k[1], v[1]), None
        if k.dtype in (torch.float32, torch.float16):
            return ops.decode_attention(q, k, v, 1 / math.sqrt(D)), None
    if isinstance(k, tuple):
        k, v = dequantize_int8_blocks(*k, q.dtype), dequantize_int8_blocks(*v, q.dtype)
    Hkv, L = k.shape[1], k.shape[2]
    G = Hq // Hkv
    if mask == "causal" and window is not None and L > window:
        i = torch.arange(L - T, L)[:, None]
        mask = ((torch.arange(L) <= i) & (torch.arange(L) > i - window))[None, None]
    if mask == "causal" and not need_probs:
        return ops.causal_attention(q, k, v), None
    if k.dtype != q.dtype:  # a float16 cache under float32 activations, off the fused path
        k, v = k.to(q.dtype), v.to(q.dtype)
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


@dataclass
class Pass:
    """What one forward pass carries through the layers (built by the engine's step, or `Pass.full`).

    rot: RoPE tables of the chunk's positions. step/kvs: the cache's view of this chunk
    (None without a cache). mask: an explicit key mask [T, L] bool for a cache-less pass
    (analysis, e.g. StreamingLLM's banded masks); None = causal. observers: objects with
    `record(layer, name, tensor)` (and optionally `needs_probs = True`: recorders, and a cache
    whose policy scores by attention), called at the named points below. sparsity: a plan
    deciding per layer which MLP neurons and heads run (see `attnlab.sparsity.plan`). quest: Quest's spec
    (`QuestSpec`): a single-token step over a cache with page summaries reads only its chosen pages in the layers
    past spec.dense (`model/quest.py`).

    rows: a step of B conversations, one token each over its own cache (`LM.step`'s eager rows): the linear layers run
    on the B rows together (one read of each weight), and RoPE, the cache and attention run per row under that
    row's own pass (its rot, step, kvs, observers, quest), in order, so consecutive rows of one cache (a
    verification row's tokens) each see the previous one's write; rot, step and kvs of the batch's pass are unused.

    prompt: the chunk is a prompt's (`Row.prompt`): attended as a chunk is even when it is one token (the causal
    kernel, exact under Quest), so a prompt's bits do not depend on where its chunks end.

    Recorded names: "attn_in" [B, T, dim] (normed attention input), "q" [B, Hq, T, D] (queries before RoPE,
    after the cache stored the chunk), "probs" [B, Hq, T, L]
    (only if some observer needs_probs), "heads" [B, Hq, T, D] (per-head outputs before wo),
    "mlp_in" [B, T, dim] (normed MLP input), "mlp_act" [B, T, hidden] (silu(gate) * up).
    """
    rot: torch.Tensor
    step: Any = None
    kvs: list | None = None
    mask: torch.Tensor | None = None
    observers: tuple = ()
    sparsity: Any = None
    quest: Any = None
    rows: list | None = None
    prompt: bool = False

    def __post_init__(self):
        self.observers = tuple(self.observers)
        self.needs_probs = any(getattr(o, "needs_probs", False) for o in self.observers)

    @classmethod
    def full(cls, rope: Rope, ids: torch.Tensor, mask: torch.Tensor | None = None, observers=(),
             sparsity=None, pos: torch.Tensor | None = None) -> "Pass":
        """A cache-less pass over ids [B, T] at positions pos [B, T] (default 0..T-1): causal, or under
        mask [T, T] bool."""
        pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1) if pos is None else pos
        return cls(rope.rotation(pos), mask=mask, observers=observers, sparsity=sparsity)

    def record(self, i: int, name: str, t: torch.Tensor) -> None:
        for o in self.observers:
            o.record(i, name, t)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.n_heads, self.n_kv, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.wo = nn.Linear(self.q_size, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, ctx: Pass, i: int = 0) -> torch.Tensor:
        """x: [B, T, dim] (normed); ctx: this pass (RoPE tables, cache, observers, sparsity); i: layer index."""
        B, T, _ = x.shape
        ctx.record(i, "attn_in", x)
        sp = ctx.sparsity  # a plan may threshold the projections' inputs (TEAL)
        qkv = (sp.project(i, "wqkv", self.wqkv, x) if sp is not None else self.wqkv(x))
        qkv = qkv.view(B, T, self.n_heads + 2 * self.n_kv, self.head_dim).transpose(1, 2)
        if ctx.rows is None:
            out = self._attend(qkv, ctx, i)
        else:  # B conversations: each row's attention over its own cache
            out = torch.cat([self._attend(qkv[b:b + 1], row, i) for b, row in enumerate(ctx.rows)])
        if sp is not None:
            out = sp.heads(i, x, out)
        ctx.record(i, "heads", out)
        out = out.transpose(1, 2).reshape(B, T, self.q_size)
        return sp.project(i, "wo", self.wo, out) if sp is not None else self.wo(out)

    def _attend(self, qkv: torch.Tensor, ctx: Pass, i: int) -> torch.Tensor:
        """qkv [B, Hq + 2 Hkv, T, D] -> the heads' outputs [B, Hq, T, D]: RoPE, the cache, attention."""
        T = qkv.shape[2]
        qk, v = qkv.split([self.n_heads + self.n_kv, self.n_kv], dim=1)  # [B, H, T, D] views
        q, k = rope_apply(qk, ctx.rot).split([self.n_heads, self.n_kv], dim=1)  # q and k in one pass
        kv = ctx.kvs[i] if ctx.kvs is not None else None
        slots = None
        if kv is None:
            mask = "causal" if ctx.mask is None else ctx.mask[None, None]
        else:
            k, v, mask = kv.update(k, v, ctx.step)
            if mask is None and ctx.prompt:
                mask = "causal"  # a prompt's one-token chunk: the chunks' kernel, not a decode step's
            if ctx.quest is not None and T == 1 and not ctx.prompt and kv.page and i >= ctx.quest.dense:
                # Quest reads pages on a decode step; a prompt's chunks stay exact
                k, v, mask, slots = read_pages(q, kv, ctx.quest, k, v, mask)
        ctx.record(i, "q", qk[:, :self.n_heads])  # pre-RoPE queries (a press's scorer reads them)
        out, probs = attend(q, k, v, mask, need_probs=ctx.needs_probs, window=self.cfg.sliding_window)
        if ctx.needs_probs:
            ctx.record(i, "probs", probs if slots is None else spread(probs, slots, ctx.step.start + 1))
        return out


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.hidden = cfg.hidden_dim
        self.w13 = nn.Linear(cfg.dim, 2 * cfg.hidden_dim, bias=False)  # gate rows, then up rows
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, ctx: Pass | None = None, i: int = 0) -> torch.Tensor:
        if ctx is not None:
            ctx.record(i, "mlp_in", x)
            if ctx.sparsity is not None:
                return ctx.sparsity.mlp(i, self, x, ctx)
        act = self.activation(x)
        if ctx is not None:
            ctx.record(i, "mlp_act", act)
        return self.w2(act)

    def activation(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up: [..., hidden], what the down projection mixes (Deja Vu's neurons)."""
        fused = getattr(self.w13, "silu_mul", None)  # a quantized layer's one-call form (QuantLinear.silu_mul)
        return fused(x) if fused is not None else ops.silu_mul(self.w13(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = FeedForward(cfg)

    def forward(self, x: torch.Tensor, ctx: Pass, i: int = 0) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), ctx, i)
        return x + self.mlp(self.mlp_norm(x), ctx, i)


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
        self.rope = Rope(cfg.head_dim, cfg.rope_base, cfg.rope_scaling)  # tables built lazily, on demand
        self.quant: str | None = None  # the weight format once quantized ("int4:32", ...), see attnlab.quant

    def forward(self, ids: torch.Tensor, ctx: Pass | None = None, keep: slice | None = None) -> torch.Tensor:
        """ids [B, T] through the pass ctx -> logits [B, T, vocab] float32, or of the positions `keep` only (the
        head is the largest matmul of a small model: slice(-1, None) for the next token's).

        Without ctx: one full causal pass from position 0. Tensor work only: the cache's
        bookkeeping around a step belongs to the engine (`attnlab.engine.LM.step`).
        """
        ctx = Pass.full(self.rope, ids) if ctx is None else ctx
        x = self.embed(ids)
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, i)
        if keep is not None:
            x = x[:, keep]
        return self.lm_head(self.norm(x)).float()
