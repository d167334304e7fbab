"""benchmarks/press_anchor.py --merge: the paired best-against-best comparison and the run `attnlab report` shows."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("press_anchor", ROOT / "benchmarks" / "press_anchor.py")
anchor = importlib.util.module_from_spec(spec)
spec.loader.exec_module(anchor)

TASKS = ["niah_single", "vt"]


def rows(scores: dict) -> list[dict]:
    """scores: (press, question, ratio) -> per-sample scores over TASKS x 4 indices."""
    return [{"press": p, "question": q, "ratio": r, "task": TASKS[i % 2], "index": i // 2, "score": v, "pred": str(v)}
            for (p, q, r), vs in scores.items() for i, v in enumerate(vs)]


def test_best_against_best_is_paired_and_respects_the_protocol():
    ours = rows({("full", "out", 0.0): [100] * 8, ("tova", "out", 0.5): [0, 0, 100, 0, 0, 0, 0, 0],
                 ("h2o", "out", 0.5): [100, 0, 100, 0, 100, 0, 0, 0], ("tova", "in", 0.5): [100] * 6 + [0, 0]})
    theirs = rows({("full", "out", 0.0): [100] * 8, ("tova", "out", 0.5): [0, 0, 100, 0, 0, 0, 0, 0],
                   ("tova", "in", 0.5): [100] * 5 + [0, 0, 0], ("tova:chunk_length=16", "in", 0.5): [0] * 8})
    anyp, out, defaults = anchor.best_against_best(ours, theirs, 0.5)
    assert (anyp["attnlab_best"], anyp["kvpress_best"]) == ("tova+q", "tova+q")
    assert anyp["mean"] == pytest.approx(12.5) and (anyp["wins"], anyp["losses"]) == (1, 0)
    # kvpress's protocol only: our h2o against its tova, the same samples in the same order
    assert (out["attnlab_best"], out["kvpress_best"], out["mean"]) == ("h2o", "tova", 25.0)
    assert (out["wins"], out["losses"], out["ties"]) == (2, 0, 6)
    assert defaults["kvpress_best"] == "tova+q" and defaults["mean"] == pytest.approx(12.5)
    theirs = [r for r in theirs if ":" not in r["press"]] + rows({("tova:chunk_length=16", "in", 0.5): [100] * 8})
    leads = anchor.best_against_best(ours, theirs, 0.5)  # a configured kvpress press now leads, but not at defaults
    assert (leads[0]["kvpress_best"], leads[2]["kvpress_best"]) == ("tova:chunk_length=16+q", "tova+q")
    only_in = [[r for r in x if r["question"] == "in" or r["press"] == "full"] for x in (ours, theirs)]
    assert [p["scope"] for p in anchor.best_against_best(*only_in, 0.5)] == ["any protocol", "kvpress at its defaults"]


def test_merge_writes_a_run_the_report_reads(tmp_path):
    from attnlab.eval.report import collect
    ours = rows({("full", "out", 0.0): [100] * 8, ("knorm", "out", 0.5): [0, 100] * 4,
                 ("knorm", "in", 0.5): [100] * 8, ("h2o", "out", 0.5): [0] * 8})  # a press kvpress has not
    theirs = rows({("full", "out", 0.0): [100] * 8, ("knorm", "out", 0.5): [0, 100] * 4,
                   ("knorm", "in", 0.5): [100] * 8})
    theirs += [{**theirs[0], "index": 9}]  # a sample only one library ran is left out
    for name, data in (("a.json", ours), ("b.json", theirs)):
        (tmp_path / name).write_text(json.dumps({"command": f"python {name}", "commit": "c", "model": "m",
                                                 "results": data}))
    anchor.merge(str(tmp_path / "a.json"), str(tmp_path / "b.json"), str(tmp_path / "out"))
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    names = {c["policy"] for c in summary["cells"]}
    assert names == {"full", "kvpress:full", "attnlab:knorm", "attnlab:knorm+q", "kvpress:knorm", "kvpress:knorm+q",
                     "attnlab:h2o"}
    assert summary["samples"] == 4 and [p["mean"] for p in summary["paired"]] == [0.0, 0.0, 0.0]
    assert "knorm+q" in (tmp_path / "out" / "table.txt").read_text()
    sections = collect([tmp_path / "out"])
    assert [s.kind for s in sections] == ["ruler"] and sections[0].figures
    assert "attnlab's knorm+q - kvpress's knorm+q = +0.0 points" in sections[0].text  # the report shows the pairing


def test_needle_positions_cover_every_token_of_each_answer():
    spec = importlib.util.spec_from_file_location("press_needles", ROOT / "benchmarks" / "press_needles.py")
    needles = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(needles)
    pieces = ["The", " number", " is", " 5", "06", "4", "07", "1", ".", " Also", " 5", "06", "4", "07", "1", " 99"]
    ids = list(range(len(pieces)))
    got = needles.needle_positions(lambda t: "".join(pieces[i] for i in t), ids, 15, ["5064071", "99", "1."])
    assert got == [[3, 4, 5, 6, 7, 10, 11, 12, 13, 14], [], [7, 8]]  # 99 lies past the context (n = 15)


def test_a_run_continued_on_other_samples_joins(tmp_path):
    first, rest = rows({("knorm", "out", 0.5): [0, 100] * 4})[:4], rows({("knorm", "out", 0.5): [0, 100] * 4})[4:]
    for name, data, commit in (("a.json", first, "c1"), ("b.json", rest, "c2"), ("c.json", first, "c3")):
        (tmp_path / name).write_text(json.dumps({"command": name, "commit": commit, "model": "m", "results": data}))
    joined = anchor._joined(f"{tmp_path / 'a.json'},{tmp_path / 'b.json'}")
    assert joined["results"] == first + rest and (joined["command"], joined["commit"]) == ("a.json ; b.json", "c1 ; c2")
    with pytest.raises(SystemExit, match="share a cell"):
        anchor._joined(f"{tmp_path / 'a.json'},{tmp_path / 'c.json'}")
