"""`attnlab report RUN_DIRS... --out report.html`: every run found under the folders on one offline page."""
from __future__ import annotations

from attnlab.cli.common import UserError


def cmd_report(args) -> int:
    from attnlab.errors import AttnlabError
    from attnlab.eval.report import build_report
    if not str(args.out).endswith((".html", ".htm")):
        raise UserError(f"--out must name an .html file, got {args.out}")
    try:
        path, n = build_report(args.runs, args.out, args.title)
    except AttnlabError as e:
        raise UserError(str(e)) from None
    print(f"wrote {path}: {n} runs, {path.stat().st_size / 2**20:.1f} MiB, self-contained (figures inlined)")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="one self-contained HTML page of the runs under some folders")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="folders (walked recursively) or result files")
    p.add_argument("--out", default="report.html", help="the HTML file to write")
    p.add_argument("--title", default="attnlab runs", help="page title")
    p.set_defaults(func=cmd_report)
