"""``attnlab dynamics <experiment>``: command-line entry to the theory lab.

``add_parser(subparsers)`` adds the ``dynamics`` sub-command with one sub-sub-command
per entry of ``registry.EXPERIMENTS``; each sets ``args.func(args) -> exit code``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from attnlab.dynamics.common import write_json_atomic
from attnlab.dynamics.registry import EXPERIMENTS
from attnlab.dynamics.spec import Experiment
from attnlab.io import finish_record, run_record


def _runner(exp: Experiment):
    def run(args: argparse.Namespace) -> int:
        out = Path(args.out) if args.out else Path("runs") / "dynamics" / exp.name
        size = "quick" if args.quick else "full"
        opts = {name: getattr(args, name) for name, *_ in exp.options}
        # the run's own record of how it was made, taken now: command, commit, dirty flag, seed; wall time at the end
        record = run_record(getattr(args, "argv", None) or ["dynamics", exp.name], args.seed)
        metrics = exp.run(out, seed=args.seed, size=size, progress=not args.no_progress, **opts)
        metrics = {**metrics, **finish_record(record), "seed": metrics.get("seed", args.seed)}
        write_json_atomic(out / "metrics.json", metrics)
        print(f"[{exp.name}] size={size} seed={args.seed} time={metrics.get('runtime_s', 0):.1f}s")
        for line in (exp.summary(metrics) if exp.summary else []):
            print("  " + line)
        print(f"  wrote {out / 'metrics.json'} and {', '.join(metrics.get('figures', []))}")
        return 0

    return run


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``dynamics`` (with one sub-command per experiment) on ``subparsers``."""
    parser = subparsers.add_parser("dynamics", help="training-dynamics theory lab (Scan and Snap, JoMA)",
                                   description="Reproduce the Scan and Snap / JoMA synthetic experiments.")
    sub = parser.add_subparsers(dest="experiment", required=True, metavar="EXPERIMENT")
    for exp in EXPERIMENTS.values():
        p = sub.add_parser(exp.name, help=exp.help, description=exp.help)
        p.add_argument("--out", default=None, help=f"output folder (default runs/dynamics/{exp.name})")
        p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
        p.add_argument("--quick", action="store_true", help="small size that finishes in seconds")
        p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
        p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
        for name, typ, default, help_ in exp.options:
            p.add_argument("--" + name.replace("_", "-"), type=typ, default=default, help=f"{help_} (default {default})")
        p.set_defaults(func=_runner(exp))
    return parser


def main(argv=None) -> int:
    """Stand-alone entry (``python -m attnlab.cli.dynamics ...``), same as ``attnlab dynamics ...``."""
    parser = argparse.ArgumentParser(prog="attnlab")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
