"""GCG's candidate scoring on a float network (bfloat16 weights: AMX tiles where the CPU has them).

A step scores B suffixes that each differ from the current one in a single position. What is shared is computed
once: the prompt's prefix (template, question) per attack, and per step the current suffix's keys and values, so
a chunk of candidates sorted by the swapped position is fed only from its first swapped position on (each row's
tokens before it equal the current suffix's). The head runs only at the positions that predict the target (the
vocabulary projection over every position was a third of a pass), and the cross-entropy reads contiguous rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from attnlab.model.llama import Pass


class SharedKV:
    """Keys/values [1, Hkv, S, D] attended in front of a chunk's own (the `Pass.kvs` protocol, broadcast to the
    chunk's rows); `into`, if given, receives the chunk's own keys/values (how the shared ones are made)."""

    def __init__(self, k=None, v=None, into: "SharedKV | None" = None):
        self.k, self.v, self.into = k, v, into

    def update(self, k, v, step):
        if self.into is not None:
            self.into.k, self.into.v = k, v
        if self.k is None:
            return k, v, None
        B = k.shape[0]
        return (torch.cat([self.k.expand(B, -1, -1, -1), k], 2), torch.cat([self.v.expand(B, -1, -1, -1), v], 2),
                None)


def run_layers(model, x: torch.Tensor, start: int, kvs: list[SharedKV]) -> torch.Tensor:
    """x [B, T, dim] at positions start.. through every block, each layer over its kvs."""
    pos = torch.arange(start, start + x.shape[1]).expand(x.shape[0], -1)
    ctx = Pass(model.rope.rotation(pos), kvs=kvs, prompt=True)  # prompt: the causal chunk kernel over the prefix
    for i, layer in enumerate(model.layers):
        x = layer(x, ctx, i)
    return x


def shared(model, ids: list[int] | torch.Tensor, start: int, before: list[SharedKV] | None = None
           ) -> tuple[list[SharedKV], torch.Tensor]:
    """The keys/values of ids (one row) at positions start.., attending over `before` (or nothing), and the last
    block's output at ids' positions [T, dim]."""
    own = [SharedKV() for _ in model.layers]
    kvs = [SharedKV(b.k, b.v, o) for b, o in zip(before, own)] if before else [SharedKV(into=o) for o in own]
    h = run_layers(model, model.embed(torch.as_tensor(ids)[None]), start, kvs)[0]
    return own, h


class FloatScorer:
    """Target losses of candidate suffixes ([B, L] ids) on `model` (an eager float network), as `gcg.Scorer` gives
    them on the engine. `share_suffix`: feed each chunk from its first swapped position (candidates must then be
    single swaps of `current`, which `set_current` names)."""

    def __init__(self, model, case, chunk: int, share_suffix: bool = True):
        self.model, self.case, self.chunk, self.share = model, case, chunk, share_suffix
        self.dtype = model.embed.weight.dtype
        with torch.inference_mode():
            self.prefix = shared(model, case.before, 0)[0]
        self.current = None
        self.tail = torch.tensor(case.after + case.target)
        self.target = torch.tensor(case.target)

    @torch.inference_mode()
    def set_current(self, suffix: torch.Tensor) -> None:
        """The suffix the candidates are swaps of: its keys/values after the prefix, one pass of L rows."""
        self.current = (suffix.clone(), shared(self.model, suffix, len(self.case.before), self.prefix)[0])

    @torch.inference_mode()
    def losses(self, suffixes: torch.Tensor) -> torch.Tensor:
        """suffixes [B, L] -> the target's mean cross-entropy per candidate [B] (float32)."""
        B, L = suffixes.shape
        first = self._first_diff(suffixes)
        order = first.argsort(stable=True)
        out = torch.empty(B)
        for part in order.split(self.chunk):
            s = int(first[part].min())
            out[part] = self._chunk(suffixes[part], s)
        return out

    def _first_diff(self, suffixes: torch.Tensor) -> torch.Tensor:
        """Per row, the first position where it differs from the current suffix (0 without sharing)."""
        if not self.share or self.current is None or self.current[0].shape[0] != suffixes.shape[1]:
            return torch.zeros(suffixes.shape[0], dtype=torch.long)
        diff = suffixes != self.current[0]
        return torch.where(diff.any(1), diff.int().argmax(1), suffixes.shape[1])

    def _chunk(self, part: torch.Tensor, s: int) -> torch.Tensor:
        model, n, nt = self.model, len(self.case.before), len(self.target)
        kvs = self.prefix
        if s > 0:  # the prefix, then the current suffix's first s positions
            kvs = [SharedKV(torch.cat([p.k, c.k[:, :, :s]], 2), torch.cat([p.v, c.v[:, :, :s]], 2))
                   for p, c in zip(self.prefix, self.current[1])]
        ids = torch.cat([part[:, s:], self.tail.expand(part.shape[0], -1)], 1)
        x = run_layers(model, model.embed(ids), n + s, kvs)
        logits = model.lm_head(model.norm(x[:, -nt - 1:-1])).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), self.target.repeat(part.shape[0]),
                               reduction="none").view(-1, nt).mean(1)
