"""Stored theory results: every figure has its numbers beside it; a long J3 run resumes exactly."""
import json
import re
from pathlib import Path

import torch

DOCS = Path(__file__).resolve().parents[2] / "docs"
FIGS = DOCS / "figures" / "theory"


def test_every_theory_figure_has_its_json():
    pngs = sorted(FIGS.glob("*.png"))
    assert pngs
    for png in pngs:
        js = png.with_suffix(".json")
        assert js.exists(), f"{png.name} has no {js.name}"
        rec = json.loads(js.read_text())
        assert rec["figure"] == png.name and rec["command"].startswith("attnlab dynamics")


def test_publish_prunes_per_step_traces(tmp_path):
    from attnlab.dynamics.publish import prune, publish
    assert prune({"a": list(range(500)), "b": [1, 2], "c": {"d": list(range(201))}}) == {
        "a": {"omitted_list_len": 500}, "b": [1, 2], "c": {"d": {"omitted_list_len": 201}}}
    run = tmp_path / "run"
    run.mkdir()
    (run / "f.png").write_bytes(b"png")
    own = {"command": "attnlab dynamics test", "commit": "abc1234", "dirty": False, "seed": 3, "wall_s": 2.5}
    (run / "metrics.json").write_text(json.dumps({"figures": ["f.png"], "x": 1.5, "trace": list(range(300)), **own}))
    publish(run, "", tmp_path / "out", rename={"f.png": "g.png"})
    rec = json.loads((tmp_path / "out" / "g.json").read_text())
    assert (tmp_path / "out" / "g.png").read_bytes() == b"png"
    assert rec["metrics"] == {"x": 1.5, "trace": {"omitted_list_len": 300}} and rec["figure"] == "g.png"
    assert {k: rec[k] for k in own} == own and "redrawn" not in rec  # the run's record, not publish time's


def test_publish_refuses_a_run_without_its_own_record_and_marks_redraws(tmp_path):
    """publish never stamps today's commit on an old run; a figure drawn again names both records."""
    import pytest

    from attnlab.dynamics.publish import publish
    from attnlab.errors import AttnlabError
    run = tmp_path / "run"
    run.mkdir()
    (run / "f.png").write_bytes(b"png")
    (run / "metrics.json").write_text(json.dumps({"figures": ["f.png"], "command": "attnlab dynamics x"}))
    with pytest.raises(AttnlabError, match="no commit"):
        publish(run, "", tmp_path / "out")
    own = {"command": "attnlab dynamics x", "commit": "abc1234", "dirty": False, "seed": 0}
    (run / "metrics.json").write_text(json.dumps({"figures": ["f.png"], **own}))
    publish(run, "", tmp_path / "out", redrawn_by="python -m redraw")
    rec = json.loads((tmp_path / "out" / "f.json").read_text())
    assert rec["commit"] == "abc1234" and rec["redrawn"]["command"] == "python -m redraw"
    assert rec["redrawn"]["from_record"].endswith("metrics.json") and "dirty" in rec["redrawn"]


def test_postln_run_resumes_bit_for_bit(tmp_path):
    """6 minibatches in one go == 4, stop, then extended to 6 from the checkpoint (model,
    optimiser, data order and dropout all restored)."""
    from attnlab.analysis.postln import train_postln
    kw = dict(dim=16, hidden_dim=16, vocab_size=1000, eval_batches=1, batch=4)
    torch.set_num_threads(1)
    straight = train_postln(1, 1e-3, 0, 6, [2, 4, 6], **kw)
    ck = tmp_path / "ck.pt"
    train_postln(1, 1e-3, 0, 4, [2, 4, 6], checkpoint=ck, save_every=2, **kw)
    resumed = train_postln(1, 1e-3, 0, 6, [2, 4, 6], checkpoint=ck, save_every=2, **kw)
    assert [r["step"] for r in resumed] == [0, 2, 4, 6]
    for a, b in zip(straight, resumed):
        assert a["val_loss"] == b["val_loss"] and a["entropy_val"] == b["entropy_val"]


def test_postln_checkpoint_records_each_session(tmp_path):
    """A resumed run keeps one record per session: its commit, dirty flag, minibatches and wall time."""
    from attnlab.analysis.postln import segments, train_postln
    kw = dict(dim=16, hidden_dim=16, vocab_size=1000, eval_batches=1, batch=4)
    torch.set_num_threads(1)
    ck = tmp_path / "ck.pt"
    train_postln(1, 1e-3, 0, 2, [2], checkpoint=ck, save_every=2, **kw)
    rows = train_postln(1, 1e-3, 0, 4, [2, 4], checkpoint=ck, save_every=2, **kw)
    seg = segments(ck)
    assert [(s["from_step"], s["to_step"]) for s in seg] == [(0, 2), (2, 4)]
    assert all("commit" in s and "dirty" in s and s["wall_s"] >= 0 for s in seg)
    assert [r["step"] for r in train_postln(1, 1e-3, 0, 2, [2], checkpoint=ck, **kw)] == [0, 2]  # none past steps
    assert len(segments(ck)) == 2 and [r["step"] for r in rows] == [0, 2, 4]
