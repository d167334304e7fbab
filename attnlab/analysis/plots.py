"""Figures of the attention anatomy and of the J3 training dynamics (matplotlib, Agg)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402,F401
import numpy as np  # noqa: E402


def _save(fig, path) -> str:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def layer_bars(stats: dict, path, title: str, sinks: int = 4) -> str:
    """Per-layer sink mass (first 1 and first `sinks` tokens) and normalised entropy, head means."""
    s1 = np.asarray(stats["sink_mass_1"]).mean(1)
    sk = np.asarray(stats[f"sink_mass_{sinks}"]).mean(1)
    ent = np.asarray(stats["entropy_normalised"]).mean(1)
    layers = np.arange(len(s1))
    fig, (a, b) = plt.subplots(2, 1, figsize=(max(6, 0.28 * len(layers) + 2), 5.5), sharex=True)
    a.bar(layers, sk, color="#9ecae1", label=f"first {sinks} tokens")
    a.bar(layers, s1, color="#3182bd", label="first token")
    a.set_ylabel("attention mass")
    a.set_ylim(0, 1)
    a.legend(loc="upper left", fontsize=8)
    a.set_title(title, fontsize=10)
    b.bar(layers, ent, color="#e6550d")
    b.set_ylabel("entropy / log(t+1)")
    b.set_ylim(0, 1)
    b.set_xlabel("layer")
    return _save(fig, path)


def head_heatmaps(stats: dict, path, title: str, sinks: int = 4) -> str:
    """Head x layer heatmaps of sink mass, normalised entropy and top-5% share."""
    panels = [(f"sink_mass_{sinks}", f"mass on first {sinks} tokens", "Blues"),
              ("entropy_normalised", "entropy / log(t+1)", "Oranges"),
              ("top5_share", "mass in top 5% keys", "Greens")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    for ax, (key, label, cmap) in zip(axes, panels):
        m = np.asarray(stats[key]).T  # [heads, layers]
        im = ax.imshow(m, aspect="auto", cmap=cmap, vmin=0, vmax=1, origin="lower", interpolation="nearest")
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("layer")
        ax.set_ylabel("query head")
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def attention_map(probs, path, title: str, tokens: int = 96) -> str:
    """The first `tokens` rows/columns of one head's [T, T] map, log colour scale."""
    p = np.asarray(probs)[:tokens, :tokens]
    fig, ax = plt.subplots(figsize=(5.2, 4.6))
    im = ax.imshow(np.log10(p + 1e-6), cmap="magma", vmin=-4, vmax=0, interpolation="nearest")
    ax.set_xlabel("key position")
    ax.set_ylabel("query position")
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, fraction=0.046, label="log10 attention")
    return _save(fig, path)


def sink_bars(result: dict, path, title: str) -> str:
    """Perplexity of each sink-experiment case (log scale) plus the running NLL."""
    cases = list(result["cases"])
    ppl = [result["cases"][c]["ppl"] for c in cases]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [1, 2]})
    colors = {"full": "#636363", "keep": "#31a354", "drop": "#de2d26", "replace": "#3182bd"}
    a.bar(cases, ppl, color=[colors.get(c, "gray") for c in cases])
    if max(ppl) > 10 * min(ppl):
        a.set_yscale("log")
    a.set_ylabel("perplexity" + (" (log scale)" if max(ppl) > 10 * min(ppl) else ""))
    for i, v in enumerate(ppl):
        a.text(i, v, f"{v:.1f}", ha="center", va="bottom", fontsize=8)
    a.set_title(title, fontsize=9)
    x0 = result["scored_from"]
    for c in cases:
        nll = np.asarray(result["nll_curve"][c])
        k = max(1, len(nll) // 40)
        smooth = np.convolve(nll, np.ones(k) / k, mode="valid")
        b.plot(x0 + np.arange(len(smooth)), smooth, color=colors.get(c, "gray"), label=c, lw=1.2)
    b.set_xlabel("token position")
    b.set_ylabel(f"NLL (running mean of {k})")
    b.legend(fontsize=8)
    return _save(fig, path)


# ---------------------------------------------------------------- J3 dynamics

def _steps_axis(ax) -> None:
    """Minibatches on a symlog axis: linear up to 10, logarithmic after (the early drop is fast)."""
    ax.set_xscale("symlog", linthresh=10, linscale=0.5)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlim(left=0)
    ax.set_xlabel("minibatches")


def _curves(ax, runs: dict, key: str, ylabel: str, baseline: float | None = None):
    styles = ["-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1))]  # one line style per layer, one colour per run
    for r_i, (label, log) in enumerate(runs.items()):
        steps = [r["step"] for r in log]
        vals = np.asarray([r[key] for r in log], dtype=float)
        if vals.ndim == 1:
            vals = vals[:, None]
        for i in range(vals.shape[1]):
            ax.plot(steps, vals[:, i], label=f"{label} L{i}" if vals.shape[1] > 1 else label, lw=1.2,
                    color=plt.get_cmap("tab10")(r_i), ls=styles[i % len(styles)])
    if baseline is not None:
        ax.axhline(baseline, color="k", ls="--", lw=0.8, label="random baseline")
    _steps_axis(ax)
    ax.set_ylabel(ylabel)


def entropy_per_layer(runs: dict, path, title: str, key: str = "entropy_val", reference: float | None = None) -> str:
    """One panel per run: attention entropy of each layer against minibatches (JoMA Fig. 6)."""
    n = len(runs)
    cols = min(n, 4)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.0 * rows), squeeze=False)
    for ax, (label, log) in zip(axes.flat, runs.items()):
        steps = [r["step"] for r in log]
        vals = np.asarray([r[key] for r in log], dtype=float)
        cmap = plt.get_cmap("tab10")
        for i in range(vals.shape[1]):
            ax.plot(steps, vals[:, i], color=cmap(i), label=f"layer {i}", lw=1.3)
        if reference is not None:
            ax.axhline(reference, color="gray", ls=":", lw=0.8, label="uniform")
        ax.set_title(label, fontsize=9)
        _steps_axis(ax)
        ax.set_ylabel("attention entropy (nats)")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def dynamics_panels(runs: dict, path, title: str, cos_baseline: float) -> str:
    """Stable rank per layer, embedding |cos| vs random baseline, sink mass on position 0, val loss."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    _curves(axes[0, 0], runs, "stable_rank", "stable rank of lower MLP weights")
    _curves(axes[0, 1], runs, "embed_abs_cos", "mean |cos| of embedding pairs", cos_baseline)
    _curves(axes[1, 0], runs, "sink_mass_val", "attention on position 0")
    _curves(axes[1, 1], runs, "val_loss", "validation loss")
    for ax in axes.flat:
        handles, labels = ax.get_legend_handles_labels()
        if len(labels) <= 14:
            ax.legend(fontsize=6, ncol=2)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)
