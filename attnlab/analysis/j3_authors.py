"""J3 against the authors' own curves: their stored per-layer entropies beside our long run.

luckmatters ``ssl/real-dataset/joma/wikitext2_multilayer_lr.pt`` holds, for every run of their
WikiText2 sweep (lr 1e-2 / 1e-3 / 1e-4, 1-10 layers, seeds 1-3, 58,000 minibatches = 20
epochs), the attention entropy per layer every 1,000 minibatches. ``summarize`` turns that file
into a small JSON (``docs/figures/theory/j3_authors_curves.json``) so the docs can quote where
their minimum is, how far each layer rebounds and how the layers are ordered at the end;
``plot_vs_authors`` draws our post-LN run beside their runs of the same depth at lr 1e-4.

    python -m attnlab.analysis.j3_authors PT_FILE OUT_JSON    # once, from a luckmatters checkout
"""
from __future__ import annotations

import sys
from pathlib import Path


def _layer_summary(steps: list[int], curve: list[float]) -> dict:
    i = min(range(len(curve)), key=curve.__getitem__)
    return {"start": curve[0], "min": curve[i], "argmin_step": steps[i], "end": curve[-1],
            "rebound": curve[-1] - curve[i]}


def summarize(pt_path: str, curves_for=((1e-4, 1), (1e-4, 2), (1e-4, 5))) -> dict:
    """{'runs': [{lr, nlayers, seed, last_step, val_loss_end, layers: [summary per layer]}],
    'curves': full per-layer curves for the (lr, nlayers) pairs in ``curves_for``}."""
    import torch

    runs, curves = [], []
    for x in torch.load(pt_path, weights_only=False, map_location="cpu"):
        e = x["this_entropies"]
        steps = [int(k) for k in x["keys"][: e.shape[0]]]
        layers = [[round(float(v), 4) for v in e[:, lvl]] for lvl in range(e.shape[1])]
        lr, n = float(x["lr"]), int(x["nlayers"])
        runs.append({"lr": lr, "nlayers": n, "seed": int(x["seed"]), "last_step": steps[-1],
                     "val_loss_end": round(float(x["this_val_loss"][-1]), 4),
                     "layers": [_layer_summary(steps, c) for c in layers]})
        if any(abs(lr - a) < 1e-12 and n == b for a, b in curves_for):
            curves.append({"lr": lr, "nlayers": n, "seed": int(x["seed"]), "steps": steps, "entropy": layers})
    key = lambda r: (r["lr"], r["nlayers"], r["seed"])  # noqa: E731
    return {"source": "facebookresearch/luckmatters ssl/real-dataset/joma/wikitext2_multilayer_lr.pt "
                      "(commit 951cf0c8), WikiText2, post-LN, d 200, batch 20, bptt 35, Adam",
            "runs": sorted(runs, key=key), "curves": sorted(curves, key=key)}


def plot_vs_authors(ours: dict[str, list[dict]], authors: dict, nlayers: int, out) -> str:
    """Entropy per layer against minibatches (log axis): our runs (label -> rows with 'step' and
    'entropy_val') on the left, the authors' lr-1e-4 runs of depth ``nlayers`` on the right."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from attnlab.io import save_figure

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True, sharex=True)
    colors = plt.cm.viridis
    for label, rows in ours.items():
        steps = [max(r["step"], 1) for r in rows]
        L = len(rows[0]["entropy_val"])
        for lvl in range(L):
            axes[0].plot(steps, [r["entropy_val"][lvl] for r in rows], color=colors(lvl / max(L - 1, 1)),
                         label=f"{label}: layer {lvl}")
    for run in authors["curves"]:
        if run["nlayers"] != nlayers or abs(run["lr"] - 1e-4) > 1e-12:
            continue
        steps = [max(s, 1) for s in run["steps"]]
        L = len(run["entropy"])
        for lvl, c in enumerate(run["entropy"]):
            axes[1].plot(steps, c, color=colors(lvl / max(L - 1, 1)), alpha=0.8,
                         label=f"seed {run['seed']}: layer {lvl}")
    axes[0].set_title("ours: post-LN on Shakespeare")
    axes[1].set_title(f"authors: {nlayers} layers, lr 1e-4, WikiText2 (their .pt; records every 1,000)")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("minibatch")
        ax.axhline(2.632, color="grey", ls=":", lw=1)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("attention entropy (nats)")
    return save_figure(fig, out)


if __name__ == "__main__":
    from attnlab.io import finish_record, run_record, write_json
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m attnlab.analysis.j3_authors PT_FILE OUT_JSON")
    record = run_record(None, None, command="python -m attnlab.analysis.j3_authors " + " ".join(sys.argv[1:]))
    summary = summarize(sys.argv[1])
    print(write_json(Path(sys.argv[2]), {**finish_record(record), **summary}))
