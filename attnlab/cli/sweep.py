"""`attnlab sweep`: a grid of any attnlab command, locally or on a Ray cluster (docs/scale.md).

    attnlab sweep spec.toml --out runs/sweep/s1
    attnlab sweep --command "dynamics scan-snap" --axis seed=0,1,2,3 --set quick=true --backend ray
A rerun skips finished cells; Ctrl-C or a killed driver loses only the cells in flight.
"""
from __future__ import annotations

from pathlib import Path

from attnlab.cli.common import UserError, nonneg_int


def cmd_sweep(args) -> int:
    from attnlab.scale.backends import make_backend
    from attnlab.scale.spec import Spec, load_spec, parse_assignments
    from attnlab.cli.sweep_cells import run_sweep

    if args.spec and args.command_line:
        raise UserError("give a spec file or --command, not both")
    if args.spec:
        spec = load_spec(args.spec)
        spec.axes.update(parse_assignments(args.axis, "--axis", split=True))
        spec.fixed.update(parse_assignments(args.set, "--set", split=False))
        spec = Spec(spec.command, spec.axes, spec.fixed, spec.plot)
    elif args.command_line:
        spec = Spec(args.command_line, parse_assignments(args.axis, "--axis", split=True),
                    parse_assignments(args.set, "--set", split=False))
    else:
        raise UserError("nothing to sweep: give a spec file (TOML/YAML) or --command")
    if spec.command[0] == "sweep":
        raise UserError("a sweep cannot sweep `attnlab sweep`")
    if args.cpus <= 0:
        raise UserError(f"--cpus must be > 0, got {args.cpus}")
    out = Path(args.out) if args.out else Path("runs") / "sweep" / "-".join(spec.command)
    cells = len(spec.grid())
    backend = make_backend(args.backend, args.address, cpus=args.cpus, max_retries=args.max_retries,
                           local_nodes=args.local_nodes)
    try:
        report, merged = run_sweep(spec, out, backend, threads=args.threads)
    finally:
        backend.close()
    print(f"{cells} cells: {report.computed} computed, {report.skipped} already done, {report.seconds:.1f} s "
          f"({backend.name}); {len(merged['rows'])} rows in {out / 'results.csv'} and {out / 'results.json'}"
          + (f", figure {merged['figure']}" if merged["figure"] else ""))
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("sweep", help="run a grid of any attnlab command, locally or on a Ray cluster (resumable)",
                       description="One cell per combination of the axes, keyed by a hash of everything that "
                                   "changes its result, written atomically; results merged into CSV + JSON + a plot.")
    p.add_argument("spec", nargs="?", default=None, help="sweep spec, TOML or YAML (command, axes, fixed, plot)")
    p.add_argument("--command", dest="command_line", default=None, type=str.split,
                   help='the attnlab command to sweep, e.g. "stream" or "dynamics scan-snap" (instead of a spec)')
    p.add_argument("--axis", action="append", default=None, metavar="NAME=V1,V2",
                   help="an axis of the grid (repeatable; adds to the spec's)")
    p.add_argument("--set", action="append", default=None, metavar="NAME=VALUE",
                   help="a fixed option of every cell (repeatable; true = a flag)")
    p.add_argument("--out", default=None, help="sweep folder: cells/, results.csv, results.json, results.png "
                                               "(default runs/sweep/COMMAND)")
    p.add_argument("--backend", choices=["local", "ray"], default="local",
                   help="local: serial in this process (no Ray needed); ray: one task per cell")
    p.add_argument("--address", default=None,
                   help="Ray cluster to join: auto or HOST:PORT (default: start a local instance on 127.0.0.1)")
    p.add_argument("--local-nodes", type=nonneg_int, default=0,
                   help="with --backend ray and no --address: a local cluster of N one-CPU worker nodes")
    p.add_argument("--cpus", type=float, default=1.0, help="Ray CPUs per cell")
    p.add_argument("--threads", type=nonneg_int, default=1, help="torch threads per cell (0: torch's choice)")
    p.add_argument("--max-retries", type=nonneg_int, default=3,
                   help="times a cell is retried elsewhere when its worker dies")
    p.set_defaults(func=cmd_sweep, resume_hint="rerun the same command: finished cells are kept")
