"""Stored results name the code that made them, and the verdicts are the script's: each rule is shown
to reject a bad record built here (mutation tests), then the repository's own files are checked."""
import json
import shutil
import subprocess

import pytest

from attnlab.dynamics import records, verdicts
from attnlab.dynamics.verdict_claims import build_rows

GIT = records.git_available()
needs_git = pytest.mark.skipif(not GIT, reason="git or a git checkout is not available: ancestry cannot be checked")


def _head() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=records.ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()


def _good() -> dict:
    return {"command": "attnlab dynamics joma-nonlinear", "commit": _head() if GIT else "abc1234", "dirty": False,
            "seed": 0}


def _problems(rec) -> list[str]:
    return records.check_record(rec, "x.json", git=GIT)


def test_a_run_record_and_a_noted_backfill_pass():
    assert _problems(_good()) == []
    back = {"x": 1, "provenance": {**{k: _good()[k] for k in ("command", "commit")}, "note": "added by 1234abc"}}
    assert _problems(back) == []


@needs_git
def test_rejects_a_commit_that_is_not_an_ancestor_of_head(tmp_path):
    assert any("not an ancestor" in p for p in _problems({**_good(), "commit": "0123456789abcdef0123456789abcdef01234567"}))
    # a real commit on another branch of a repository is not an ancestor of its HEAD either
    g = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, capture_output=True, text=True, check=True).stdout.strip()  # noqa: E731
    g("init", "-q")
    g("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "--allow-empty", "-m", "base")
    g("checkout", "-q", "-b", "side")
    g("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "--allow-empty", "-m", "side")
    side = g("rev-parse", "HEAD")
    g("checkout", "-q", "-")
    rec = {**_good(), "commit": side}
    assert any("not an ancestor" in p for p in records.check_record(rec, "x.json", True, tmp_path))
    assert records.check_record({**rec, "commit": g("rev-parse", "HEAD")}, "x.json", True, tmp_path) == []


def test_rejects_dirty_without_a_note_and_a_missing_seed():
    assert any("dirty is true" in p for p in _problems({**_good(), "dirty": True}))
    assert _problems({**_good(), "dirty": True, "dirty_note": "only docs/ differed"}) == []
    assert any("no dirty flag" in p for p in _problems({**_good(), "dirty": None}))
    no_seed = _good()
    del no_seed["seed"]
    assert any("no seed" in p for p in _problems(no_seed))


@pytest.mark.parametrize("bad", [{"transcribed": True}, {"source": "transcribed"}, {"carried_over": True},
                                 {"note": "carried over, not rerun with the current code"}])
def test_rejects_transcribed_or_carried_over_records(bad):
    assert any("transcri" in p or "carried" in p for p in _problems({**_good(), **bad}))
    back = {"provenance": {"command": "x", "commit": _good()["commit"], "note": "numbers transcribed from a log"}}
    assert _problems(back)


def test_rejects_a_backfill_without_a_note_and_a_record_without_command_or_commit():
    prov = {k: _good()[k] for k in ("command", "commit")}
    assert _problems({"provenance": {**prov, "note": "  "}})
    assert _problems({"provenance": prov})  # no note: not a backfill, and no run record either
    for key in ("command", "commit"):
        rec = _good()
        del rec[key]
        assert any(f"names no {key}" in p for p in _problems(rec))


def test_tree_check_covers_every_folder_and_lists(tmp_path):
    figs = tmp_path / "figures"
    (figs / "bench" / "deep").mkdir(parents=True)
    (figs / "bench" / "deep" / "a.json").write_text(json.dumps({"tok_s": 10.0}))
    (figs / "b.json").write_text(json.dumps(_good()))
    (figs / "rows.json").write_text(json.dumps([1, 2]))
    problems = records.check_tree(figs, git=GIT)
    assert any(p.startswith("bench/deep/a.json") for p in problems) and any(p.startswith("rows.json") for p in problems)
    assert not any(p.startswith("b.json") for p in problems)
    (figs / "bench" / "deep" / "a.json").write_text(json.dumps({"tok_s": 10.0, "provenance": {
        "command": "python benchmarks/x.py", "commit": _good()["commit"], "note": "backfilled"}}))
    reg = {**_good(), "command": "python -m attnlab.dynamics.records backfill", "seed": None,
           "records": {"rows.json": {"command": "python x.py", "commit": _good()["commit"], "note": "backfilled"}}}
    (figs / "provenance.json").write_text(json.dumps(reg))
    assert records.check_tree(figs, git=GIT) == []


def test_every_stored_result_under_docs_figures_carries_its_provenance():
    """All folders of docs/figures: a run record or a noted backfill (ancestry checked where git runs)."""
    problems = records.check_tree(git=GIT)
    assert len(records.stored_results()) > 150
    assert not problems, "\n".join(problems[:20])


def test_verdict_rules_and_tables_are_the_scripts_output():
    theory = (records.ROOT / "docs" / "theory.md").read_text()
    readme = (records.ROOT / "README.md").read_text()
    from attnlab.dynamics.verdict_claims import FIGS
    assert verdicts.check_docs(theory, readme, build_rows(), FIGS) == []


def test_a_changed_claim_or_verdict_cell_fails(tmp_path):
    rows = build_rows()
    theory = (records.ROOT / "docs" / "theory.md").read_text()
    readme = (records.ROOT / "README.md").read_text()
    cells = verdicts.table_cells(verdicts.between(readme, verdicts.README_MARK))
    claim, verdict = cells["J3"]
    for old, new in ((claim, claim.replace("upper layers end higher", "rebounds in every layer")),
                     (verdict, verdict.replace("not reproduced", "reproduced", 1))):
        assert old != new
        bad = readme.replace(old, new, 1)
        assert any("J3: README" in p for p in verdicts.check_docs(theory, bad, rows))


def test_verdict_rules_decide_as_written():
    c = verdicts.Claim
    assert c("", "", 3, 3, [True]).verdict == "reproduced"
    assert c("", "", 3, 3, [True, False]).verdict == "reproduced in kind"
    assert c("", "", 3, 3, [True], seeds=1).verdict == "reproduced in kind"
    assert c("", "", 2, 2).verdict == "reproduced in kind"
    assert c("", "", 1, 2).verdict == "not reproduced" and c("", "", 0, 0).verdict == "not reproduced"
    assert c("", "", 3, 3, status="pending").verdict == "pending"
    assert verdicts.band_agrees([0.19], [0.35, 0.52]) is False and verdicts.band_agrees([0.3], [0.35, 0.52])
    assert verdicts.se_agrees(1.84, 0.1, 10, 1.786, 0.17, 10) and not verdicts.se_agrees(1.0, 0.01, 10, 1.1, 0.01, 10)


def test_s2_authors_cells_read_from_pickle_strings():
    """The pickle's strings, in its row order (lexical by value), land in the sweep's cells by job number."""
    from attnlab.dynamics.authors_refs import s2_cells
    rows = []
    for j in (0, 3, 1, 2) + tuple(range(4, 64)):
        rows.append((f"{j / 100:.3f} \u00b1 0.010 [10]", ",".join(str(j + 64 * s) for s in range(10)) + "[10]"))
    raw = ("".join(a for a, _ in rows) + "".join(b for _, b in rows)).encode()
    cells = s2_cells(raw)
    assert cells[0][0][3]["mean"] == 0.03 and cells[3][3][3]["mean"] == 0.63 and cells[1][2][1]["n"] == 10
    with pytest.raises(ValueError):
        s2_cells(raw[: len(raw) // 2])


def test_without_git_the_ancestry_check_is_skipped_not_failed(monkeypatch):
    """A clone without git (or a tarball): git_available says so, and the key checks still run."""
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert records.git_available() is False
    assert records.check_record({**_good(), "commit": "0123456"}, "x.json", git=False) == []
    assert records.check_record({**_good(), "dirty": True}, "x.json", git=False)


def test_backfill_adds_provenance_without_touching_anything_else(tmp_path):
    """The added record leaves every other byte's meaning and the file's layout alone."""
    back = {"command": "python x.py", "commit": "abc1234", "note": "backfilled"}
    for text in ('{"a": 1.5, "b": [1, 2]}\n', '{\n  "a": 1.5,\n  "b": [\n    1\n  ]\n}\n'):
        new = records.with_provenance(text, json.loads(text), back)
        assert json.loads(new) == {**json.loads(text), "provenance": back}
        assert new.startswith(text.rstrip()[:-1].rstrip())
    text = json.dumps({"a": 1, "provenance": {"run": "cmd (commit 1234567)"}}, indent=1)
    assert json.loads(records.with_provenance(text, json.loads(text), back))["provenance"] == {
        "run": "cmd (commit 1234567)", **back}
