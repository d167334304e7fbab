"""Each experiment's claims read from its stored result files (docs/figures/theory), for `verdicts`.

Every number in a verdict cell comes from here; a file that is not stored yet makes its claim
"pending" with the command that makes it.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from .verdicts import EFFECT, ORTH, Claim, Row, band_agrees, se_agrees

FIGS = Path(__file__).resolve().parents[2] / "docs" / "figures" / "theory"
LN_BAND = math.log(1.2)  # Theorem 3: a prediction within 20 %


def load(name: str, figs: Path = FIGS) -> dict | None:
    p = figs / name
    return json.loads(p.read_text()) if p.exists() else None


def _pending(name: str, command: str) -> Claim:
    return Claim(name, f"not stored; `{command}`", status="pending")


def s1(figs):
    m = load("s1_z_trajectories.json", figs)["metrics"]
    r1, r10, n = m["runs"]["ratio_1"], m["runs"]["ratio_10"], m["config"]["seeds"]
    common = (abs(r1["initial_loss"] - m["log_vocab"]) < 0.01 and r1["z_common_final_max"] < 0
              and r1["z_distinct_order_spearman"] >= 0.9 and r1["z_speed"]["freeze_step"] < m["config"]["iters"]
              and r10["z_speed"]["freeze_step"] < r1["z_speed"]["freeze_step"])
    start = r1["entropy"]["start"]
    per_seed = [a - start <= -EFFECT and b > a for a, b in zip(r1["final_entropy_per_seed"], r10["final_entropy_per_seed"])]
    paper = m["paper_fig4_loss"]
    sizes = [band_agrees([r1["loss_at"][k]], [paper[k]]) for k in ("2", "4", "6", "8", "10")]
    ev = (f"loss {r1['loss_at']['0']:.3f} -> {r1['loss_at']['2']:.3f} (it. 2) -> {r1['loss_at']['10']:.4f} (it. 10), "
          f"authors' log {paper['2']} / {paper['10']}; Spearman(z, P) {r1['z_distinct_order_spearman']:.2f}; entropy "
          f"{start:.3f} -> {r1['entropy']['final']:.3f} (ratio 1) vs {r10['entropy']['final']:.3f} (ratio 10), frozen by "
          f"it. {r1['z_speed']['freeze_step']} vs {r10['z_speed']['freeze_step']}; {n} seeds (`s1_z_trajectories.json`)")
    return [Claim("", ev, sum(per_seed) if common else 0, n, sizes)]


def s2(figs):
    m = load("s2_entropy_sweep.json", figs)["metrics"]
    a = load("s2_authors_cells.json", figs)
    q, zs, rs = m["config"]["queries"], m["config"]["lr_z"], m["config"]["ratios"]
    trends = [all(x > y for x, y in zip(bz, bz[1:])) and br[1] <= br[2] <= br[3]
              for bz, br in zip(m["entropy_by_lr_z"], m["entropy_by_ratio"])]
    if a is None:
        return [Claim("", "authors' cells not stored", sum(trends), len(trends), [False])]
    n, worst, sizes = m["config"]["seeds"], (0.0, None), []
    for i in range(len(q)):
        for j in range(len(zs)):
            for k in range(len(rs)):
                mo, so = m["final_entropy_mean"][i][j][k], m["final_entropy_std"][i][j][k]
                c = a["cells"][i][j][k]
                sizes.append(se_agrees(mo, so, n, c["mean"], c["std"], c["n"]))
                if abs(mo - c["mean"]) > worst[0]:
                    worst = (abs(mo - c["mean"]), (q[i], zs[j], rs[k], mo, c["mean"]))
    d, (wq, wz, wr, mo, ma) = worst
    ev = (f"falls with eta_Z and rises with eta_Y/eta_Z from 2 for {sum(trends)} of {len(trends)} query counts; "
          f"{sum(sizes)} of {len(sizes)} cells within 2 combined standard errors of the authors' pickle, largest "
          f"difference {d:.3f} ({wq} {'query' if wq == 1 else 'queries'}, eta_Z {wz:g}, ratio {wr}: {mo:.3f} vs {ma:.3f}); "
          f"{n} seeds per cell (`s2_entropy_sweep.json`, `s2_authors_cells.json`)")
    return [Claim("", ev, sum(trends), len(trends), sizes)]


S3_RUNS = (("s3_theorems_quick.json", "10x, 2k"), ("s3_theorems_x10_20k.json", "10x, 20k"), ("s3_theorems.json", "base, 1e5"))


def s3(figs):
    runs = [(load(f, figs)["metrics"], tag) for f, tag in S3_RUNS if load(f, figs)]
    e = [(r["theorem3_log_error"], tag) for r, tag in runs]
    thm3 = Claim("Thm 3", "median / p90 |ln measured - ln predicted| " + ", ".join(
        f"{x['median']:.3f} / {x['p90']:.3f} ({t})" for x, t in e) + f"; within 20 % = {LN_BAND:.3f}; 1 seed",
        sum(x["median"] <= LN_BAND for x, _ in e), len(e), [x["p90"] <= LN_BAND for x, _ in e], seeds=1)

    def early_share(r):
        t = r["config"]["iters"]
        key = max(int(k) for k in r["B_at"] if int(k) <= t / 100)
        return r["B_at"][str(key)] / r["B_final"]
    sh = [(early_share(r), tag) for r, tag in runs]
    phases = Claim("two phases", "B(t_max/100) / B(t_max) " + ", ".join(f"{x:.2f} ({t})" for x, t in sh)
                   + " (>= 0.5: half the growth in the first 1 %); 1 seed", sum(x >= 0.5 for x, _ in sh), len(sh), seeds=1)
    best = [(r["rival_fits"]["best_aic"], r["rival_fits"]["discriminated"], tag) for r, tag in runs]
    lnln = Claim("ln ln t law", "best of four laws by AIC: " + ", ".join(f"{b} ({t})" for b, _, t in best)
                 + "; discriminated in no run", sum(d == "lnln" for _, d, _ in best), len(best))
    return [thm3, phases, lnln]


def j1(figs):
    m = load("j1_invariant.json", figs)["metrics"]
    ok = [s["nc_min"] >= 0.95 and s["wta_class0"]["ratio"] >= 2 for s in m["per_seed"]]
    ev = (f"min NC(z, z_hat) {min(s['nc_min'] for s in m['per_seed']):.3f} over {len(ok)} seeds (>= 0.95 on "
          f"{sum(s['nc_min'] >= 0.95 for s in m['per_seed'])}); winner/runner-up "
          f"{min(s['wta_class0']['ratio'] for s in m['per_seed']):.1f}-{max(s['wta_class0']['ratio'] for s in m['per_seed']):.1f}"
          f" (`j1_invariant.json`)")
    return [Claim("", ev, sum(ok), len(ok))]


def j2(figs):
    m = load("j2_entropy.json", figs)["metrics"]
    if "draws" not in m:
        return [_pending("", "attnlab dynamics joma-nonlinear --threads 1")]
    d, a = m["draws"], m["authors_draw"]
    ok = [x["rebound"] >= EFFECT for x in d]
    if not m["linear"]["monotone_decreasing"]:
        ok = [False] * len(d)
    sizes = [band_agrees([x[k] for x in d], [a[k]]) for k in ("min", "argmin", "rebound")]
    o = m["over_draws"]
    ev = (f"{len(d)} mu draws: minimum {o['min']['min']:.3f}-{o['min']['max']:.3f} at steps {o['argmin']['min']}-"
          f"{o['argmin']['max']}, rebound {o['rebound']['min']:.3f}-{o['rebound']['max']:.3f} (U on {sum(ok)}); the authors' "
          f"draw {a['min']:.3f} at {a['argmin']}, rebound {a['rebound']:.3f}; linear monotone (`j2_entropy.json`)")
    return [Claim("", ev, sum(ok), len(ok), sizes)]


def _authors_j3(figs, nlayers: int, upto: int) -> list[dict]:
    """Per seed and layer of the authors' runs at lr 1e-4: minimum, its step, rebound by ``upto``."""
    a = load("j3_authors_curves.json", figs)
    out = []
    for c in a["curves"]:
        if int(c["nlayers"]) != nlayers or abs(float(c["lr"]) - 1e-4) > 1e-12:
            continue
        steps = [int(s) for s in c["steps"]]
        keep = [i for i, s in enumerate(steps) if s <= upto]
        for layer, ent in enumerate(c["entropy"]):
            v = [ent[i] for i in keep]
            i = min(range(len(v)), key=v.__getitem__)
            out.append({"layer": layer, "min": v[i], "argmin": steps[keep[i]], "rebound": v[-1] - v[i]})
    return out


J3_600 = ("j3_postln_entropy_val.json", "j3_postln_1layer_seeds12.json", "j3_postln_2layers_seeds12.json",
          "j3_postln_3layers_seeds12.json")
J3_DEEP = "j3_postln_5layers_6000.json"
J3_DEEP_CMD = ("attnlab dynamics attention-entropy --arch postln --layers 5 --steps 6000 --seeds 3 --threads 1 "
               "--out runs/j3_deep")


J3_LONG = ("j3_postln_2layers_long.json", "j3_postln_2layers_15000_seeds12.json")  # 2 layers to 15,000: seed 0; 1-2
J3_L1 = "j3_postln_1layer_10000.json"  # 1 layer to 10,000, 3 seeds
J3_L1_CMD = "attnlab dynamics attention-entropy --arch postln --layers 1 --steps 10000 --seeds 3 --threads 1"


def _summaries(files, figs) -> dict:
    out = {}
    for f in files:
        r = load(f, figs)
        if r:
            out.update({(f, label): v for label, v in r["metrics"]["summary"].items()})
    return out


def j3(figs):
    runs = _summaries(J3_600 + J3_LONG + (J3_L1,), figs)
    drops = [c["drop"] for s in runs.values() for c in s["entropy_val"]]
    drop = Claim("drop", f"every layer of {len(runs)} runs (1-5 layers, seeds 0-2, 600 minibatches and the long runs) "
                         f"falls by {min(drops):.2f}-{max(drops):.2f} nats", sum(all(c["drop"] >= EFFECT for c in s["entropy_val"]) for s in runs.values()), len(runs))
    longs = [s["entropy_val"] for s in _summaries(J3_LONG, figs).values()]
    n = len(longs)
    auth = _authors_j3(figs, 2, 15000)
    by = {layer: [x for x in auth if x["layer"] == layer] for layer in (0, 1)}
    rng = lambda xs, k: [x[k] for x in xs]  # noqa: E731
    seeds = f"{n} seed{'s' if n > 1 else ''}"
    at = lambda layer, k, f: ", ".join(f(c[layer][k]) for c in longs)  # noqa: E731
    mins = Claim("minimum step", f"layer 0 @{at(0, 'argmin_step', '{:,}'.format)}, layer 1 "
                 f"@{at(1, 'argmin_step', '{:,}'.format)}; authors @{min(rng(auth, 'argmin')):,}-"
                 f"{max(rng(auth, 'argmin')):,}; 2 layers, {seeds}, 15,000 minibatches",
                 sum(all(0 < c["argmin_step"] < 15000 for c in run) for run in longs), n,
                 [band_agrees(rng([run[i] for run in longs], "argmin_step"), rng(by[i], "argmin")) for i in (0, 1)])
    plus = lambda v: f"{v:+.2f}"  # noqa: E731
    top = Claim("top-layer rebound", f"{at(1, 'rebound', plus)} by 15,000 vs the authors' "
                f"+{min(rng(by[1], 'rebound')):.2f}-{max(rng(by[1], 'rebound')):.2f}; {seeds}",
                sum(run[1]["rebound"] >= EFFECT for run in longs), n,
                [band_agrees(rng([run[1] for run in longs], "rebound"), rng(by[1], "rebound"))])
    low = Claim("lowest-layer rebound", f"{at(0, 'rebound', plus)} by 15,000 vs the authors' "
                f"+{min(rng(by[0], 'rebound')):.2f}-{max(rng(by[0], 'rebound')):.2f}; {seeds}",
                sum(run[0]["rebound"] >= EFFECT for run in longs), n,
                [band_agrees(rng([run[0] for run in longs], "rebound"), rng(by[0], "rebound"))])
    short = [s["entropy_val"] for k, s in runs.items() if k[0] in J3_600 and len(s["entropy_val"]) >= 2]
    highest = [c[-1]["end"] > max(x["end"] for x in c[:-1]) for c in short]
    top_end = Claim("top layer highest at the end", "layer 1 vs layer 0 at 15,000: " + ", ".join(
                    f"{run[1]['end']:.3f} vs {run[0]['end']:.3f}" for run in longs) + f" ({seeds}; judged on runs of "
                    f"15,000+ only: at 600 minibatches the top layer is highest in {sum(highest)} of {len(short)} runs); "
                    "the authors: all runs", sum(run[1]["end"] > run[0]["end"] for run in longs), n)
    return [drop, mins, top, low, top_end, _j3_one_layer(figs)]


def _j3_one_layer(figs) -> Claim:
    ones = [s["entropy_val"][0] for s in _summaries((J3_L1,), figs).values()]
    if not ones:
        return _pending("1 layer", J3_L1_CMD)
    auth = _authors_j3(figs, 1, 10000)
    mins = ", ".join(f"{c['min']:.2f} @{c['argmin_step']:,}" for c in ones)
    ev = (f"minimum {mins}, rebound by 10,000 {', '.join(format(c['rebound'], '+.2f') for c in ones)}; the authors' "
          f"{min(x['min'] for x in auth):.2f}-{max(x['min'] for x in auth):.2f} @{min(x['argmin'] for x in auth):,}-"
          f"{max(x['argmin'] for x in auth):,}, rebound +{min(x['rebound'] for x in auth):.2f}-"
          f"{max(x['rebound'] for x in auth):.2f}; {len(ones)} seeds (`{J3_L1}`)")
    return Claim("1-layer rebound", ev, sum(c["rebound"] >= EFFECT for c in ones), len(ones),
                 [band_agrees([c["rebound"] for c in ones], [x["rebound"] for x in auth])])


def j3_deep(figs):
    r = load(J3_DEEP, figs)
    if r is None:
        return [_pending("", J3_DEEP_CMD)]
    summ = r["metrics"]["summary"]
    ok = [all(c["rebound"] < EFFECT for c in s["entropy_val"][:2]) and s["entropy_val"][-1]["rebound"] >= EFFECT
          for s in summ.values()]
    auth = _authors_j3(figs, 5, 6000)
    ev = (f"{sum(ok)} of {len(ok)} seeds: layers 0-1 rebound < {EFFECT} and the top layer >= {EFFECT} by 6,000 "
          f"(authors' top-layer rebound +{min(x['rebound'] for x in auth if x['layer'] == 4):.2f}-"
          f"{max(x['rebound'] for x in auth if x['layer'] == 4):.2f}) (`{J3_DEEP}`)")
    return [Claim("", ev, sum(ok), len(ok))]


def orth(figs):
    claims_runs, lines = [], []
    for r in filter(None, (load(f, figs) for f in J3_LONG + (J3_L1,))):
        m = r["metrics"]
        base = m["cos_baseline"]
        for label, log in m["runs"].items():
            if not isinstance(log, list):
                continue
            cooc = [x["emb_cooc_abs_cos"] for x in log]
            rnd = [x["emb_random_abs_cos"] for x in log]
            if abs(cooc[-1] - cooc[0]) < 0.1 * base:
                continue  # the embeddings did not move: the run does not test the claim
            over = next((x["step"] for x in log if x["emb_cooc_abs_cos"] > ORTH * base), None)
            claims_runs.append(max(cooc) <= ORTH * base)
            when = f"above {ORTH}x from minibatch {over:,}" if over is not None else f"never above {ORTH}x"
            run = label.replace("postln ", "").replace(", lr 0.0001", "")
            lines.append(f"{run}: co-occurring |cos| {cooc[0]:.3f} -> {cooc[-1]:.3f} over {log[-1]['step']:,} minibatches "
                         f"({cooc[-1] / base:.2f}x sqrt(2/(pi d)) = {base:.3f}; {when}), "
                         f"random pairs {rnd[0]:.3f} -> {rnd[-1]:.3f}")
    o = load("orthogonality.json", figs)
    if o:
        s, e = o["metrics"]["start"], o["metrics"]["end"]
        lines.append(f"not counted: d 768, 200 minibatches ({s['emb_cooc_abs_cos']:.4f} -> {e['emb_cooc_abs_cos']:.4f}: "
                     "the embeddings do not move)")
    if not claims_runs:
        return [Claim("", "; ".join(lines) or "no run moves the embeddings", status="not tested")]
    files = ", ".join(f"`{f}`" for f in J3_LONG + (J3_L1,) if load(f, figs))
    return [Claim("", "; ".join(lines) + f"; {len(claims_runs)} run{'s' if len(claims_runs) > 1 else ''} ({files})",
                  sum(claims_runs), len(claims_runs))]


def j4(figs):
    m = load("j4_hierarchy.json", figs)["metrics"]
    A = m["authors_measure"]
    tr, un = A["trained_true_per_seed"], A["untrained_true_per_seed"]
    pairs = lambda xs: ", ".join(f"{a:.3f} > {b:.3f}" for a, b in xs)  # noqa: E731
    order = Claim("trained layer 0 > layer 1", f"trained {pairs(tr)} ({len(tr)} seeds), inside Table 1's range for layer 1 "
                  f"(0.55-0.81); not produced by training: untrained already {pairs(un)}",
                  sum(a > b for a, b in tr), len(tr), [band_agrees([b for _, b in tr], [0.55, 0.81])])
    g, gs = A["gain_true_per_seed"], A["gain_shuffled_per_seed"]
    spec = Claim("hierarchy-specific learning", "layer-1 gain with true latents " + ", ".join(f"{x[1]:+.3f}" for x in g)
                 + " vs class-shuffled latents " + ", ".join(f"{x[1]:+.3f}" for x in gs) + " (control gains more); "
                 f"d {m['config']['dim']}, {m['config']['steps']:,} steps (`j4_hierarchy.json`)",
                 sum(a[1] > b[1] for a, b in zip(g, gs)), len(g))
    return [order, spec]


def _new(file: str, command: str, read):
    def claims(figs):
        r = load(file, figs)
        return [_pending("", command)] if r is None else read(r["metrics"], file)
    return claims


def _superposition(m, file):
    t, c = m["trained"], m["control"]
    u = [p["untrained"]["layer1"]["true"][0] for p in m["per_seed"]]
    ok = [a > b and a > v for a, b, v in zip(t["per_seed"], c["per_seed"], u)]
    return [Claim("", "block-1 units encoding two unrelated level-1 latents (corr >= 0.5): trained " + ", ".join(
        f"{x:.3f}" for x in t["per_seed"]) + ", shuffled-latent control " + ", ".join(f"{x:.3f}" for x in c["per_seed"])
        + ", untrained " + ", ".join(f"{x:.3f}" for x in u) + f"; above both controls on {sum(ok)} of {len(ok)} seeds "
        f"(`{file}`)", sum(ok), len(ok))]


def _bottom_up(m, file):
    ok = [x["low_first"] for x in m["per_seed"]]
    return [Claim("", f"mean step a pair is learned: same level-0 latent {m['mean_step']['low']:.1f}, same class only "
                      f"{m['mean_step']['high']:.1f}; low first (beating 95 % of height permutations) on {sum(ok)} of "
                      f"{len(ok)} seeds, permutation p " + ", ".join(f"{x['permutation_p']:.2f}" for x in m["per_seed"])
                  + f" (`{file}`)", sum(ok), len(ok))]


def _rank(m, file):
    models = m["models"]
    ok = [x["below_random"] for x in models.values()]
    ev = "; ".join(f"{k}: input projection {x['ratio_to_random'][0]:.2f}-{x['ratio_to_random'][1]:.2f}x the stable rank "
                   f"of random weights of its shape in every layer (lowest third of layers {x['lower']:.1f}, highest "
                   f"{x['upper']:.1f}, random {x['random']:.1f})" for k, x in models.items())
    skipped = f"; not on this machine: {', '.join(m['skipped'])}" if m.get("skipped") else ""
    return [Claim("", f"{ev}; {len(ok)} model{'s' if len(ok) > 1 else ''}{skipped} (`{file}`)", sum(ok), len(ok))]


ROWS = [
    ("S1", "Scan and Snap Fig. 4: common-token z go negative, distinct z grow in order of P(l|n); entropy drops then "
           "freezes; a faster decoder snaps earlier, less sparse", "log `scan_snap/figure_4.log`: 2 queries x 1 next "
           "token, M 34, zero init, SGD+mom., eta 1, batch 128, 100 iters", "same, 10 seeds, eta_Y/eta_Z 1 and 10", s1),
    ("S2", "Fig. 6: final entropy falls with eta_Z, rises with eta_Y/eta_Z from 2", "queries {1,3,5,10} x eta_Z "
           "{0.5..3} x ratio {1..10}, 10 seeds; cells in `figure_6_data.pkl`", "same", s2),
    ("S3", "Theorem 3: r(t) = r(0) exp(2 dz); Theorem 4: scan (ln t) then snap (ln ln t)", "none published (theorems)",
           "Fig. 4 data, zero init; 2,000 and 20,000 iters at 10x lr, 1e5 at base lr", s3),
    ("J1", "JoMA Figs. 2-3: NC(z, z_hat) ~ 1 throughout; one component of v wins (linear)", "20 tokens, K 20, d 30, "
           "T 0.5, SGD 0.1, 2000 steps", "same, 5 seeds", j1),
    ("J2", "Fig. 4: nonlinear entropy sparse then dense (U), linear monotone", "`joma/draw_figure_4.py`: one mu ~ "
           "U[1,4]^10 (seed 0), 5000 steps", "same update, 10 mu draws and the authors' draw", j2),
    ("J3", "Figs. 6, 8: entropy drops early in every layer, then bounces back; upper layers end higher",
           "stored curves: post-LN d 200, WikiText2, Adam 1e-4, 58,000 minibatches, 3 seeds", "same architecture on "
           "Shakespeare; 600 minibatches (1-5 layers, 1-3 seeds), 1 layer to 10,000 (3 seeds), 2 layers to 15,000 (3 seeds)",
           j3),
    ("J3 deep", "JoMA, deep models: lower layers' entropy keeps falling while top layers bounce back",
           "5 layers, 3 seeds, minima at 1,000-10,000 minibatches", "5 layers x 3 seeds to 6,000 minibatches", j3_deep),
    ("J4", "Table 1: layer-0 units track level-0 latents, layer 1 lower; the hierarchy is learned", "`decoder_only_hier.py`: "
           "d 1024, 3 post-LN layers, 10,000 Adam steps", "d 128, 2,000 steps, 3 seeds; true vs class-shuffled latents", j4),
    ("J4 order", "JoMA, hierarchy: learned bottom-up (pairs with a low common ancestor first)", "(claim, no run)",
           "latent-tree data, 6 seeds; step at which a leaf pair's block-0 similarity has made half its change",
           _new("j4_bottom_up.json", "attnlab dynamics bottom-up --threads 1", _bottom_up)),
    ("superp.", "JoMA, hierarchy: one MLP unit encodes several unrelated patterns (superposition)", "(claim, no run)",
           "latent-tree model, 6 seeds; units vs class-shuffled latents and the untrained model",
           _new("j4_superposition.json", "attnlab dynamics superposition --threads 1", _superposition)),
    ("rank", "JoMA, pretrained models: the lower layer of the MLP (input projection) has low stable rank",
           "pretrained checkpoints (OPT / Pythia)",
           "SmolLM2-135M and Qwen2.5-Coder-0.5B (their GGUF files) vs random weights of the same shapes",
           _new("mlp_rank.json", "attnlab dynamics mlp-rank --threads 1", _rank)),
    ("orth.", "talk: embeddings stay near-orthogonal (cos ~ 0.03) during training", "(talk)",
           "co-occurring vs random word pairs while J3 trains", orth),
]


def build_rows(figs: Path = FIGS) -> list[Row]:
    return [Row(exp, claim, setup, ours, read(figs)) for exp, claim, setup, ours, read in ROWS]
