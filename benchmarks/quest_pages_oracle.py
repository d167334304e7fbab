"""Is it the pages or the bound? Quest's page selection against an oracle that ranks pages by their true best score.

Decodes the RULER batch of a cache kept by `benchmarks/quest_ruler.py --save DIR` (DIR/<length>-s<index>.pt) again,
under the same budget, with pages ranked three ways (the first and last page always read, as Quest does):
  std     Quest: the upper bound from the page's key min/max (`attnlab.model.quest`)
  oracle  the largest true q.k over the page's keys and the group's query heads (reads every key: a diagnostic)
  denseN  Quest with the first N layers dense
  hmaxR   CHANNELS R scored per query head, the max over the group's heads (CHANNELS before it summed the group)
  chR     Quest with CHANNELS R (quest:BUDGET:16:0:R: pages by their best key's q.k on R channels, `attnlab.model.quest`)
  lamL    the box's centre plus L times its half-width: q.(min+max)/2 + L |q|.(max-min)/2 (L=1 is Quest's bound,
          L=0 the centre's score); the same summaries and the same two products as the bound
  mean    q.(the page's mean key) (reads every key: a diagnostic)
  topR[_lamL]  the bound (or lamL's score) over the R channels where each query head's |q| is largest
  pcaR    the largest q.k over the page's keys, both projected on the top R principal directions of the layer and
          KV head's keys (per row, from the first call's keys: the prompt's), Loki's low-rank scores
  sparqR  the largest q.k over the page's keys on the R channels where |q| is largest (SparQ's first step)
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

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]  # this checkout's attnlab


def oracle_read(q, kv, spec, k, v, mask):
    """`read_pages` with pages ranked by the largest true score of their keys (over the KV head's query heads)."""
    if isinstance(k, tuple):
        raise SystemExit("the oracle reads float caches only")
    B, Hq, _, D = q.shape
    Hkv = k.shape[1]
    s = (q.float().reshape(B, Hkv, Hq // Hkv, D) @ k.float().transpose(-1, -2)).amax(-2)  # [B, Hkv, n]
    return _ranked_read(s, kv, spec, k, v, mask)


def box_scores(lam, top=None):
    """`page_bounds` with the half-width weighted by lam: a score from the same min/max, no longer a bound if lam < 1;
    top: over the `top` channels of largest |q| of each query head only."""
    def scores(q, page_min, page_max):
        B, Hq, _, D = q.shape
        Hkv = page_min.shape[1]
        if top:
            keep = q.abs().topk(top, dim=-1).indices
            q = torch.zeros_like(q).scatter_(-1, keep, q.gather(-1, keep))
        qg = q.float().reshape(B, Hkv, Hq // Hkv, D).transpose(-1, -2)
        qp, qn = qg.clamp(min=0), qg.clamp(max=0)
        a, b = (1 + lam) / 2, (1 - lam) / 2
        return (page_max.float() @ (a * qp + b * qn) + page_min.float() @ (a * qn + b * qp)).amax(-1)
    return scores


def mean_read(q, kv, spec, k, v, mask):
    """`read_pages` with pages ranked by q . (their mean key), over the KV head's query heads."""
    from attnlab.model.quest import read_chosen, select_pages
    if isinstance(k, tuple):
        raise SystemExit("the mean reads float caches only")
    B, Hq, _, D = q.shape
    Hkv, n = k.shape[1], k.shape[2]
    P = kv.page_min.shape[2]
    K = torch.nn.functional.pad(k.float(), (0, 0, 0, P * kv.page - n)).reshape(B, Hkv, P, kv.page, D)
    counts = torch.full((P,), float(kv.page))
    counts[-1] = n - (P - 1) * kv.page
    means = K.sum(3) / counts[:, None]
    s = (means @ q.float().reshape(B, Hkv, Hq // Hkv, D).transpose(-1, -2)).amax(-1)
    return read_chosen(select_pages(s, spec.budget, kv.page), kv, k, v, mask)


def _ranked_read(s, kv, spec, k, v, mask):
    """Read the pages with the largest per-token scores s [B, Hkv, n] (their page's max)."""
    from attnlab.model.quest import page_best, read_chosen, select_pages
    if mask is not None:
        s = s.masked_fill(~mask[:, :, 0], float("-inf"))
    s = page_best(s, kv.page)
    return read_chosen(select_pages(s, spec.budget, kv.page), kv, k, v, mask)


_BASES: dict = {}


def pca_read(rank):
    def read(q, kv, spec, k, v, mask):
        B, Hq, _, D = q.shape
        Hkv = k.shape[1]
        if id(kv) not in _BASES:  # the prompt's keys, centred: their top `rank` right singular vectors
            K = k.float()
            _BASES[id(kv)] = torch.linalg.svd(K - K.mean(2, keepdim=True), full_matrices=False)[2][..., :rank, :]
        P = _BASES[id(kv)]  # [B, Hkv, rank, D]
        qg = q.float().reshape(B, Hkv, Hq // Hkv, D) @ P.transpose(-1, -2)  # [B, Hkv, G, rank]
        kp = k.float() @ P.transpose(-1, -2)  # [B, Hkv, n, rank] (a real cache would keep these)
        return _ranked_read((qg @ kp.transpose(-1, -2)).amax(-2), kv, spec, k, v, mask)
    return read


def sparq_read(r, shared=False):
    def read(q, kv, spec, k, v, mask):
        B, Hq, _, D = q.shape
        Hkv = k.shape[1]
        qg = q.float().reshape(B, Hkv, Hq // Hkv, D)
        keep = qg.abs().topk(r, dim=-1).indices if not shared else \
            qg.abs().sum(2, keepdim=True).topk(r, dim=-1).indices.expand(-1, -1, Hq // Hkv, -1)
        qs = torch.zeros_like(qg).scatter_(-1, keep, qg.gather(-1, keep))
        return _ranked_read((qs @ k.float().transpose(-1, -2)).amax(-2), kv, spec, k, v, mask)
    return read


def head_max_channels(q, keys_t, keys_s, channels, page):
    """CHANNELS' first scores: each query head's own product on the channels of largest sum_g |q_g|, the page's
    score the max over its keys and the group's heads (`channel_scores` sums the group's queries instead)."""
    B, Hq, _, D = q.shape
    Hkv, n = keys_t.shape[1], keys_t.shape[3]
    G = Hq // Hkv
    qg = q.float().reshape(B, Hkv, G, D)
    chosen = qg.abs().sum(2).sort(dim=-1, descending=True, stable=True).indices[..., :channels]  # [B, Hkv, R]
    rows = keys_t.gather(2, chosen[..., None].expand(-1, -1, -1, n)).float()  # [B, Hkv, R, n]
    from attnlab.model.quest import page_best
    return page_best((qg.gather(-1, chosen[:, :, None].expand(-1, -1, G, -1)) @ rows).amax(2) * keys_s, page)


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
    p.add_argument("--page", type=int, default=16, help="pages of this many slots (the kept cache's summaries are "
                   "recomputed for it: quest_ruler.repaged)")
    p.add_argument("--modes", default="std,oracle")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    import attnlab
    import attnlab.model.llama as llama
    from attnlab.eval.ruler import TASKS, make_sample, string_match_all
    from attnlab.eval.ruler_run import answer_batch
    from quest_ruler import load_saved, repaged
    torch.set_num_threads(args.threads)
    lm = attnlab.load(args.model, kv_dtype=args.kv, rope=args.rope, attention="quest:32:16")
    samples = [make_sample(t, lm.encode, args.length, args.seed, args.index) for t in TASKS]
    cache, logits = load_saved(args.cache)
    if args.page != cache.layers[0].page:
        cache = repaged(cache, args.page)
    import attnlab.model.quest as quest
    quest_read, bounds, by_channels = llama.read_pages, quest.page_bounds, quest.channel_scores
    for mode in args.modes.split(","):
        llama.read_pages = {"oracle": oracle_read, "mean": mean_read}.get(mode, quest_read)
        if mode.startswith("pca"):
            llama.read_pages = pca_read(int(mode[3:]))
            _BASES.clear()
        elif mode.startswith("sparq"):
            llama.read_pages = sparq_read(int(mode[5:].lstrip("g")), shared=mode[5:].startswith("g"))
        quest.page_bounds = box_scores(float(mode[3:])) if mode.startswith("lam") else bounds
        quest.channel_scores = head_max_channels if mode.startswith("hmax") else by_channels
        if mode.startswith("top"):
            r, _, lam = mode[3:].partition("_lam")
            quest.page_bounds = box_scores(float(lam or 1), int(r))
        spec = f"quest:{args.budget}:{args.page}:{mode[5:]}" if mode.startswith("dense") else \
            f"quest:{args.budget}:{args.page}:0:{mode[2:]}" if mode.startswith("ch") else \
            f"quest:{args.budget}:{args.page}:0:{mode[4:]}" if mode.startswith("hmax") else \
            None if mode == "full" else f"quest:{args.budget}:{args.page}"
        preds = answer_batch(lm.with_attention(spec), copy.deepcopy(cache), logits.clone(), [[] for _ in samples],
                             [x["max_new"] for x in samples])
        scores = [100 * string_match_all(pr, x["answers"]) for pr, x in zip(preds, samples)]
        print(f"{args.length} s{args.index} {mode} ({spec}): avg {sum(scores) / len(scores):.1f} | " +
              " ".join(f"{t}={s:.1f}" for t, s in zip(TASKS, scores)), flush=True)
    llama.read_pages, quest.page_bounds, quest.channel_scores = quest_read, bounds, by_channels
    return 0


if __name__ == "__main__":
    sys.exit(main())
