"""The CLI contract: add_parser(subparsers), one sub-command per registry entry, outputs."""

import argparse
import json

from attnlab.cli.dynamics import add_parser
from attnlab.dynamics.registry import EXPERIMENTS, Experiment, register


def _parser():
    parser = argparse.ArgumentParser(prog="attnlab")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    return parser


def test_all_experiments_registered():
    assert set(EXPERIMENTS) >= {"scan-snap", "scan-snap-sweep", "scan-snap-theorems",
                                "joma-invariant", "joma-nonlinear", "hierarchy"}


def test_cli_writes_json_and_png(tmp_path, capsys):
    args = _parser().parse_args(["dynamics", "joma-nonlinear", "--quick", "--seed", "3",
                                 "--out", str(tmp_path), "--no-progress"])
    assert args.func(args) == 0
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["experiment"] == "joma-nonlinear" and m["seed"] == 3 and m["size"] == "quick"
    assert all((tmp_path / f).stat().st_size > 1000 for f in m["figures"])
    assert not list(tmp_path.glob("*.tmp"))
    assert "rebound" in capsys.readouterr().out


def test_cli_run_records_its_command_and_commit(tmp_path):
    """A result names the command line that made it and the code's commit (docs/figures rule)."""
    import re

    from attnlab.cli import main
    argv = ["dynamics", "joma-nonlinear", "--quick", "--seed", "2", "--out", str(tmp_path), "--no-progress"]
    assert main(argv) == 0
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["command"] == "attnlab " + " ".join(argv) and m["seed"] == 2
    assert re.fullmatch(r"[0-9a-f]{40}|unknown", m["commit"]) and m["dirty"] in (True, False, None)


def test_cli_record_is_taken_when_the_run_starts_and_names_its_wall_time(tmp_path, monkeypatch):
    """The commit and dirty flag are read before the experiment runs (a change made during the run
    cannot leak into its record), and the wall time covers the whole run."""
    import time

    from attnlab.cli import main
    from attnlab.dynamics.registry import EXPERIMENTS, Experiment, register
    seen = {}

    def run(out, seed, size, progress):
        seen["t"] = time.time()
        monkeypatch.setattr("attnlab.io.provenance", lambda argv: {"command": "x", "commit": "late", "dirty": True})
        time.sleep(0.3)
        return {"figures": []}
    register(Experiment("record-test", "test only", run))
    try:
        assert main(["dynamics", "record-test", "--seed", "4", "--out", str(tmp_path), "--no-progress"]) == 0
    finally:
        EXPERIMENTS.pop("record-test")
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["commit"] != "late" and m["started_unix"] <= seen["t"] and m["wall_s"] >= 0.3 and m["seed"] == 4


def test_registering_a_new_experiment_adds_a_subcommand(tmp_path):
    calls = []
    register(Experiment("dummy-test", "test only", lambda out, seed, size, progress: calls.append(size) or {}))
    try:
        args = _parser().parse_args(["dynamics", "dummy-test", "--quick", "--out", str(tmp_path)])
        assert args.func(args) == 0 and calls == ["quick"]
    finally:
        EXPERIMENTS.pop("dummy-test")


def test_no_experiment_module_imports_the_registry_back():
    """registry -> experiment modules only (issue 22's dynamics cycle): no module of
    attnlab.dynamics other than the registry itself imports it."""
    import ast
    from pathlib import Path

    import attnlab.dynamics as pkg
    for f in Path(pkg.__file__).parent.glob("*.py"):
        if f.name == "registry.py":
            continue
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [a.name for a in node.names]
                assert not any(n == "registry" or n.endswith(".registry") for n in names), f.name
            elif isinstance(node, ast.Import):
                assert not any(a.name.endswith("dynamics.registry") for a in node.names), f.name
