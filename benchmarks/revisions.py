"""Decode speed of this checkout against another git revision, process by process, interleaved.

A change that should not move speed (a restructuring) is checked by running the same
`benchmarks/decode_speed.py` command in two trees, alternating which goes first, `--rounds`
times each; every (variant, column) is reported as the median over rounds per tree and their
ratio. The baseline tree is an export of REV (`git archive`) run with PYTHONPATH pointing at it,
so both run in this venv. Machines here are shared: read the ratio, not the absolute numbers.

    python benchmarks/revisions.py --baseline 227c6d0 --rounds 3 -- --variants fp32 --compile int4:32 \\
        --compile-kv float16 --lengths 128,1024 --threads 1 --repeats 3 --no-transformers --no-llamacpp
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def export(rev: str, into: Path) -> Path:
    """The tree of `rev` under into/rev (benchmarks and package), read from git without touching this checkout."""
    dest = into / rev
    dest.mkdir(parents=True, exist_ok=True)
    blob = subprocess.run(["git", "archive", "--format=tar", rev], cwd=ROOT, capture_output=True, check=True).stdout
    tar = dest / "tree.tar"
    tar.write_bytes(blob)
    with tarfile.open(tar) as t:
        t.extractall(dest, filter="data")
    return dest


def run(tree: Path, bench_args: list[str], out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(tree / "benchmarks" / "decode_speed.py"), *bench_args, "--json", str(out)]
    subprocess.run(cmd, cwd=tree, env=env, check=True)
    return json.loads(out.read_text())


def cells(result: dict) -> dict[tuple, float]:
    return {(t, variant, col): x["tok_s"] for t, rows in result["threads"].items()
            for variant, r in rows.items() for col, x in r.items()}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, bench_args = _split(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="git revision to compare against")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None, help="write both sides' medians and ratios here")
    args = p.parse_args(ours)
    sys.path.insert(0, str(ROOT))
    from attnlab.io import provenance
    prov = {**provenance(None), "command": "python " + shlex.join(["benchmarks/revisions.py", *argv]), "seed": 0}
    with tempfile.TemporaryDirectory() as tmp:
        base = export(args.baseline, Path(tmp))
        trees = {"baseline": base, "this": ROOT}
        got: dict[str, list[dict]] = {"baseline": [], "this": []}
        for r in range(args.rounds):
            for name in (("baseline", "this") if r % 2 == 0 else ("this", "baseline")):
                print(f"round {r + 1}/{args.rounds}: {name}", file=sys.stderr, flush=True)
                got[name].append(cells(run(trees[name], bench_args, Path(tmp) / f"{name}{r}.json")))
    keys = sorted(set(got["baseline"][0]) & set(got["this"][0]))
    rows = []
    print(f"\n| threads | variant | column | {args.baseline} tok/s | this tok/s | this / {args.baseline} |")
    print("|---|---|---|---|---|---|")
    for k in keys:
        b = statistics.median(g[k] for g in got["baseline"])
        t = statistics.median(g[k] for g in got["this"])
        rows.append({"threads": k[0], "variant": k[1], "column": k[2], "baseline": b, "this": t, "ratio": t / b})
        print(f"| {k[0]} | {k[1]} | {k[2]} | {b:.1f} | {t:.1f} | {t / b:.3f} |")
    if args.json:
        from attnlab.io import write_json
        write_json(args.json, {**prov, "baseline": args.baseline, "rounds": args.rounds, "args": bench_args,
                               "rows": rows,
                               "runs": {k: [{"|".join(map(str, c)): v for c, v in g.items()} for g in gs]
                                        for k, gs in got.items()}})
    return 0


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """This script's options, then decode_speed.py's after `--`."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


if __name__ == "__main__":
    sys.exit(main())
