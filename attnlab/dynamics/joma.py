"""JoMA (Tian et al., ICLR 2024): joint dynamics of MLP and attention.

JoMA shows that, with fixed orthonormal embeddings, the attention logits z are
tied to the lower MLP weights by an invariant, z ≈ (sum_k v_k^2 - xbar sum_k
||w_k||^2) / (2T) + C, so attention is whatever the MLP weights make it.
This module reproduces the two synthetic checks of the paper:

* J1 (Figs. 2-3): a joint linear MLP + attention model trained by SGD, where the
  normalised correlation NC(z, z_hat) stays near 1 and one component of each
  class's projected weight vector v_k grows much faster than the rest
  (winner-take-all).
* J2 (Fig. 4): the reduced dynamics of v with a nonlinear activation, whose
  attention entropy falls then rises again (U shape), next to the linear
  variant whose entropy only falls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .common import centred_cosine, entropy

from attnlab.errors import AttnlabError


@dataclass(frozen=True)
class TokenWeightSetup:
    """JoMA's synthetic token weights: X[l, k] = P(context token l | class k).

    The first ``num_bump`` tokens carry a Gaussian bump centred at num_bump * k / K (the
    discriminative, class-specific tokens); the remaining ones get U(0, noise_max)
    (weakly informative tokens). Columns are normalised to sum to 1.
    """

    num_tokens: int = 20
    num_bump: int = 10
    num_classes: int = 20
    bump_width: float = 30.0
    noise_max: float = 0.5

    def weights(self, gen: torch.Generator) -> torch.Tensor:
        """(num_tokens, num_classes) column-stochastic matrix X."""
        if not 0 < self.num_bump <= self.num_tokens:
            raise AttnlabError("num_bump must be in 1..num_tokens")
        Mc, K = self.num_tokens, self.num_classes
        X = torch.rand(Mc, K, generator=gen) * self.noise_max
        idx = torch.arange(self.num_bump, dtype=torch.float32)
        for k in range(K):
            X[: self.num_bump, k] = torch.exp(-(idx - self.num_bump * k / K) ** 2 / self.bump_width)
        return X / X.sum(0, keepdim=True)


class JointModel:
    """Attention over context + linear MLP on top, with fixed orthonormal embeddings U.

    Class k's input: attention b_k ∝ X[:, k] * exp(z / T) over the Mc context tokens
    (T -> infinity limit of sampled sequences), f_k = U_c b_k + u_q (the query's
    embedding as residual), logits_k = W^T f_k. Trainable: W (d, K), z (Mc,).
    """

    def __init__(self, X: torch.Tensor, dim: int, temperature: float, gen: torch.Generator,
                 init_scale: float = 0.01):
        Mc, K = X.shape
        if dim < Mc + 1:
            raise AttnlabError(f"embedding dim {dim} must be >= number of tokens + query ({Mc + 1})")
        self.X, self.T = X, temperature
        self.U = torch.eye(dim)[:, : Mc + 1]  # identity embeddings: orthonormal columns
        self.W = torch.randn(dim, K, generator=gen) * init_scale
        self.z = torch.randn(Mc, generator=gen) * init_scale
        self.xbar = X.mean(1)  # (Mc,) average token distribution
        self._C = self.z - self.z_hat_raw()  # invariant's integration constant

    def attention(self, z: torch.Tensor | None = None) -> torch.Tensor:
        """(K, Mc) attention of each class's query over context tokens."""
        z = self.z if z is None else z
        b = self.X.T * torch.exp((z - z.max()) / self.T)
        return b / b.sum(1, keepdim=True)

    def loss(self, W: torch.Tensor, z: torch.Tensor, activation: str = "linear") -> torch.Tensor:
        """Mean cross-entropy over the K classes (full batch)."""
        Mc = self.X.shape[0]
        f = self.attention(z) @ self.U[:, :Mc].T + self.U[:, Mc]  # (K, d)
        h = f @ W  # (K, K)
        if activation == "relu":
            h = torch.relu(h)
        return F.cross_entropy(h, torch.arange(self.X.shape[1]))

    def V(self) -> torch.Tensor:
        """Projected lower weights V = U_c^T W: (Mc, K); column k is v_k."""
        return self.U[:, : self.X.shape[0]].T @ self.W

    def z_hat_raw(self) -> torch.Tensor:
        """(sum_k v_k^2 - xbar * sum_k ||w_k||^2) / (2T): (Mc,)."""
        return ((self.V() ** 2).sum(1) - self.xbar * (self.W ** 2).sum()) / (2 * self.T)

    def z_hat(self) -> torch.Tensor:
        """JoMA's prediction of z, with C = z(0) - z_hat_raw(0): (Mc,)."""
        return self.z_hat_raw() + self._C


def winner_share(V: torch.Tensor) -> torch.Tensor:
    """Share of each column's largest squared component: V (Mc, K) -> (K,)."""
    v2 = V ** 2
    return v2.amax(0) / v2.sum(0)


def train_joint(model: JointModel, steps: int, lr: float, activation: str = "linear",
                record_every: int = 10, progress=None) -> dict:
    """Plain SGD on (W, z); records NC(z, z_hat) and the V trajectory.

    Returns dict: 'steps' (S,), 'loss', 'nc' (with C), 'nc_raw' (without C),
    'attn_entropy' (S,) and 'V' (S, Mc, K).
    """
    rec = {k: [] for k in ("steps", "loss", "nc", "nc_raw", "attn_entropy", "V")}
    for t in range(steps + 1):
        W = model.W.clone().requires_grad_(True)
        z = model.z.clone().requires_grad_(True)
        loss = model.loss(W, z, activation)
        if t % record_every == 0 or t == steps:
            rec["steps"].append(t)
            rec["loss"].append(loss.item())
            rec["nc"].append(centred_cosine(model.z, model.z_hat()).item())
            rec["nc_raw"].append(centred_cosine(model.z, model.z_hat_raw()).item())
            rec["attn_entropy"].append(entropy(model.attention()).mean().item())
            rec["V"].append(model.V())
        if t == steps:
            break
        gW, gz = torch.autograd.grad(loss, (W, z))
        model.W = model.W - lr * gW
        model.z = model.z - lr * gz
        if progress is not None:
            progress.update(1)
    out = {k: torch.tensor(v) for k, v in rec.items() if k != "V"}
    out["V"] = torch.stack(rec["V"])
    return out


def v_dynamics(mu: torch.Tensor, steps: int, lr: float, temperature: float, v0: float,
               nonlinear: bool = True) -> dict:
    """JoMA's reduced dynamics of one projected weight vector v (paper Fig. 4).

    Nonlinear: v <- v + lr * (mu - v) * softmax(v^2 / T) (fixed point v = mu).
    Linear:    v <- v + lr * mu * softmax(v^2 / T)        (no fixed point, v grows).
    mu: (n,). Returns 'entropy' (steps + 1,) of softmax(v^2 / T) and 'v' (steps + 1, n).
    """
    v = torch.full_like(mu, v0)
    vs, ent = [v], []
    for _ in range(steps):
        a = torch.softmax(v ** 2 / temperature, 0)
        ent.append(entropy(a))
        v = v + lr * ((mu - v) if nonlinear else mu) * a
        vs.append(v)
    ent.append(entropy(torch.softmax(v ** 2 / temperature, 0)))
    return {"entropy": torch.stack(ent), "v": torch.stack(vs)}


def u_shape_stats(ent: torch.Tensor) -> dict:
    """Start, interior minimum (value, step), end and rebound = end - min of an entropy curve."""
    i = int(ent.argmin())
    return {"start": float(ent[0]), "min": float(ent[i]), "argmin": i, "end": float(ent[-1]),
            "rebound": float(ent[-1] - ent[i]),
            "monotone_decreasing": bool((ent[1:] <= ent[:-1] + 1e-7).all())}
