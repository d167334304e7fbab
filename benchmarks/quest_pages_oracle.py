"""Is it the pages or the bound? Quest's page selection against an oracle that ranks pages by their true best score.

Decodes the RULER batch of a cache kept by `benchmarks/quest_ruler.py --save DIR` (DIR/<length>-s<index>.pt) again,
under the same budget, with pages ranked three ways (the first and last page always read, as Quest does):
  std     Quest: the upper bound from the page's key min/max (`attnlab.model.quest`)
  oracle  the largest true q.k over the page's keys and the group's query heads (reads every key: a diagnostic)
  denseN  Quest with the first N layers dense
A diagnostic of the eager path (it replaces `read_pages` in `attnlab.model.llama`), not an attention option.

    python -P benchmarks/quest_pages_oracle.py --length 4096 --index 0 --cache runs/quest_cache/4096-s0.pt \
        --budget 512 --modes std,oracle
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's attnlab


def oracle_read(q, kv, budget, k, v, mask):
    """`read_pages` with pages ranked by the largest true score of their keys (over the KV head's query heads)."""
    from attnlab.model.quest import select_pages
    K = k[0] if isinstance(k, tuple) else k
    if isinstance(k, tuple):
        raise SystemExit("the oracle reads float caches only")
    B, Hq, _, D = q.shape
    Hkv, n = K.shape[1], K.shape[2]
    s = (q.float().reshape(B, Hkv, Hq // Hkv, D) @ K.float().transpose(-1, -2)).amax(-2)  # [B, Hkv, n]
    if mask is not None:
        s = s.masked_fill(~mask[:, :, 0], float("-inf"))
    P = kv.page_min.shape[2]
    s = torch.nn.functional.pad(s, (0, P * kv.page - n), value=float("-inf")).reshape(B, Hkv, P, kv.page).amax(-1)
    pages = select_pages(s, budget, kv.page)
    if pages is None:
        return k, v, mask, None
    last = n - (P - 1) * kv.page
    m = (pages.shape[-1] - 1) * kv.page + last
    slots = (pages[..., None] * kv.page + torch.arange(kv.page)).flatten(-2)[..., :m]
    mask = None if mask is None else mask.gather(3, slots[:, :, None])
    return (*kv.read(slots), mask, slots)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kv", default="float16")
    p.add_argument("--rope", default=None)
    p.add_argument("--length", type=int, required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", required=True, help="a cache kept by quest_ruler.py --save")
    p.add_argument("--budget", type=int, default=512)
    p.add_argument("--modes", default="std,oracle")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    import attnlab
    import attnlab.model.llama as llama
    from attnlab.eval.ruler import TASKS, make_sample, string_match_all
    from attnlab.eval.ruler_run import answer_batch
    torch.set_num_threads(args.threads)
    lm = attnlab.load(args.model, kv_dtype=args.kv, rope=args.rope, attention="quest:32:16")
    samples = [make_sample(t, lm.encode, args.length, args.seed, args.index) for t in TASKS]
    cache, logits = torch.load(args.cache, weights_only=False)
    quest_read = llama.read_pages
    for mode in args.modes.split(","):
        llama.read_pages = oracle_read if mode == "oracle" else quest_read
        spec = f"quest:{args.budget}:16:{mode[5:]}" if mode.startswith("dense") else \
            None if mode == "full" else f"quest:{args.budget}"
        preds = answer_batch(lm.with_attention(spec), copy.deepcopy(cache), logits.clone(), [[] for _ in samples],
                             [x["max_new"] for x in samples])
        scores = [100 * string_match_all(pr, x["answers"]) for pr, x in zip(preds, samples)]
        print(f"{args.length} s{args.index} {mode} ({spec}): avg {sum(scores) / len(scores):.1f} | " +
              " ".join(f"{t}={s:.1f}" for t, s in zip(TASKS, scores)), flush=True)
    llama.read_pages = quest_read
    return 0


if __name__ == "__main__":
    sys.exit(main())
