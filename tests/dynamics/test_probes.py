"""Superposition, bottom-up order and MLP stable rank: each measure on data whose answer is known,
then the quick runs end to end."""
import math

import torch

from attnlab.dynamics.hierarchy_probes import learned_steps, order_test, superposed_fraction
from attnlab.dynamics.mlp_rank import judge, model_ranks, stable_rank


def test_superposed_fraction_counts_units_encoding_two_unrelated_latents():
    # 8 inputs, latents A = {0,1}, B = {2,3} (disjoint leaves), C = {0,4} sharing leaf 0 with A
    ind = torch.zeros(8, 3)
    ind[[0, 1], 0] = 1
    ind[[2, 3], 1] = 1
    ind[[0, 4], 2] = 1
    leaves = torch.tensor([[1, 1, 0, 0], [0, 0, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    or_ab = ind[:, 0] + ind[:, 1]            # A or B: two unrelated patterns
    only_a = ind[:, 0] + 0.01 * torch.arange(8.0)
    a_or_c = (ind[:, 0] + ind[:, 2]).clamp(max=1)  # related patterns (shared leaf)
    dead = torch.zeros(8)
    h = torch.stack([or_ab, only_a, a_or_c, dead], 1)
    sup, enc = superposed_fraction(h, ind, leaves)
    assert math.isclose(sup, 1 / 3) and math.isclose(enc, 1.0)  # 3 live units, all encode; only A-or-B superposes


def test_learned_steps_and_order_test_find_a_planted_order():
    steps = list(range(0, 100, 5))
    t = torch.tensor(steps, dtype=torch.float32)[:, None]
    early, late = torch.sigmoid((t - 20) / 3), torch.sigmoid((t - 60) / 3)
    cos = torch.cat([early.expand(-1, 10), late.expand(-1, 10), 1e-4 * t.expand(-1, 2)], 1)
    when = learned_steps(steps, cos)
    assert torch.isnan(when[20:]).all()  # moved < 0.02: left out
    # half of the final change: just past the midpoint at 20 (start 0.0013 above 0), exactly at 60
    assert (when[:10] == 25).all() and (when[10:20] == 60).all()
    height = torch.tensor([1] * 10 + [3] * 10 + [2] * 2)
    r = order_test(when, height, torch.Generator().manual_seed(0))
    assert r["low_first"] and r["gap"] == 35 and r["permutation_p"] < 0.05
    r = order_test(when, torch.tensor([3] * 10 + [1] * 10 + [2] * 2), torch.Generator().manual_seed(0))
    assert not r["low_first"] and r["gap"] == -35


def test_stable_rank_and_the_random_control():
    assert math.isclose(stable_rank(torch.ones(6, 4)), 1.0, rel_tol=1e-5)
    assert math.isclose(stable_rank(torch.eye(5)), 5.0, rel_tol=1e-5)

    class Layer(torch.nn.Module):
        def __init__(self, w13):
            super().__init__()
            self.mlp = torch.nn.Module()
            self.mlp.w13, self.mlp.w2 = torch.nn.Linear(8, 32, bias=False), torch.nn.Linear(16, 8, bias=False)
            self.mlp.w13.weight.data = w13
    low = torch.randn(32, 1) @ torch.randn(1, 8) + 0.01 * torch.randn(32, 8)
    r = model_ranks([Layer(low), Layer(low), Layer(torch.randn(32, 8))], torch.Generator().manual_seed(0))
    j = judge(r)
    assert r["w13"][0] < 1.5 < r["random_w13"][0] and j["lower_below_upper"] and not j["below_random"]


def test_quick_runs(tmp_path):
    from attnlab.dynamics.hierarchy_probes import run_bottom_up, run_superposition
    torch.set_num_threads(1)
    m = run_superposition(tmp_path / "s", size="quick", progress=False)
    assert len(m["per_seed"]) == 2 and 0 <= m["control"]["mean"] < m["trained"]["mean"] <= 1  # measured 0.018 < 0.036
    m = run_bottom_up(tmp_path / "b", size="quick", progress=False)
    assert all(0 <= p["permutation_p"] <= 1 and 1 in p["mean_step_by_height"] for p in m["per_seed"])
    assert (tmp_path / "b" / "j4_bottom_up.png").exists() and (tmp_path / "s" / "metrics.json").exists()
