"""J1, J2 (JoMA) and J4 (hierarchy) must-shows at --quick size."""

import torch

from attnlab.dynamics.common import centred_cosine, make_generator
from attnlab.dynamics.experiments_joma import run_hierarchy, run_joma_invariant, run_joma_nonlinear
from attnlab.dynamics.hierarchy import LatentTree, cooccurrence_by_height


def test_centred_cosine_ignores_offsets():
    a = torch.randn(20, generator=make_generator(0))
    assert abs(float(centred_cosine(a, 3 * a + 5)) - 1) < 1e-5
    assert abs(float(centred_cosine(a, -a)) + 1) < 1e-5


def test_j1_invariant_and_winner_take_all(tmp_path):
    """Quick size: seeds 0-2. Minimum NC(z, z_hat) over steps, median over seeds (measured 0.951 on
    seed 0, >= 0.994 on the others), and winner-take-all of v_0 on every seed."""
    m = run_joma_invariant(tmp_path, seed=0, size="quick", progress=False)
    assert m["nc_min_median_over_seeds"] >= 0.98
    assert m["nc_min_over_seeds"] >= 0.94
    for s in m["per_seed"]:
        assert s["attn_entropy"][1] < s["attn_entropy"][0] - 1.5  # 2.75 -> 0.65-0.68
        w = s["wta_class0"]
        assert w["ratio"] >= 2.5  # one component of v_0 dominates the rest (2.8-5.2 measured)
        assert w["winner_growth_second_half"] > 3 * abs(w["runner_up_growth_second_half"])
    assert (tmp_path / "j1_invariant.png").exists()


def test_j2_u_shape_vs_monotone(tmp_path):
    m = run_joma_nonlinear(tmp_path, seed=0, size="quick", progress=False)
    n, lin = m["nonlinear"], m["linear"]
    assert abs(n["start"] - m["ln10"]) < 1e-6
    # measured (seed 0): minimum 0.897 at step 633, end 1.417 -> rebound 0.520
    assert abs(n["min"] - 0.897) < 0.01 and abs(n["argmin"] - 633) <= 10
    assert abs(n["rebound"] - 0.520) < 0.02
    assert lin["monotone_decreasing"] and lin["end"] < 0.05


def test_cooccurrence_decays_with_ancestor_height():
    co = cooccurrence_by_height(LatentTree(make_generator(0)))
    means = [co[h][0] for h in sorted(co)]
    assert abs(means[0] - 1) < 1e-6
    assert all(a > b for a, b in zip(means, means[1:]))


def test_j4_probe_trained_minus_untrained(tmp_path):
    """Quick size, seeds 0-2 (d = 32, MLP 400, 300 Adam steps at lr 1e-3), leave-one-class-out probe.

    Measured: layer 0 / level-0 latents 0.888 -> 0.879, layer 1 / level-1 0.266 -> 0.183 (gain per
    seed -0.207, +0.001, -0.044), shuffled latents -0.16 / -0.12. The untrained layer 1 already
    scores what a perfect level-0 code scores (0.27 vs 0.30), far below a perfect level-1 code (0.66).
    The full runs (d = 256, 5000 steps at the authors' lr 1e-4; docs/theory.md) show no layer-1 gain
    either, so the issue's "gain in layer 1 > 0 over seeds" is NOT asserted: this pins what we
    measure: the probe sees the tree (true >> shuffled), layer 0 > layer 1, the task is learnt,
    untrained layer 1 sits at the level-0 reference, and the layer-1 gain stays at or below zero."""
    m = run_hierarchy(tmp_path, seed=0, size="quick", progress=False)
    S = m["summary"]
    for stage in ("untrained", "trained"):
        true, shuf = S[f"{stage}_true"], S[f"{stage}_shuffled"]
        assert true[0]["probe"] > shuf[0]["probe"] + 0.7 and true[1]["probe"] > shuf[1]["probe"] + 0.15
        assert true[0]["probe"] > true[1]["probe"] + 0.5  # the ordering of JoMA's Table 1
    assert min(m["accuracy"]) > 0.9  # 0.95, 0.95, 1.00 (two classes share a leaf set in seeds 0, 1)
    ref = S["references"][1]
    assert ref["level1"] > ref["level0"] + 0.25 > ref["leaves"] + 0.25
    assert abs(S["untrained_true"][1]["probe"] - ref["level0"]) < 0.08
    assert -0.15 < S["gain_true"][1]["probe"] < 0.03
    assert S["trained_true"][1]["probe"] < ref["level0"]  # no step towards a level-1 code
