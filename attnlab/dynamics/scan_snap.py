"""Scan and Snap (Tian et al., NeurIPS 2023): sequence classes and the Y/Z model.

The paper folds a 1-layer Transformer (no positional encoding, long context,
l2-normalised attention output) into two vocabulary x vocabulary matrices:
``Z`` (pairwise attention logits between a query token and context tokens) and
``Y`` (decoder). This module holds the synthetic data the paper uses to show
that attention learns a TF-IDF-like pattern (common tokens down, distinct
tokens up, ordered by P(l|n)) and then freezes ("snap"), and a training loop
that runs many independent (eta_Y, eta_Z, seed) runs as one batched tensor
computation so a whole sweep costs about as much as a few single runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .common import entropy

from attnlab.errors import AttnlabError


@dataclass
class SequenceClasses:
    """Sequence classes n = 0..K-1 with K = num_queries * next_per_query.

    Class n has query token psi(n) (shared by ``next_per_query`` classes) and next token
    n. Its context tokens are drawn i.i.d. from P(l|n): ``num_common`` common tokens
    (shared by all classes, weight ``common_weight``) plus ``num_distinct`` distinct
    tokens of its own with weights linspace(distinct_min, distinct_max).

    Vocabulary layout: [common | distinct of class 0 | ... | queries | next tokens].
    """

    num_queries: int = 2
    next_per_query: int = 2
    num_common: int = 10
    num_distinct: int = 10
    common_weight: float = 1.0
    distinct_min: float = 0.1
    distinct_max: float = 1.0
    probs: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_queries < 1 or self.next_per_query < 1 or self.num_distinct < 1:
            raise AttnlabError("num_queries, next_per_query and num_distinct must be >= 1")
        K, C, D = self.num_classes, self.num_common, self.num_distinct
        probs = torch.zeros(K, self.vocab_size, dtype=torch.float64)
        probs[:, :C] = self.common_weight
        w = torch.linspace(self.distinct_min, self.distinct_max, D, dtype=torch.float64)
        for n in range(K):
            probs[n, self.distinct_tokens(n)] = w
        self.probs = probs / probs.sum(1, keepdim=True)  # (K, M)

    @property
    def num_classes(self) -> int:
        return self.num_queries * self.next_per_query

    @property
    def vocab_size(self) -> int:
        K = self.num_classes
        return self.num_common + K * self.num_distinct + self.num_queries + K

    def distinct_tokens(self, n: int) -> torch.Tensor:
        """Token ids of class n's distinct tokens, in increasing P(l|n): (D,)."""
        start = self.num_common + n * self.num_distinct
        return torch.arange(start, start + self.num_distinct)

    @property
    def distinct_index(self) -> torch.Tensor:
        """(K, D) token ids of each class's distinct tokens."""
        return torch.stack([self.distinct_tokens(n) for n in range(self.num_classes)])

    @property
    def query_of_class(self) -> torch.Tensor:
        """(K,) query token psi(n) of each class."""
        base = self.num_common + self.num_classes * self.num_distinct
        return base + torch.arange(self.num_classes) // self.next_per_query

    @property
    def next_of_class(self) -> torch.Tensor:
        """(K,) next token of each class."""
        base = self.num_common + self.num_classes * self.num_distinct + self.num_queries
        return base + torch.arange(self.num_classes)

    def sample(self, runs: int, batch: int, context: int, gen: torch.Generator):
        """Draw ``runs`` x ``batch`` sequences of ``context`` context tokens.

        Returns (classes (R, B) long, counts (R, B, M) float32): counts[r, b, l] is how
        often token l occurs in the context; order is irrelevant without positions.
        """
        K, M = self.num_classes, self.vocab_size
        cls = torch.randint(0, K, (runs, batch), generator=gen)
        tok = torch.multinomial(self.probs.float()[cls.reshape(-1)], context, replacement=True,
                                generator=gen)
        counts = torch.zeros(runs * batch, M)
        counts.scatter_add_(1, tok, torch.ones_like(tok, dtype=torch.float32))
        return cls, counts.view(runs, batch, M)


@dataclass
class YZRuns:
    """R independent Y/Z models trained side by side with SGD + momentum.

    Y, Z: (R, M, M); lr_y, lr_z: (R,) per-run learning rates. Z[m, l] is the attention
    logit of query m on context token l; Y[k, l] the decoder weight of output k.
    """

    Y: torch.Tensor
    Z: torch.Tensor
    lr_y: torch.Tensor
    lr_z: torch.Tensor
    momentum: float = 0.9

    @classmethod
    def create(cls, runs: int, vocab: int, lr_y, lr_z, zero_init: bool,
               gen: torch.Generator, momentum: float = 0.9) -> "YZRuns":
        """Zero init (paper Fig. 4) or nn.Linear's default U(-1/sqrt(M), 1/sqrt(M))."""
        if zero_init:
            Y, Z = torch.zeros(runs, vocab, vocab), torch.zeros(runs, vocab, vocab)
        else:
            bound = vocab ** -0.5
            Y = (torch.rand(runs, vocab, vocab, generator=gen) * 2 - 1) * bound
            Z = (torch.rand(runs, vocab, vocab, generator=gen) * 2 - 1) * bound
        lr_y = torch.as_tensor(lr_y, dtype=torch.float32).expand(runs).clone()
        lr_z = torch.as_tensor(lr_z, dtype=torch.float32).expand(runs).clone()
        return cls(Y, Z, lr_y, lr_z, momentum)

    def __post_init__(self) -> None:
        self._buf_y = torch.zeros_like(self.Y)
        self._buf_z = torch.zeros_like(self.Z)

    def loss(self, queries: torch.Tensor, counts: torch.Tensor, targets: torch.Tensor,
             Y: torch.Tensor | None = None, Z: torch.Tensor | None = None) -> torch.Tensor:
        """Mean cross-entropy per run: queries, targets (R, B) long; counts (R, B, M) -> (R,)."""
        Y = self.Y if Y is None else Y
        Z = self.Z if Z is None else Z
        R, B, M = counts.shape
        zq = torch.gather(Z, 1, queries.unsqueeze(-1).expand(R, B, M))  # (R, B, M)
        zq = zq.masked_fill(counts == 0, float("-inf"))
        w = counts * torch.exp(zq - zq.amax(-1, keepdim=True))  # unnormalised attention mass
        f = w / w.norm(dim=-1, keepdim=True)  # l2-normalised pooled vector
        logits = torch.bmm(f, Y.transpose(1, 2))  # (R, B, M)
        ce = F.cross_entropy(logits.reshape(R * B, M), targets.reshape(-1), reduction="none")
        return ce.view(R, B).mean(1)

    def step(self, queries, counts, targets) -> torch.Tensor:
        """One SGD-momentum step on every run; returns the per-run loss before it: (R,)."""
        Y = self.Y.detach().requires_grad_(True)
        Z = self.Z.detach().requires_grad_(True)
        loss = self.loss(queries, counts, targets, Y, Z)
        gy, gz = torch.autograd.grad(loss.sum(), (Y, Z))
        with torch.no_grad():
            self._buf_y.mul_(self.momentum).add_(gy)
            self._buf_z.mul_(self.momentum).add_(gz)
            self.Y = self.Y - self.lr_y.view(-1, 1, 1) * self._buf_y
            self.Z = self.Z - self.lr_z.view(-1, 1, 1) * self._buf_z
        return loss.detach()


def z_blocks(data: SequenceClasses, Z: torch.Tensor):
    """Logits of each class's query on common and on its distinct tokens.

    Z: (R, M, M) -> (z_common (R, K, C), z_distinct (R, K, D)); distinct in increasing P(l|n).
    """
    q = data.query_of_class
    rows = Z[:, q, :]  # (R, K, M)
    z_common = rows[:, :, : data.num_common]
    z_distinct = torch.gather(rows, 2, data.distinct_index.unsqueeze(0).expand(Z.shape[0], -1, -1))
    return z_common, z_distinct


def expected_attention(data: SequenceClasses, Z: torch.Tensor) -> torch.Tensor:
    """Attention in the long-context limit, c_l ∝ P(l|n) exp(z_{psi(n) l}): (R, K, M)."""
    rows = Z[:, data.query_of_class, :].double()
    w = data.probs.unsqueeze(0) * torch.exp(rows - rows.amax(-1, keepdim=True))
    return (w / w.sum(-1, keepdim=True)).float()


def distinct_attention(data: SequenceClasses, Z: torch.Tensor) -> torch.Tensor:
    """Attention restricted to each class's distinct tokens, renormalised: (R, K, D)."""
    c = expected_attention(data, Z)
    cd = torch.gather(c, 2, data.distinct_index.unsqueeze(0).expand(Z.shape[0], -1, -1))
    return cd / cd.sum(-1, keepdim=True)


def distinct_entropy(data: SequenceClasses, Z: torch.Tensor) -> torch.Tensor:
    """Entropy of the renormalised distinct-token attention, mean over classes: (R,)."""
    return entropy(distinct_attention(data, Z)).mean(-1)


def common_mass(data: SequenceClasses, Z: torch.Tensor) -> torch.Tensor:
    """Attention mass on common tokens, mean over classes: (R,)."""
    return expected_attention(data, Z)[:, :, : data.num_common].sum(-1).mean(-1)


def train_runs(data: SequenceClasses, runs: YZRuns, iters: int, batch: int, context: int,
               gen: torch.Generator, record_every: int = 1, progress=None) -> dict:
    """Train all runs for ``iters`` steps, recording trajectories every ``record_every`` steps.

    Returns dict with 'steps' (S,), 'loss' (S, R), 'entropy' (S, R), 'common_mass' (S, R),
    'z_common' (S, R, K, C) and 'z_distinct' (S, R, K, D).
    """
    R = runs.Z.shape[0]
    q_of, y_of = data.query_of_class, data.next_of_class
    rec = {k: [] for k in ("steps", "loss", "entropy", "common_mass", "z_common", "z_distinct")}

    def record(t, loss):
        zc, zd = z_blocks(data, runs.Z)
        rec["steps"].append(t)
        rec["loss"].append(loss)
        rec["entropy"].append(distinct_entropy(data, runs.Z))
        rec["common_mass"].append(common_mass(data, runs.Z))
        rec["z_common"].append(zc.clone())
        rec["z_distinct"].append(zd.clone())

    for t in range(iters):
        cls, counts = data.sample(R, batch, context, gen)
        loss = runs.step(q_of[cls], counts, y_of[cls])
        if t % record_every == 0:
            record(t, loss)
        if progress is not None:
            progress.update(1)
    cls, counts = data.sample(R, batch, context, gen)
    with torch.no_grad():
        record(iters, runs.loss(q_of[cls], counts, y_of[cls]))
    out = {k: torch.stack(v) if k != "steps" else torch.tensor(v) for k, v in rec.items()}
    return out
