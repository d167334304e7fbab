"""What Deja Vu sparsity costs in quality on held-out text, and how good the predictors are.

Perplexity runs through chunked prefill, i.e. the plan's masked execution, which computes
exactly what the sparse decode step computes (tests/sparsity check the two against each
other). Rows are written after every evaluation, so an interrupted sweep resumes.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from attnlab.eval.perplexity import perplexity
from attnlab.io import save_figure, write_json
from attnlab.sparsity.plan import make_plan, methods
from attnlab.sparsity.predictors import Predictors, recall

SPARSITIES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
COLORS = {"oracle": "C0", "lowbit": "C1", "threshold": "C2", "predictor": "C3", "lookahead": "C4", "teal": "C5"}


def sweep(lm, predictors: dict[str, Predictors], ids, out: Path, sparsities=SPARSITIES,
          head_keep=(8, 6, 4), window: int = 1024, key: dict | None = None, progress=None, teal=None) -> list[dict]:
    """Perplexity of ids under every method and MLP sparsity, then under head sparsity (MLP dense).

    predictors: {"predictor": P, "lookahead": P2, ...} (the threshold method uses the first one's
    calibration); teal: a TEAL `Calibration` (its sparsity is every projection input's, model-wide, on
    every token: prefill sparse), up to its calibrated maximum. Returns rows {"method", "sparsity",
    "head_sparsity", "ppl", "nll", "tokens"}.
    """
    path = Path(out) / "eval.json"
    key = dict(key or {}, tokens=len(ids), window=window)
    old = json.loads(path.read_text()) if path.exists() else {}
    done = {_row_id(r): r for r in old.get("rows", [])} if old.get("key") == key else {}
    first = next(iter(predictors.values())) if predictors else None
    jobs = [("dense", None, 0.0, 0.0)]
    if teal is not None and lm.quant:  # the transposed copies' own cost: requantised along the output dimension
        jobs.append(("teal", teal, 0.0, 0.0))
    for s in sparsities:
        if s == 0:
            continue
        jobs.append(("oracle", None, s, 0.0))
        if not lm.quant:
            jobs.append(("lowbit", None, s, 0.0))
        if first is not None:
            jobs.append(("threshold", first, s, 0.0))
        jobs += [(name, p, s, 0.0) for name, p in predictors.items()]
        if teal is not None and s <= float(teal.effective.max(dim=1).values.min()) + 0.01:
            jobs.append(("teal", teal, s, 0.0))
    H = lm.cfg.n_heads
    for k in head_keep:
        if 0 < k < H:
            hs = (H - k) / H
            jobs.append(("oracle", None, 0.0, hs))
            jobs += [(name, p, 0.0, hs) for name, p in predictors.items()]
    rows = []
    for method, pred, s, hs in jobs:
        rid = (method, round(s, 4), round(hs, 4))
        if rid in done:
            rows.append(done[rid])
        else:
            plan = None
            if method != "dense":
                plan = make_plan(method if method in methods() else "predictor", s, hs, pred, sparse_exec=False)
                if method == "teal":
                    plan.prefill_sparse = True  # every token as a sparse decode step computes it
            r = perplexity(lm.with_sparsity(plan and plan.bind(lm.model)), ids, window=window)
            rows.append({"method": method, "sparsity": s, "head_sparsity": hs, "ppl": r["ppl"], "nll": r["nll"],
                         "tokens": r["tokens"]})
            write_json(path, {"key": key, "rows": rows + [r for i, r in done.items() if i not in
                                                          {_row_id(x) for x in rows}]})
        if progress is not None:
            progress(1)
    return rows


def _row_id(r: dict) -> tuple:
    return (r["method"], round(r["sparsity"], 4), round(r["head_sparsity"], 4))


@torch.inference_mode()
def predictor_quality(lm, predictors: dict[str, Predictors], held: dict[str, torch.Tensor],
                      sparsity: float = 0.5, head_sparsity: float = 4 / 9) -> dict:
    """On held-out activity (see `collect`): per layer, recall of the oracle's kept neurons (and heads)
    by each predictor, and the sparsity the threshold calibration really reaches."""
    res = {"sparsity": sparsity, "head_sparsity": head_sparsity, "recall": {}, "head_recall": {},
           "threshold_sparsity": []}
    L = held["act"].shape[0]
    for name, p in predictors.items():
        res["recall"][name] = [recall(p.mlp_scores(i, held["mlp_in"][i - 1 if p.lookahead and i > 0 else i]),
                                      held["act"][i].float(), 1 - sparsity) for i in range(L)]
        res["head_recall"][name] = [recall(p.head_scores(i, held["attn_in"][i]), held["head_norm"][i].float(),
                                           1 - head_sparsity) for i in range(L)]
    first = next(iter(predictors.values()))
    from attnlab.sparsity.collect import _weight
    lowbit = None
    if not lm.quant:
        lowbit = make_plan("lowbit", sparsity).bind(lm.model)
        res["recall"]["lowbit"] = []
    res["recall"]["threshold"] = []
    for i, layer in enumerate(lm.model.layers):
        ffn = layer.mlp
        x, act = held["mlp_in"][i].float(), held["act"][i].float()
        g = F.silu(x @ _weight(ffn.w13)[:ffn.hidden].T).abs()
        res["threshold_sparsity"].append(float((g <= first.threshold(i, sparsity)).float().mean()))
        res["recall"]["threshold"].append(recall(g, act, 1 - sparsity))  # the gate's ranking at the same k
        if lowbit is not None:
            res["recall"]["lowbit"].append(recall(lowbit.scores(i, ffn, x, x), act, 1 - sparsity))
    return res


def sparsity_at(rows: list[dict], method: str, max_rise: float = 0.05) -> float | None:
    """The largest MLP sparsity of `method` whose perplexity is within (1 + max_rise) of dense."""
    dense = next(r["ppl"] for r in rows if r["method"] == "dense")
    ok = [r["sparsity"] for r in rows if r["method"] == method and not r["head_sparsity"]
          and r["ppl"] <= dense * (1 + max_rise)]
    return max(ok) if ok else None


def plot(rows: list[dict], quality: dict | None, path: Path, title: str) -> str:
    """Perplexity against MLP sparsity per method (left) and predictor recall per layer (right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dense = next(r["ppl"] for r in rows if r["method"] == "dense")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ax = axes[0]
    for m in dict.fromkeys(r["method"] for r in rows if r["method"] != "dense"):
        pts = sorted((r["sparsity"], r["ppl"]) for r in rows if r["method"] == m and not r["head_sparsity"])
        if pts:
            ax.plot([0] + [p[0] for p in pts], [dense] + [p[1] for p in pts], marker="o", ms=3, label=m,
                    color=COLORS.get(m))
    ax.axhline(dense * 1.05, color="grey", ls=":", lw=1, label="dense + 5%")
    ax.set_yscale("log")
    ax.set_xlabel("sparsity (MLP neurons skipped per token; teal: every projection's input channels)")
    ax.set_ylabel("perplexity (log; lower is better)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax = axes[1]
    if not quality:
        ax.axis("off")  # no Deja Vu predictors evaluated: nothing to recall
    if quality:
        for name, r in quality["recall"].items():
            ax.plot(r, marker=".", label=f"{name}: neurons", color=COLORS.get(name))
        for name, r in quality["head_recall"].items():
            ax.plot(r, ls="--", label=f"{name}: heads", color=COLORS.get(name))
        ax.set_ylim(0, 1)
        ax.set_xlabel("layer")
        ax.set_ylabel(f"recall of the oracle's kept set (MLP sparsity {quality['sparsity']:.0%})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, path, dpi=110)


def plot_concentration(stats: dict, path: Path, title: str) -> str:
    """Per layer: relative error of the MLP (and attention) output rebuilt from the top fraction kept."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = stats["layers"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for k in stats["keep"]:
        axes[0].plot([r["mlp"][k] if k in r["mlp"] else r["mlp"][str(k)] for r in layers], marker=".",
                     label=f"top {k:.0%} neurons")
    H = stats["n_heads"]
    for k in sorted({int(x) for r in layers for x in r["heads"]}):
        axes[1].plot([r["heads"].get(k, r["heads"].get(str(k))) for r in layers], marker=".", label=f"top {k}/{H} heads")
    for ax, what in zip(axes, ("MLP output", "attention output")):
        ax.set_xlabel("layer")
        ax.set_ylabel(f"relative error of the {what}")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    return save_figure(fig, path, dpi=110)


def summary_line(rows: list[dict]) -> list[str]:
    dense = next(r["ppl"] for r in rows if r["method"] == "dense")
    out = [f"dense perplexity {dense:.3f}"]
    for m in dict.fromkeys(r["method"] for r in rows if r["method"] != "dense"):
        s = sparsity_at(rows, m)
        out.append(f"{m}: largest MLP sparsity within +5% perplexity: {'none' if s is None else f'{s:.0%}'}")
    return out


@torch.inference_mode()
def decode_quality(lm, plans: dict, ids, prompt: int = 512, progress=None) -> list[dict]:
    """Perplexity of ids[prompt:] fed one token at a time through the real decode step (TEAL's fused
    column-sparse ops), after ids[:prompt] is prefilled: dense prefill (the plan's default) against sparse
    prefill, per plan. plans: {name: Teal plan or None (dense)}. Rows {"variant", "prefill", "ppl", "tokens"}."""
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    rows = []
    for name, plan in plans.items():
        for prefill_sparse in ((False,) if plan is None else (False, True)):
            if plan is not None:
                plan.prefill_sparse = prefill_sparse
            engine = lm.with_sparsity(plan)
            cache = engine.new_cache(capacity=len(ids) + 1)
            logits = engine.prefill(ids[None, :prompt], cache)
            nll = 0.0
            for t in range(prompt, len(ids)):
                nll -= float(F.log_softmax(logits.float(), dim=-1)[0, ids[t]])
                logits = engine.forward(ids[None, t:t + 1], cache)[:, -1]
                if progress is not None:
                    progress(1)
            n = len(ids) - prompt
            rows.append({"variant": name, "prefill": "sparse" if prefill_sparse else "dense",
                         "ppl": float(torch.tensor(nll / n).exp()), "tokens": n})
    return rows
