"""The sink experiment: masked forward equals the network's forward, cases run end to end."""
import math

import pytest
import torch

from attnlab.analysis.sinks import band_mask, forward_masked, sink_experiment
from attnlab.eval.perplexity import token_nll
from attnlab.model.llama import ModelConfig, Transformer


def tiny():
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=40, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48)).eval()


def test_band_mask():
    m = band_mask(8, window=3, sinks=2)
    assert m[7].tolist() == [True, True, False, False, False, True, True, True]
    assert m[2].tolist() == [True, True, True] + [False] * 5
    assert band_mask(8, 3, 0)[7].tolist() == [False] * 5 + [True] * 3


@torch.no_grad()
def test_masked_forward_matches_network():
    model = tiny()
    ids = torch.randint(0, 40, (2, 30))
    ref = model(ids)
    torch.testing.assert_close(forward_masked(model, ids, None), ref, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(forward_masked(model, ids, band_mask(30, 30, 0)), ref, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_sink_experiment_end_to_end():
    model = tiny()
    ids = torch.randint(1, 40, (80,), generator=torch.Generator().manual_seed(0))
    r = sink_experiment(model, ids, sinks=4, window=16, replace_id=0)
    assert set(r["cases"]) == {"full", "keep", "drop", "replace"}
    start = 20
    nll = token_nll(model(ids[None])[:, start:-1], ids[None, start + 1:])
    assert r["cases"]["full"]["ppl"] == pytest.approx(math.exp(float(nll.mean())), rel=1e-5)
    assert r["cases"]["full"]["tokens"] == 80 - start - 1
    assert all(math.isfinite(c["ppl"]) for c in r["cases"].values())
    assert r["cases"]["keep"]["ppl"] != r["cases"]["drop"]["ppl"]
    with pytest.raises(ValueError):
        sink_experiment(model, ids[:20], sinks=4, window=16)


@pytest.mark.slow
def test_smollm2_sinks_matter(tmp_path):
    """On the embedded SmolLM2: dropping the first tokens explodes perplexity, replacing them does not."""
    from attnlab.cli import main

    assert main(["analyze", "--tokens", "48", "--sink-tokens", "160", "--window", "32", "--threads", "2",
                 "--out", str(tmp_path)]) == 0
    import json
    result = json.loads((tmp_path / "anatomy.json").read_text())
    assert result["command"].startswith("attnlab analyze --tokens 48") and len(result["commit"]) in (40, 7)
    r = result["sink_experiment"]["cases"]
    assert r["drop"]["ppl"] > 5 * r["keep"]["ppl"]
    assert r["replace"]["ppl"] < 2 * r["keep"]["ppl"]
    assert all((tmp_path / f).stat().st_size > 5000 for f in ("layers.png", "heads.png", "attention_map.png"))
