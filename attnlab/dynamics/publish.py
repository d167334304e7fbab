"""Copy a theory-lab run's figures into the docs with the numbers behind them beside each.

``python -m attnlab.dynamics.publish RUN_DIR [--command "attnlab dynamics ..."] [--rename a.png=b.png]``
copies every figure named in RUN_DIR/metrics.json to docs/figures/theory/ and writes
``<figure stem>.json`` next to it: the run's own record (command, commit and dirty flag taken
when the run started, seed, wall time; never the commit at publishing), the machine's load, and
the run's metrics with long per-step arrays left out (their length kept), so every number the
docs quote can be checked against a file. A figure drawn again later from an old run's metrics
(``--redrawn-by "COMMAND"``) says so: ``redrawn`` names the drawing command and its commit and
the run's record it was drawn from. Both files are written atomically.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from attnlab.errors import AttnlabError
from attnlab.io import write_atomic, write_json

MAX_LIST = 200  # longer lists are per-step traces: dropped, their length kept


def prune(x):
    """``x`` with lists longer than MAX_LIST replaced by {'omitted_list_len': n}."""
    if isinstance(x, dict):
        return {k: prune(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return {"omitted_list_len": len(x)} if len(x) > MAX_LIST else [prune(v) for v in x]
    return x


RUN_RECORD = ("command", "commit", "dirty", "seed", "started", "wall_s")


def publish(run_dir: str | os.PathLike, command: str = "", dest: str | os.PathLike = "docs/figures/theory",
            rename: dict | None = None, note: str = "", redrawn_by: str = "") -> list[Path]:
    """Copy the run's figures to ``dest`` (renamed per ``rename``) with a JSON beside each.

    The record is the run's own (RUN_DIR/metrics.json, written by the CLI when the run started);
    a run without a commit and dirty flag is refused rather than given today's commit."""
    run_dir, dest, rename = Path(run_dir), Path(dest), rename or {}
    mfile = run_dir / "metrics.json"
    if not mfile.exists():
        raise AttnlabError(f"no metrics.json in {run_dir}")
    metrics = json.loads(mfile.read_text())
    figures = metrics.get("figures") or []
    if not figures:
        raise AttnlabError(f"{mfile} names no figures")
    if not (metrics.get("command") or command):
        raise AttnlabError(f"{mfile} records no command: pass --command")
    if not metrics.get("commit") or not isinstance(metrics.get("dirty"), bool) or "seed" not in metrics:
        raise AttnlabError(f"{mfile} records no commit, dirty flag or seed of its own: rerun it with `attnlab dynamics`")
    redrawn = None
    if redrawn_by:
        from attnlab.io import provenance
        redrawn = {**provenance(None), "command": redrawn_by, "from_record": str(mfile)}
    written = []
    for fig in figures:
        src = run_dir / fig
        if not src.exists():
            raise AttnlabError(f"figure {src} is missing")
        out = dest / rename.get(fig, fig)
        write_atomic(out, lambda tmp, s=src: shutil.copyfile(s, tmp))
        # the run's own record (written by the CLI when it ran) wins over what publish is told now
        record = {"figure": out.name, **{k: metrics[k] for k in RUN_RECORD if k in metrics},
                  "command": metrics.get("command") or command, "runtime_s": metrics.get("runtime_s"),
                  "load_average": os.getloadavg(), "note": note,
                  **({"redrawn": redrawn} if redrawn else {}),
                  "metrics": prune({k: v for k, v in metrics.items() if k not in ("figures", "started_unix", *RUN_RECORD)})}
        written += [out, write_json(out.with_suffix(".json"), record)]
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--command", default="", help="the command that produced the run (runs made by the CLI record their own)")
    ap.add_argument("--dest", default="docs/figures/theory")
    ap.add_argument("--rename", action="append", default=[], metavar="OLD=NEW")
    ap.add_argument("--note", default="")
    ap.add_argument("--redrawn-by", default="", metavar="COMMAND",
                    help="the figures were drawn again from the run's metrics by COMMAND (recorded beside the run's own record)")
    a = ap.parse_args(argv)
    try:
        rename = dict(r.split("=", 1) for r in a.rename)
        for p in publish(a.run_dir, a.command, a.dest, rename, a.note, a.redrawn_by):
            print(p)
    except (AttnlabError, ValueError) as e:
        print(f"error: {e}")
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
