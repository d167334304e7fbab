"""TEAL (Liu et al., ICLR 2025): training-free activation sparsity on the input of every projection.

SwiGLU MLPs have no exact zeros, so Deja Vu's neuron sparsity is bounded by the MLP's share of a
step. TEAL thresholds the *input* of every weight matrix instead (wqkv, wo, w13, w2 here: q/k/v
share an input, as do gate/up): an input channel with |x_j| <= tau contributes nothing, so its
column of W is never read (`attnlab.kernels.ops.bound_cols`: one fused op per projection, weights
stored transposed). The thresholds come from the distribution of each input's magnitudes on
calibration text (a quantile table: a sparsity is one lookup), and how much each projection is
sparsified comes from TEAL's greedy block-wise allocation: per layer, starting dense, repeatedly
raise the sparsity of the one projection whose step (sized inversely to its parameter count, so each
step adds the same model-wide sparsity) hurts the block's output least, and record the allocation
at every step. A target s then takes, in every layer, the recorded allocation whose parameter-weighted
sparsity is closest to s (the authors' `greedyopt.py` and `get_layer_greedy_sparsities`).

The calibration is saved as safetensors (tensors + JSON metadata), atomically, and cached per model
under ~/.cache/attnlab/teal (keyed by the weights), so `--sparsity teal:0.4` calibrates once.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from attnlab.errors import AttnlabError

FORMAT = "attnlab-teal/1"
PROJ = ("wqkv", "wo", "w13", "w2")  # the four inputs of a layer: attention in, head outputs, MLP in, silu(g)*u
LEVELS = 1001  # quantile table of |x|: sparsity 0.000, 0.001, ..., 1.000
CACHE = Path(os.environ.get("ATTNLAB_CACHE", Path.home() / ".cache" / "attnlab")) / "teal"
CALIBRATION_TEXT = "shakespeare:train"


def proj_params(cfg) -> list[int]:
    """Weights per layer of wqkv, wo, w13, w2 (the greedy's step sizes and the model-wide average)."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    return [cfg.dim * (q + 2 * kv), q * cfg.dim, cfg.dim * 2 * cfg.hidden_dim, cfg.hidden_dim * cfg.dim]


class Calibration:
    """quantiles [L, 4, LEVELS] of each projection input's |x|; alloc [L, S, 4]: the greedy's per-projection
    sparsities after each step (step 0 dense); effective [L, S] their parameter-weighted average; error
    [L, S] the block output's error at each step (mean L2 over calibration tokens)."""

    def __init__(self, quantiles: torch.Tensor, alloc: torch.Tensor, effective: torch.Tensor, error: torch.Tensor,
                 config: dict):
        self.quantiles, self.alloc, self.effective, self.error = quantiles.float(), alloc.float(), effective.float(), error.float()
        self.config = config

    def allocation(self, i: int, sparsity: float) -> list[float]:
        """Layer i's per-projection sparsities for a model-wide target (the closest recorded step)."""
        if sparsity <= 0:
            return [0.0] * len(PROJ)
        if sparsity > float(self.effective[i].max()) + 0.01:
            raise AttnlabError(f"TEAL calibration reaches {float(self.effective[i].max()):.0%} sparsity, "
                               f"{sparsity:.0%} asked: recalibrate with a higher --max-sparsity")
        step = int((self.effective[i] - sparsity).abs().argmin())
        return [float(v) for v in self.alloc[i, step]]

    def threshold(self, i: int, p: int, sparsity: float) -> float:
        """|x| at or below which projection p of layer i drops an input channel to skip `sparsity` of them."""
        if sparsity <= 0:
            return -1.0  # keep everything, zeros included: exactly the dense product
        q = self.quantiles[i, p]
        pos = min(sparsity, 1.0) * (LEVELS - 1)
        lo = int(pos)
        hi = min(lo + 1, LEVELS - 1)
        return float(q[lo] + (q[hi] - q[lo]) * (pos - lo))

    def thresholds(self, i: int, sparsity: float) -> list[float]:
        return [self.threshold(i, p, s) for p, s in enumerate(self.allocation(i, sparsity))]

    def check_model(self, cfg) -> None:
        want = {"n_layers": cfg.n_layers, "dim": cfg.dim, "hidden": cfg.hidden_dim, "n_heads": cfg.n_heads}
        got = {k: self.config.get(k) for k in want}
        if got != want:
            raise AttnlabError(f"this TEAL calibration was made for a model with {got}, not {want}")

    def save(self, path: str | Path) -> Path:
        from attnlab.io import write_tensors
        t = {"quantiles": self.quantiles, "alloc": self.alloc, "effective": self.effective, "error": self.error}
        return write_tensors(path, t, FORMAT, self.config)

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        from attnlab.io import read_tensors
        path = Path(path).expanduser()
        if path.is_dir():
            path = path / "teal.safetensors"
        if not path.is_file():
            raise AttnlabError(f"no TEAL calibration at {path} (make one with `attnlab dejavu calibrate`)")
        tensors, config = read_tensors(path, FORMAT, "TEAL calibration")
        return cls(**tensors, config=config)


class Inputs:
    """Observer keeping every projection input of every layer (batch 1), as |x| in half precision."""

    def __init__(self, n_layers: int):
        self.data = [[[] for _ in PROJ] for _ in range(n_layers)]

    def record(self, i: int, name: str, t: torch.Tensor) -> None:
        if name == "heads":  # [B, Hq, T, D] -> wo's input [T, Hq * D]
            t = t.transpose(1, 2).reshape(t.shape[0], t.shape[2], -1)
        p = {"attn_in": 0, "heads": 1, "mlp_in": 2, "mlp_act": 3}.get(name)
        if p is not None:
            self.data[i][p].append(t[0].abs().half())

    def quantiles(self, limit: int = 1 << 20) -> torch.Tensor:
        """[L, 4, LEVELS]: quantiles of |x| per layer and projection (a strided subsample past `limit` values)."""
        levels = torch.linspace(0, 1, LEVELS)
        out = torch.zeros(len(self.data), len(PROJ), LEVELS)
        for i, per in enumerate(self.data):
            for p, parts in enumerate(per):
                a = torch.cat(parts).flatten().float()
                a = a[:: a.numel() // limit + 1]
                out[i, p] = torch.quantile(a, levels)
        return out


class _Fixed:
    """A plan stand-in for one block: projection p's input thresholded at taus[p] (masked, every token)."""

    def __init__(self, taus):
        self.taus = taus

    def project(self, i, name, linear, x):
        tau = self.taus[PROJ.index(name)]
        return linear(x * (x.abs() > tau)) if tau >= 0 else linear(x)

    def mlp(self, i, ffn, x, ctx):
        gate, up = self.project(i, "w13", ffn.w13, x).split(ffn.hidden, dim=-1)
        return self.project(i, "w2", ffn.w2, F.silu(gate) * up)

    def heads(self, i, x, out):
        return out


@torch.inference_mode()
def calibrate(lm, ids, greedy_tokens: int = 64, max_sparsity: float = 0.8, step: float = 0.2, window: int = 1024,
              progress=None) -> Calibration:
    """Thresholds from the magnitudes of every projection input over ids (1-D, the dense model, windows of
    `window` tokens), then TEAL's greedy allocation per layer on the first `greedy_tokens` of them, up to
    `max_sparsity` model-wide. step: TEAL's base step (a projection's step is step / its parameters relative
    to wo's). progress(n) is called per window and per layer."""
    from attnlab.model.llama import Pass
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    if ids.numel() < greedy_tokens or greedy_tokens < 2:
        raise AttnlabError(f"TEAL calibration needs at least {max(greedy_tokens, 2)} tokens, got {ids.numel()}")
    model, cfg = lm.model, lm.cfg
    obs = Inputs(cfg.n_layers)
    for w0 in range(0, ids.numel(), window):
        part = ids[w0:w0 + window]
        model(part[None], Pass.full(model.rope, part[None], observers=[obs]))
        if progress is not None:
            progress(1)
    quantiles = obs.quantiles()
    del obs
    calib = Calibration(quantiles, torch.zeros(1), torch.zeros(1), torch.zeros(1), {})
    w = torch.tensor(proj_params(cfg), dtype=torch.float64)
    sizes = step * w[1] / w  # TEAL: step / relative weight, so every step adds step * w_o / sum(w)
    g = ids[None, :greedy_tokens]
    x = model.embed(g)
    allocs, errors = [], []
    for i, layer in enumerate(model.layers):
        a, e = _greedy(layer, x, Pass.full(model.rope, g), calib, i, sizes, w, max_sparsity)
        allocs.append(a)
        errors.append(e)
        x = layer(x, Pass.full(model.rope, g), i)  # the next block sees the dense model's input
        if progress is not None:
            progress(1)
    n = min(len(a) for a in allocs)  # every layer takes the same number of steps (equal effective increments)
    alloc = torch.stack([a[:n] for a in allocs]).float()
    effective = (alloc.double() * w).sum(-1) / w.sum()
    config = {"n_layers": cfg.n_layers, "dim": cfg.dim, "hidden": cfg.hidden_dim, "n_heads": cfg.n_heads,
              "tokens": ids.numel(), "greedy_tokens": greedy_tokens, "step": step, "max_sparsity": max_sparsity}
    return Calibration(quantiles, alloc, effective.float(), torch.stack([e[:n] for e in errors]), config)


def _greedy(layer, x, ctx, calib: Calibration, i: int, sizes, w, max_sparsity: float):
    """One block: the allocation after each greedy step ([S, 4]) and the block output's error at each.
    A trial that moves only w13 or w2 reuses the attention half of the current allocation."""
    def half(s):  # the residual stream after attention under allocation s
        ctx.sparsity = _Fixed([calib.threshold(i, p, v) for p, v in enumerate(s)])
        h = x + layer.attn(layer.attn_norm(x), ctx, i)
        ctx.sparsity = None
        return h

    def block(s, h):
        ctx.sparsity = _Fixed([calib.threshold(i, p, v) for p, v in enumerate(s)])
        out = h + layer.mlp(layer.mlp_norm(h), ctx, i)
        ctx.sparsity = None
        return out
    ref = layer(x, ctx, i)
    s = [0.0] * len(PROJ)
    h = half(s)
    allocs, errors = [list(s)], [0.0]
    while float((torch.tensor(s, dtype=torch.float64) * w).sum() / w.sum()) < max_sparsity - 1e-9:
        best = None
        for p in range(len(PROJ)):
            if s[p] + sizes[p] > 0.999:
                continue
            trial = list(s)
            trial[p] = s[p] + float(sizes[p])
            th = half(trial) if p < 2 else h
            err = float((block(trial, th) - ref).norm(dim=-1).mean())
            if best is None or err < best[0]:
                best = (err, trial, th)
        if best is None:
            break
        _, s, h = best
        allocs.append(list(s))
        errors.append(best[0])
    return torch.tensor(allocs), torch.tensor(errors)


def fingerprint(model) -> str:
    """A key for the cache: the config, the weight format and a sample of every layer's weights."""
    h = hashlib.sha1(repr((model.cfg, model.quant)).encode())
    for layer in model.layers:
        for lin in (layer.attn.wqkv, layer.mlp.w2):
            t = lin.weight if hasattr(lin, "weight") else lin.dequantize()
            h.update(t.detach().float().flatten()[:4096].numpy().tobytes())
    return h.hexdigest()[:16]


def cached(model) -> Calibration:
    """The model's calibration from the cache (`make_cached` or `attnlab dejavu calibrate` made it): a load
    never calibrates behind the user's back (a minute of work on the training plays)."""
    path = CACHE / f"{fingerprint(model)}.safetensors"
    if not path.is_file():
        raise AttnlabError("no cached TEAL calibration for this model: run `attnlab dejavu calibrate` once "
                           "(or teal.make_cached(lm.model, lm.tokenizer)), or give teal@PATH")
    return Calibration.load(path)


def make_cached(model, tokenizer, tokens: int = 4096, progress=None) -> Calibration:
    """Calibrate on the training plays and cache the result where `teal:S` specs find it (the explicit step)."""
    import sys
    from types import SimpleNamespace

    from attnlab.data import corpus
    from attnlab.io import progress as bar
    print(f"attnlab: calibrating TEAL thresholds on {CALIBRATION_TEXT} (once per model; cached in {CACHE})",
          file=sys.stderr, flush=True)
    ids = tokenizer.encode(corpus(CALIBRATION_TEXT), add_special_tokens=False)[:tokens]
    with bar(-(-len(ids) // 1024) + model.cfg.n_layers, "teal calibrate", unit="step") as b:
        calib = calibrate(SimpleNamespace(model=model, cfg=model.cfg), ids, progress=progress or b.update)
    calib.save(CACHE / f"{fingerprint(model)}.safetensors")
    return calib


def measure(lm, plan, ids, window: int = 1024) -> dict:
    """The sparsity plan really reaches on ids: per projection, the fraction of input channels at or under
    its threshold (all tokens, masked execution), and the parameter-weighted model-wide average."""
    from attnlab.model.llama import Pass
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    cfg = lm.cfg
    dropped = torch.zeros(cfg.n_layers, len(PROJ), dtype=torch.float64)
    total = torch.zeros(cfg.n_layers, len(PROJ), dtype=torch.float64)

    class Count(Inputs):
        def record(self, i, name, t):
            if name == "heads":
                t = t.transpose(1, 2).reshape(t.shape[0], t.shape[2], -1)
            p = {"attn_in": 0, "heads": 1, "mlp_in": 2, "mlp_act": 3}.get(name)
            if p is not None:
                dropped[i, p] += float((t.abs() <= plan.taus[i][p]).sum())
                total[i, p] += t.numel()

    with torch.inference_mode():
        for w0 in range(0, ids.numel(), window):
            part = ids[w0:w0 + window][None]
            lm.model(part, Pass.full(lm.model.rope, part, observers=[Count(cfg.n_layers)], sparsity=plan))
    frac = dropped / total
    w = torch.tensor(proj_params(cfg), dtype=torch.float64)
    return {"per_projection": {n: float(frac[:, p].mean()) for p, n in enumerate(PROJ)},
            "per_layer": [float((frac[i] * w).sum() / w.sum()) for i in range(cfg.n_layers)],
            "model_wide": float((frac * w).sum() / (w.sum() * cfg.n_layers))}


# ---------------------------------------------------------------- the plan

from dataclasses import dataclass  # noqa: E402
from typing import ClassVar  # noqa: E402

from attnlab.sparsity.columns import columns  # noqa: E402
from attnlab.sparsity.plan import Plan  # noqa: E402  (plan.py imports this module lazily, in `methods`)


@dataclass
class Teal(Plan):
    """TEAL: every projection's input thresholded at its calibrated |x| (per layer, greedy allocation for the
    model-wide `sparsity`); `predictors` holds the `Calibration`. One-token steps run the fused column-sparse
    op on transposed weights (sparse_exec); longer chunks (prefill) run dense unless prefill_sparse, which
    evaluation sets: masked execution, the same thresholds on every token."""
    prefill_sparse: bool = False
    method: ClassVar[str] = "teal"
    chooses_heads: ClassVar[bool] = False

    def bind(self, model) -> "Teal":
        if self.predictors is None:
            self.predictors = cached(model)
        if not isinstance(self.predictors, Calibration):
            raise AttnlabError("the teal method needs a TEAL calibration (attnlab dejavu calibrate), not predictors")
        self.predictors.check_model(model.cfg)
        self.taus = [self.predictors.thresholds(i, self.sparsity) for i in range(model.cfg.n_layers)]
        self._cols = [[columns(getattr(layer.attn if p < 2 else layer.mlp, n)) for p, n in enumerate(PROJ)]
                      for layer in model.layers]
        self._layer_of = {}
        return self

    def native_step(self) -> bool:
        """Whether the engine's native step may run this plan's decode rows (`step_columns`)."""
        return self.sparse_exec

    def step_columns(self, i: int, p: int):
        """Layer i's projection p (`PROJ`) by input channel, and its threshold: what the native step runs."""
        return self._cols[i][p], self.taus[i][p]

    def project(self, i: int, name: str, linear, x: torch.Tensor) -> torch.Tensor:
        p = PROJ.index(name)
        tau = self.taus[i][p]
        cols = self._cols[i][p]
        if x.shape[0] * x.shape[1] == 1 and self.sparse_exec:
            y = cols.mv(x.reshape(-1).float().contiguous(), tau)
            if cols.bias is not None:
                y = y + cols.bias
            return y.view(1, 1, -1).to(x.dtype)
        if x.shape[1] > 1 and not self.prefill_sparse:
            return linear(x)
        xm = x * (x.abs() > tau) if tau >= 0 else x
        return linear(xm) if cols.dense is None else F.linear(xm.float(), cols.dense(), cols.bias).to(x.dtype)

    def mlp(self, i, ffn, x, ctx):
        gate, up = self.project(i, "w13", ffn.w13, x).split(ffn.hidden, dim=-1)
        act = F.silu(gate) * up
        ctx.record(i, "mlp_act", act)
        return self.project(i, "w2", ffn.w2, act)

    def heads(self, i, x, out):
        return out

    def bytes_per_token(self, model) -> dict:
        """Weight bytes one decode step reads in the projections: dense vs the calibrated allocation."""
        dense = sparse = mlp_dense = mlp_sparse = 0
        for i, row in enumerate(self._cols):
            alloc = self.predictors.allocation(i, self.sparsity)
            for p, c in enumerate(row):
                dense += c.nbytes
                sparse += c.nbytes * (1 - alloc[p])
                if p >= 2:
                    mlp_dense += c.nbytes
                    mlp_sparse += c.nbytes * (1 - alloc[p])
        return {"dense_mlp": mlp_dense, "sparse_mlp": int(mlp_sparse), "dense_proj": dense, "sparse_proj": int(sparse)}
