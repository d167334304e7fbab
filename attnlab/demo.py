"""`make demo`: the main job on the embedded defaults (SmolLM2-135M, Shakespeare's test plays)."""
from __future__ import annotations

import argparse
import sys
import time

from attnlab.cli_common import positive_int, progress


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m attnlab.demo")
    p.add_argument("--threads", type=positive_int, default=2)
    p.add_argument("--tokens", type=positive_int, default=1024, help="test-play tokens to score")
    args = p.parse_args(argv)

    from attnlab.data import corpus
    from attnlab.engine import load
    from attnlab.eval.perplexity import perplexity

    t0 = time.perf_counter()
    lm = load("smollm2-135m", threads=args.threads)
    print(f"loaded {lm.source.name} ({lm.cfg.n_params / 1e6:.0f}M parameters) in {time.perf_counter() - t0:.1f}s")
    question = "In one sentence, why do language models put attention on the first token?"
    print(f"\nuser> {question}\nbot> ", end="", flush=True)
    print(lm.generate(question, max_new_tokens=48, chat=True))
    ids = lm.encode(corpus("shakespeare:test"))[:args.tokens]
    with progress(len(ids) - 1, "perplexity") as bar:
        r = perplexity(lm, ids, progress=bar.update)
    print(f"\nperplexity on the first {r['tokens']} tokens of the test plays: {r['ppl']:.2f} "
          f"({r['tokens'] / r['seconds']:.0f} tok/s, {args.threads} threads)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
