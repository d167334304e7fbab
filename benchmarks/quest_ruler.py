"""RULER's synthetic tasks under full attention and Quest, on the same samples and the same prefill.

Prefill is exact under Quest, so per (length, sample index) the samples of every task are prefilled once as
one left-padded batch (as `attnlab ruler` does: `attnlab.eval.ruler_run.generate_batch`), and every attention
variant answers greedily (`answer_batch`) from a copy of that cache. The numbers equal `attnlab ruler
--policies '' [--attention SPEC]` run once per variant (same samples, prefill and decoding), at half the prefill
cost. Each (length, index) is written to OUT/<length>-s<index>.json when done; a rerun skips those (with --save,
variants added later decode from the kept cache, no prefill). Prints per-task
scores, the average and, per variant, the paired difference with full over the (task, sample) scores.

    python -P benchmarks/quest_ruler.py --lengths 4096 --samples 4 --variants quest:512
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's attnlab


def load_saved(path):
    """(cache, logits) kept by --save, caches saved before the cache kept `shift`, `first`, `_home` and `keys_t`
    (07e2c19 .. this commit) given their defaults; a float16 keys_t (3074d91 .. int8 keys_t) dropped, to be rebuilt
    in int8 when a variant reads it."""
    cache, logits = torch.load(path, weights_only=False)
    cache.__dict__.setdefault("shift", 0)
    for layer in cache.layers:
        for name, value in (("first", 0), ("_home", None), ("keys_t", None), ("keys_s", None)):
            layer.__dict__.setdefault(name, value)
        if layer.keys_t is not None and layer.keys_t.dtype != torch.int8:
            layer.keys_t = layer.keys_s = None
    return cache, logits


def repaged(cache, page: int):
    """A copy of a prefilled cache whose page summaries are recomputed for pages of `page` slots, so variants with
    different page sizes answer from one prefill (the summaries depend on the keys and the page size only)."""
    cache = copy.deepcopy(cache)
    for layer in cache.layers:
        B, H, C, D = layer.k.shape
        layer.page = page
        layer.pages_lo = torch.zeros(B, H, -(-C // page), D, dtype=torch.float16)
        layer.pages_hi = torch.zeros_like(layer.pages_lo)
        layer._summarize(0, layer.n)
    return cache


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kv", default="float16")
    p.add_argument("--rope", default=None)
    p.add_argument("--lengths", default="4096")
    p.add_argument("--tasks", default="all")
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default="quest:512", help="attention specs beside full")
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="runs/quest_ruler")
    p.add_argument("--save", default=None, help="keep each prefilled cache here: later variants decode from it")
    args = p.parse_args(argv)
    import attnlab
    from attnlab.eval.ruler import TASKS, make_sample, string_match_all
    from attnlab.eval.ruler_run import answer_batch
    from attnlab.stats import paired_difference
    torch.set_num_threads(args.threads)
    tasks = list(TASKS) if args.tasks == "all" else args.tasks.split(",")
    lm = attnlab.load(args.model, kv_dtype=args.kv, rope=args.rope, attention="quest:32:16")  # caches keep pages
    specs = ["full", *args.variants.split(",")]
    views = {s: lm.with_attention(None if s == "full" else s) for s in specs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"model {args.model}, {args.kv} cache, rope {args.rope}, {args.threads} thread(s), "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    records = []
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    command = "python " + " ".join(sys.argv)
    for length in [int(x) for x in args.lengths.split(",")]:
        for index in range(args.samples):
            path = out / f"{length}-s{index}.json"
            saved = Path(args.save) / f"{length}-s{index}.pt" if args.save else None
            ident = {"model": args.model, "kv": args.kv, "rope": args.rope, "tasks": tasks, "seed": args.seed,
                     "chunk": args.chunk, "length": length, "index": index}
            rec = json.loads(path.read_text()) if path.exists() else None
            rec = rec if rec is not None and rec["identity"] == ident else None
            todo = [s for s in specs if rec is None or s not in rec["variants"]]
            if not todo:
                records.append(rec)
                continue
            samples = [make_sample(task, lm.encode, length, args.seed, index) for task in tasks]
            if rec is not None and saved is not None and saved.exists():  # more variants from the kept cache
                cache, logits = load_saved(saved)
            else:
                t = time.perf_counter()
                prompts = [s["ids"] for s in samples]
                width = max(len(x) for x in prompts)
                steps = max(s["max_new"] for s in samples)
                pad_id = lm.cfg.eos_token_ids[0] if lm.cfg.eos_token_ids else 0
                ids = torch.tensor([[pad_id] * (width - len(x)) + list(x) for x in prompts])
                cache = lm.new_cache(len(prompts), capacity=width + steps, positions="original")
                cache.pad = torch.tensor([width - len(x) for x in prompts])
                with torch.inference_mode():
                    logits = lm.prefill(ids, cache, chunk=args.chunk)
                rec = {"identity": ident, "tokens": [len(x) for x in prompts], "prefill_s": time.perf_counter() - t,
                       "variants": {}}
                todo = specs
                if saved is not None:
                    saved.parent.mkdir(parents=True, exist_ok=True)
                    torch.save((cache, logits), saved)
            for s in todo:
                t = time.perf_counter()
                page = views[s].options.attention.page if s != "full" else cache.layers[0].page
                preds = answer_batch(views[s], repaged(cache, page), logits.clone(), [[] for _ in samples],
                                     [x["max_new"] for x in samples])
                rec["variants"][s] = {"seconds": time.perf_counter() - t, "commit": commit, "command": command, "results": [
                    {"task": x["task"], "score": 100 * string_match_all(pr, x["answers"]), "pred": pr,
                     "answers": x["answers"]} for x, pr in zip(samples, preds)]}
            rec["load"] = os.getloadavg()[0]
            path.write_text(json.dumps(rec, indent=1))
            records.append(rec)
            print(f"  {length} s{index}: prefill {rec['prefill_s']:.0f} s, " +
                  ", ".join(f"{s} {rec['variants'][s]['seconds']:.0f} s "
                            f"{sum(r['score'] for r in rec['variants'][s]['results']) / len(tasks):.1f}"
                            for s in specs) + f"; load {rec['load']:.1f}", file=sys.stderr, flush=True)
    for length in sorted({r["identity"]["length"] for r in records}):
        recs = [r for r in records if r["identity"]["length"] == length]
        print(f"\nlength {length}, {len(recs)} sample(s) per task (seed {args.seed}), tokens "
              f"{min(min(r['tokens']) for r in recs)}-{max(max(r['tokens']) for r in recs)}")
        print("| attention | " + " | ".join(tasks) + " | avg |\n|---|" + "---|" * (len(tasks) + 1))
        scores = {}
        for s in specs:
            per = {t: [x["score"] for r in recs for x in r["variants"][s]["results"] if x["task"] == t] for t in tasks}
            scores[s] = [v for t in tasks for v in per[t]]
            print(f"| {s} | " + " | ".join(f"{sum(per[t]) / len(per[t]):.1f}" for t in tasks) +
                  f" | {sum(scores[s]) / len(scores[s]):.1f} |")
        for s in specs[1:]:
            d = paired_difference(scores[s], scores["full"])
            print(f"{s} - full: {d['mean']:+.1f} points (95% bootstrap {d['lo']:+.1f} .. {d['hi']:+.1f}; "
                  f"{d['wins']} better, {d['losses']} worse, {d['ties']} tied of {d['n']}; sign test p {d['sign_p']:.2f})")
        print(f"prefill {sum(r['prefill_s'] for r in recs) / 60:.1f} min; decode " +
              ", ".join(f"{s} {sum(r['variants'][s]['seconds'] for r in recs) / 60:.1f} min" for s in specs))
    return 0



if __name__ == "__main__":
    sys.exit(main())
