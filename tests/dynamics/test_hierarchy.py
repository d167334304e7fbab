"""J4 (JoMA Table 1) building blocks: the exact fast paths and the probe's scale."""

import torch
import torch.nn.functional as F

from attnlab.dynamics.common import make_generator
from attnlab.dynamics.hierarchy import (HierConfig, HierTransformer, LatentTree, batch_loss, probe_references,
                                        probe_score)


def _model(seed: int, dim: int = 32) -> HierTransformer:
    torch.manual_seed(seed)
    return HierTransformer(HierConfig(vocab=100, num_classes=20, dim=dim, mlp_hidden=400))


def test_compact_sequences_give_the_same_logits_and_pooled_activations():
    tree = LatentTree(make_generator(0))
    model = _model(0)
    seqs, copies = tree.compact_sequences()
    assert seqs.shape == (20, 9) and copies == 22 and (seqs[:, 0] == tree.pad).all()
    with torch.no_grad():
        lf, hf = model(tree.sequences)
        lc, hc = model(seqs, copies)
        l1, _ = model(seqs)  # without the weight of the folded pads the logits differ
    assert (lf - lc).abs().max() < 1e-4
    assert all((a.amax(1) - b.amax(1)).abs().max() < 1e-4 for a, b in zip(hf, hc))
    assert (lf - l1).abs().max() > 1e-2


def test_batch_loss_equals_the_plain_batch_loss_and_gradient():
    tree = LatentTree(make_generator(1))
    y = torch.randint(0, 20, (128,), generator=make_generator(2))
    model = _model(1)
    plain = F.cross_entropy(model(tree.sequences[y])[0], y)
    g_plain = torch.autograd.grad(plain, model.embed.weight)[0]
    fast = batch_loss(model, tree, y)
    g_fast = torch.autograd.grad(fast, model.embed.weight)[0]
    assert abs(plain.item() - fast.item()) < 1e-5
    assert (g_plain - g_fast).abs().max() < 1e-5 * max(1.0, float(g_plain.abs().max()))


def test_probe_scale_ideal_codes_and_shuffled_control():
    """Leave-one-class-out probe of level-1 latents: a perfect level-1 code scores far above a
    perfect level-0 code, which scores above the raw bag of leaves (seed 0: 0.683 / 0.323 / 0.175);
    against class-shuffled latents even the perfect code scores near zero."""
    tree = LatentTree(make_generator(0))
    ref = probe_references(tree)
    assert abs(ref[1]["level1"] - 0.683) < 0.01 and abs(ref[1]["level0"] - 0.323) < 0.01
    assert abs(ref[1]["leaves"] - 0.175) < 0.01
    assert ref[0]["level0"] > ref[0]["leaves"] > ref[1]["level0"]
    shuffled = tree.latent_indicators(torch.randperm(20, generator=make_generator(3)), 1)
    assert probe_score(tree.active[2].float(), shuffled) < 0.2


def test_hierarchy_cli_rejects_a_negative_size(tmp_path, capsys):
    from attnlab.cli import main
    assert main(["dynamics", "hierarchy", "--dim", "-1", "--quick", "--out", str(tmp_path)]) == 2
    assert "dim" in capsys.readouterr().err
