"""Passkey retrieval at long contexts: full attention, Quest's page selection (with and without dense first
layers), and a sink cache of the same budget, on the same prompts.

Prefill is exact under Quest, so each prompt is prefilled once (native step, page summaries kept) and every
attention variant decodes its answer greedily from a copy of that cache; the sink cache prefills the prompt
itself (it evicts while reading). Prints one row per (length, depth) with each variant's answers.

    python benchmarks/quest_passkey.py --lengths 4096,8192 --depths 0.1,0.3,0.5,0.7,0.9 --trials 2 \
        --variants quest:1024,quest:1024:16:2 --sink 1024
    python benchmarks/quest_passkey.py --lengths 16384 --rope yarn:4 ...
"""
from __future__ import annotations

import argparse
import os
import random
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's attnlab


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kv", default="float16")
    p.add_argument("--rope", default=None)
    p.add_argument("--lengths", default="4096,8192")
    p.add_argument("--depths", default="0.1,0.5,0.9")
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--variants", default="quest:1024,quest:1024:16:2", help="attention specs beside full")
    p.add_argument("--sink", type=int, default=1024, help="a sink cache of this budget too (0: none)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    import attnlab
    from attnlab.eval.passkey import passkey_prompt, retrieve
    from benchmarks.quest_ruler import repaged  # a copy of the cache with summaries for a variant's page size
    from attnlab.kv import make_policy
    from attnlab.sampling import Sampler
    torch.set_num_threads(args.threads)
    lm = attnlab.load(args.model, kv_dtype=args.kv, rope=args.rope, attention="quest:32:16")
    specs = ["full", *args.variants.split(",")]
    views = {s: lm.with_attention(None if s == "full" else s) for s in specs}
    keys = [str(random.Random(t).randint(10000, 99999)) for t in range(args.trials)]
    print(f"model {args.model}, {args.kv} cache, rope {args.rope}, {args.threads} thread(s), "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    names = specs + ([f"sink:{args.sink}"] if args.sink else [])
    print("| length | depth | " + " | ".join(names) + " |\n|---|---|" + "---|" * len(names), flush=True)
    found = {n: 0 for n in names}
    for length in [int(x) for x in args.lengths.split(",")]:
        for depth in [float(x) for x in args.depths.split(",")]:
            cells = {n: [] for n in names}
            for key in keys:
                ids = passkey_prompt(lm, length, depth, key)
                t = time.perf_counter()
                cache = lm.new_cache(capacity=len(ids) + 16)
                logits = lm.prefill(torch.tensor([ids]), cache)
                n_new = len(lm.encode_rendered(" " + key)) + 2
                for s in specs:
                    page = views[s].options.attention.page if s != "full" else cache.layers[0].page
                    out = [int(x) for x in views[s].decode(repaged(cache, page), logits, Sampler(), n_new)]
                    answer = lm.tokenizer.decode(out, skip_special_tokens=True)
                    digits = re.search(r"\d+", answer)
                    ok = bool(digits) and digits.group() == key
                    cells[s].append("ok" if ok else answer.strip()[:8] or "-")
                    found[s] += ok
                if args.sink:
                    ok, answer = retrieve(views["full"], ids, key, policy=make_policy("sink", args.sink, chunk=64))
                    cells[names[-1]].append("ok" if ok else answer[:8] or "-")
                    found[names[-1]] += ok
                print(f"  ({len(ids)} tokens, {time.perf_counter() - t:.0f} s)", file=sys.stderr, flush=True)
            print(f"| {length} | {depth} | " + " | ".join(", ".join(cells[n]) for n in names) + " |", flush=True)
    print("\nfound: " + ", ".join(f"{n} {found[n]}" for n in names) + f"; load average {os.getloadavg()[0]:.1f}")
    return 0



if __name__ == "__main__":
    sys.exit(main())
