"""Figures for the theory lab, laid out to be read next to the papers' figures.

Every function takes plain tensors/dicts produced by the experiment modules and
writes one PNG (matplotlib Agg backend, no display needed); nothing here trains.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

DPI = 90


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def s1_trajectories(path, steps, runs: dict) -> Path:
    """Scan and Snap Fig. 4 analogue. runs: label -> dict(z_common (S, C), z_distinct (S, D),
    entropy (S,), loss (S,)) for one class of one run."""
    n = len(runs)
    fig, axes = plt.subplots(1, n + 1, figsize=(4.2 * (n + 1), 3.4))
    cmap = plt.get_cmap("viridis")
    for ax, (label, r) in zip(axes, runs.items()):
        D = r["z_distinct"].shape[1]
        for j in range(D):
            ax.plot(steps, r["z_distinct"][:, j], color=cmap(j / max(D - 1, 1)), lw=1.2)
        for j in range(r["z_common"].shape[1]):
            ax.plot(steps, r["z_common"][:, j], color="tab:red", lw=0.8, alpha=0.6)
        ax.axhline(0, color="k", lw=0.5, ls="--")
        ax.set_title(f"{label}: z of class 0's query")
        ax.set_xlabel("iteration")
        ax.set_ylabel(r"$z_{ml}$")
        ax.plot([], [], color="tab:red", label="common tokens")
        ax.plot([], [], color=cmap(1.0), label="distinct, high P(l|n)")
        ax.plot([], [], color=cmap(0.0), label="distinct, low P(l|n)")
        ax.legend(fontsize=7, loc="upper left")
    ax = axes[-1]
    for label, r in runs.items():
        ax.plot(steps, r["entropy"], label=label)
    ax.set_title("entropy of attention on distinct tokens")
    ax.set_xlabel("iteration")
    ax.set_ylabel("entropy (nats)")
    ax.legend(fontsize=8)
    return _save(fig, path)


def s1_attention_rows(path, rows: torch.Tensor, iters, num_common: int) -> Path:
    """Scan and Snap Fig. 4 (heatmap) analogue: attention c_l of class 0 over [common | distinct]
    tokens at the listed iterations. rows: (len(iters), C + D)."""
    fig, ax = plt.subplots(figsize=(4.2, 4.3))
    ax.imshow(rows.float().numpy(), aspect="auto")
    ax.axvline(num_common - 0.5, color="w", ls="--", lw=1)
    ax.set_yticks(range(len(iters)), [f"iter {t}" for t in iters[:-1]] + [f"final ({iters[-1]})"])
    ax.set_xlabel("token #")
    ax.set_title("common tokens | distinct tokens (class 0)", fontsize=9)
    return _save(fig, path)


def s2_sweep(path, entropy: torch.Tensor, std: torch.Tensor, queries, lr_z, ratios) -> Path:
    """Scan and Snap Fig. 6 analogue. entropy, std: (Q, len(lr_z), len(ratios))."""
    nq = len(queries)
    fig, axes = plt.subplots(2, nq, figsize=(3.4 * nq, 6.2), squeeze=False)
    vmin, vmax = float(entropy.min()), float(entropy.max())
    for i, q in enumerate(queries):
        ax = axes[0, i]
        im = ax.imshow(entropy[i], cmap="magma", vmin=vmin, vmax=vmax, origin="lower")
        ax.set_xticks(range(len(ratios)), [str(r) for r in ratios])
        ax.set_yticks(range(len(lr_z)), [str(z) for z in lr_z])
        ax.set_xlabel(r"$\eta_Y/\eta_Z$")
        if i == 0:
            ax.set_ylabel(r"$\eta_Z$")
        ax.set_title(f"{q} queries / {2 * q} next tokens", fontsize=9)
        for a in range(len(lr_z)):
            for b in range(len(ratios)):
                ax.text(b, a, f"{float(entropy[i, a, b]):.2f}", ha="center", va="center",
                        fontsize=7, color="w" if entropy[i, a, b] < (vmin + vmax) / 2 else "k")
        ax = axes[1, i]
        for a, z in enumerate(lr_z):
            ax.errorbar(ratios, entropy[i, a], std[i, a], label=rf"$\eta_Z$={z}", capsize=2)
        ax.set_xscale("log")
        ax.set_xticks(ratios, [str(r) for r in ratios])
        ax.set_xlabel(r"$\eta_Y/\eta_Z$")
        if i == 0:
            ax.set_ylabel("final distinct-token entropy")
            ax.legend(fontsize=7)
    fig.colorbar(im, ax=axes[0, :].tolist(), shrink=0.8)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return path


def s3_theorems(path, steps, gain: dict, B: torch.Tensor, fit: dict, curves: dict) -> Path:
    """Theorem 3 (measured vs predicted relative gain) and Theorem 4 (B(t) vs scan/snap curves)."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    ax = axes[0]
    cmap = plt.get_cmap("viridis")
    m, p = gain["measured"], gain["predicted"]
    for j in range(m.shape[1]):
        c = cmap(j / max(m.shape[1] - 1, 1))
        ax.plot(steps, m[:, j], color=c, lw=1.5)
        ax.plot(steps, p[:, j], color=c, lw=1.0, ls="--")
    ax.plot([], [], "k-", label="measured $c_l^2/c_{l'}^2-1$")
    ax.plot([], [], "k--", label=r"predicted $r(0)\,e^{2(z_{ml}(t)-z_{ml}(0))}$")
    ax.set_yscale("log")
    ax.set_xscale("symlog", linthresh=10)
    ax.set_xlim(0, float(steps.max()))
    ax.set_xlabel("iteration")
    ax.set_title("Theorem 3: relative gain, top distinct token vs others", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[1]
    ax.plot(steps, B, "k", lw=2, label="measured $B(t)$")
    early, late = steps <= 2 * fit["split_step"], steps >= fit["split_step"] / 2
    ax.plot(steps[early], curves["scan"][early], "tab:blue", ls="--", label=r"scan fit $a\ln(1+t/\tau)+b$")
    ax.plot(steps[late], curves["snap"][late], "tab:orange", ls="--", label=r"snap fit $a\ln\ln(e+t/\tau)+b$")
    ax.axvline(fit["split_step"], color="gray", lw=0.8, ls=":")
    ax.set_xscale("symlog", linthresh=10)
    ax.set_xlim(0, float(steps.max()))
    ax.set_ylim(float(B.min()) - 0.05, float(B.max()) * 1.3 + 0.05)
    ax.set_xlabel("iteration")
    ax.set_ylabel("growth of top distinct logit")
    ax.set_title("Theorem 4: two phases of $B_n(t)$", fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, path)


def j1_invariant(path, steps, nc, nc_raw, X, V0, V1, v_traj) -> Path:
    """JoMA Figs. 2-3 analogue: X, NC(z, z_hat) over steps, V at init/end, v_0 components."""
    fig, axes = plt.subplots(1, 5, figsize=(17, 3.3), gridspec_kw={"width_ratios": [1, 1.6, 1, 1, 1.6]})
    axes[0].imshow(torch.as_tensor(X).numpy(), aspect="auto", cmap="Blues")
    axes[0].set_title("X (tokens x classes)")
    axes[0].set_xlabel("class")
    axes[0].set_ylabel("context token")
    ax = axes[1]
    ax.plot(steps, nc, "r", lw=2, label=r"NC$(z, \hat z)$, $\hat z$ with C")
    ax.plot(steps, nc_raw, "b--", lw=1, label=r"NC without C (no init term)")
    ax.axhline(0.95, color="k", lw=0.5, ls=":")
    ax.set_ylim(min(-0.3, float(min(nc_raw))) if len(nc_raw) else -0.3, 1.05)
    ax.set_xlabel("step")
    ax.set_title("JoMA invariant")
    ax.legend(fontsize=7, loc="lower right")
    for ax, V, title in ((axes[2], V0, "V at init"), (axes[3], V1, "V after training")):
        im = ax.imshow(V, aspect="auto", cmap="RdBu_r", vmin=-float(V.abs().max()), vmax=float(V.abs().max()))
        ax.set_title(title)
        ax.set_xlabel("class k")
        fig.colorbar(im, ax=ax, shrink=0.8)
    ax = axes[4]
    for i in range(4):
        ax.plot(steps, v_traj[:, i], label=f"component {i}")
    ax.axhline(0, color="k", lw=0.5, ls="--")
    ax.set_xlabel("step")
    ax.set_ylabel(r"$\mathbf{v}_0(t)$")
    ax.set_title("winner-take-all (class 0)")
    ax.legend(fontsize=7)
    return _save(fig, path)


def j2_entropy(path, mu, v_traj, ent_nonlinear, ent_linear, draws=()) -> Path:
    """JoMA Fig. 4 analogue: v(t) towards mu, and entropy curves (nonlinear U vs linear; the
    nonlinear curves of other mu draws thin and grey)."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    ax = axes[0]
    cmap = plt.get_cmap("rainbow")
    S = v_traj.shape[0]
    for t in range(0, S, max(1, S // 50)):
        ax.plot(v_traj[t], color=cmap(t / S), lw=0.8)
    ax.plot(mu, "k--", label=r"target $\mu$")
    ax.set_xlabel(r"sorted index of $\mathbf{v}$ components")
    ax.set_ylabel(r"$\mathbf{v}$")
    ax.set_title(r"nonlinear: $\mathbf{v}(t)$ (colour = time)", fontsize=9)
    ax.legend(fontsize=8)
    ax = axes[1]
    for i, e in enumerate(draws[1:]):
        ax.plot(e, color="0.7", lw=0.7, label=f"nonlinear, {len(draws) - 1} other $\\mu$ draws" if i == 0 else None)
    ax.plot(ent_nonlinear, label="nonlinear (fixed point $\\mu$)")
    ax.plot(ent_linear, label="linear (no fixed point)")
    ax.set_xlabel("iteration")
    ax.set_ylabel(r"entropy of softmax$(v^2/T)$")
    ax.set_title("sparse then dense (U) vs monotone", fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path)


def j4_hierarchy(path, steps, probe, summary: dict, cooc: dict, authors: dict | None = None) -> Path:
    """JoMA Table 1 analogue: class-held-out probe over training (probe: (seeds, S, 2); mean bold,
    seeds thin) with the layer-1 reference levels, a table (mean over seeds, untrained / trained /
    shuffled-latent control) of the authors' measure (``authors``, if given) and of the probe,
    co-occurrence vs ancestor height."""
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.4), gridspec_kw={"width_ratios": [1.3, 1.3, 1.0]})
    ax = axes[0]
    for lvl, color in zip(range(probe.shape[2]), ("C0", "C1")):
        for s in range(probe.shape[0]):
            ax.plot(steps, probe[s, :, lvl], color=color, lw=0.6, alpha=0.5)
        ax.plot(steps, probe[:, :, lvl].mean(0), color=color, lw=2, label=f"layer {lvl} vs level-{lvl} latents")
    ref = summary.get("references")
    if ref:
        for key, ls in (("level0", ":"), ("level1", "--")):
            ax.axhline(ref[1][key], color="C1", ls=ls, lw=1, label=f"level-1 probe of ideal {key} code")
    ax.set_ylim(-0.3, 1.02)
    ax.set_xlabel("step")
    ax.set_ylabel("class-held-out probe")
    ax.legend(fontsize=7)
    ax = axes[1]
    ax.axis("off")
    rows = []
    for lvl in range(len(authors["trained_true"]) if authors else 0):
        u, t = authors["untrained_true"][lvl], authors["trained_true"][lvl]
        rows.append([f"authors, L{lvl}", f"{u:.3f}", f"{t:.3f}", f"{t - u:+.3f}",
                     f"{authors['gain_shuffled'][lvl]:+.3f}"])
    for lvl in range(len(summary["trained_true"])):
        u, t = summary["untrained_true"][lvl], summary["trained_true"][lvl]
        us, ts = summary["untrained_shuffled"][lvl], summary["trained_shuffled"][lvl]
        rows.append([f"probe, L{lvl}", f"{u['probe']:.3f}", f"{t['probe']:.3f}", f"{t['probe'] - u['probe']:+.3f}",
                     f"{ts['probe'] - us['probe']:+.3f}"])
    tbl = ax.table(cellText=rows, colLabels=["measure", "untrained", "trained", "gain", "gain, shuffled"],
                   loc="center", cellLoc="center")
    tbl.auto_set_font_size(False)
    tbl.set_fontsize(8)
    tbl.scale(1.15, 1.6)
    ax.set_title("block l vs level-l latents (mean over seeds)", fontsize=9)
    ax = axes[2]
    hs = sorted(cooc)
    ax.plot(hs, [cooc[h][0] for h in hs], "o-")
    ax.set_xticks(hs, [{1: "1 (level-0)", 2: "2 (level-1)", 3: "3 (class)", 4: "4 (root)"}[h] for h in hs],
                  fontsize=7)
    ax.set_xlabel("height of lowest common ancestor")
    ax.set_ylabel("P(b in seq | a in seq)")
    ax.set_title("leaf co-occurrence vs ancestor height")
    return _save(fig, path)


def orthogonality(path, steps, curves: dict, baseline: float, dim: int) -> Path:
    """|cos| of relevant pairs (solid) vs random pairs (dashed) over training, with sqrt(2/(pi d))."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, (rel, rnd, title) in zip(axes, (("emb_cooc_abs_cos", "emb_random_abs_cos", "token embeddings"),
                                            ("qk_attended_abs_cos", "qk_random_abs_cos", "query vs key"))):
        ax.plot(steps, curves[rel], "o-", ms=3, label="co-occurring pairs" if "emb" in rel else "most-attended key")
        ax.plot(steps, curves[rnd], "s--", ms=3, label="random pairs" if "emb" in rel else "random earlier key")
        ax.axhline(baseline, color="gray", ls=":", label=rf"$\sqrt{{2/(\pi d)}}$ = {baseline:.4f}")
        ax.set_xscale("symlog", linthresh=10)
        ax.set_xlabel("minibatch")
        ax.set_ylabel("mean |cos|")
        ax.set_title(f"{title}, d = {dim}", fontsize=9)
        ax.legend(fontsize=7)
    return _save(fig, path)


def j4_authors_bars(path, authors: dict, title: str) -> Path:
    """The authors' J4 measure per layer: untrained / trained, true vs class-shuffled latents
    (bars: seed mean; dots: seeds)."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
    for lvl, ax in enumerate(axes):
        for i, (stage, tag) in enumerate((("untrained", "true"), ("trained", "true"),
                                          ("untrained", "shuffled"), ("trained", "shuffled"))):
            vals = [v[lvl] for v in authors[f"{stage}_{tag}_per_seed"]]
            ax.bar(i, sum(vals) / len(vals), color="C0" if tag == "true" else "C7", alpha=0.5 if stage == "untrained" else 1)
            ax.plot([i] * len(vals), vals, "k.", ms=4)
        ax.set_xticks(range(4), ["untrained\ntrue", "trained\ntrue", "untrained\nshuffled", "trained\nshuffled"], fontsize=7)
        ax.set_title(f"layer {lvl} vs level-{lvl} latents", fontsize=9)
    axes[0].set_ylabel("signed max-corr (authors' measure)")
    fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def seed_bars(path, groups: dict, title: str, ylabel: str) -> Path:
    """One bar per group (mean over seeds) with the seeds as dots: groups = {label: [value per seed]}."""
    fig, ax = plt.subplots(figsize=(1.3 * len(groups) + 2, 3.2))
    for i, (label, vals) in enumerate(groups.items()):
        vals = [v for v in vals if v == v]  # NaN: no pair of that kind moved
        ax.bar(i, sum(vals) / max(len(vals), 1), color=f"C{i}", alpha=0.7)
        ax.plot([i] * len(vals), vals, "k.", ms=5)
    ax.set_xticks(range(len(groups)), list(groups), fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    return _save(fig, path)


def mlp_rank(path, ranks: dict) -> Path:
    """Per-layer MLP stable rank of each model (solid) beside Gaussian weights of the same shapes (dashed)."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.3))
    for ax, name in zip(axes, ("w13", "w2")):
        for i, (model, r) in enumerate(ranks.items()):
            ax.plot(r[name], f"C{i}-o", ms=3, label=model)
            ax.plot(r[f"random_{name}"], f"C{i}--", lw=0.8, label=f"{model}: random, same shapes")
        ax.set_yscale("log")
        ax.set_xlabel("layer")
        ax.set_ylabel("stable rank")
        ax.set_title(f"MLP {name}", fontsize=9)
    axes[0].legend(fontsize=7)
    return _save(fig, path)
