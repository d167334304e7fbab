"""The memory floor of a decode step's attention: what reading full attention's keys and values, Quest's chosen pages
and Quest's page summaries costs with no arithmetic at all, on this CPU, for SmolLM2's cache shape.

Why: a speed ratio between full attention and Quest is bounded by what each must read. `page_reads.cpp` (beside
this file; a measuring program, not part of attnlab) is compiled here with the system's g++ (-O3 -march=native)
into a temporary folder and run: per step every layer's KV heads (shared out among the threads) read (full) all
rows in order, (pages) BUDGET / PAGE random pages of PAGE rows, (summaries) every page's float16 minimum and
maximum, caches flushed before each repeat, on 4 KiB pages and on transparent huge pages. Compare with
`quest_speed.py --phases` (attention / rest).

    python benchmarks/page_reads.py --depths 16384,32768
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from native_step import cpu  # noqa: E402

SOURCE = Path(__file__).with_suffix(".cpp")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depths", default="16384,32768")
    p.add_argument("--layers", type=int, default=30, help="SmolLM2-135M: 30 layers of 3 KV heads, head size 64")
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", default="1,2", help="the heads shared out among this many threads (OpenMP)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "page_reads"
        subprocess.run(["g++", "-O3", "-march=native", "-fopenmp", "-o", str(exe), str(SOURCE)], check=True)
        print(f"cpu: {cpu()}\n{args.layers} layers x {args.heads} KV heads, head size 64, float16; "
              f"pages of {args.page}, {args.budget // args.page} read per head (budget {args.budget}); "
              f"ms per step, median of {args.repeats} (best)\n")
        print("| depth | threads | memory pages | full: every key and value | quest: chosen pages | "
              "quest: page summaries |")
        print("|---|---|---|---|---|---|")
        for depth in [int(d) for d in args.depths.split(",")]:
            for threads in args.threads.split(","):
                for huge in (0, 1):
                    out = subprocess.run([str(exe), str(args.layers), str(args.heads), str(depth), str(args.page),
                                          str(args.budget // args.page), str(huge), str(args.repeats), threads],
                                         check=True, capture_output=True, text=True).stdout
                    cells = {mode: f"{float(med):.2f} ({float(best):.2f})"
                             for mode, med, best in (line.split() for line in out.splitlines())}
                    print(f"| {depth} | {threads} | {'2 MiB (THP)' if huge else '4 KiB'} | {cells['full']} | "
                          f"{cells['pages']} | {cells['summaries']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
