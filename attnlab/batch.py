"""A batch of rows: what the engine's one step (`LM.step`) takes, as llama.cpp's `llama_batch` does.

Why one shape: a prompt's chunk, one conversation's next token, eight conversations' next tokens and a
row of k + 1 draft tokens to score (speculative verification) are the same thing, some tokens appended to a
cache at its next positions, and go through the same step. A row is consecutive tokens of one cache: ids
[b, T] (b = the cache's batch: 1 for a conversation, more for a left-padded batch of prompts that advance
together), which of its logits it wants ("last", "all", "none", or a range of its positions: a prompt's chunk whose
tokens a guard scores) and its own observers (recorders of
its pass, a press's scorer). Rows of one batch hold distinct caches; each row's arithmetic is its own
(see `LM.step`), so a row's logits do not depend on what else is in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from attnlab.errors import AttnlabError

WANTS = ("last", "all", "none")


@dataclass
class Row:
    ids: torch.Tensor       # [b, T] token ids, appended at the cache's next positions
    cache: object           # the `KVCache` they go into
    logits: str | range = "last"  # which come back: "last" [b, 1, vocab], "all" [b, T, vocab], "none", or positions
                                  # range(a, c) of a prompt's chunk [b, c - a, vocab]
    observers: tuple = ()   # recorders of this row's pass (beside the cache's own)
    prompt: bool = False    # a prompt's chunk (not sampled tokens): attended as a chunk even when one token long
    verify: bool = False    # sampled tokens scored one by one as decode steps (speculative verification), in one step

    def __post_init__(self):
        self.ids = as_ids(self.ids)
        self.observers = tuple(self.observers)
        if self.ids.shape[1] == 0:
            raise AttnlabError("a row needs at least one token")
        if isinstance(self.logits, range):
            r = self.logits
            if not (self.prompt and r.step == 1 and 0 <= r.start <= r.stop <= self.tokens):
                raise AttnlabError(f"a range of logits is a prompt chunk's positions in 0..{self.tokens}, not "
                                   f"{self.logits!r}")
        elif self.logits not in WANTS:
            raise AttnlabError(f"a row wants logits {' / '.join(WANTS)} or a range, not {self.logits!r}")
        if self.ids.shape[0] != self.cache.batch:
            raise AttnlabError(f"{self.ids.shape[0]} rows of ids for a cache of batch {self.cache.batch}")
        if self.verify and (self.prompt or self.cache.batch != 1):
            raise AttnlabError("a verification row holds sampled tokens of one conversation (batch 1, not a prompt)")

    @property
    def tokens(self) -> int:
        return self.ids.shape[1]

    @property
    def single(self) -> bool:
        """One sampled token of one conversation (a decode step): what the native step and the batched eager pass
        take."""
        return self.ids.shape == (1, 1) and not self.prompt

    @property
    def keep(self) -> slice | None:
        """The positions whose logits the network computes (None: all)."""
        if isinstance(self.logits, range):
            return slice(self.logits.start, self.logits.stop)
        return None if self.logits == "all" else slice(-1, None)

    def part(self, a: int, b: int) -> str | range:
        """What the part [a, b) of this row wants when a bounded cache takes it in parts: "all" or "none", or the
        positions of its range in [a, b), counted from a."""
        if not isinstance(self.logits, range):
            return "all" if self.logits == "all" else "none"
        r = self.logits
        return range(min(max(r.start, a), b) - a, max(min(r.stop, b), a) - a)

    def units(self, i: int, step, split: bool) -> list[tuple]:
        """(row index i, ids, step) of what the network runs for this row: the row whole, or its tokens one by one
        (split: a verification row's), each at its own slot of the row's step (`KVCache.begin`)."""
        if not (split and self.tokens > 1):
            return [(i, self.ids, step)]
        return [(i, self.ids[:, j:j + 1], replace(step, pos=step.pos[:, j:j + 1], q_pos=step.q_pos[:, j:j + 1],
                                                   rot=step.rot[:, :, j:j + 1], start=step.start + j))
                for j in range(self.tokens)]


@dataclass
class Batch:
    rows: list[Row] = field(default_factory=list)

    def __post_init__(self):
        if len({id(r.cache) for r in self.rows}) != len(self.rows):
            raise AttnlabError("a batch's rows go into distinct caches (one row per cache)")

    @classmethod
    def one(cls, ids, cache, logits: str = "last", observers=(), prompt: bool = False, verify: bool = False) -> "Batch":
        return cls([Row(ids, cache, logits, observers, prompt, verify)])

    @classmethod
    def decode(cls, tokens, caches: list) -> "Batch":
        """One token per conversation: tokens [B] (or [B, 1]) appended to caches[b], each of batch 1."""
        ids = as_ids(tokens).reshape(-1, 1)
        if ids.shape[0] != len(caches) or not caches:
            raise AttnlabError(f"a decode batch takes one token per cache, got {ids.shape[0]} tokens for "
                               f"{len(caches)} caches")
        if any(c.batch != 1 for c in caches):
            raise AttnlabError("a decode batch takes distinct caches of one conversation each (batch 1)")
        return cls([Row(ids[b:b + 1], c) for b, c in enumerate(caches)])


def as_ids(ids) -> torch.Tensor:
    ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2:
        raise AttnlabError(f"token ids must be [batch, tokens], got shape {tuple(ids.shape)}")
    return ids
