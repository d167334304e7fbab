"""The JoMA experiments (J1, J2) and the hierarchy experiment (J4) as runnable units.

Same contract as ``experiments.py``: (out folder, seed, size, progress) -> metrics dict,
with figures and ``metrics.json`` written to the folder.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from . import plots
from .common import make_generator
from .experiments import finish, progress_bar
from .hierarchy import (authors_measure, cooccurrence_by_height, hierarchy_measures, probe_references, seeded_model,
                        train_hierarchy)
from .hierarchy_random import random_measure, train_random
from .joma import JointModel, TokenWeightSetup, train_joint, u_shape_stats, v_dynamics

from attnlab.errors import AttnlabError

J1_SIZES = {"quick": dict(steps=2000, seeds=3), "full": dict(steps=2000, seeds=5)}
J2_SIZES = {"quick": dict(steps=5000, draws=3), "full": dict(steps=5000, draws=10)}
# MLP width 400 = 4 x vocabulary and Adam lr 1e-4, wd 1e-4, batch 128 as in the authors' Table-1
# runs (luckmatters README: hidden_multi_type=M, hidden_multi=4; joma/draw_table_1.py keeps lr 1e-4,
# d 1024); d and steps cut for the CPU (the authors: d 1024, 10,000 steps).
# samples: sequences the authors' measure is taken on (their test_batchsize).
J4_SIZES = {"quick": dict(dim=32, hidden=400, steps=300, batch=128, lr=1e-3, eval_every=50, seeds=3, samples=1280),
            "full": dict(dim=128, hidden=400, steps=2000, batch=128, lr=1e-4, eval_every=250, seeds=3, samples=1280)}


def wta_stats(v_traj: torch.Tensor) -> dict:
    """Winner-take-all along v_k(t): v_traj (S, Mc) for one class.

    Among components that end positive, the winner is the largest; reports winner /
    runner-up at the end, and how much each grew over the second half of training.
    """
    end = v_traj[-1]
    top2 = end.topk(2).indices
    w, r = int(top2[0]), int(top2[1])
    half = v_traj.shape[0] // 2
    return {"winner": w, "runner_up": r, "winner_value": float(end[w]), "runner_up_value": float(end[r]),
            "ratio": float(end[w] / end[r].clamp_min(1e-9)),
            "winner_growth_second_half": float(end[w] - v_traj[half, w]),
            "runner_up_growth_second_half": float(end[r] - v_traj[half, r])}


def run_joma_invariant(out: Path, seed: int = 0, size: str = "full", progress: bool = True) -> dict:
    """J1: linear MLP + attention; NC(z, z_hat) over training and winner-take-all in v."""
    t0 = time.perf_counter()
    cfg = J1_SIZES[size]
    setup = TokenWeightSetup()
    per_seed, first = [], None
    with progress_bar(cfg["steps"] * cfg["seeds"], "joma-invariant", progress) as bar:
        for s in range(cfg["seeds"]):
            gen = make_generator(seed + s)
            X = setup.weights(gen)
            model = JointModel(X, dim=30, temperature=0.5, gen=gen)
            tr = train_joint(model, cfg["steps"], lr=0.1, record_every=10, progress=bar)
            per_seed.append({"nc_min": float(tr["nc"].min()), "nc_final": float(tr["nc"][-1]),
                             "nc_raw_final": float(tr["nc_raw"][-1]),
                             "attn_entropy": [float(tr["attn_entropy"][0]), float(tr["attn_entropy"][-1])],
                             "loss": [float(tr["loss"][0]), float(tr["loss"][-1])],
                             "wta_class0": wta_stats(tr["V"][:, :, 0])})
            if first is None:
                first = (tr, X)
    tr, X = first
    figs = [plots.j1_invariant(Path(out) / "j1_invariant.png", tr["steps"], tr["nc"], tr["nc_raw"], X,
                               tr["V"][0], tr["V"][-1], tr["V"][:, :, 0])]
    metrics = {"config": {**cfg, "tokens": setup.num_tokens, "classes": setup.num_classes, "dim": 30,
                          "temperature": 0.5, "lr": 0.1},
               "nc_min_over_seeds": min(p["nc_min"] for p in per_seed),
               "nc_min_median_over_seeds": float(torch.tensor([p["nc_min"] for p in per_seed]).median()),
               "wta_ratio_min_over_seeds": min(p["wta_class0"]["ratio"] for p in per_seed),
               "per_seed": per_seed}
    return finish(out, "joma-invariant", size, seed, metrics, figs, t0)


def authors_mu() -> torch.Tensor:
    """The authors' draw of mu (luckmatters joma/draw_figure_4.py: torch.manual_seed(0), then
    sorted torch.rand(10) * 3 + 1, float32), made without touching the global generator."""
    return (torch.rand(10, generator=make_generator(0)) * 3 + 1).sort().values


def run_joma_nonlinear(out: Path, seed: int = 0, size: str = "full", progress: bool = True) -> dict:
    """J2: v <- v + 0.02 (mu - v) softmax(v^2/3) (U-shaped entropy) vs the linear variant, on
    ``draws`` mu draws (seeds seed, seed + 1, ...; the first is plotted) and on the authors' draw."""
    t0 = time.perf_counter()
    cfg = J2_SIZES[size]
    kw = dict(lr=0.02, temperature=3.0, v0=0.05)
    draws, curves = [], []
    for k in range(cfg["draws"]):
        mu = (torch.rand(10, generator=make_generator(seed + k), dtype=torch.float64) * 3 + 1).sort().values
        run = v_dynamics(mu, cfg["steps"], nonlinear=True, **kw)
        if k == 0:
            first_mu, nonlin, lin = mu, run, v_dynamics(mu, cfg["steps"], nonlinear=False, **kw)
        draws.append({"seed": seed + k, "mu": mu, **u_shape_stats(run["entropy"])})
        curves.append(run["entropy"])
    theirs = u_shape_stats(v_dynamics(authors_mu(), cfg["steps"], nonlinear=True, **kw)["entropy"])
    figs = [plots.j2_entropy(Path(out) / "j2_entropy.png", first_mu, nonlin["v"], nonlin["entropy"], lin["entropy"],
                             draws=curves)]
    col = {k: [d[k] for d in draws] for k in ("min", "argmin", "rebound")}
    metrics = {"config": {**cfg, **kw, "mu": first_mu},
               "nonlinear": u_shape_stats(nonlin["entropy"]), "linear": u_shape_stats(lin["entropy"]),
               "draws": draws, "over_draws": {k: {"min": min(v), "max": max(v)} for k, v in col.items()},
               "authors_draw": {"mu": authors_mu(), **theirs},
               "ln10": float(torch.log(torch.tensor(10.0)))}
    return finish(out, "joma-nonlinear", size, seed, metrics, figs, t0)


def _mean_measures(rows: list[dict], key: str) -> list[dict]:
    """Mean over seeds of per-layer measure dicts: rows[seed][key][layer][name]."""
    layers = len(rows[0][key])
    return [{n: sum(r[key][lvl][n] for r in rows) / len(rows) for n in rows[0][key][lvl]} for lvl in range(layers)]


def _authors_summary(per_seed: list[dict], key: str = "authors") -> dict:
    """Seed means of the authors' measure: {stage_tag: [layer 0, layer 1]}, stages untrained /
    trained / gain, tags true / shuffled; plus the per-seed layer-1 values."""
    out = {}
    for stage in ("untrained", "trained", "gain"):
        for tag in ("true", "shuffled"):
            vals = torch.tensor([p[key][stage][tag] for p in per_seed])  # (seeds, layers)
            out[f"{stage}_{tag}"] = vals.mean(0).tolist()
            out[f"{stage}_{tag}_per_seed"] = vals.tolist()
    return out


def _gain(before: dict, after: dict) -> dict:
    return {"untrained": before, "trained": after,
            "gain": {tag: [a - b for a, b in zip(after[tag], before[tag])] for tag in ("true", "shuffled")}}


def run_hierarchy(out: Path, seed: int = 0, size: str = "full", progress: bool = True,
                  dim: int = 0, steps: int = 0, lr: float = 0.0, child_prob: float = 1.0) -> dict:
    """J4: 3-layer Transformer on latent-tree data; per-layer latent measures, trained minus untrained.

    Each seed draws its own tree and model; the untrained measures are taken on that same
    model at initialisation, and a class permutation gives the shuffled-latent control. The
    headline number is the authors' own (``authors_corr`` on 1,280 sampled sequences); our
    class-held-out probe and |corr| on the 20 class sequences are kept beside it.
    ``dim``, ``steps``, ``lr``: override the size's defaults (0 = keep). ``child_prob`` < 1:
    the random-activation generative model (``hierarchy_random``) instead of the authors' one.
    """
    t0 = time.perf_counter()
    if dim < 0 or steps < 0 or lr < 0:
        raise AttnlabError(f"dim, steps and lr must be >= 0 (0 = the size's default), got {dim}, {steps}, {lr}")
    if not 0.0 < child_prob <= 1.0:
        raise AttnlabError(f"--child-prob must be in (0, 1], got {child_prob}")
    cfg = dict(J4_SIZES[size])
    cfg.update({k: v for k, v in (("dim", dim), ("steps", steps), ("lr", lr)) if v})
    cfg["child_prob"] = child_prob
    per_seed, first = [], None
    with progress_bar(cfg["steps"] * cfg["seeds"], "hierarchy", progress) as bar:
        for s in range(seed, seed + cfg["seeds"]):
            gen, tree, shuffle, model = seeded_model(s, cfg["dim"], cfg["hidden"])
            if child_prob < 1.0:
                per_seed.append(_random_seed(model, tree, shuffle, cfg, s, gen, bar))
                continue
            sample = torch.randint(0, tree.num_classes, (cfg["samples"],), generator=gen)
            a0, before = authors_measure(model, tree, sample, shuffle), hierarchy_measures(model, tree, shuffle)
            tr = train_hierarchy(model, tree, cfg["steps"], cfg["batch"], cfg["lr"], weight_decay=1e-4,
                                 gen=gen, eval_every=cfg["eval_every"], progress=bar)
            a1, after = authors_measure(model, tree, sample, shuffle), hierarchy_measures(model, tree, shuffle)
            gain = {tag: [{n: after[tag][lvl][n] - before[tag][lvl][n] for n in after[tag][lvl]}
                          for lvl in range(len(after[tag]))] for tag in after}
            per_seed.append({"seed": s, "authors": _gain(a0, a1), "untrained": before, "trained": after,
                             "gain": gain, "references": probe_references(tree), "probe_curve": tr["probe"],
                             "accuracy": tr["accuracy"], "loss": [float(tr["loss"][0]), float(tr["loss"][-1])],
                             "distinct_class_sequences": len({tuple(q.tolist()) for q in tree.sequences})})
            if first is None:
                first = (tr, tree)
    config = {**cfg, "layers": 3, "weight_decay": 1e-4, "leaves": 99, "latents": [10, 20], "classes": 20,
              "seq_len": 30}
    authors = _authors_summary(per_seed)
    if child_prob < 1.0:
        metrics = {"config": config, "authors_measure": authors, "per_seed": per_seed,
                   "accuracy": [p["accuracy"] for p in per_seed]}
        figs = [plots.j4_authors_bars(Path(out) / "j4_random_activation.png", authors,
                                      f"J4, random child activation p = {child_prob:g}: authors' measure, mean over seeds")]
        return finish(out, "hierarchy", size, seed, metrics, figs, t0)
    tr, tree = first
    cooc = cooccurrence_by_height(tree)
    summary = {f"{stage}_{tag}": _mean_measures([{k: p[stage][tag]} for p in per_seed], k)
               for stage in ("untrained", "trained", "gain") for tag in ("true", "shuffled") for k in [stage]}
    summary["references"] = [{k: sum(p["references"][lvl][k] for p in per_seed) / len(per_seed)
                              for k in per_seed[0]["references"][lvl]} for lvl in range(2)]
    gains_l1 = [p["gain"]["true"][1]["probe"] for p in per_seed]
    probe_curve = torch.stack([p["probe_curve"] for p in per_seed])  # (seeds, S, 2)
    figs = [plots.j4_hierarchy(Path(out) / "j4_hierarchy.png", tr["steps"], probe_curve, summary, cooc, authors)]
    metrics = {"config": config, "authors_measure": authors,
               "summary": summary, "probe_gain_layer1_per_seed": gains_l1,
               "curve_steps": tr["steps"].tolist(), "probe_curve_mean": probe_curve.mean(0).tolist(),
               "accuracy": [p["accuracy"] for p in per_seed], "per_seed": per_seed,
               "cooccurrence_by_height": {str(h): {"mean": v[0], "pairs": v[1]} for h, v in cooc.items()}}
    return finish(out, "hierarchy", size, seed, metrics, figs, t0)


def _random_seed(model, tree, shuffle, cfg: dict, seed: int, gen: torch.Generator, bar) -> dict:
    """One seed of the random-activation variant: the authors' measure on fresh draws, before
    and after training on fresh draws."""
    mgen = make_generator(10_000 + seed)  # measurement draws: the same before and after training
    a0 = random_measure(model, tree, cfg["child_prob"], cfg["samples"], shuffle, mgen)
    losses = train_random(model, tree, cfg["child_prob"], cfg["steps"], cfg["batch"], cfg["lr"], 1e-4, gen, bar)
    mgen = make_generator(10_000 + seed)
    a1 = random_measure(model, tree, cfg["child_prob"], cfg["samples"], shuffle, mgen)
    acc = [a0.pop("accuracy"), a1.pop("accuracy")]
    return {"seed": seed, "authors": _gain(a0, a1), "accuracy": acc[1], "accuracy_untrained": acc[0],
            "loss": [losses[0], sum(losses[-50:]) / len(losses[-50:])]}
