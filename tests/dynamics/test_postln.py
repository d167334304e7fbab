"""The paper's post-LN model for J3 and the orthogonality probe: attention, causality, pairs, CLI."""
import math

import pytest
import torch

from attnlab.analysis.entropy_dynamics import UNIFORM_35
from attnlab.analysis.postln import PostLNConfig, PostLNLM, cooccurring_pairs, probe, sinusoidal


def _model(layers=2, dim=16):
    torch.manual_seed(0)
    return PostLNLM(PostLNConfig(vocab_size=50, dim=dim, hidden_dim=dim, n_layers=layers))


def test_uniform_attention_gives_the_reference_entropy_and_random_cosines():
    model = _model()
    with torch.no_grad():
        for layer in model.layers:
            layer.qkv.weight[:32].zero_()  # q = k = 0 (biases too): uniform causal attention
            layer.qkv.bias[:32].zero_()
    x = torch.randint(0, 50, (3, 35), generator=torch.Generator().manual_seed(0))
    row = probe(model, [(x, x)], torch.arange(50), torch.tensor([[1, 2], [3, 4]]))
    for e in row["entropy_val"] + row["entropy_chunk"]:
        assert abs(e - UNIFORM_35) < 1e-4
    assert model.training  # probe restores the mode it found


def test_causal_and_sinusoidal():
    model = _model().eval()
    x = torch.randint(0, 50, (2, 35), generator=torch.Generator().manual_seed(1))
    y = x.clone()
    y[:, 20:] = (y[:, 20:] + 1) % 50
    assert torch.allclose(model(x)[:, :20], model(y)[:, :20], atol=1e-5)
    assert not torch.allclose(model(x)[:, 20:], model(y)[:, 20:], atol=1e-3)
    pe = sinusoidal(35, 16)
    assert torch.allclose(pe[0, 1::2], torch.ones(8)) and abs(float(pe[3, 0]) - math.sin(3)) < 1e-6


def test_cooccurring_pairs_finds_adjacent_pairs():
    ids = torch.tensor([5, 7, 5, 7, 5, 7, 1, 2, 9, 9, 9])
    pairs = cooccurring_pairs(ids, torch.tensor([5, 7, 1, 9, 2]), n_pairs=2)
    assert sorted(pairs[0].tolist()) == [5, 7]  # 5 counts as (5,7) and (7,5) alike; 9-9 is excluded
    assert all(a != b for a, b in pairs.tolist())


def test_cli_rejects_unknown_arch(tmp_path):
    from attnlab.cli import main
    assert main(["dynamics", "attention-entropy", "--arch", "bogus", "--quick", "--out", str(tmp_path)]) == 2


@pytest.mark.slow
def test_postln_quick_run_drops_entropy(tmp_path):
    from attnlab.analysis.entropy_dynamics import run_attention_entropy
    m = run_attention_entropy(tmp_path, size="quick", progress=False, arch="postln")
    assert m["arch"] == "postln" and len(m["runs"]) == 2
