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


def test_j4_run_records_both_measures_with_their_controls(tmp_path):
    """The experiment wiring (quick size cut to 50 steps, seeds 0-2): the authors' measure and the
    probe, untrained and trained, true and shuffled latents, per seed, and the figure. What both
    show before any training is the tree itself: true latents far above shuffled ones, layer 0
    above layer 1 (Table 1's ordering, present at initialisation). The learning effect and its
    control are pinned in test_hierarchy.py."""
    m = run_hierarchy(tmp_path, seed=0, size="quick", progress=False, steps=50)
    A, S = m["authors_measure"], m["summary"]
    assert len(A["gain_true_per_seed"]) == 3 and (tmp_path / "j4_hierarchy.png").exists()
    assert A["untrained_true"][0] > 0.95 and A["untrained_true"][0] > A["untrained_true"][1] + 0.3
    assert A["untrained_true"][1] > A["untrained_shuffled"][1] + 0.05
    t, sh = S["untrained_true"], S["untrained_shuffled"]
    assert t[0]["probe"] > sh[0]["probe"] + 0.7 and t[1]["probe"] > sh[1]["probe"] + 0.15
    assert t[0]["probe"] > t[1]["probe"] + 0.5
