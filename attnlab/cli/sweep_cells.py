"""`attnlab sweep`: a grid of any CLI command, one cell per combination, merged into a table.

Cells run in-process through `attnlab.cli.main(argv)` (stdout captured), not as
subprocesses: a Ray worker or the local loop imports torch and attnlab once instead of once
per cell (2-3 s each on a busy 2-core machine, more than a small cell costs), and a cell's
failure still comes back as an exception. Files a cell writes go to a temporary folder on
its worker; the JSON it prints or writes is the cell's result, returned to the driver.
"""
from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import shlex
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from attnlab.errors import AttnlabError
from attnlab.io import save_figure, write_atomic, write_json
from attnlab.scale.cells import Cell, CellStore, Report, run_cells
from attnlab.scale.spec import NOT_IN_KEY, Spec


@dataclass(frozen=True)
class Family:
    """How cells of one command run and read back."""
    out: str | None = "redirect"  # redirect: --out is a fresh temp folder; inputs: a temp copy of --out's files
    json_flag: bool = False       # the command prints its result with --json
    files: tuple = ()             # result files read back from --out (first one found wins)
    y: str | None = None          # the default plotted column


FAMILIES = {
    "dynamics": Family(files=("metrics.json",)),
    "stream": Family(json_flag=True, y="ppl"),
    "passkey": Family(out=None, json_flag=True, y="accuracy"),
    "quant-eval": Family(files=("quant.json",), y="ppl"),
    "dejavu eval": Family(out="inputs", files=("eval.json",), y="ppl"),
}


def family_of(command: list[str]) -> tuple[str, Family]:
    for n in (2, 1):
        name = " ".join(command[:n])
        if name in FAMILIES:
            return name, FAMILIES[name]
    return command[0], Family(out=None)


def run_cli(argv: list[str], family: str) -> dict:
    """One cell (what a worker runs): `attnlab ARGV` in this process -> {stdout_json, files, stdout}."""
    from attnlab.cli import main
    fam = FAMILIES.get(family, Family(out=None))
    asked = "attnlab " + shlex.join(argv)  # what the results name: the cell's command, not its scratch folder
    argv = list(argv)
    tmp = Path(tempfile.mkdtemp(prefix="attnlab-cell-"))
    try:
        if fam.out == "inputs":  # the command reads inputs from --out and writes beside them
            src = Path(argv[argv.index("--out") + 1])
            for f in src.iterdir() if src.is_dir() else []:
                if f.is_file() and f.name not in fam.files:
                    (tmp / f.name).symlink_to(f.absolute())
            argv[argv.index("--out") + 1] = str(tmp)
        elif fam.out == "redirect":
            argv += ["--out", str(tmp)]
        if fam.json_flag:
            argv.append("--json")
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except SystemExit as e:  # argparse refused the command line
                rc = e.code if isinstance(e.code, int) else 2
        if rc:
            tail = " ".join((err.getvalue() or out.getvalue()).split())[-400:]
            raise AttnlabError(f"`attnlab {' '.join(argv)}` exited {rc}: {tail}")
        files = {name: json.loads((tmp / name).read_text()) for name in fam.files if (tmp / name).is_file()}
        for record in files.values():
            if isinstance(record, dict) and "command" in record:
                record["command"] = asked
        text = out.getvalue()
        parsed = None
        if fam.json_flag:
            try:
                parsed = json.loads(text.strip().splitlines()[-1])
            except (ValueError, IndexError):
                pass
        return {"stdout_json": parsed, "files": files, "stdout": text[-2000:]}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_argv(argv: list[str]) -> None:
    """Parse a cell's command line as the CLI would, so a typo fails before any cell runs."""
    from attnlab.cli import build_parser
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit:
        msg = " ".join(err.getvalue().split()).removeprefix("attnlab: error: ")
        raise AttnlabError(f"cell `attnlab {' '.join(argv)}`: {msg}") from None


def _file_identity(path: Path) -> list:
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else []
    return [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def input_identity(spec: Spec, params: dict) -> dict:
    """Inputs named by option that change the numbers: model files, text content, input folders."""
    import attnlab
    values = {**spec.fixed, **params}
    ident = {"attnlab": getattr(attnlab, "__version__", "?")}
    model = values.get("model") or (values.get("_") if spec.command[0] != "dynamics" else None)
    if model:
        try:
            from attnlab.model.loaders import resolve
            ident["model_files"] = _file_identity(resolve(str(model)))
        except (AttnlabError, OSError, ValueError):
            ident["model_files"] = str(model)
    if isinstance(values.get("text"), str):
        from attnlab.data import corpus
        try:
            ident["text_sha256"] = hashlib.sha256(corpus(values["text"]).encode("utf-8", "surrogatepass")).hexdigest()
        except (AttnlabError, OSError, ValueError):
            pass
    if family_of(spec.command)[1].out == "inputs" and values.get("out"):
        ident["inputs"] = _file_identity(Path(str(values["out"])))
    return ident


def sweep_cells(spec: Spec, threads: int = 1) -> list[tuple[dict, Cell]]:
    """(axis values, cell) per grid point; the key leaves out options that do not change results."""
    name, _ = family_of(spec.command)
    fixed = dict(spec.fixed)
    if threads:  # 0: each command's own default
        fixed.setdefault("threads", threads)
    if spec.command[0] == "dynamics":
        fixed.setdefault("no-progress", True)
    spec = Spec(spec.command, spec.axes, fixed, spec.plot)
    out = []
    for params in spec.grid():
        keyed = {k: v for k, v in {**spec.fixed, **params}.items() if k not in NOT_IN_KEY or k == "out"}
        if FAMILIES.get(name, Family()).out == "redirect":
            keyed.pop("out", None)
        check_argv(spec.argv(params) + (["--json"] if FAMILIES.get(name, Family()).json_flag else []))
        readable = "_".join(f"{k}={v}" for k, v in params.items())
        cell = Cell("attnlab.cli.sweep_cells:run_cli", {"argv": spec.argv(params), "family": name},
                    ident={"command": spec.command, "options": keyed, **input_identity(spec, params)},
                    readable=readable, keyed={"family": name})
        out.append((params, cell))
    return out


def _flatten(obj, prefix: str = "", depth: int = 0, out: dict | None = None) -> dict:
    out = {} if out is None else out
    if isinstance(obj, dict) and depth < 4:
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), depth + 1, out)
    elif isinstance(obj, (int, float, str, bool)) or obj is None:
        out[prefix] = obj
    return out


def rows_of(params: dict, result: dict) -> list[dict]:
    """Table rows of one cell: its list of results/rows if it has one, else its flattened scalars."""
    data = result.get("stdout_json") or next(iter(result.get("files", {}).values()), None) or {}
    for key in ("results", "rows"):
        if isinstance(data, dict) and isinstance(data.get(key), list) and all(isinstance(r, dict) for r in data[key]):
            return [{**params, **_flatten(r)} for r in data[key]]
    return [{**params, **_flatten(data)}]


def merge(spec: Spec, pairs: list[tuple[dict, dict]], out: Path) -> dict:
    """results.json + results.csv (+ results.png) of every cell's rows, in grid order."""
    rows = [row for params, record in pairs for row in rows_of(params, record["result"])]
    cols = list(dict.fromkeys(k for row in rows for k in row))
    write_json(out / "results.json", {"command": spec.command, "axes": spec.axes, "fixed": spec.fixed, "rows": rows,
                                      "cells": [{"params": p, "key": r["key"], "seconds": r.get("seconds"),
                                                 "host": r.get("host")} for p, r in pairs]})

    def write_csv(tmp):
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols)
            w.writeheader()
            w.writerows(rows)
    write_atomic(out / "results.csv", write_csv)
    figure = plot(spec, rows, out / "results.png")
    return {"rows": rows, "figure": figure}


def plot(spec: Spec, rows: list[dict], path: Path) -> str | None:
    """y (mean over the other axes) against x, one line per hue; None when nothing numeric to draw."""
    axes = list(spec.axes)
    num = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    y = spec.plot.get("y") or family_of(spec.command)[1].y
    if y is None or not any(y in r for r in rows):
        y = next((k for r in rows[:1] for k, v in r.items()
                  if k not in axes and num(v) and "runtime" not in k and "seconds" not in k), None)
    x = spec.plot.get("x") or (axes[0] if axes else None)
    if y is None or x is None:
        return None
    hue = spec.plot.get("hue") or next((a for a in axes if a != x), None)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    groups: dict = {}
    for r in rows:
        if num(r.get(y)):
            groups.setdefault(r.get(hue) if hue else "", {}).setdefault(r.get(x), []).append(r[y])
    fig, ax = plt.subplots(figsize=(6, 4))
    for label, pts in groups.items():
        xs = list(pts)
        ax.plot([str(v) for v in xs] if not all(num(v) for v in xs) else xs,
                [sum(v) / len(v) for v in pts.values()], marker="o", label=f"{hue}={label}" if hue else None)
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(f"attnlab {' '.join(spec.command)}", fontsize=9)
    if hue:
        ax.legend(fontsize=7)
    return save_figure(fig, path)


def run_sweep(spec: Spec, out: str | Path, backend=None, threads: int = 1) -> tuple[Report, dict]:
    """Every cell of the grid (finished ones read back), then the merged table in `out`."""
    out = Path(out)
    pairs = sweep_cells(spec, threads)
    report = run_cells([c for _, c in pairs], CellStore(out / "cells"), backend, desc=f"sweep {spec.command[0]}",
                       threads=threads)
    merged = merge(spec, [(p, r) for (p, _), r in zip(pairs, report.records)], out)
    return report, merged
