"""benchmarks/pi_repro.py on its tiny configuration: every arm trains/rescales and is scored,
fine-tuned arms carry their scaling, scores are cached (a rerun trains nothing), and the
word-level passkey prompt hides its key where asked and fits its length."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pi_repro():
    spec = importlib.util.spec_from_file_location("pi_repro", ROOT / "benchmarks" / "pi_repro.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def run(pi_repro, tmp_path_factory):
    out = tmp_path_factory.mktemp("pi")
    torch.set_num_threads(1)
    assert pi_repro.main(["--config", "tiny", "--out", str(out), "--figure", str(out / "fig.png")]) == 0
    return out


def test_all_arms_scored_with_their_scaling(pi_repro, run):
    res = json.loads((run / "results.json").read_text())
    p = res["config"]
    assert set(res["arms"]) == set(pi_repro.ARMS)
    windows = {str(p["context"] * m) for m in (1, 2, p["factor"])}
    for arm, row in res["arms"].items():
        assert set(row["ppl"]) == windows and all(v > 1 for v in row["ppl"].values())
        kind = (row["scaling"] or {}).get("rope_type")
        assert kind == {"pi": "linear", "ntk": "ntk", "yarn": "yarn", "none": None}[pi_repro.ARMS[arm][0]], arm
    # the fine-tune trained at 4C for ft_steps steps, from the base model
    state = json.loads((run / "pi+ft" / "latest.json").read_text())
    assert state["step"] == p["ft_steps"]
    assert res["arms"]["pi"]["ppl"] != res["arms"]["pi+ft"]["ppl"]
    # scaling changes the scores; factor-4 linear without tuning differs from the base
    assert res["arms"]["pi"]["ppl"] != res["arms"]["base"]["ppl"]
    assert set(res["claim"]) >= {"within_10pct", "a_better_than_b", "ratio_a_to_base"}
    assert (run / "fig.png").stat().st_size > 1000


def test_rerun_reuses_scores(pi_repro, run):
    before = {p.name: p.stat().st_mtime_ns for p in (run / "scores").iterdir()}
    assert pi_repro.main(["--config", "tiny", "--out", str(run), "--figure", ""]) == 0
    assert {p.name: p.stat().st_mtime_ns for p in (run / "scores").iterdir()} == before


def test_passkey_prompt(pi_repro):
    from attnlab.data import corpus
    from attnlab.train.tokenizers import make_tokenizer
    tok = make_tokenizer("word", corpus("shakespeare:train"), pi_repro.CONFIGS["cpu"]["vocab"])
    keys = pi_repro.passkey_keys(tok, 5)
    assert len(set(keys)) == 5 and all(tok.index[k] > 0 for k in keys)
    assert all(tok.index[w] > 0 for w in (pi_repro.FILLER + pi_repro.QUESTION).split()), "filler has <unk>"
    for depth in (0.1, 0.9):
        ids = pi_repro.passkey_ids(tok, 200, depth, keys[0])
        assert 150 < len(ids) <= 200
        at = ids.index(tok.index[keys[0]]) / len(ids)
        assert abs(at - depth) < 0.15
    with pytest.raises(ValueError, match="too short"):
        pi_repro.passkey_ids(tok, 20, 0.5, keys[0])


def test_ppl_by_position_matches_the_evaluator(pi_repro, run):
    """Averaged over its buckets (equal sizes), the positional breakdown is the evaluator's perplexity
    on the same full windows."""
    import math
    from attnlab.engine import LM
    from attnlab.eval.perplexity import perplexity
    from attnlab.train.trainer import load_checkpoint
    model, _, _ = load_checkpoint(run / "base")
    ids = torch.randint(0, model.cfg.vocab_size, (3 * 32 + 1,), generator=torch.Generator().manual_seed(0)).tolist()
    parts = pi_repro.ppl_by_position(model, ids, 32, 8)
    assert list(parts) == ["0-7", "8-15", "16-23", "24-31"]
    mean = math.exp(sum(math.log(v) for v in parts.values()) / 4)
    assert mean == pytest.approx(perplexity(LM(model), ids, window=32)["ppl"], rel=1e-5)


def test_replicate_names(pi_repro):
    """--ft-seed N keeps unscaled/untuned arms shared and gives fine-tunes their own folders."""
    p = dict(pi_repro.CONFIGS["tiny"], ft_seed=2)
    assert pi_repro.run_name(p, "pi+ft") == "pi+ft@seed2" and pi_repro.run_name(p, "yarn") == "yarn"
    assert pi_repro.ft_config(p, None).seed == 2 and pi_repro.ft_config(pi_repro.CONFIGS["tiny"], None).seed == 1
