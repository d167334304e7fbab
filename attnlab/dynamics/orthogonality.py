"""Near-orthogonality during training (the talk's "cosine about 0.03"), measured on relevant pairs.

The Scan and Snap / JoMA analyses treat embeddings of different tokens as (nearly)
orthogonal. A mean |cos| over all frequent-word pairs is the random baseline
sqrt(2 / (pi d)) at any time and says nothing; here a 1-layer post-LN Transformer of
width 768 (the talk's width) is trained on Shakespeare and we track |cos| between
(a) embeddings of frequently co-occurring (adjacent) token pairs vs random pairs, and
(b) each query and the key it attends to most vs a random earlier key, against the
baseline. Registered as ``attnlab dynamics orthogonality``.
"""
from __future__ import annotations

import math
import time
from pathlib import Path

from .spec import Experiment

SIZES = {"quick": dict(dim=64, steps=10, lr=1e-4, eval_batches=1, vocab_size=1000),
         "full": dict(dim=768, steps=200, lr=1e-4, eval_batches=3, vocab_size=2000)}
MARKS = [1, 2, 5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 400, 500]


def run_orthogonality(out: Path, seed: int = 0, size: str = "full", progress: bool = True) -> dict:
    from attnlab.analysis.postln import train_postln
    from attnlab.io import progress as bar

    from . import plots
    from .experiments import finish

    t0 = time.perf_counter()
    cfg = SIZES[size]
    with bar(cfg["steps"], "orthogonality", unit="batch") as pb:
        pb.disable = not progress
        rows = train_postln(1, cfg["lr"], seed, cfg["steps"], [m for m in MARKS if m < cfg["steps"]],
                                dim=cfg["dim"], hidden_dim=cfg["dim"], vocab_size=cfg["vocab_size"],
                                eval_batches=cfg["eval_batches"], progress=pb)
    base = math.sqrt(2 / (math.pi * cfg["dim"]))
    keys = ("emb_cooc_abs_cos", "emb_random_abs_cos", "qk_attended_abs_cos", "qk_random_abs_cos")
    curves = {k: [r[k] if not isinstance(r[k], list) else r[k][0] for r in rows] for k in keys}
    steps = [r["step"] for r in rows]
    figs = [plots.orthogonality(Path(out) / "orthogonality.png", steps, curves, base, cfg["dim"])]
    metrics = {"config": {**cfg, "layers": 1, "arch": "postln"}, "baseline": base, "steps": steps, "curves": curves,
               "start": {k: v[0] for k, v in curves.items()}, "end": {k: v[-1] for k, v in curves.items()},
               "max_over_training": {k: max(v) for k, v in curves.items()},
               "val_loss": [rows[0]["val_loss"], rows[-1]["val_loss"]], "entropy": [rows[0]["entropy_val"][0],
                                                                                       rows[-1]["entropy_val"][0]]}
    return finish(out, "orthogonality", size, seed, metrics, figs, t0)


def _summary(m):
    s, e = m["start"], m["end"]
    return [f"random baseline sqrt(2/(pi d)) = {m['baseline']:.4f} (d = {m['config']['dim']})"] + [
        f"{k}: {s[k]:.4f} -> {e[k]:.4f} (max {m['max_over_training'][k]:.4f})" for k in s]


EXPERIMENT = Experiment("orthogonality", "|cos| of co-occurring tokens and attended query/key pairs over training, "
                        "1-layer post-LN at width 768, vs sqrt(2/(pi d))", run_orthogonality, _summary)
