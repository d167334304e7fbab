"""Deja Vu on the embedded SmolLM2: threshold calibration on held-out text, the CLI end to end."""
import json

import pytest
import torch

from attnlab.data import corpus
from attnlab.sparsity.collect import collect
from attnlab.eval.dejavu import predictor_quality
from attnlab.sparsity.predictors import Predictors, gate_quantiles


@torch.inference_mode()
def test_threshold_calibration_hits_target_on_heldout(smollm2):
    """Calibrated on one play, the gate threshold skips the target share of neurons on another (within 2 points)."""
    calib = collect(smollm2, smollm2.encode(corpus("shakespeare:hamlet"))[:384], window=384, chunk=384)
    held = collect(smollm2, smollm2.encode(corpus("shakespeare:macbeth"))[:384], window=384, chunk=384)
    cfg = smollm2.cfg
    pred = Predictors(cfg.n_layers, cfg.dim, cfg.hidden_dim, cfg.n_heads, rank=4, head_rank=2,
                      gate_quantiles=gate_quantiles(smollm2, calib["mlp_in"]))
    for target in (0.5, 0.8):
        got = predictor_quality(smollm2, {"p": pred}, held, sparsity=target)["threshold_sparsity"]
        assert abs(sum(got) / len(got) - target) < 0.02
        assert max(abs(g - target) for g in got) < 0.06  # every layer close too


def test_dejavu_cli_end_to_end(tmp_path, capsys):
    from attnlab.cli import main
    out = str(tmp_path / "dv")
    assert main(["dejavu", "collect", "--out", out, "--tokens", "300", "--heldout-tokens", "128"]) == 0
    assert main(["dejavu", "train", "--out", out, "--rank", "8", "--epochs", "1", "--lookahead"]) == 0
    assert main(["dejavu", "eval", "--out", out, "--tokens", "96", "--sparsities", "0.5", "--heads", "6"]) == 0
    rows = json.loads((tmp_path / "dv" / "eval.json").read_text())["rows"]
    by = {(r["method"], r["sparsity"], r["head_sparsity"]): r["ppl"] for r in rows}
    dense = by[("dense", 0.0, 0.0)]
    assert by[("oracle", 0.5, 0.0)] < by[("threshold", 0.5, 0.0)]  # the oracle is the best a selector can do
    assert all(p > dense * 0.98 for p in by.values())
    assert (tmp_path / "dv" / "ppl_vs_sparsity.png").stat().st_size > 10_000
    assert (tmp_path / "dv" / "concentration.png").stat().st_size > 10_000
    assert main(["dejavu", "bench", "--out", out, "--depth", "8", "--steps", "3", "--repeats", "1",
                 "--sparsities", "0.5"]) == 0
    capsys.readouterr()
    assert main(["ppl", "--text", "shakespeare:hamlet", "--tokens", "64", "--json", "--sparsity", f"{out}:0.5"]) == 0
    sparse = json.loads(capsys.readouterr().out)["ppl"]
    assert main(["ppl", "--text", "shakespeare:hamlet", "--tokens", "64", "--json"]) == 0
    assert sparse > json.loads(capsys.readouterr().out)["ppl"]
    assert main(["ppl", "--sparsity", str(tmp_path / "nothing") + ":0.5", "--tokens", "8"]) == 2
    assert "dejavu train" in capsys.readouterr().err
