"""What Deja Vu learns from: per-token MLP and attention-head activity of the dense model.

A `Collector` observes the network's own forward pass (see `attnlab.model.llama.Pass`)
and keeps, per layer and token, the normed MLP input, |silu(gate) * up| (how much each
neuron contributes before the down projection) and the normed attention input with
each head's output norm. Stored in half precision: 4K tokens of SmolLM2 are ~0.5 GB.

Concentration (the "understand" half): if the MLP output y = sum_j a_j w2[:, j] is
rebuilt from the k neurons with the largest |a_j|, the relative error ||y - y_k|| / ||y||
says how sparse the layer really is; likewise for heads (top heads by ||wo_h o_h||).
"""
from __future__ import annotations

import torch

from attnlab.errors import AttnlabError

KEEP = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7)  # kept fractions at which concentration is reported


class Collector:
    """Observer storing per-layer inputs and activity of every token fed (batch 1)."""

    def __init__(self, n_layers: int):
        self.data = {k: [[] for _ in range(n_layers)] for k in ("mlp_in", "act", "attn_in", "head_norm")}

    def record(self, i: int, name: str, t: torch.Tensor) -> None:
        if name == "mlp_in":
            self.data["mlp_in"][i].append(t[0].half())
        elif name == "mlp_act":
            self.data["act"][i].append(t[0].abs().half())
        elif name == "attn_in":
            self.data["attn_in"][i].append(t[0].half())
        elif name == "heads":  # [1, Hq, T, D] -> [T, Hq]
            self.data["head_norm"][i].append(t[0].norm(dim=-1).T.half())

    def tensors(self) -> dict[str, torch.Tensor]:
        """{name: [L, N, width]} stacked over layers."""
        return {k: torch.stack([torch.cat(parts) for parts in v]) for k, v in self.data.items()}


@torch.inference_mode()
def collect(lm, ids, window: int = 1024, chunk: int = 256, progress=None) -> dict[str, torch.Tensor]:
    """Run ids (1-D) through the dense model in windows (fresh cache each) and collect activity.

    Returns {"mlp_in", "attn_in": [L, N, dim], "act": [L, N, hidden], "head_norm": [L, N, Hq]} (fp16).
    """
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    if ids.numel() < 1:
        raise AttnlabError("collect needs at least one token")
    if lm.sparsity is not None:
        raise AttnlabError("collect the dense model's activity: load it without --sparsity")
    col = Collector(lm.cfg.n_layers)
    for w0 in range(0, ids.numel(), window):
        cache = lm.new_cache(capacity=min(window, ids.numel() - w0))
        for c0 in range(w0, min(w0 + window, ids.numel()), chunk):
            part = ids[c0:min(c0 + chunk, w0 + window, ids.numel())]
            lm.forward(part[None], cache, last_only=True, observers=[col])
            if progress is not None:
                progress(part.numel())
    return col.tensors()


def _rebuild_error(contrib: torch.Tensor, weights: torch.Tensor, keep: float) -> torch.Tensor:
    """contrib [N, n] signed coefficients, weights [n, out] rows they scale; relative error per token [N]
    of rebuilding y = contrib @ weights from the top ceil(keep * n) |contrib| entries."""
    n = contrib.shape[1]
    k = max(1, round(keep * n))
    y = contrib @ weights
    idx = contrib.abs().topk(k, dim=1).indices
    yk = (torch.zeros_like(contrib).scatter(1, idx, contrib.gather(1, idx))) @ weights
    return (y - yk).norm(dim=1) / y.norm(dim=1).clamp_min(1e-12)


@torch.inference_mode()
def concentration(lm, ids, keep=KEEP, max_tokens: int = 1024) -> dict:
    """Per layer, mean relative error of the MLP output (neurons) and of the attention output (heads)
    when only the top `keep` fraction is kept. Rows: {"layer", "mlp": {keep: err}, "heads": {keep: err}}."""
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()[:max_tokens]

    class Full:  # signed activations and head outputs of every token
        def __init__(self):
            self.act, self.heads = {}, {}

        def record(self, i, name, t):
            if name == "mlp_act":
                self.act[i] = t[0].float()
            elif name == "heads":
                self.heads[i] = t[0].float()  # [Hq, T, D]

    obs = Full()
    lm.logits(ids[None], observers=[obs])
    cfg = lm.cfg
    H, D = cfg.n_heads, cfg.head_dim
    rows = []
    for i, layer in enumerate(lm.model.layers):
        w2 = _weight(layer.mlp.w2).T  # [hidden, dim]: neuron j's output direction
        wo = _weight(layer.attn.wo).T.reshape(H, D, -1)  # head h's [D, dim] block
        # per-head output vectors [T, H, dim]; rebuild with unit coefficients over heads
        per_head = torch.einsum("htd,hdo->tho", obs.heads[i], wo)
        mlp = {k: float(_rebuild_error(obs.act[i], w2, k).mean()) for k in keep}
        head = {}
        for k in sorted(set(max(1, round(f * H)) for f in keep)):
            norms = per_head.norm(dim=-1)
            top = norms.topk(k, dim=1).indices
            y = per_head.sum(1)
            yk = per_head.gather(1, top[..., None].expand(-1, -1, per_head.shape[-1])).sum(1)
            head[k] = float(((y - yk).norm(dim=1) / y.norm(dim=1).clamp_min(1e-12)).mean())
        rows.append({"layer": i, "mlp": mlp, "heads": head})
    return {"tokens": ids.numel(), "keep": list(keep), "n_heads": H, "layers": rows}


def _weight(linear) -> torch.Tensor:
    """The float weight of an nn.Linear or a QuantLinear."""
    return linear.dequantize().float() if hasattr(linear, "dequantize") else linear.weight.float()
