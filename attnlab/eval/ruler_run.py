"""Scoring RULER's tasks for every KV policy at several compression ratios, resumably.

A unit of work is one (length, policy, compression ratio, sample index): the samples of
every task at that length and index go through the engine as one left-padded batch
(decoding is the slow part on a CPU, and a batch of 7 costs little more than 1), the
prompt prefilled in chunks through a cache that the policy thins between chunks, then
decoded greedily until each row writes a newline. Each unit is written atomically to
`<out>/units/<key>.json`, its key a hash of everything its numbers depend on, so a rerun
skips finished units, and raising --samples only adds the new indices.

Compression ratio is kvpress's: the share of the prompt's KV pairs the policy drops, so
a ratio r keeps (1 - r) x length tokens per layer and KV head; the full cache is ratio 0.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from attnlab.batch import Batch
from attnlab.errors import AttnlabError
from attnlab.eval.ruler import TASKS, make_sample, string_match_all
from attnlab.io import keyed_name, save_figure, write_json

VERSION = 2  # bump when the generators or the decoding change the numbers


def budget_for(length: int, ratio: float) -> int:
    """Tokens kept per layer and KV head when a share `ratio` of a `length`-token prompt is dropped."""
    if not 0 <= ratio < 1:
        raise AttnlabError(f"compression ratio must be in [0, 1), got {ratio}")
    return max(8, round((1 - ratio) * length))


PRESS = "press:"  # a cell named press:NAME compresses once after the prompt (attnlab.kv.press)


def build_cell_press(name: str, ratio: float):
    """The press of a press:NAME cell (None for a policy cell); its ratio is kvpress's, of the pressed tokens."""
    from attnlab.kv.press import make_press
    return make_press(name[len(PRESS):], ratio) if name.startswith(PRESS) else None


def build_cell_policy(name: str, length: int, ratio: float, chunk: int, positions: str, n_sink: int):
    from attnlab.kv.policies import make_policy
    if name == "full" or name.startswith(PRESS):
        return None
    return make_policy(name, budget_for(length, ratio), positions=positions, n_sink=n_sink, chunk=chunk)


@torch.inference_mode()
def generate_batch(lm, prompts: list[list[int]], max_new: list[int], policy=None, chunk: int = 128, press=None,
                   context: list[int] | None = None) -> list[str]:
    """Greedy continuations of left-padded prompts; a row stops at EOS, at a newline after some text, or
    after its own max_new tokens (the batch stops when every row has).

    press: compress the prefilled cache once (`attnlab.kv.press`). context: the question protocol, per row
    the number of leading prompt tokens that are prefilled (and pressed); the rest, the question, is fed
    after, token by token in the same batch (a row starts answering once its own question is in)."""
    context = context or [len(p) for p in prompts]
    heads, questions = [p[:c] for p, c in zip(prompts, context)], [list(p[c:]) for p, c in zip(prompts, context)]
    width, steps = max(len(p) for p in heads), max(max_new) + max(len(q) for q in questions)
    pad_id = lm.cfg.eos_token_ids[0] if lm.cfg.eos_token_ids else 0
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in heads])
    cache = lm.new_cache(len(prompts), capacity=width + steps, policy=policy, positions="original")
    cache.pad = torch.tensor([width - len(p) for p in heads])
    logits = lm.prefill(ids, cache, chunk=chunk, press=press)
    return answer_batch(lm, cache, logits, questions, max_new)


@torch.inference_mode()
def answer_batch(lm, cache, logits: torch.Tensor, questions: list[list[int]], max_new: list[int]) -> list[str]:
    """After the prefill: feed each row's question tokens (if any), then decode greedily (generate_batch's rule)."""
    questions = [list(q) for q in questions]
    steps = max(max_new) + max(len(q) for q in questions)
    out: list[list[int]] = [[] for _ in questions]
    done = [False] * len(questions)
    eos = lm.eos_ids
    for step in range(steps):
        token = logits.argmax(-1)
        for b, t in enumerate(token.tolist()):
            if questions[b]:
                token[b] = questions[b].pop(0)
                continue
            if done[b]:
                continue
            if t in eos:
                done[b] = True
                continue
            out[b].append(t)
            text = lm.tokenizer.decode(out[b], skip_special_tokens=True)
            done[b] = len(out[b]) >= max_new[b] or "\n" in text.lstrip()
        if all(done) or step == steps - 1:
            break
        logits = lm.step(Batch.one(token[:, None], cache))[0][:, -1]
    return [lm.tokenizer.decode(o, skip_special_tokens=True) for o in out]


def unit_key(identity: dict, length: int, policy: str, ratio: float, index: int) -> tuple[str, dict]:
    ident = {**identity, "length": length, "policy": policy, "ratio": ratio, "index": index, "version": VERSION}
    return keyed_name(f"{length}-{policy}-{ratio:g}-s{index}", ident), ident


def run_unit(lm, samples: list[dict], name: str, ratio: float, chunk: int, positions: str, n_sink: int,
             question: str = "in") -> dict:
    """question: "out" presses the context only and feeds the question after (kvpress's protocol); "in"
    presses the prompt but its last token, question included (a query-aware press sees the question; the
    last token is fed after, so no answer token is computed from the unpressed cache)."""
    length = samples[0]["length"]
    press = build_cell_press(name, ratio)
    policy = build_cell_policy(name, length, ratio, chunk, positions, n_sink)
    context = None if press is None else [s["context_tokens"] if question == "out" else len(s["ids"]) - 1
                                          for s in samples]
    start = time.perf_counter()
    preds = generate_batch(lm, [s["ids"] for s in samples], [s["max_new"] for s in samples], policy, chunk,
                           press, context)
    results = [{"task": s["task"], "score": 100 * string_match_all(p, s["answers"]), "pred": p,
                "answers": s["answers"], "tokens": s["tokens"], **({"depths": s["depths"]} if "depths" in s else {})}
               for s, p in zip(samples, preds)]
    return {"length": length, "policy": name, "ratio": ratio if name != "full" else 0.0,
            "budget": policy.tokens if policy else None, **({"question": question} if press else {}),
            "index": samples[0]["index"],
            "seconds": time.perf_counter() - start, "results": results}


def plan(lengths: list[int], policies: list[str], ratios: list[float], samples: int) -> list[tuple]:
    """Units in the order they run: sample index first (a cut-short run still covers every cell), then length."""
    cells = [("full", 0.0)] + [(p, r) for p in policies if p != "full" for r in ratios]
    return [(i, length, p, r) for i in range(samples) for length in lengths for p, r in cells]


def run_ruler(lm, tasks: list[str], lengths: list[int], policies: list[str], ratios: list[float], samples: int,
              out: str | Path, identity: dict, seed: int = 0, haystack: str = "plays", chunk: int = 128,
              positions: str = "original", n_sink: int = 4, force: bool = False, progress=None,
              compute: bool = True, question: str = "in") -> list[dict]:
    """Run (or read back) every unit; returns the units' records. lm may be a function that loads the
    model: it is called only if some unit is not on disk yet (a finished run is tabled without a load).
    compute=False only reads the finished units back (the table of a run cut short)."""
    bad = [t for t in tasks if t not in TASKS]
    if bad:
        raise AttnlabError(f"unknown RULER task {bad[0]!r}; choose from {', '.join(TASKS)}")
    identity = {**identity, "tasks": list(tasks), "seed": seed, "haystack": haystack, "chunk": chunk,
                "positions": positions, "n_sink": n_sink}
    units, cached_samples, loaded = [], {}, []

    def model():
        if not loaded:
            loaded.append(lm() if callable(lm) and not hasattr(lm, "forward") else lm)
        return loaded[0]

    for index, length, name, ratio in plan(lengths, policies, ratios, samples):
        base = {**identity, "question": question} if name.startswith(PRESS) else identity
        key, ident = unit_key(base, length, name, ratio, index)
        path = Path(out) / "units" / f"{key}.json"
        record = None
        if path.exists() and not force:
            try:
                record = json.loads(path.read_text())
            except (OSError, ValueError):
                record = None  # a damaged file: recompute
            if record is not None and record.get("identity") != json.loads(json.dumps(ident)):
                record = None
        if record is None and not compute:
            continue
        if record is None:
            if (length, index) not in cached_samples:
                cached_samples = {(length, index): [make_sample(t, model().encode, length, seed, index, haystack)
                                                    for t in tasks]}
            record = run_unit(model(), cached_samples[(length, index)], name, ratio, chunk, positions, n_sink,
                              question)
            record["identity"] = ident
            write_json(path, record)
        units.append(record)
        if progress is not None:
            progress(1)
    return units


def cells(units: list[dict]) -> list[dict]:
    """Mean score per (task, length, policy, ratio) over the sample indices present."""
    acc: dict = {}
    for u in units:
        for r in u["results"]:
            acc.setdefault((r["task"], u["length"], u["policy"], u["ratio"]), []).append(r["score"])
    return [{"task": t, "length": n, "policy": p, "ratio": r, "samples": len(v), "score": sum(v) / len(v)}
            for (t, n, p, r), v in acc.items()]


def _mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def _common_lengths(rows: list[dict]) -> list[int]:
    """Lengths that every (policy, ratio) row has cells at: averages over them compare like with like."""
    keys = {(r["policy"], r["ratio"]) for r in rows}
    return sorted(n for n in {r["length"] for r in rows}
                  if all(any(x["length"] == n and (x["policy"], x["ratio"]) == k for x in rows) for k in keys))


def table(rows: list[dict]) -> str:
    """kvpress-style: one row per (policy, compression ratio), one column per task and per length, then the
    average; task columns and the average are over the lengths every row has (all of them in a finished run)."""
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    lengths = sorted({r["length"] for r in rows})
    common = _common_lengths(rows)
    keys = sorted({(r["policy"], r["ratio"]) for r in rows}, key=lambda k: (k[0] != "full", k[0], k[1]))
    short = {"niah_single": "single", "niah_multikey": "mkey", "niah_multivalue": "mvalue",
             "niah_multiquery": "mquery"}
    width = max([9] + [len(r["policy"]) for r in rows])
    head = f"{'policy':<{width}} {'ratio':>5} " + " ".join(f"{short.get(t, t):>6}" for t in tasks) + " | " + \
        " ".join(f"{n:>6}" for n in lengths) + f" | {'avg':>5}"
    lines = [head, "-" * len(head)]
    for p, r in keys:
        sel = [x for x in rows if x["policy"] == p and x["ratio"] == r]
        inner = [x for x in sel if x["length"] in common]
        by_task = [_mean([x["score"] for x in inner if x["task"] == t]) for t in tasks]
        by_len = [_mean([x["score"] for x in sel if x["length"] == n]) for n in lengths]
        lines.append(f"{p:<{width}} {r:>5.2f} " + " ".join(f"{v:>6.1f}" for v in by_task) + " | " +
                     " ".join(f"{v:>6.1f}" if v == v else f"{'-':>6}" for v in by_len) +
                     f" | {_mean([x['score'] for x in inner]):>5.1f}")
    if common != lengths:
        lines.append(f"(task columns and avg over lengths {', '.join(map(str, common))}: the ones every row has)")
    return "\n".join(lines)


def full_by_task(rows: list[dict]) -> str:
    """The control: the full cache's score per task and length (where the model itself fails)."""
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    lengths = sorted({r["length"] for r in rows})
    lines = [f"{'task':<16} " + " ".join(f"{n:>6}" for n in lengths)]
    for t in tasks:
        vals = [_mean([x["score"] for x in rows if x["policy"] == "full" and x["task"] == t and x["length"] == n])
                for n in lengths]
        lines.append(f"{t:<16} " + " ".join(f"{v:>6.1f}" for v in vals))
    return "\n".join(lines)


def plot(rows: list[dict], path: str | Path, title: str = "") -> str:
    """kvpress's figure: average score against compression ratio, one line per policy (full at ratio 0),
    one panel for the mean over lengths and one per length."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["length"] for r in rows})
    panels = [("all lengths", lengths)] + [(f"{n} tokens", [n]) for n in lengths]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels), 3.4), sharey=True, squeeze=False)
    policies = sorted({r["policy"] for r in rows} - {"full"})
    for ax, (name, sel_lengths) in zip(axes[0], panels):
        sel = [r for r in rows if r["length"] in sel_lengths]
        for p in policies:
            own = sorted({r["length"] for r in sel if r["policy"] == p})  # full on the same lengths as p
            if not own:
                continue
            ratios = sorted({r["ratio"] for r in sel if r["policy"] == p})
            ys = [_mean([r["score"] for r in sel if r["policy"] == "full" and r["length"] in own])] + \
                [_mean([r["score"] for r in sel if r["policy"] == p and r["ratio"] == x]) for x in ratios]
            ax.plot([0.0] + ratios, ys, marker="o", label=p, color=f"C{policies.index(p)}", alpha=0.85)
        full = _mean([r["score"] for r in sel if r["policy"] == "full"])
        ax.axhline(full, color="black", ls="--", lw=1, label="full")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("compression ratio")
        ax.set_xlim(-0.03, max([r["ratio"] for r in rows] + [0.5]) + 0.05)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("RULER score (mean over tasks)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title or "RULER score against compression ratio", fontsize=10)
    return save_figure(fig, path, dpi=120)
