"""Perplexity per 2K bin past SmolLM2's 8,192 trained positions: RoPE scalings against a sink cache.

Each variant is one `attnlab stream` run over the same Shakespeare test tokens (full attention by
chunked prefill, the sink cache token-exactly in chunks of its block); this script reads their run
files, prints the table and draws the figure. The runs (1 thread, ~7 min per 16K run, ~35 min per
32K one on this 2-core machine):

    A="attnlab stream smollm2-135m --threads 1 --bins 2048"
    $A --out runs/rope32k/none_16k --policy full --tokens 16384
    $A --out runs/rope32k/yarn2_16k --policy full --tokens 16384 --rope yarn:2
    $A --out runs/rope32k/ntk2_16k --policy full --tokens 16384 --rope ntk:2
    $A --out runs/rope32k/yarn4_32k --policy full --tokens 32768 --rope yarn:4
    $A --out runs/rope32k/ntk4_32k --policy full --tokens 32768 --rope ntk:4
    $A --out runs/rope32k/sink_32k --policy sink --budget 1024 --block 64 --chunk 64 --tokens 32768
    python benchmarks/rope_long.py runs/rope32k --figure docs/figures/rope/ppl_bins_32k.png
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from attnlab.eval.streaming import bins
from attnlab.io import save_figure

LABELS = {"none_16k": "no scaling", "yarn2_16k": "yarn:2", "ntk2_16k": "ntk:2", "yarn4_32k": "yarn:4",
          "ntk4_32k": "ntk:4", "sink_32k": "sink, 1,024 cache"}


def load_runs(folder: Path) -> dict:
    """{variant: per-token NLL [N]} for every variant folder holding one finished stream run."""
    runs = {}
    for name in LABELS:
        files = sorted((folder / name).glob("*.json"))
        if files:
            runs[name] = torch.tensor(json.loads(files[-1].read_text())["nll_tokens"])
    return runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path)
    p.add_argument("--bin", type=int, default=2048)
    p.add_argument("--figure", default=None)
    args = p.parse_args(argv)
    runs = load_runs(args.folder)
    if not runs:
        print(f"no finished runs under {args.folder}", file=sys.stderr)
        return 1
    table = {name: bins(nll.reshape(1, -1), args.bin) for name, nll in runs.items()}
    longest = max(table.values(), key=len)
    print("| tokens | " + " | ".join(LABELS[n] for n in table) + " |")
    print("|---|" + "---|" * len(table))
    for i, b in enumerate(longest):
        cells = [f"{t[i]['ppl']:.1f}" if i < len(t) else "" for t in table.values()]
        print(f"| {b['start']}-{b['end']} | " + " | ".join(cells) + " |")
    if args.figure:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for name, t in table.items():
            ax.plot([b["end"] for b in t], [b["ppl"] for b in t], marker="o", ms=3, label=LABELS[name])
        ax.axvline(8192, color="grey", ls=":", lw=1)
        ax.text(8300, ax.get_ylim()[1] * 0.9, "trained length", color="grey", fontsize=8)
        ax.set(xlabel="token position (end of 2K bin)", ylabel="perplexity (log scale)", yscale="log",
               title="SmolLM2-135M on Shakespeare test plays: perplexity per 2K bin")
        ax.legend(fontsize=8)
        print(f"figure: {save_figure(fig, args.figure)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
