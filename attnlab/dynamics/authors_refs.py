"""The authors' S2 numbers as a JSON: luckmatters ``scan_snap/figure_6_data.pkl`` read without unpickling.

The pickle is a pandas DataFrame whose ``entropy/agg`` column holds strings "mean ± std [n]" and
whose ``folder`` column lists the sweep's job numbers ("0,64,...[10]", one per seed). Unpickling
would run the file's code and needs pandas; the strings are enough: the first job number of a row,
modulo 64, gives its cell in the authors' sweep order (num_last, lr_z, lr_y_multi_on_z, last
fastest; their ``figure_6.log`` command line). ``python -m attnlab.dynamics.authors_refs PKL OUT``.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

QUERIES, LR_Z, RATIOS = (1, 3, 5, 10), (0.5, 1.0, 2.0, 3.0), (1, 2, 5, 10)
_AGG = re.compile(r"(-?[\d.]+) \u00b1 ([\d.]+) \[(\d+)\]")
_JOBS = re.compile(r"(\d+(?:,\d+)*)\[\d+\]")


def s2_cells(raw: bytes) -> list:
    """cells[query][lr_z][ratio] = {"mean", "std", "n"} from the pickle's bytes."""
    text = raw.decode("utf-8", "replace")
    cells_n = len(QUERIES) * len(LR_Z) * len(RATIOS)
    aggs, jobs = _AGG.findall(text)[:cells_n], _JOBS.findall(text)[:cells_n]
    if len(aggs) != cells_n or len(jobs) != cells_n:
        raise ValueError(f"expected {cells_n} entropy cells and job lists, found {len(aggs)} and {len(jobs)}")
    cells = [[[None] * len(RATIOS) for _ in LR_Z] for _ in QUERIES]
    for (mean, std, n), job in zip(aggs, jobs):
        j = int(job.split(",")[0]) % cells_n
        q, z, r = j // 16, (j // 4) % 4, j % 4
        if cells[q][z][r] is not None:
            raise ValueError(f"job {j} appears twice")
        cells[q][z][r] = {"mean": float(mean), "std": float(std), "n": int(n)}
    return cells


def main(argv=None) -> int:
    from attnlab.io import finish_record, run_record, write_json
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1])
        return 2
    record = run_record(None, None, command="python -m attnlab.dynamics.authors_refs " + " ".join(argv))
    cells = s2_cells(Path(argv[0]).read_bytes())
    write_json(argv[1], {**finish_record(record), "source": "facebookresearch/luckmatters "
                         "ssl/real-dataset/scan_snap/figure_6_data.pkl (commit 76a25aa1), the authors' Fig. 6 sweep",
                         "axes": {"queries": QUERIES, "lr_z": LR_Z, "ratios": RATIOS}, "cells": cells})
    print(f"wrote {argv[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
