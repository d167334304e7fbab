"""JoMA on pretrained checkpoints: the lower layer of each MLP (its input projection) has a low stable
rank, against random weights of the same shapes (`attnlab dynamics mlp-rank`).

Stable rank ||W||_F^2 / ||W||_2^2 of the MLP's input projection (gate and up rows, [2h, d]) and of
its output projection ([d, h]), per Transformer layer. Control: a Gaussian matrix of the same shape
(stable rank set by the shape alone), one per layer and projection, from the run's seed. The claim
holds for a model when the input projection is below its random control in every layer; the
means over the lowest and the highest third of the layers are reported beside it. Models are
loaded as float32 (an embedded GGUF is dequantised); a model that is not on this machine is listed
as skipped, never downloaded.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from . import plots
from .common import make_generator
from .experiments import finish
from .spec import Experiment

DEFAULT_MODELS = "smollm2-135m,qwen2.5-coder-0.5b"


def stable_rank(w: torch.Tensor) -> float:
    s = torch.linalg.svdvals(w.detach().float())
    return float((s ** 2).sum() / s[0] ** 2)


def model_ranks(layers, gen: torch.Generator, limit: int = 0) -> dict:
    """{"w13", "w2", "random_w13", "random_w2"}: per-layer stable ranks of ``layers`` (modules with
    ``mlp.w13`` / ``mlp.w2``) and of Gaussian matrices of the same shapes."""
    out = {k: [] for k in ("w13", "w2", "random_w13", "random_w2")}
    for layer in list(layers)[: limit or None]:
        for name in ("w13", "w2"):
            w = getattr(layer.mlp, name).weight
            out[name].append(stable_rank(w))
            out[f"random_{name}"].append(stable_rank(torch.randn(w.shape, generator=gen)))
    return out


def judge(r: dict) -> dict:
    n = len(r["w13"])
    third = max(n // 3, 1)
    lower, upper = sum(r["w13"][:third]) / third, sum(r["w13"][-third:]) / third
    ratio = [a / b for a, b in zip(r["w13"], r["random_w13"])]
    return {"lower": lower, "upper": upper, "random": sum(r["random_w13"]) / n,
            "ratio_to_random": [min(ratio), max(ratio)], "lower_below_upper": lower < upper,
            "below_random": all(x < 1 for x in ratio),
            "w2_below_random": all(a < b for a, b in zip(r["w2"], r["random_w2"]))}


def run_mlp_rank(out: Path, seed: int = 0, size: str = "full", progress: bool = True, models: str = DEFAULT_MODELS) -> dict:
    from attnlab.errors import AttnlabError
    from attnlab.model.loaders import load_model
    t0 = time.perf_counter()
    gen = make_generator(seed)
    ranks, skipped = {}, {}
    for spec in [m.strip() for m in models.split(",") if m.strip()]:
        try:
            model, _, _ = load_model(spec, dtype=torch.float32)
        except AttnlabError as e:  # not on this machine: never fetched here
            skipped[spec] = str(e)
            continue
        ranks[spec] = model_ranks(model.layers, gen, limit=3 if size == "quick" else 0)
        del model
    if not ranks:
        raise AttnlabError(f"none of the models {models!r} is on this machine: {skipped}")
    figs = [plots.mlp_rank(Path(out) / "mlp_rank.png", ranks)]
    metrics = {"config": {"models": models, "projections": "w13 = [gate; up] (2h x d), w2 (d x h)"},
               "ranks": ranks, "models": {k: judge(v) for k, v in ranks.items()}, "skipped": skipped}
    return finish(out, "mlp-rank", size, seed, metrics, figs, t0)


def _summary(m):
    out = [f"{k}: w13 stable rank lower third {x['lower']:.1f}, upper third {x['upper']:.1f}, random {x['random']:.1f}; "
           f"every layer below random {x['below_random']} ({x['ratio_to_random'][0]:.2f}-{x['ratio_to_random'][1]:.2f}x); "
           f"lower < upper third {x['lower_below_upper']}"
           for k, x in m["models"].items()]
    return out + [f"skipped {k}: {v}" for k, v in m["skipped"].items()]


EXPERIMENT = Experiment("mlp-rank", "JoMA: per-layer MLP stable rank of pretrained models vs random weights",
                        run_mlp_rank, _summary,
                        options=(("models", str, DEFAULT_MODELS, "comma-separated model names or files (skipped if absent)"),))
