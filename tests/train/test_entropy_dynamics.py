"""J3 probes: uniform attention gives the 2.63 reference; the experiment is registered and runs."""
import math

import torch

from attnlab.analysis.entropy_dynamics import UNIFORM_35, curve_summary, embedding_cosines, make_probe, stable_rank
from attnlab.model.llama import ModelConfig, Transformer


def test_uniform_attention_entropy_and_sink_mass():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=50, dim=16, n_layers=2, n_heads=1, n_kv_heads=1, hidden_dim=16))
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.wqkv.weight[:32].zero_()  # q = k = 0: uniform causal attention
    x = torch.randint(0, 50, (3, 35))
    row = make_probe(torch.arange(10))(model, [(x, x), (x, x)])
    assert abs(UNIFORM_35 - 2.632) < 1e-3
    for e in row["entropy_val"] + row["entropy_chunk"]:
        assert abs(e - UNIFORM_35) < 1e-4
    expected_sink = sum(1 / (t + 1) for t in range(1, 35)) / 34
    assert all(abs(s - expected_sink) < 1e-5 for s in row["sink_mass_val"])
    assert len(row["stable_rank"]) == 2 and all(1 <= r <= 16 for r in row["stable_rank"])


def test_stable_rank_and_cosines():
    assert math.isclose(stable_rank(torch.eye(5)), 5.0, rel_tol=1e-5)
    assert math.isclose(stable_rank(torch.ones(4, 3)), 1.0, rel_tol=1e-5)
    torch.manual_seed(0)
    c = embedding_cosines(torch.randn(400, 200))
    assert abs(c["embed_abs_cos"] - math.sqrt(2 / (math.pi * 200))) < 0.003


def test_curve_summary():
    s = curve_summary([0, 1, 2, 3], [2.6, 1.0, 0.8, 1.2])
    assert s["min"] == 0.8 and s["argmin_step"] == 2 and s["bounces_back"]
    assert not curve_summary([0, 1, 2], [2.6, 1.0, 0.9])["bounces_back"]


def test_registered_in_dynamics():
    from attnlab.dynamics.registry import EXPERIMENTS
    assert "attention-entropy" in EXPERIMENTS


def test_dynamics_cli_writes_metrics_and_figures(tmp_path, monkeypatch, capsys):
    import json

    from attnlab.analysis import entropy_dynamics
    from attnlab.cli import main

    monkeypatch.setitem(entropy_dynamics.SIZES, "quick", dict(layers=(2,), lrs=(1e-3,), sweep_layers=1, sweep_lrs=(),
                                                             steps=4, eval_every=2, eval_batches=1, vocab_size=200))
    assert main(["dynamics", "attention-entropy", "--quick", "--out", str(tmp_path), "--no-progress"]) == 0
    m = json.loads((tmp_path / "metrics.json").read_text())
    run = m["runs"]["2 layers, lr 0.001"]
    assert [r["step"] for r in run] == [0, 2, 4]
    assert len(run[-1]["entropy_val"]) == 2 and len(run[-1]["stable_rank"]) == 2
    assert all((tmp_path / f).stat().st_size > 5000 for f in m["figures"])
    assert "val loss" in capsys.readouterr().out
