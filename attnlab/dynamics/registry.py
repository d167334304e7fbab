"""Registry of runnable theory-lab experiments, keyed by their CLI name.

The CLI (``attnlab dynamics <name>``) builds one sub-command per entry. Imports run one way:
this module imports the experiment modules, which describe themselves with
``spec.Experiment`` (an ``EXPERIMENT`` attribute) and never import the registry back. Adding
an experiment is one ``register(...)`` call (or one module in ``_SELF_DESCRIBED``) with a
function ``run(out: Path, seed: int, size: str, progress: bool, **options) -> dict``.
"""

from __future__ import annotations

from . import attention_entropy, hierarchy_probes, mlp_rank, orthogonality
from .experiments import run_scan_snap, run_scan_snap_sweep, run_scan_snap_theorems
from .experiments_joma import run_hierarchy, run_joma_invariant, run_joma_nonlinear
from .spec import Experiment

__all__ = ["EXPERIMENTS", "Experiment", "register"]
_SELF_DESCRIBED = (attention_entropy, orthogonality)  # J3 and the orthogonality probe


EXPERIMENTS: dict[str, Experiment] = {}


def register(exp: Experiment) -> Experiment:
    """Add ``exp`` to the registry (later registrations with the same name replace earlier ones)."""
    EXPERIMENTS[exp.name] = exp
    return exp


def _s1(m):
    out = [f"vocabulary {m['vocab_size']}, ln M = {m['log_vocab']:.3f}"]
    for k, r in m["runs"].items():
        out.append(f"{k}: loss {r['initial_loss']:.3f} -> {r['final_loss']:.2e}; z common {r['z_common_final_mean']:+.3f}, "
                   f"z distinct {r['z_distinct_final_mean']:+.3f} (order rho {r['z_distinct_order_spearman']:.2f}); "
                   f"entropy {r['entropy']['start']:.3f} -> {r['entropy']['final']:.3f}, "
                   f"z fastest at step {r['z_speed']['peak_step']}, frozen by {r['z_speed']['freeze_step']}")
    return out


def _s2(m):
    out = [f"initial entropy {', '.join(f'{e:.3f}' for e in m['initial_entropy'])}"]
    for q, by_z, by_r in zip(m["config"]["queries"], m["entropy_by_lr_z"], m["entropy_by_ratio"]):
        out.append(f"{q} queries: by eta_Z {[round(float(x), 3) for x in by_z]}, by eta_Y/eta_Z {[round(float(x), 3) for x in by_r]}")
    return out


def _s3(m):
    e, f, r = m["theorem3_log_error"], m["theorem4_fit"], m["rival_fits"]
    return [f"Theorem 3 |ln measured - ln predicted|: median {e['median']:.3f}, p90 {e['p90']:.3f}",
            f"Theorem 4: split at step {f['split_step']:.0f}, scan rmse {f['scan']['rmse']:.4f}, snap rmse {f['snap']['rmse']:.4f}"
            f" (single-curve rmse: scan {f['scan_only_rmse']:.4f}, snap {f['snap_only_rmse']:.4f})",
            f"late phase t >= {m['late_fits']['start']:.0f}: AIC(ln ln) - AIC(ln) = {m['late_fits']['aic_lnln_minus_ln']:.1f}; "
            f"held-out rmse ln {m['late_fits']['ln']['heldout_rmse']:.4f}, ln ln {m['late_fits']['lnln']['heldout_rmse']:.4f}",
            f"dB/d ln t: early {m['growth_slope']['early']:.4f}, late {m['growth_slope']['late']:.4f}, "
            f"ratio {m['growth_slope']['late_over_early']:.3f} (ln ln t predicts ~{m['growth_slope']['lnln_prediction']:.2f}, ln t 1)",
            "rival laws (t >= {:.0f}; dAIC rescaled to n_eff {:.0f} of {}): ".format(
                r["start"], r["n_effective"], r["n"]) + "; ".join(
                f"{k} rmse {v['rmse']:.5f} dAIC_eff {v['daic_effective']:.1f} held-out {v['heldout_rmse']:.4f}"
                for k, v in r["laws"].items()),
            f"discriminated: {r['discriminated'] or 'no (within margin: ' + ', '.join(r['indistinguishable']) + ')'}"]


def _j1(m):
    w = m["per_seed"][0]["wta_class0"]
    return [f"min NC(z, z_hat) over steps and seeds: {m['nc_min_over_seeds']:.4f}",
            f"class 0: winner token {w['winner']} v={w['winner_value']:.2f}, runner-up v={w['runner_up_value']:.2f} "
            f"(ratio {w['ratio']:.1f}; min over seeds {m['wta_ratio_min_over_seeds']:.1f})"]


def _j2(m):
    n, li = m["nonlinear"], m["linear"]
    return [f"nonlinear entropy {n['start']:.3f} -> min {n['min']:.3f} @ {n['argmin']} -> {n['end']:.3f} (rebound {n['rebound']:.3f})",
            f"linear entropy {li['start']:.3f} -> {li['end']:.3f}, monotone decreasing: {li['monotone_decreasing']}",
            "over {} mu draws: min {:.3f}-{:.3f} at steps {}-{}, rebound {:.3f}-{:.3f}".format(
                len(m["draws"]), *(m["over_draws"][k][e] for k in ("min", "argmin", "rebound") for e in ("min", "max"))),
            "authors' draw (their seed 0): min {min:.3f} @ {argmin}, rebound {rebound:.3f}".format(**m["authors_draw"])]


def _j4(m):
    A = m["authors_measure"]
    out = [f"authors' measure (signed max-corr, {m['config']['samples']} samples), layer {lvl}: "
           f"{A['untrained_true'][lvl]:.3f} -> {A['trained_true'][lvl]:.3f} (gain {A['gain_true'][lvl]:+.3f}; "
           f"class-shuffled latents gain {A['gain_shuffled'][lvl]:+.3f})" for lvl in range(len(A["trained_true"]))]
    out.append(f"layer-1 gain per seed: true {', '.join(f'{g[1]:+.3f}' for g in A['gain_true_per_seed'])}; "
               f"shuffled {', '.join(f'{g[1]:+.3f}' for g in A['gain_shuffled_per_seed'])}; "
               f"accuracy {', '.join(f'{a:.2f}' for a in m['accuracy'])}")
    if "summary" not in m:  # random-activation variant: no probe
        return out
    S, c = m["summary"], m["cooccurrence_by_height"]
    for lvl in range(len(S["trained_true"])):
        u, t, g, gs = S["untrained_true"][lvl], S["trained_true"][lvl], S["gain_true"][lvl], S["gain_shuffled"][lvl]
        out.append(f"layer {lvl} probe {u['probe']:.3f} -> {t['probe']:.3f} (gain {g['probe']:+.3f}, shuffled "
                   f"{gs['probe']:+.3f}); 20-sequence |corr| max {u['max_corr']:.3f} -> {t['max_corr']:.3f}")
    r = S["references"][1]
    out.append(f"layer-1 probe references: bag of leaves {r['leaves']:.3f}, level-0 code {r['level0']:.3f}, "
               f"level-1 code {r['level1']:.3f}")
    out.append("co-occurrence by LCA height: " + ", ".join(f"{h}: {v['mean']:.2f}" for h, v in c.items()))
    return out


for _exp in (
    Experiment("scan-snap", "S1: z of common vs distinct tokens, entropy snap (Scan and Snap Fig. 4)", run_scan_snap, _s1,
               options=(("next_per_query", int, 1, "next tokens per query (1 = paper Fig. 4, 2 = the 2 x 2 variant)"),
                        ("iters", int, 0, "iterations (0 = the size's default: 100, as in Fig. 4)"))),
    Experiment("scan-snap-sweep", "S2: distinct-token entropy over eta_Z x eta_Y/eta_Z (Fig. 6)", run_scan_snap_sweep, _s2,
               options=(("backend", str, "local", "local (serial) or ray: one cell per query count x eta_Z"),
                        ("local_nodes", int, 0, "with --backend ray: a local cluster of N one-CPU nodes"))),
    Experiment("scan-snap-theorems", "S3: Theorem 3 relative gain and Theorem 4 scan/snap phases", run_scan_snap_theorems, _s3,
               options=(("iters", int, 0, "iterations (0 = the size's default: 100000 full, 2000 quick)"),
                        ("lr_scale", float, 0.0, "multiplier of eta_Z 0.05 / eta_Y 0.5 (0 = default: 1 full, 10 quick)"))),
    Experiment("joma-invariant", "J1: JoMA invariant NC(z, z_hat) and linear winner-take-all (Figs. 2-3)", run_joma_invariant, _j1),
    Experiment("joma-nonlinear", "J2: nonlinear sparse-then-dense entropy vs linear (Fig. 4)", run_joma_nonlinear, _j2),
    Experiment("hierarchy", "J4: latent-tree data, per-layer hidden/latent correlation (Table 1)", run_hierarchy, _j4,
               options=(("dim", int, 0, "model width (0 = the size's default: 128 full, 32 quick; the authors' 1024)"),
                        ("steps", int, 0, "Adam steps (0 = the size's default: 2000 full, 300 quick; the authors' 10000)"),
                        ("lr", float, 0.0, "Adam learning rate (0 = the size's default: 1e-4 full, 1e-3 quick)"),
                        ("child_prob", float, 1.0, "probability that an active latent turns each child on "
                                                   "(1 = the authors' generator; < 1 = random activation)"))),
):
    register(_exp)
for _mod in _SELF_DESCRIBED:
    register(_mod.EXPERIMENT)
for _exp in (hierarchy_probes.SUPERPOSITION, hierarchy_probes.BOTTOM_UP, mlp_rank.EXPERIMENT):
    register(_exp)
