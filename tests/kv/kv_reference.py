"""Brute-force references for the policy tests: full attention over the whole history, masked.

`run` feeds a policy-bound cache step by step and records, per layer, row and KV head, after
which step each token was evicted. The references then recompute every layer from scratch
with all past keys/values kept and only the evicted ones masked out.
"""
from __future__ import annotations

import torch

from attnlab.model.llama import attend
from attnlab.rope import apply as rope_apply

NEVER = 1 << 30


def run(lm, ids: torch.Tensor, policy, steps: list[int]):
    """Feed ids [B, N] in steps (chunk sizes summing to N). Returns logits [B, N, V], evicted_after
    [L, B, H, N] (last token index of the step after which a token left; NEVER if it stayed), sizes
    (len(cache) after every step) and the cache."""
    B, N = ids.shape
    cache = lm.new_cache(B, policy=policy)
    L, H = lm.cfg.n_layers, lm.cfg.n_kv_heads
    evicted = torch.full((L, B, H, N), NEVER, dtype=torch.long)
    present = torch.zeros(L, B, H, N, dtype=torch.bool)
    outs, sizes, a = [], [], 0
    for T in steps:
        outs.append(lm.forward(ids[:, a:a + T], cache))
        present[..., a:a + T] = True
        e = a + T - 1
        for li, layer in enumerate(cache.layers):
            now = torch.zeros(B, H, N, dtype=torch.bool)
            now.scatter_(2, layer.pos[:, :, layer.first:layer.n], True)  # slots before `first` were evicted
            gone = present[li] & ~now
            evicted[li][gone] = e
            present[li] = now
        sizes.append(len(cache))
        a += T
    assert a == N
    return torch.cat(outs, 1), evicted, sizes, cache


def _step_ends(steps: list[int]) -> torch.Tensor:
    ends, a = [], 0
    for T in steps:
        ends += [a + T - 1] * T
        a += T
    return torch.tensor(ends)


def _qkv(layer, x, cfg):
    a = layer.attn
    B, T, _ = x.shape
    q, k, v = a.wqkv(layer.attn_norm(x)).split([a.q_size, a.kv_size, a.kv_size], dim=-1)
    return (q.view(B, T, cfg.n_heads, -1).transpose(1, 2), k.view(B, T, cfg.n_kv_heads, -1).transpose(1, 2),
            v.view(B, T, cfg.n_kv_heads, -1).transpose(1, 2))


def _finish(layer, x, out):
    B, T = x.shape[:2]
    x = x + layer.attn.wo(out.transpose(1, 2).reshape(B, T, -1))
    return x + layer.mlp(layer.mlp_norm(x))


@torch.inference_mode()
def original_reference(lm, ids: torch.Tensor, evicted: torch.Tensor, steps: list[int]) -> torch.Tensor:
    """Absolute positions: one causal forward where query t cannot see tokens evicted before its step."""
    model, cfg = lm.model, lm.cfg
    B, N = ids.shape
    end = _step_ends(steps)
    causal = torch.ones(N, N, dtype=torch.bool).tril()
    x = model.embed(ids)
    rot = model.rope.rotation(torch.arange(N).expand(B, -1))
    for li, layer in enumerate(model.layers):
        mask = causal & (evicted[li][:, :, None, :] >= end[None, None, :, None])  # [B, H, N, N]
        q, k, v = _qkv(layer, x, cfg)
        out, _ = attend(rope_apply(q, rot), rope_apply(k, rot), v, mask)
        x = _finish(layer, x, out)
    return model.lm_head(model.norm(x)).float()


@torch.inference_mode()
def cache_reference(lm, ids: torch.Tensor, evicted: torch.Tensor, steps: list[int]) -> torch.Tensor:
    """Cache positions: step by step, every layer keeps all pre-RoPE keys; the visible ones are
    re-rotated at their rank among the visible (their slot index), queries at theirs."""
    model, cfg = lm.model, lm.cfg
    B, N = ids.shape
    hist_k = [None] * cfg.n_layers
    hist_v = [None] * cfg.n_layers
    outs, a = [], 0
    for T in steps:
        e = a + T - 1
        x = model.embed(ids[:, a:a + T])
        for li, layer in enumerate(model.layers):
            q, k, v = _qkv(layer, x, cfg)
            hist_k[li] = k if hist_k[li] is None else torch.cat([hist_k[li], k], 2)
            hist_v[li] = v if hist_v[li] is None else torch.cat([hist_v[li], v], 2)
            visible = evicted[li][..., :e + 1] >= e                     # [B, H, e+1]
            rank = (visible.cumsum(-1) - 1).clamp_min(0)                 # slot index of each visible token
            q_rank = rank[:, 0, a:a + T]                                 # same for every head
            kr = model.rope.rotate(hist_k[li], rank)
            qr = model.rope.rotate(q, q_rank)
            s = torch.arange(e + 1)
            mask = visible[:, :, None, :] & (s[None, :] <= torch.arange(a, a + T)[:, None])[None, None]
            out, _ = attend(qr, kr, hist_v[li], mask)
            x = _finish(layer, x, out)
        outs.append(model.lm_head(model.norm(x)).float())
        a += T
    return torch.cat(outs, 1)
