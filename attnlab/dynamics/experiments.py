"""The Scan and Snap experiments (S1, S2, S3) as runnable units, plus the shared runner.

Each experiment takes an output folder, a seed and a size ("quick" for seconds,
"full" for the paper-sized run), writes its figures and a ``metrics.json``, and
returns a short summary dict. The registry that the CLI builds on lives in
``registry.py``; the JoMA and hierarchy experiments are in ``experiments_joma.py``.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from . import plots
from .common import make_generator, spearman, write_json_atomic
from .scan_snap import SequenceClasses, YZRuns, train_runs
from .scan_snap_theory import (compare_late_fits, compare_rival_fits, fit_two_phases, log_time_slope, relative_gain, scan_curve,
                               snap_curve)

from attnlab.errors import AttnlabError

S1_SIZES = {"quick": dict(iters=100, seeds=2, batch=128, context=128),
            "full": dict(iters=100, seeds=10, batch=128, context=128)}
# The authors' Fig. 4 run (luckmatters ssl/real-dataset/scan_snap/figure_4.log: 2 queries x 1 next
# token, M = 34, zero init, SGD lr_z = lr_y = 1, momentum 0.9, batch 128, L = 128, seed 2): its
# logged training loss at these iterations, set beside ours in metrics.json and docs/theory.md.
PAPER_FIG4_LOSS = {0: 3.526, 2: 2.368, 4: 0.7335, 6: 0.1608, 8: 0.04443, 10: 0.01295, 20: 2.05e-4,
                   50: 2.58e-5, 98: 2.22e-5}
PAPER_FIG4_ITERS = (0, 2, 4, 6, 8, 10)  # attention rows shown in the paper's Fig. 4 (plus the final one)
S2_SIZES = {"quick": dict(queries=(1, 3), seeds=4, iters=100, batch=128, context=128),
            "full": dict(queries=(1, 3, 5, 10), seeds=10, iters=100, batch=128, context=128)}
S2_LR_Z = (0.5, 1.0, 2.0, 3.0)
S2_RATIOS = (1, 2, 5, 10)
# quick: 10x the learning rates, so 2000 steps cover both phases (the scan ends within ~100 steps)
S3_SIZES = {"quick": dict(iters=2000, batch=128, context=128, record_every=10, lr_scale=10.0),
            "full": dict(iters=100000, batch=128, context=128, record_every=10, lr_scale=1.0)}


def progress_bar(total: int, desc: str, enabled: bool):
    return tqdm(total=total, desc=desc, disable=not enabled, leave=False, dynamic_ncols=True)


def finish(out: Path, name: str, size: str, seed: int, metrics: dict, figures: list, t0: float) -> dict:
    """Write ``metrics.json`` atomically and return it (with figure paths and runtime)."""
    metrics = {"experiment": name, "size": size, "seed": seed,
               "runtime_s": round(time.perf_counter() - t0, 2),
               "figures": [str(Path(f).name) for f in figures], **metrics}
    write_json_atomic(Path(out) / "metrics.json", metrics)
    return metrics


def entropy_freeze(ent: torch.Tensor, tol: float = 0.1) -> dict:
    """Drop, late change and snap step of an entropy curve ent: (S,) recorded every step.

    The snap step is the first t after which the entropy never moves more than
    ``tol`` x (initial drop) away from H(t) again, i.e. when attention froze.
    """
    S = len(ent)
    drop = max(float(ent[0] - ent.min()), 1e-9)
    late = float((ent[S // 2 :] - ent[-1]).abs().max())
    hi = torch.flip(torch.cummax(torch.flip(ent, [0]), 0).values, [0])  # max over t' >= t
    lo = torch.flip(torch.cummin(torch.flip(ent, [0]), 0).values, [0])
    frozen = torch.maximum(hi - ent, ent - lo) <= tol * drop
    snap = int(frozen.float().argmax()) if frozen.any() else S
    return {"start": float(ent[0]), "min": float(ent.min()), "final": float(ent[-1]),
            "drop": drop, "late_change": late, "snap_step": snap}


def snap_timing(z: torch.Tensor, frac: float = 0.1) -> dict:
    """When the logits move fastest and when they freeze. z: (S, N) logits recorded every step.

    Returns 'peak_step' (largest per-step change ||z(t+1) - z(t)||) and 'freeze_step' (first
    step after the peak where the change falls below ``frac`` x the peak).
    """
    speed = (z[1:] - z[:-1]).norm(dim=-1)
    peak = int(speed.argmax())
    below = (speed[peak:] < frac * speed[peak]).nonzero()
    freeze = peak + int(below[0]) if len(below) else len(speed)
    return {"peak_step": peak, "freeze_step": freeze}


def run_scan_snap(out: Path, seed: int = 0, size: str = "full", progress: bool = True,
                  next_per_query: int = 1, iters: int = 0) -> dict:
    """S1: zero-init Y/Z, eta_Z = 1, eta_Y/eta_Z in {1, 10}.

    Default: the paper's Fig. 4 (2 queries x 1 next token, M = 34, 100 iterations);
    ``next_per_query=2`` (M = 56, e.g. 300 iterations) is the 2 x 2 variant.
    """
    t0 = time.perf_counter()
    cfg = dict(S1_SIZES[size])
    if iters < 0:
        raise AttnlabError(f"iters must be >= 0, got {iters}")
    cfg["iters"] = iters or cfg["iters"]
    data = SequenceClasses(num_queries=2, next_per_query=next_per_query)
    gen = make_generator(seed)
    ratios = (1.0, 10.0)
    n = cfg["seeds"]
    lr_y = torch.tensor(ratios).repeat_interleave(n)
    runs = YZRuns.create(len(ratios) * n, data.vocab_size, lr_y=lr_y, lr_z=1.0, zero_init=True, gen=gen)
    with progress_bar(cfg["iters"], "scan-snap", progress) as bar:
        tr = train_runs(data, runs, cfg["iters"], cfg["batch"], cfg["context"], gen, progress=bar)
    per_ratio, fig_runs = {}, {}
    for i, ratio in enumerate(ratios):
        sl = slice(i * n, (i + 1) * n)
        ent = tr["entropy"][:, sl].mean(1)
        zc, zd = tr["z_common"][-1, sl], tr["z_distinct"][-1, sl]  # (n, K, C), (n, K, D)
        order = spearman(zd, torch.arange(zd.shape[-1]).float().expand_as(zd))  # (n, K)
        loss = tr["loss"][:, sl]
        per_ratio[f"ratio_{ratio:g}"] = {
            "initial_loss": float(loss[0].mean()),
            "final_loss": float(loss[-1].mean()),
            "loss_at": {str(t): float(loss[t].mean()) for t in PAPER_FIG4_LOSS if t <= cfg["iters"]},
            "final_entropy_per_seed": tr["entropy"][-1, sl],
            "z_common_final_mean": float(zc.mean()),
            "z_common_final_max": float(zc.max()),
            "z_distinct_final_mean": float(zd.mean()),
            "z_distinct_order_spearman": float(order.mean()),
            "common_attention_mass": [float(tr["common_mass"][0, sl].mean()), float(tr["common_mass"][-1, sl].mean())],
            "entropy": entropy_freeze(ent),
            "z_speed": snap_timing(torch.cat([tr["z_common"][:, sl].flatten(2),
                                              tr["z_distinct"][:, sl].flatten(2)], 2).flatten(1))}
        fig_runs[rf"$\eta_Y/\eta_Z$={ratio:g}"] = {
            "z_common": tr["z_common"][:, i * n, 0], "z_distinct": tr["z_distinct"][:, i * n, 0],
            "entropy": ent, "loss": tr["loss"][:, sl].mean(1)}
    # attention of class 0 over [common | its distinct tokens], first run with eta_Y = eta_Z (paper Fig. 4)
    rows_at = [t for t in PAPER_FIG4_ITERS if t < cfg["iters"]] + [cfg["iters"]]
    C = data.num_common
    rows = []
    for t in rows_at:
        z = torch.cat([tr["z_common"][t, 0, 0], tr["z_distinct"][t, 0, 0]]).double()
        p = data.probs[0, : C + data.num_distinct] * torch.exp(z - z.max())
        rows.append(p / p.sum())
    figs = [plots.s1_trajectories(Path(out) / "s1_z_trajectories.png", tr["steps"], fig_runs),
            plots.s1_attention_rows(Path(out) / "s1_attention_rows.png", torch.stack(rows), rows_at, C)]
    metrics = {"vocab_size": data.vocab_size, "log_vocab": math.log(data.vocab_size),
               "config": {**cfg, "num_queries": 2, "next_per_query": next_per_query, "lr_z": 1.0,
                          "ratios": ratios, "momentum": 0.9},
               "paper_fig4_loss": {str(k): v for k, v in PAPER_FIG4_LOSS.items()},
               "attention_rows_class0": {"iters": rows_at, "c": torch.stack(rows)}, "runs": per_ratio}
    return finish(out, "scan-snap", size, seed, metrics, figs, t0)


def s2_cell(queries: int, iz: int, seed: int, size: str) -> dict:
    """One S2 cell: every (eta_Y/eta_Z, seed) run at one query count and eta_Z, batched; its own
    generator (seeded from the cell), so cells run anywhere in any order (attnlab.scale)."""
    cfg = S2_SIZES[size]
    nr, ns = len(S2_RATIOS), cfg["seeds"]
    gen = make_generator(seed * 1_000_003 + queries * 1_009 + iz)
    lr_z = torch.full((nr * ns,), S2_LR_Z[iz])
    lr_y = lr_z * torch.tensor(S2_RATIOS, dtype=torch.float32).repeat_interleave(ns)
    data = SequenceClasses(num_queries=queries, next_per_query=2)
    runs = YZRuns.create(nr * ns, data.vocab_size, lr_y=lr_y, lr_z=lr_z, zero_init=False, gen=gen)
    tr = train_runs(data, runs, cfg["iters"], cfg["batch"], cfg["context"], gen, record_every=cfg["iters"])
    return {"final": tr["entropy"][-1].view(nr, ns).tolist(), "initial": float(tr["entropy"][0].mean())}


def run_scan_snap_sweep(out: Path, seed: int = 0, size: str = "full", progress: bool = True,
                        backend: str = "local", local_nodes: int = 0) -> dict:
    """S2: final distinct-token entropy over queries x eta_Z x eta_Y/eta_Z x seeds; one cell per
    (queries, eta_Z), run by attnlab.scale (backend local or ray) and kept in out/cells."""
    from attnlab.scale import Cell, CellStore, make_backend, run_cells
    t0 = time.perf_counter()
    cfg = S2_SIZES[size]
    nz, nr, ns = len(S2_LR_Z), len(S2_RATIOS), cfg["seeds"]
    cells = [Cell("attnlab.dynamics.experiments:s2_cell", dict(queries=q, iz=iz, seed=seed, size=size),
                  ident={"config": cfg, "lr_z": S2_LR_Z, "ratios": S2_RATIOS}, readable=f"s2-q{q}-z{iz}")
             for q in cfg["queries"] for iz in range(nz)]
    runner = make_backend(backend, local_nodes=local_nodes)
    try:
        report = run_cells(cells, CellStore(Path(out) / "cells"), runner, desc="scan-snap-sweep",
                           threads=torch.get_num_threads())
    finally:
        runner.close()
    recs = [r for r in report.records]
    mean, std, initial, times = [], [], [], {}
    for i, q in enumerate(cfg["queries"]):
        final = torch.tensor([recs[i * nz + iz]["result"]["final"] for iz in range(nz)])  # (nz, nr, ns)
        mean.append(final.mean(-1))
        std.append(final.std(-1))
        initial.append(sum(recs[i * nz + iz]["result"]["initial"] for iz in range(nz)) / nz)
        times[str(q)] = round(sum(recs[i * nz + iz]["seconds"] for iz in range(nz)), 2)
    mean, std = torch.stack(mean), torch.stack(std)  # (Q, nz, nr)
    by_lr_z = mean.mean(2)  # (Q, nz) averaged over ratios
    by_ratio = mean.mean(1)  # (Q, nr) averaged over eta_Z
    figs = [plots.s2_sweep(Path(out) / "s2_entropy_sweep.png", mean, std, cfg["queries"], S2_LR_Z, S2_RATIOS)]
    metrics = {"config": {**cfg, "lr_z": S2_LR_Z, "ratios": S2_RATIOS, "runs_per_query": nz * nr * ns},
               "initial_entropy": initial, "final_entropy_mean": mean, "final_entropy_std": std,
               "entropy_by_lr_z": by_lr_z, "entropy_by_ratio": by_ratio,
               "seconds_per_query_count": times, "cells": {"computed": report.computed, "reused": report.skipped,
                                                           "backend": backend}}
    return finish(out, "scan-snap-sweep", size, seed, metrics, figs, t0)


def run_scan_snap_theorems(out: Path, seed: int = 0, size: str = "full", progress: bool = True,
                           iters: int = 0, lr_scale: float = 0.0) -> dict:
    """S3: Theorem 3 (relative gain) and Theorem 4 (scan/snap phases) along one slow, long run.

    The theorems describe gradient flow with a fast decoder, so this run uses small steps
    (eta_Z = 0.05, eta_Y = 0.5, still SGD with momentum 0.9) from zero init, on the Fig. 4 data
    (2 queries x 1 next token). Theorem 4 is judged on the late phase: ln t against ln ln t by AIC
    and held-out (later-time) error, and the slope dB/d ln t of the last decade against the
    decade before the split point (ln t: ratio 1; ln ln t: ratio ~ ln t_early / ln t_late); and
    against two more rivals (saturating power law, logistic in ln t) by AIC with parameter errors
    (``compare_rival_fits``). ``iters`` / ``lr_scale`` > 0 replace the size's values (longer runs).
    """
    t0 = time.perf_counter()
    if iters < 0 or lr_scale < 0:
        raise AttnlabError(f"--iters and --lr-scale must be >= 0 (0 = the size's default), got {iters}, {lr_scale}")
    cfg = dict(S3_SIZES[size])
    cfg.update({k: v for k, v in (("iters", iters), ("lr_scale", lr_scale)) if v})
    if cfg["iters"] < 500:
        raise AttnlabError(f"--iters must be >= 500 for the phase fits, got {cfg['iters']}")
    data = SequenceClasses(num_queries=2, next_per_query=1)
    gen = make_generator(seed)
    lr_y, lr_z = 0.5 * cfg["lr_scale"], 0.05 * cfg["lr_scale"]
    runs = YZRuns.create(1, data.vocab_size, lr_y=lr_y, lr_z=lr_z, zero_init=True, gen=gen)
    with progress_bar(cfg["iters"], "scan-snap-theorems", progress) as bar:
        tr = train_runs(data, runs, cfg["iters"], cfg["batch"], cfg["context"], gen,
                        record_every=cfg["record_every"], progress=bar)
    zd = tr["z_distinct"][:, 0]  # (S, K, D)
    gains = [relative_gain(data, zd, cls=k) for k in range(data.num_classes)]
    log_err = torch.cat([g["log_error"].flatten() for g in gains])
    B = (zd[:, :, -1] - zd[0, :, -1]).mean(1)  # growth of the top distinct logit, mean over classes
    steps = tr["steps"]
    fit = fit_two_phases(steps, B)
    T = cfg["iters"]
    late_fits = compare_late_fits(steps, B, start=T / 100)
    rivals = compare_rival_fits(steps, B, start=T / 100)
    early_win, late_win = (T / 100, T / 10), (T / 10, T)
    slope_early, slope_late = log_time_slope(steps, B, *early_win), log_time_slope(steps, B, *late_win)
    decades = [(10.0 ** k, 10.0 ** (k + 1)) for k in range(1, 6) if 10.0 ** (k + 1) <= T]
    slope_by_decade = {f"{lo:g}-{hi:g}": log_time_slope(steps, B, lo, hi) for lo, hi in decades}
    t = steps.double()
    curves = {"scan": scan_curve(t, fit["scan"]["a"], fit["scan"]["tau"], fit["scan"]["b"]),
              "snap": snap_curve(t, fit["snap"]["a"], fit["snap"]["tau"], fit["snap"]["b"])}
    figs = [plots.s3_theorems(Path(out) / "s3_theorems.png", steps, gains[0], B, fit, curves)]
    marks = sorted({10, 50, 100, 500, 1000, 2000, 5000, 10000, 20000, T})
    metrics = {"config": {**cfg, "lr_z": lr_z, "lr_y": lr_y, "momentum": 0.9, "num_queries": 2, "next_per_query": 1},
               "theorem3_log_error": {"median": float(log_err.median()), "p90": float(log_err.quantile(0.9)),
                                      "max": float(log_err.max())},
               "theorem4_fit": fit, "late_fits": late_fits, "rival_fits": rivals,
               "growth_slope": {"early_window": early_win, "late_window": late_win, "early": slope_early,
                                "late": slope_late, "late_over_early": slope_late / slope_early,
                                "lnln_prediction": math.log(math.sqrt(early_win[0] * early_win[1]))
                                / math.log(math.sqrt(late_win[0] * late_win[1])),
                                "by_decade": slope_by_decade},
               "B_final": float(B[-1]),
               "B_at": {str(int(s)): float(B[i]) for i, s in enumerate(steps) if int(s) in marks}}
    return finish(out, "scan-snap-theorems", size, seed, metrics, figs, t0)
