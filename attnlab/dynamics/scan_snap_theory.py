"""Numerical checks of the Scan and Snap theorems along a trained trajectory.

The paper states closed forms for how attention sharpens: the relative gain of
two distinct tokens grows as exp(2 (z_ml(t) - z_ml(0))) (its Theorem 3), and the
growth B_n(t) of the logits runs in two phases, fast (~ ln t, "scan") then very
slow (~ ln ln t, "snap", its Theorem 4). These functions take the recorded
logit trajectories of ``scan_snap.train_runs`` and put the measured quantities
next to the predicted ones, so the figures can show where the theory fits.
"""

from __future__ import annotations

import math

import torch

from .scan_snap import SequenceClasses

from attnlab.errors import AttnlabError


def relative_gain(data: SequenceClasses, z_distinct: torch.Tensor, cls: int = 0) -> dict:
    """Theorem 3 check for class ``cls``, top distinct token l vs every other distinct l'.

    z_distinct: (S, K, D) logits of one run. c_l ∝ P(l|n) exp(z_l), so the measured gain
    is r(t) = c_l^2 / c_l'^2 - 1; the prediction is r(0) * exp(2 (z_l(t) - z_l(0))).
    Returns 'measured', 'predicted' (S, D-1) and 'log_error' = |ln measured - ln predicted|.
    """
    p = data.probs[cls, data.distinct_tokens(cls)].float()  # (D,) increasing
    z = z_distinct[:, cls].float()  # (S, D)
    top = z.shape[1] - 1
    ratio_p = (p[top] / p[:top]) ** 2  # (D-1,)
    measured = ratio_p * torch.exp(2 * (z[:, top : top + 1] - z[:, :top])) - 1
    predicted = measured[0] * torch.exp(2 * (z[:, top : top + 1] - z[0, top]))
    keep = measured[0] > 1e-6  # equal-probability pairs have r(0) = 0
    log_err = (measured[:, keep].clamp_min(1e-12).log() - predicted[:, keep].log()).abs()
    return {"measured": measured[:, keep], "predicted": predicted[:, keep], "log_error": log_err}


def _fit_linear(x: torch.Tensor, y: torch.Tensor):
    """Least squares y ≈ a x + b; returns (a, b, rmse)."""
    A = torch.stack([x, torch.ones_like(x)], 1).double()
    sol = torch.linalg.lstsq(A, y.double().unsqueeze(1)).solution.flatten()
    rmse = float(((A @ sol - y.double()) ** 2).mean().sqrt())
    return float(sol[0]), float(sol[1]), rmse


def scan_curve(t: torch.Tensor, a: float, tau: float, b: float = 0.0) -> torch.Tensor:
    """Scan phase: B(t) = a ln(1 + t / tau) + b."""
    return a * torch.log1p(t / tau) + b


def snap_curve(t: torch.Tensor, a: float, tau: float, b: float) -> torch.Tensor:
    """Snap phase: B(t) = a ln ln(e + t / tau) + b."""
    return a * torch.log(torch.log(math.e + t / tau)) + b


def fit_two_phases(steps: torch.Tensor, B: torch.Tensor, taus=None) -> dict:
    """Fit the scan curve before a split step and the snap curve after it.

    steps, B: (S,) with B(0) = 0. The split and both time scales tau are chosen on a grid
    to minimise the total squared error. Returns the parameters, the split step and the
    per-phase RMSE, plus the RMSE of each curve fitted alone to the whole trajectory.
    """
    t = steps.double()
    B = B.double()
    taus = taus if taus is not None else torch.logspace(-1, 3, 41).tolist()

    def best(curve, tt, yy):
        out = None
        for tau in taus:
            x = curve(tt, 1.0, tau, 0.0)
            a, b, rmse = _fit_linear(x, yy)
            if out is None or rmse < out[3]:
                out = (a, tau, b, rmse)
        return out

    S = len(t)
    best_split = None
    for i in range(max(3, S // 20), S - 3, max(1, S // 60)):
        s1, s2 = best(scan_curve, t[: i + 1], B[: i + 1]), best(snap_curve, t[i:], B[i:])
        err = s1[3] ** 2 * (i + 1) + s2[3] ** 2 * (S - i)
        if best_split is None or err < best_split[0]:
            best_split = (err, i, s1, s2)
    _, i, s1, s2 = best_split
    whole_scan, whole_snap = best(scan_curve, t, B), best(snap_curve, t, B)
    return {"split_step": float(t[i]),
            "scan": {"a": s1[0], "tau": s1[1], "b": s1[2], "rmse": s1[3]},
            "snap": {"a": s2[0], "tau": s2[1], "b": s2[2], "rmse": s2[3]},
            "scan_only_rmse": whole_scan[3], "snap_only_rmse": whole_snap[3]}


def _fit_curve(curve, t, y, taus):
    """Best a * curve(t, 1, tau, 0) + b over the tau grid: (a, tau, b)."""
    out = None
    for tau in taus:
        a, b, rmse = _fit_linear(curve(t, 1.0, tau, 0.0), y)
        if out is None or rmse < out[3]:
            out = (a, tau, b, rmse)
    return out[:3]


def compare_late_fits(steps: torch.Tensor, B: torch.Tensor, start: float, train_frac: float = 0.25,
                      taus=None) -> dict:
    """ln t against ln ln t on the late phase t >= ``start``, by AIC and by extrapolation.

    Both curves have three parameters (a, tau, b). AIC = n ln(RSS / n) + 2k on the whole late
    window (lower is better; residuals of a recorded trajectory are correlated, so read the
    difference as a ranking, not a likelihood ratio). Held-out: fit on start <= t <= train_frac
    * t_max, report the RMSE on the later points (extrapolation in time, where the two laws part).
    """
    t, y = steps.double(), B.double()
    taus = taus if taus is not None else torch.logspace(-1, 4, 51).tolist()
    late = t >= start
    fit_part = late & (t <= train_frac * t.max())
    held = t > train_frac * t.max()
    if int(fit_part.sum()) < 5 or int(held.sum()) < 5:
        raise AttnlabError("too few recorded steps for the late-phase comparison")
    out = {"start": float(start), "train_until": float(train_frac * t.max())}
    for name, curve in (("ln", scan_curve), ("lnln", snap_curve)):
        a, tau, b = _fit_curve(curve, t[late], y[late], taus)
        rss = float(((curve(t[late], a, tau, b) - y[late]) ** 2).sum())
        n = int(late.sum())
        a2, tau2, b2 = _fit_curve(curve, t[fit_part], y[fit_part], taus)
        held_rmse = float(((curve(t[held], a2, tau2, b2) - y[held]) ** 2).mean().sqrt())
        out[name] = {"a": a, "tau": tau, "b": b, "rmse": math.sqrt(rss / n),
                     "aic": n * math.log(max(rss, 1e-300) / n) + 6, "heldout_rmse": held_rmse}
    out["aic_lnln_minus_ln"] = out["lnln"]["aic"] - out["ln"]["aic"]
    return out


def log_time_slope(steps: torch.Tensor, B: torch.Tensor, lo: float, hi: float) -> float:
    """Least-squares slope dB / d ln t over lo <= t <= hi (a ln t law gives a constant slope,
    ln ln t a slope falling like 1 / ln t)."""
    t = steps.double()
    sel = (t >= lo) & (t <= hi)
    if int(sel.sum()) < 3:
        raise AttnlabError(f"fewer than 3 recorded steps in [{lo}, {hi}]")
    return _fit_linear(t[sel].log(), B.double()[sel])[0]
