"""Deja Vu's learned predictors and the training-free gate threshold, for SwiGLU models.

SwiGLU has no exact zeros, so "active" is defined by rank: at a target sparsity s a token
keeps the (1 - s) fraction of neurons with the largest |silu(gate) * up| (the oracle).
A predictor is a small per-layer network, relu(x A + a) B + b, scoring every neuron (and
every head) from the layer's normed input; trained with binary cross-entropy on the
oracle's top `label_keep` set, it is then used by rank, so one predictor serves every
target. Look-ahead: layer l's MLP set is predicted from layer l-1's MLP input, so the
prediction can run a layer early (Deja Vu's asynchronous look-ahead).

The threshold method needs no training: the gate is computed exactly and a neuron is kept
when |silu(gate)| exceeds a per-layer threshold, calibrated as a quantile of |silu(gate)|
over calibration text (a table of quantiles, so any target is one lookup).

Saved as safetensors (tensors + a JSON config in the metadata), never pickled.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from attnlab.errors import AttnlabError

FORMAT = "attnlab-dejavu/1"
QUANTILES = 101  # gate quantile table: sparsity 0.00, 0.01, ..., 1.00


class Predictors(nn.Module):
    """Per-layer low-rank scorers for MLP neurons and attention heads (stacked over layers)."""

    def __init__(self, n_layers: int, dim: int, hidden: int, n_heads: int, rank: int = 64,
                 head_rank: int = 16, lookahead: bool = False, gate_quantiles: torch.Tensor | None = None):
        super().__init__()
        self.config = {"n_layers": n_layers, "dim": dim, "hidden": hidden, "n_heads": n_heads,
                       "rank": rank, "head_rank": head_rank, "lookahead": lookahead}
        self.lookahead = lookahead
        g = torch.Generator().manual_seed(0)

        def init(*shape, fan_in):
            return nn.Parameter(torch.randn(*shape, generator=g) / fan_in ** 0.5)
        self.mlp_a, self.mlp_b = init(n_layers, dim, rank, fan_in=dim), init(n_layers, rank, hidden, fan_in=rank)
        self.mlp_a0, self.mlp_b0 = nn.Parameter(torch.zeros(n_layers, rank)), nn.Parameter(torch.zeros(n_layers, hidden))
        self.head_a = init(n_layers, dim, head_rank, fan_in=dim)
        self.head_b = init(n_layers, head_rank, n_heads, fan_in=head_rank)
        self.head_a0 = nn.Parameter(torch.zeros(n_layers, head_rank))
        self.head_b0 = nn.Parameter(torch.zeros(n_layers, n_heads))
        q = gate_quantiles if gate_quantiles is not None else torch.zeros(n_layers, QUANTILES)
        self.register_buffer("gate_quantiles", q.float())

    def mlp_scores(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] (layer i's normed MLP input, or layer i-1's with look-ahead) -> [..., hidden]."""
        h = F.relu(x.float() @ self.mlp_a[i] + self.mlp_a0[i])
        return h @ self.mlp_b[i] + self.mlp_b0[i]

    def layer(self, i: int) -> tuple:
        """Layer i's MLP scorer as contiguous transposed tensors for two `addmv`s (the decode step's form)."""
        return (self.mlp_a[i].detach().T.contiguous(), self.mlp_a0[i].detach().clone(),
                self.mlp_b[i].detach().T.contiguous(), self.mlp_b0[i].detach().clone())

    def head_scores(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] (layer i's normed attention input) -> [..., n_heads]."""
        return F.relu(x.float() @ self.head_a[i] + self.head_a0[i]) @ self.head_b[i] + self.head_b0[i]

    def threshold(self, i: int, sparsity: float) -> float:
        """|silu(gate)| below which layer i skips a neuron to reach `sparsity` on the calibration text."""
        q = self.gate_quantiles[i]
        pos = sparsity * (QUANTILES - 1)
        lo = int(pos)
        hi = min(lo + 1, QUANTILES - 1)
        return float(q[lo] + (q[hi] - q[lo]) * (pos - lo))

    @property
    def nbytes(self) -> int:
        """Bytes a decode step reads for one layer's MLP predictor (the cost beside the saved rows)."""
        return (self.mlp_a[0].numel() + self.mlp_b[0].numel()) * 4

    def save(self, path: str | Path) -> None:
        from attnlab.io import write_tensors
        write_tensors(path, self.state_dict(), FORMAT, self.config)

    @classmethod
    def load(cls, path: str | Path) -> "Predictors":
        path = Path(path)
        if path.is_dir():
            path = path / "predictors.safetensors"
        if not path.is_file():
            raise FileNotFoundError(f"no Deja Vu predictors at {path} (make them with `attnlab dejavu train`)")
        from attnlab.io import read_tensors
        tensors, config = read_tensors(path, FORMAT, "Deja Vu predictor file")
        p = cls(**config)
        p.load_state_dict(tensors)
        return p

    def check_model(self, cfg) -> None:
        want = {"n_layers": cfg.n_layers, "dim": cfg.dim, "hidden": cfg.hidden_dim, "n_heads": cfg.n_heads}
        got = {k: self.config[k] for k in want}
        if got != want:
            raise AttnlabError(f"these predictors were trained for a model with {got}, not {want}")


def top_labels(values: torch.Tensor, keep: float) -> torch.Tensor:
    """values [N, n] -> float labels, 1 for each row's top ceil(keep * n) entries."""
    k = max(1, round(keep * values.shape[1]))
    return torch.zeros_like(values, dtype=torch.float32).scatter(1, values.float().topk(k, dim=1).indices, 1.0)


def gate_quantiles(lm, mlp_in: torch.Tensor) -> torch.Tensor:
    """[L, QUANTILES]: quantiles of |silu(gate)| per layer over the collected inputs mlp_in [L, N, dim]."""
    from attnlab.sparsity.collect import _weight
    out = []
    levels = torch.linspace(0, 1, QUANTILES)
    for i, layer in enumerate(lm.model.layers):
        ffn = layer.mlp
        gate = mlp_in[i].float() @ _weight(ffn.w13)[:ffn.hidden].T
        a = F.silu(gate).abs().flatten()
        if a.numel() > 2_000_000:  # torch.quantile's limit: a strided subsample is enough
            a = a[:: a.numel() // 2_000_000 + 1]
        out.append(torch.quantile(a, levels))
    return torch.stack(out)


def train(lm, data: dict[str, torch.Tensor], rank: int = 64, head_rank: int = 16, lookahead: bool = False,
          label_keep: float = 0.3, head_keep: float = 0.5, epochs: int = 8, batch: int = 256, lr: float = 3e-3,
          seed: int = 0, progress=None) -> Predictors:
    """Fit every layer's predictors on collected activity (see `collect`): data["mlp_in"|"attn_in"] [L, N, dim],
    data["act"] [L, N, hidden] (|silu(gate) * up|), data["head_norm"] [L, N, Hq]."""
    cfg = lm.cfg
    L, N, _ = data["mlp_in"].shape
    if L != cfg.n_layers:
        raise AttnlabError(f"activity has {L} layers, the model {cfg.n_layers}")
    if N < batch:
        raise AttnlabError(f"need at least {batch} collected tokens to train, got {N}")
    pred = Predictors(cfg.n_layers, cfg.dim, cfg.hidden_dim, cfg.n_heads, rank, head_rank, lookahead,
                      gate_quantiles(lm, data["mlp_in"]))
    g = torch.Generator().manual_seed(seed)
    for i in range(L):
        src = data["mlp_in"][i - 1 if lookahead and i > 0 else i]
        jobs = [((pred.mlp_a, pred.mlp_a0, pred.mlp_b, pred.mlp_b0), src, top_labels(data["act"][i], label_keep)),
                ((pred.head_a, pred.head_a0, pred.head_b, pred.head_b0), data["attn_in"][i],
                 top_labels(data["head_norm"][i], head_keep))]
        for params, x, y in jobs:
            _fit(params, i, x.float(), y, epochs, batch, lr, g)
        if progress is not None:
            progress(1)
    return pred.requires_grad_(False)


def _fit(params, i: int, x: torch.Tensor, y: torch.Tensor, epochs: int, batch: int, lr: float, g) -> None:
    """Adam on layer i's slice of the stacked parameters (BCE against the oracle labels)."""
    a, a0, b, b0 = (p[i].detach().clone().requires_grad_(True) for p in params)
    opt = torch.optim.Adam([a, a0, b, b0], lr=lr)
    pos_weight = ((1 - y.mean()) / y.mean().clamp_min(1e-6)).clamp(max=20)  # balance the rare positives
    with torch.enable_grad():
        for _ in range(epochs):
            for idx in torch.randperm(x.shape[0], generator=g).split(batch):
                logits = F.relu(x[idx] @ a + a0) @ b + b0
                loss = F.binary_cross_entropy_with_logits(logits, y[idx], pos_weight=pos_weight)
                opt.zero_grad()
                loss.backward()
                opt.step()
    with torch.no_grad():
        for p, v in zip(params, (a, a0, b, b0)):
            p[i].copy_(v)


def recall(scores: torch.Tensor, truth: torch.Tensor, keep: float) -> float:
    """Mean share of the true top-k (by truth [N, n]) found in the predicted top-k (by scores [N, n])."""
    k = max(1, round(keep * truth.shape[1]))
    t = top_labels(truth, keep)
    p = top_labels(scores, keep)
    return float((t * p).sum() / (k * truth.shape[0]))
