"""Two of JoMA's claims about hierarchical data on the latent-tree data (J4's generator and model), each with a control.

**Superposition** (`attnlab dynamics superposition`): one MLP unit encodes several unrelated
latent patterns. For block l (0, 1) a unit *encodes* a level-l latent when the Pearson correlation
of its position-max-pooled ReLU activation over the 20 class sequences with the latent's indicator
is >= ``ENCODE``; it is *superposed* when it encodes two latents whose leaf sets are disjoint
(unrelated patterns). Control: the same activations against the latents of a class permutation
(the J4 control), which keeps every unit's activation statistics and breaks the hierarchy.

**Bottom-up order** (`attnlab dynamics bottom-up`): pairs of leaves whose lowest common ancestor
is low (same level-0 latent: they always co-occur) are learned before pairs whose ancestor is high
(same class only). A leaf's representation is block 0's MLP activation on the leaf alone (the
embeddings themselves barely move at this learning rate); a pair is *learned* at the first
recorded step where the change of the cosine of the two leaves' representations from
initialisation reaches half of its final change (pairs whose final change is below ``MOVED`` are
left out). Control: the pairs' heights permuted at random
(``PERMUTATIONS`` times); the gap between heights must beat 95 % of the permuted gaps.

Both train J4's quick size (d 32, MLP 400, Adam lr 1e-3, 300 steps) on 6 seeds: about half a CPU
minute each. ``--quick`` cuts it to 2 seeds and 100 steps for the tests.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from . import plots
from .experiments import finish, progress_bar
from .hierarchy import LatentTree, batch_loss, pooled_activations, seeded_model
from .spec import Experiment

SIZES = {"quick": dict(dim=32, hidden=400, steps=100, lr=1e-3, seeds=2, record_every=5),
         "full": dict(dim=32, hidden=400, steps=300, lr=1e-3, seeds=6, record_every=5)}
ENCODE = 0.5
MOVED = 0.02
PERMUTATIONS = 200


def _seeds(cfg: dict, seed: int, name: str, progress: bool, one) -> list:
    """[one(seed, gen, tree, shuffle, model, bar) for each of the size's seeds], one progress bar."""
    with progress_bar(cfg["steps"] * cfg["seeds"], name, progress) as bar:
        return [one(s, *seeded_model(s, cfg["dim"], cfg["hidden"]), bar) for s in range(seed, seed + cfg["seeds"])]


def _train(model, tree, cfg, gen, on_step=None, bar=None):
    opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"], weight_decay=1e-4)
    for t in range(cfg["steps"] + 1):
        if on_step is not None and t % cfg["record_every"] == 0:
            on_step(t)
        if t == cfg["steps"]:
            break
        loss = batch_loss(model, tree, torch.randint(0, tree.num_classes, (128,), generator=gen))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if bar is not None:
            bar.update(1)


def _corr(h: torch.Tensor, ind: torch.Tensor) -> torch.Tensor:
    """(units, latents) Pearson correlation of activations h (N, units) with indicators (N, latents)."""
    h = h - h.mean(0)
    ind = ind - ind.mean(0)
    den = h.norm(dim=0)[:, None] * ind.norm(dim=0)[None, :]
    return (h.T @ ind) / den.clamp_min(1e-12)


def superposed_fraction(h: torch.Tensor, ind: torch.Tensor, leaves: torch.Tensor) -> tuple[float, float]:
    """(fraction of live units that encode two unrelated latents, fraction that encode any).

    h (N, units) activations; ind (N, latents) 0/1; leaves (latents, leaves) bool: which leaves
    lie below each latent (disjoint leaf sets = unrelated patterns)."""
    live = h.std(0) > 1e-6
    enc = (_corr(h[:, live], ind) >= ENCODE) & (ind.std(0) > 0)[None, :]
    unrelated = ~((leaves.float() @ leaves.float().T) > 0)
    pairs = (enc.float() @ unrelated.float() @ enc.float().T).diagonal() > 0  # some encoded pair is unrelated
    n = max(int(live.sum()), 1)
    return float(pairs.sum()) / n, float(enc.any(1).sum()) / n


def _leaf_sets(tree: LatentTree, level: int) -> torch.Tensor:
    return tree._leaf_cover(level + 1)  # (latents of that level, leaves)


def run_superposition(out: Path, seed: int = 0, size: str = "full", progress: bool = True) -> dict:
    t0, cfg = time.perf_counter(), SIZES[size]

    def one(s, gen, tree, shuffle, model, bar):
        labels = torch.arange(tree.num_classes)

        def measure():
            with torch.no_grad():
                pooled = pooled_activations(model, tree, labels)
            return {f"layer{lvl}": {tag: superposed_fraction(h, tree.latent_indicators(lab, lvl), _leaf_sets(tree, lvl))
                                    for tag, lab in (("true", labels), ("shuffled", shuffle))}
                    for lvl, h in enumerate(pooled)}
        before = measure()
        _train(model, tree, cfg, gen, bar=bar)
        return {"seed": s, "untrained": before, "trained": measure()}
    per_seed = _seeds(cfg, seed, "superposition", progress, one)
    head = [p["trained"]["layer1"]["true"][0] for p in per_seed]
    ctrl = [p["trained"]["layer1"]["shuffled"][0] for p in per_seed]
    metrics = {"config": {**cfg, "encode": ENCODE, "headline": "block 1 vs level-1 latents"}, "per_seed": per_seed,
               "trained": {"per_seed": head, "mean": sum(head) / len(head)},
               "control": {"per_seed": ctrl, "mean": sum(ctrl) / len(ctrl)},
               "untrained": {"mean": sum(p["untrained"]["layer1"]["true"][0] for p in per_seed) / len(per_seed)}}
    figs = [plots.seed_bars(Path(out) / "j4_superposition.png", {"trained": head, "shuffled control": ctrl, "untrained": [
        p["untrained"]["layer1"]["true"][0] for p in per_seed]}, "superposition: block-1 units encoding two unrelated "
        "level-1 latents", "fraction of live units")]
    return finish(out, "superposition", size, seed, metrics, figs, t0)


def learned_steps(steps: list[int], cos: torch.Tensor) -> torch.Tensor:
    """cos (S, P) pair cosines over recorded steps -> (P,) first step where |cos - cos_0| reaches
    half its final value (NaN for pairs that moved less than MOVED)."""
    d = (cos - cos[0]).abs()
    final = d[-1]
    reached = d >= 0.5 * final
    first = reached.float().argmax(0)
    out = torch.tensor(steps, dtype=torch.float32)[first]
    out[final < MOVED] = float("nan")
    return out


def order_test(when: torch.Tensor, height: torch.Tensor, gen: torch.Generator) -> dict:
    """Mean learned step per height, gap = high (3) - low (1), and the fraction of permuted-height
    gaps at least as large (the control)."""
    ok = ~torch.isnan(when)
    when, height = when[ok], height[ok]

    def gap(h):
        lo, hi = when[h == 1], when[h == 3]
        return float(hi.mean() - lo.mean()) if len(lo) and len(hi) else float("nan")
    g = gap(height)
    perm = [gap(height[torch.randperm(len(height), generator=gen)]) for _ in range(PERMUTATIONS)]
    p = sum(x >= g for x in perm) / len(perm)
    by = {int(h): float(when[height == h].mean()) for h in height.unique()}
    return {"mean_step_by_height": by, "pairs_by_height": {int(h): int((height == h).sum()) for h in height.unique()},
            "gap": g, "permutation_p": p, "low_first": bool(g > 0 and p < 0.05)}


def run_bottom_up(out: Path, seed: int = 0, size: str = "full", progress: bool = True) -> dict:
    t0, cfg = time.perf_counter(), SIZES[size]

    def one(s, gen, tree, _shuffle, model, bar):
        used = tree.active[0].any(0).nonzero().flatten()
        height = tree.lca_height()[used][:, used]
        iu = torch.triu_indices(len(used), len(used), 1)
        steps, cos = [], []

        def record(t):
            with torch.no_grad():  # block 0's MLP units on each leaf alone: how the first layer sees it
                e = torch.nn.functional.normalize(model(used[:, None])[1][0][:, 0], dim=-1)
            steps.append(t)
            cos.append((e @ e.T)[iu[0], iu[1]])
        _train(model, tree, cfg, gen, on_step=record, bar=bar)
        return {"seed": s, **order_test(learned_steps(steps, torch.stack(cos)), height[iu[0], iu[1]], gen)}
    per_seed = _seeds(cfg, seed, "bottom-up", progress, one)
    low = [p["mean_step_by_height"].get(1, float("nan")) for p in per_seed]
    high = [p["mean_step_by_height"].get(3, float("nan")) for p in per_seed]
    metrics = {"config": {**cfg, "moved": MOVED, "permutations": PERMUTATIONS}, "per_seed": per_seed,
               "mean_step": {"low": sum(low) / len(low), "high": sum(high) / len(high)}}
    heights = sorted({h for p in per_seed for h in p["mean_step_by_height"]})
    figs = [plots.seed_bars(Path(out) / "j4_bottom_up.png", {f"LCA height {h}": [p["mean_step_by_height"].get(h, float(
        "nan")) for p in per_seed] for h in heights}, "bottom-up: step a leaf pair's block-0 cosine reaches half its change",
        "mean step")]
    return finish(out, "bottom-up", size, seed, metrics, figs, t0)


def _sup_summary(m):
    return [f"block 1 units encoding two unrelated level-1 latents: trained {m['trained']['mean']:.3f} "
            f"({', '.join(f'{x:.3f}' for x in m['trained']['per_seed'])}), shuffled control {m['control']['mean']:.3f}, "
            f"untrained {m['untrained']['mean']:.3f}"]


def _order_summary(m):
    return [f"seed {p['seed']}: learned step by LCA height {p['mean_step_by_height']}, gap {p['gap']:.1f}, "
            f"permutation p {p['permutation_p']:.3f}, low first {p['low_first']}" for p in m["per_seed"]]


SUPERPOSITION = Experiment("superposition", "JoMA: MLP units encoding several unrelated latents vs a shuffled control",
                           run_superposition, _sup_summary)
BOTTOM_UP = Experiment("bottom-up", "JoMA: leaf pairs with a low common ancestor learned before high ones",
                       run_bottom_up, _order_summary)
