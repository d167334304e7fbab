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


# Rival laws for the late growth B(t): name -> (curve(t, *params), parameter names). tau is fitted
# through its log so it stays positive; "power" saturates at c, "logistic" is a sigmoid in ln t.
RIVALS = {
    "lnln": (lambda t, a, lt, b: a * torch.log(torch.log(math.e + t / math.exp(lt))) + b, ("a", "ln_tau", "b")),
    "ln": (lambda t, a, lt, b: a * torch.log1p(t / math.exp(lt)) + b, ("a", "ln_tau", "b")),
    "power": (lambda t, c, a, lt, p: c - a * (1 + t / math.exp(lt)) ** (-p), ("c", "a", "ln_tau", "p")),
    "logistic": (lambda t, b, a, lt, k: b + a * torch.sigmoid(k * (torch.log(t) - lt)), ("b", "a", "ln_tau", "k")),
}
DISCRIMINATED_DAIC = 10.0  # "decisive" on the usual AIC scale, after the autocorrelation correction


def _fit_rival(name: str, t: torch.Tensor, y: torch.Tensor):
    """Least-squares fit of RIVALS[name]: (params, standard errors, rss). A grid over the nonlinear
    parameters with the linear ones solved exactly, then scipy's curve_fit from the best grid point
    for all parameters and their covariance (errors assume independent residuals: optimistic)."""
    import numpy as np
    from scipy.optimize import curve_fit

    curve, _ = RIVALS[name]
    lts = torch.linspace(math.log(max(float(t.min()), 1.0)) - 4, math.log(float(t.max())) + 2, 31).tolist()
    shapes = {"power": [0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0],
              "logistic": [0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0]}.get(name, [None])
    best = None
    for lt in lts:
        for sh in shapes:
            if name in ("ln", "lnln"):
                x = curve(t, 1.0, lt, 0.0)
            elif name == "power":
                x = -(1 + t / math.exp(lt)) ** (-sh)
            else:
                x = torch.sigmoid(sh * (torch.log(t) - lt))
            a, b, rmse = _fit_linear(x, y)
            if best is None or rmse < best[0]:
                p0 = {"ln": (a, lt, b), "lnln": (a, lt, b), "power": (b, a, lt, sh), "logistic": (b, a, lt, sh)}[name]
                best = (rmse, p0)
    tn, yn = t.numpy(), y.numpy()
    f = lambda tt, *p: curve(torch.from_numpy(tt), *p).numpy()  # noqa: E731
    try:
        popt, pcov = curve_fit(f, tn, yn, p0=best[1], maxfev=20000)
        se = np.sqrt(np.clip(np.diag(pcov), 0, None))
    except (RuntimeError, ValueError):  # no convergence: keep the grid optimum, errors unknown
        popt, se = np.array(best[1]), np.full(len(best[1]), float("nan"))
    rss = float(((f(tn, *popt) - yn) ** 2).sum())
    return [float(v) for v in popt], [float(v) for v in se], rss


def compare_rival_fits(steps: torch.Tensor, B: torch.Tensor, start: float, train_frac: float = 0.25) -> dict:
    """ln ln t against ln t, a saturating power law and a logistic in ln t on t >= ``start``.

    Per law: parameters with standard errors, RMSE, AIC = n ln(RSS/n) + 2k, and the RMSE when fitted
    on start <= t <= train_frac * t_max and extrapolated to the later points. A recorded trajectory
    has strongly correlated residuals, so the AIC differences are also given rescaled to an
    effective sample size n_eff = n (1 - rho) / (1 + rho) (rho: lag-1 autocorrelation of the best
    law's residuals). 'discriminated' names the best law only if it beats every rival by
    >= DISCRIMINATED_DAIC in the rescaled AIC *and* extrapolates best; otherwise it is None and
    'indistinguishable' lists the laws within that margin.
    """
    t, y = steps.double(), B.double()
    late = t >= start
    fit_part, held = late & (t <= train_frac * t.max()), t > train_frac * t.max()
    if int(fit_part.sum()) < 8 or int(held.sum()) < 5:
        raise AttnlabError("too few recorded steps for the late-phase comparison")
    n, out = int(late.sum()), {"start": float(start), "train_until": float(train_frac * t.max()), "laws": {}}
    for name, (curve, pnames) in RIVALS.items():
        p, se, rss = _fit_rival(name, t[late], y[late])
        ph, _, _ = _fit_rival(name, t[fit_part], y[fit_part])
        held_rmse = float(((curve(t[held], *ph) - y[held]) ** 2).mean().sqrt())
        out["laws"][name] = {"params": dict(zip(pnames, p)), "stderr": dict(zip(pnames, se)),
                             "rmse": math.sqrt(rss / n), "aic": n * math.log(max(rss, 1e-300) / n) + 2 * len(p),
                             "heldout_rmse": held_rmse}
    laws = out["laws"]
    best = min(laws, key=lambda k: laws[k]["aic"])
    r = y[late] - RIVALS[best][0](t[late], *laws[best]["params"].values())
    rho = float(torch.corrcoef(torch.stack([r[:-1], r[1:]]))[0, 1])
    n_eff = max(2.0, n * (1 - rho) / (1 + rho))
    for k, v in laws.items():
        v["daic"] = v["aic"] - laws[best]["aic"]
        v["daic_effective"] = v["daic"] * n_eff / n
    close = sorted(k for k, v in laws.items() if v["daic_effective"] < DISCRIMINATED_DAIC)
    best_held = min(laws, key=lambda k: laws[k]["heldout_rmse"])
    out.update({"n": n, "residual_lag1_autocorr": rho, "n_effective": n_eff, "best_aic": best,
                "best_heldout": best_held, "indistinguishable": close,
                "discriminated": best if close == [best] and best_held == best else None})
    return out
