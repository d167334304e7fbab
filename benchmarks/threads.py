"""Decode speed of SmolLM2 by torch thread count, alternating settings (the thread default is chosen from this).

On a busy machine more threads than free cores make every matmul wait for the slowest
thread; run this where attnlab will run. `python benchmarks/threads.py --threads 1,2 --rounds 3`.
"""
from __future__ import annotations

import argparse
import time

import torch

from attnlab.engine import LM
from attnlab.sampling import Sampler


def main() -> None:
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--threads", default="1,2", help="thread counts to compare")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    p.add_argument("--tokens", type=int, default=48, help="greedy tokens per measurement")
    args = p.parse_args()
    lm = LM.load("smollm2-135m", threads=1)
    ids = lm.encode("The quality of mercy is not strained; it droppeth as the gentle rain from heaven")
    for _ in range(args.rounds):
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            run = lm.with_threads(threads)  # the native step's team is the engine's, built for this count
            start = time.perf_counter()
            n = len(list(run.stream(ids, lm.new_cache(), Sampler(), args.tokens, stop_at_eos=False)))
            seconds = time.perf_counter() - start
            print(f"threads {threads}: {n} tokens in {seconds:.2f} s = {n / seconds:.1f} tok/s", flush=True)


if __name__ == "__main__":
    main()
