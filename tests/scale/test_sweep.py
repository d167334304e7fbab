"""Cells, keys, atomic results and resume on the local backend (no Ray): the default suite."""
from __future__ import annotations

import csv
import json

import pytest

from attnlab.errors import AttnlabError
from attnlab.scale import Cell, CellStore, LocalBackend, run_cells
from attnlab.scale.backends import is_loopback
from attnlab.scale.spec import Spec, load_spec, parse_assignments
from attnlab.cli.sweep_cells import rows_of, run_sweep, sweep_cells

CALLS = []


def square(x: int, fail: bool = False) -> dict:
    CALLS.append(x)
    if fail:
        raise AttnlabError(f"cell {x} refuses")
    return {"x": x, "y": x * x}


def cells(n, **extra):
    return [Cell("tests.scale.test_sweep:square", {"x": i, **extra}, readable=f"x={i}") for i in range(n)]


def test_key_covers_params_and_identity():
    a, b = Cell("m:f", {"x": 1, "y": [1, 2]}), Cell("m:f", {"y": [1, 2], "x": 1})
    assert a.key == b.key  # order does not matter
    assert Cell("m:f", {"x": 2, "y": [1, 2]}).key != a.key
    assert Cell("m:g", {"x": 1, "y": [1, 2]}).key != a.key
    assert Cell("m:f", {"x": 1, "y": [1, 2]}, ident={"model": "size 1"}).key != a.key


def test_rerun_skips_finished_cells(tmp_path):
    CALLS.clear()
    store = CellStore(tmp_path)
    first = run_cells(cells(5), store)
    assert (first.computed, first.skipped) == (5, 0) and CALLS == list(range(5))
    assert [r["result"]["y"] for r in first.records] == [0, 1, 4, 9, 16]
    CALLS.clear()
    again = run_cells(cells(7), store)
    assert (again.computed, again.skipped) == (2, 5) and CALLS == [5, 6]
    # a stale file under a cell's name (hand-edited identity) is recomputed, not trusted
    path = store.path(cells(1)[0])
    record = json.loads(path.read_text())
    record["identity"]["params"]["x"] = 99
    path.write_text(json.dumps(record))
    CALLS.clear()
    assert run_cells(cells(1), store).computed == 1 and CALLS == [0]


def test_failed_cell_leaves_no_file_and_others_are_kept(tmp_path):
    todo = cells(3) + [Cell("tests.scale.test_sweep:square", {"x": 3, "fail": True})]
    with pytest.raises(AttnlabError, match="1 cell\\(s\\) failed.*cell 3 refuses"):
        run_cells(todo, CellStore(tmp_path), LocalBackend())
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 3 and all(n.startswith("x=") and n.endswith(".json") for n in names)  # no temp files


def test_spec_toml_yaml_and_cli_axes(tmp_path):
    (tmp_path / "s.toml").write_text('command = "stream"\n[fixed]\ntokens = 64\nfull_decode = true\n'
                                     '[axes]\npolicy = ["window", "sink"]\nbudget = [16, 32]\n')
    spec = load_spec(tmp_path / "s.toml")
    assert spec.grid()[1] == {"policy": "window", "budget": 32} and len(spec.grid()) == 4
    assert spec.argv(spec.grid()[0]) == ["stream", "--tokens", "64", "--full-decode", "--policy", "window",
                                         "--budget", "16"]
    (tmp_path / "s.yaml").write_text("command: [dynamics, scan-snap]\naxes: {seed: [0, 1]}\nfixed: {quick: true}\n")
    assert load_spec(tmp_path / "s.yaml").argv({"seed": 1}) == ["dynamics", "scan-snap", "--quick", "--seed", "1"]
    assert parse_assignments(["budget=16,0.5", "x=a"], "--axis", split=True) == {"budget": [16, 0.5], "x": ["a"]}
    with pytest.raises(AttnlabError, match="NAME=VALUE"):
        parse_assignments(["budget"], "--axis", split=True)
    (tmp_path / "bad.toml").write_text("command = \n")
    with pytest.raises(AttnlabError, match="does not parse"):
        load_spec(tmp_path / "bad.toml")
    with pytest.raises(AttnlabError, match="both an axis and fixed"):
        Spec("stream", {"tokens": [1]}, {"tokens": 2})


def test_threads_and_out_do_not_change_the_key():
    spec = Spec("dynamics scan-snap", {"seed": [0]}, {"quick": True})
    (_, a), = sweep_cells(spec, threads=1)
    (_, b), = sweep_cells(Spec("dynamics scan-snap", {"seed": [0]}, {"quick": True, "out": "/x"}), threads=2)
    (_, c), = sweep_cells(Spec("dynamics scan-snap", {"seed": [0]}, {"quick": True, "iters": 5}), threads=1)
    assert a.key == b.key != c.key


def test_rows_of_list_results_and_flat_metrics():
    assert rows_of({"b": 1}, {"stdout_json": {"results": [{"ppl": 2.0}, {"ppl": 3.0}]}}) == \
        [{"b": 1, "ppl": 2.0}, {"b": 1, "ppl": 3.0}]
    assert rows_of({"s": 0}, {"stdout_json": None, "files": {"metrics.json": {"a": {"b": 1.5}, "l": [1]}}}) == \
        [{"s": 0, "a.b": 1.5}]


def test_sweep_of_a_cli_command_resumes_and_merges(tmp_path):
    """A real family end to end: 4 dynamics cells, a rerun computes nothing, the table has every cell."""
    spec = Spec("dynamics scan-snap", {"seed": [0, 1], "next-per-query": [1, 2]}, {"quick": True, "iters": 5})
    report, merged = run_sweep(spec, tmp_path)
    assert (report.computed, report.skipped) == (4, 0)
    rows = list(csv.DictReader(open(tmp_path / "results.csv")))
    assert [(r["seed"], r["next-per-query"]) for r in rows] == [("0", "1"), ("0", "2"), ("1", "1"), ("1", "2")]
    assert rows[0]["config.iters"] == "5" and float(rows[0]["runs.ratio_1.final_loss"]) < float(
        rows[0]["runs.ratio_1.initial_loss"])
    assert rows[0]["runs.ratio_1.final_loss"] != rows[2]["runs.ratio_1.final_loss"]  # seeds differ
    assert merged["figure"] and (tmp_path / "results.png").stat().st_size > 0
    again, _ = run_sweep(spec, tmp_path)
    assert (again.computed, again.skipped) == (0, 4)
    assert json.loads((tmp_path / "results.json").read_text())["rows"] == merged["rows"]


def test_cli_errors_are_one_line(tmp_path, capsys):
    from attnlab.cli import main
    assert main(["sweep"]) == 2 and "nothing to sweep" in capsys.readouterr().err
    assert main(["sweep", "--command", "sweep", "--out", str(tmp_path)]) == 2
    assert main(["sweep", "--command", "dynamics scan-snap", "--axis", "seed", "--out", str(tmp_path)]) == 2
    assert main(["sweep", "--command", "dynamics scan-snap", "--set", "nonsense-option=1",
                 "--out", str(tmp_path)]) == 2
    assert "unrecognized arguments: --nonsense-option 1" in capsys.readouterr().err
    assert main(["sweep", "--command", "dynamics scan-snap", "--address", "auto", "--out", str(tmp_path)]) == 2


def test_loopback_addresses():
    assert is_loopback(None) and is_loopback("127.0.0.1:6379") and is_loopback("localhost:1")
    assert not is_loopback("10.0.0.5:6379") and not is_loopback("auto")
