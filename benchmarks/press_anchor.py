"""Our presses on the kvpress anchor's samples: one prefill per sample, every (press, ratio) on a copy.

The samples are the JSON that `benchmarks/kvpress_anchor.py --write-samples` writes (attnlab's seeded
RULER samples); the protocol is kvpress's (the context prefilled and pressed once, the question fed
after, greedy decoding with `attnlab ruler`'s stop rule, RULER's string_match_all). Prefilling once and
pressing copies gives the same numbers as a prefill per cell (a press reads the prefill, never changes
it) at a fraction of the CPU time. `--merge` tables ours beside kvpress's as an `attnlab ruler` run
(summary.json, table.txt, ruler.png), which `attnlab report` shows.

    python benchmarks/press_anchor.py runs/anchor/samples.json --out runs/anchor/ours.json
    python benchmarks/press_anchor.py --merge runs/anchor/ours.json runs/anchor/kvpress.json --out runs/anchor/table
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvpress_anchor import load_samples  # noqa: E402  (the samples file's one reader)


def _recorders(presses: list[str], ratio: float) -> dict:
    """One recorder per press name, shared where two scorers read the same record (h2o and sink_h2o both read
    the prefill's accumulated attention; two recorders would add it twice)."""
    from attnlab.kv.press import PressRecorder, make_press
    recs: dict = {}
    for name in presses:
        p = make_press(name, ratio)
        shared = "probs" if p.needs_probs else name
        recs.setdefault(shared, PressRecorder(p, None))
        recs[name] = recs[shared]
    return recs


def _unique(recs: dict) -> list:
    return list({id(r): r for r in recs.values()}.values())



def run(samples_path: str, out: str, presses: list[str], ratios: list[float], model: str, extra: list[str],
        questions: list[str], argv: list[str], quest: tuple[int, ...] = ()) -> None:
    """questions: "out" (kvpress's protocol: the context pressed, the question fed after) and/or "in" (the whole
    prompt pressed). Both from one context prefill: "in" continues a copy of it with the question, observed.
    quest: channel counts; per count C and ratio R a cell that presses nothing and answers with Quest reading
    (1 - R) of the prompt's tokens per step (whole pages of 16, ranked by Quest's bound for C = 0, by the best key
    on C channels otherwise; question out): the same share of the cache read as a press of ratio R leaves, but
    every token kept in memory, so a later query can still reach it. Named "quest" (C = 0) or "quest:cC"."""
    import attnlab
    from attnlab.eval.ruler_run import answer_batch
    from attnlab.io import provenance, write_json
    from attnlab.kv.pages import QuestSpec
    from attnlab.kv.press import compress, make_press
    prov = {**provenance(argv), "command": " ".join(["python", "benchmarks/press_anchor.py"] + argv), "seed": 0}
    torch.set_num_threads(1)
    lm = attnlab.load(model, dtype="float32", **({"attention": "quest:32:16"} if quest else {}))  # caches keep pages
    full = lm.with_attention(None)
    samples = load_samples(samples_path)
    names = [n for n in presses + extra if n]
    cells = [("full", "out", 0.0)] + [(n, q, r) for q in questions for n in names for r in ratios]
    quests = {("quest" if c == 0 else f"quest:c{c}"): c for c in quest}
    cells += [(name, "out", r) for name in quests for r in ratios]
    results = []
    for s in samples:
        start = time.process_time()
        n = s["context_tokens"]
        made = {(name, r): make_press(name, r) for name in names for r in ratios}
        recs = _recorders(names, ratios[0])  # a recorder reads, never writes: one serves every ratio
        cache = lm.new_cache(1, capacity=len(s["ids"]) + 64)
        for rec in _unique(recs):
            rec.layers = cache.layers
        logits = lm.prefill(torch.tensor([s["ids"][:n]]), cache, chunk=512, observers=_unique(recs))
        state = {"out": (cache, recs, logits, s["ids"][n:])}
        prefill = time.process_time() - start
        if "in" in questions:  # the question observed too, so the scorers' last queries are the question's;
            c2, r2 = copy.deepcopy((cache, recs))  # the last token is fed after the press, so no answer token
            lm.prefill(torch.tensor([s["ids"][n:-1]]), c2, chunk=512, observers=_unique(r2))  # sees the full cache
            state["in"] = (c2, r2, logits, s["ids"][-1:])
        for name, question, ratio in cells:
            t = time.process_time()
            base, recorders, first, rest = state[question]
            pressed = copy.deepcopy(base)
            answerer = full
            if name in quests:
                budget = 16 * max(2, round((1 - ratio) * len(s["ids"]) / 16))
                answerer = lm.with_attention(QuestSpec(budget, 16, 0, quests[name]))
            elif name != "full":
                compress(pressed, made[(name, ratio)], recorders[name])
            pred = answer_batch(answerer, pressed, first, [rest], [s["max_new"]])[0]
            score = 100 * sum(a.lower() in pred.lower() for a in s["answers"]) / len(s["answers"])
            results.append({"press": name, "question": question, "ratio": ratio, "task": s["task"],
                            "index": s["index"], "score": score, "pred": pred,
                            "cpu_seconds": time.process_time() - t, "prefill_cpu_seconds": prefill})
            print(json.dumps(results[-1]), flush=True)
        write_json(Path(out), {**prov, "model": model, "results": results})  # after each sample: a cut run keeps


def compare_kept(samples_path: str, theirs: str, model: str, ratio: float) -> None:
    """Our kept indices on the first sample against kvpress's (`kvpress_anchor.py --dump-kept`): per press,
    the share of (layer, KV head) whose kept sets are identical and the mean overlap."""
    import attnlab
    from attnlab.kv.press import PressRecorder, compress, make_press
    torch.set_num_threads(1)
    lm = attnlab.load(model, dtype="float32")
    s = load_samples(samples_path)[0]
    ref = torch.load(theirs)
    presses = {name: make_press(name, ratio) for name in ref}
    recorders = {name: PressRecorder(p, None) for name, p in presses.items()}
    cache = lm.new_cache(1, capacity=s["context_tokens"] + 8)
    for rec in recorders.values():
        rec.layers = cache.layers
    lm.prefill(torch.tensor([s["ids"][:s["context_tokens"]]]), cache, chunk=512, observers=list(recorders.values()))
    for name, press in presses.items():
        pressed = copy.deepcopy(cache)
        compress(pressed, press, recorders[name])
        same = overlap = total = 0
        for layer, want in zip(pressed.layers, ref[name]):
            got = layer.pos[0, :, :layer.n].sort(-1).values
            for h in range(got.shape[0]):
                a, b = set(got[h].tolist()), set(want[h].tolist())
                same += a == b
                overlap += len(a & b) / len(b)
                total += 1
        print(f"{name:<20} ratio {ratio}: identical kept sets in {same}/{total} (layer, KV head); "
              f"mean overlap {overlap / total:.4f}")


def _key(r: dict) -> tuple:
    return r["press"], r.get("question", "out"), r["ratio"], r["task"], r["index"]


def _label(press: str, question: str) -> str:
    return press + ("+q" if question == "in" else "")  # +q: the question pressed too (compress_questions)


def side_by_side(ours: list[dict], theirs: list[dict]) -> str:
    """Per (press, question, ratio): RULER average (over every sample both ran) of each library, the paired
    difference with its 95% bootstrap interval, and in how many samples the two answers are the same string."""
    from attnlab.stats import paired_difference
    mine, other = {_key(r): r for r in ours}, {_key(r): r for r in theirs}
    cells = sorted({k[:3] for k in mine if k in other}, key=lambda c: (c[0] != "full", c[2], c[1], c[0]))
    lines = [f"{'press':<22} {'ratio':>5} {'attnlab':>8} {'kvpress':>8} {'diff':>6} {'95% interval':>15}  same answer"]
    for cell in cells:
        ks = [k for k in mine if k[:3] == cell and k in other]
        d = paired_difference([mine[k]["score"] for k in ks], [other[k]["score"] for k in ks])
        x = sum(mine[k]["score"] for k in ks) / len(ks)
        same = sum(mine[k]["pred"] == other[k]["pred"] for k in ks)
        lines.append(f"{_label(cell[0], cell[1]):<22} {cell[2]:>5.2f} {x:>8.1f} {x - d['mean']:>8.1f} "
                     f"{d['mean']:>+6.1f} "
                     f"{'[' + format(d['lo'], '+.1f') + ', ' + format(d['hi'], '+.1f') + ']':>15}  {same}/{len(ks)}")
    return "\n".join(lines)


def best_against_best(ours: list[dict], theirs: list[dict], ratio: float) -> list[dict]:
    """The must-show comparison at one ratio: each library's best cell (highest mean on these samples) against
    the other's, paired per sample; once over every cell (either may press the question), once over kvpress's
    protocol only (question out). The best is the highest RULER average on these samples (chosen on the same
    samples, so the gain is optimistic); the difference is the mean over samples, paired. A third line holds
    kvpress to its presses at their defaults (names without fields), the anchor's five as kvpress ships them."""
    from attnlab.stats import paired_difference
    out = []
    for scope, allowed, defaults_only in (("any protocol", {"out", "in"}, False), ("question out", {"out"}, False),
                                          ("kvpress at its defaults", {"out", "in"}, True)):
        per: dict = {}
        for lib, rows in (("attnlab", ours), ("kvpress", theirs)):
            cells: dict = {}
            for r in rows:
                if lib == "kvpress" and defaults_only and ":" in r["press"]:  # a spec sets fields
                    continue
                if r["ratio"] == ratio and r.get("question", "out") in allowed:
                    cells.setdefault((r["press"], r.get("question", "out")), {})[(r["task"], r["index"])] = r["score"]
            per[lib] = cells
        if not all(per.values()):
            continue  # a run of one protocol only
        common = set.intersection(*[set(v) for c in per.values() for v in c.values()])
        tasks = sorted({t for t, _ in common})

        def ruler(scores):  # RULER average: the mean over tasks of each task's mean (the table's avg)
            return sum(sum(v for (t, _), v in scores.items() if t == task and (t, _) in common) /
                       sum(1 for x in common if x[0] == task) for task in tasks) / len(tasks)
        best = {lib: max(c, key=lambda k: ruler(c[k])) for lib, c in per.items()}
        order = sorted(common)
        d = paired_difference([per["attnlab"][best["attnlab"]][s] for s in order],
                              [per["kvpress"][best["kvpress"]][s] for s in order])
        out.append({"ratio": ratio, "scope": scope, "attnlab_best": _label(*best["attnlab"]),
                    "kvpress_best": _label(*best["kvpress"]), **d})
    return out


def bars(rows: list[dict], path: Path, title: str) -> None:
    """RULER average per press at each ratio, attnlab's and kvpress's bars side by side (one alone where only one
    library has the press), the full cache as a dashed line: easier to read than one line per press."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from attnlab.io import save_figure

    def ruler(name, ratio):
        tasks = {r["task"]: r["score"] for r in rows if r["policy"] == name and r["ratio"] == ratio}
        return sum(tasks.values()) / len(tasks) if tasks else None
    ratios = sorted({r["ratio"] for r in rows if r["ratio"]})
    labels = sorted({r["policy"].split(":", 1)[1] for r in rows if r["ratio"] and ":" in r["policy"]})
    fig, axes = plt.subplots(len(ratios), 1, figsize=(max(6.0, 0.55 * len(labels) + 1), 3.8 * len(ratios)),
                             squeeze=False)
    for ax, ratio in zip(axes[:, 0], ratios):
        for j, lib in enumerate(("attnlab", "kvpress")):
            ys = [ruler(f"{lib}:{x}", ratio) for x in labels]
            xs = [i + (j - 0.5) * 0.4 for i, y in enumerate(ys) if y is not None]
            ax.bar(xs, [y for y in ys if y is not None], 0.4, label=lib, color=f"C{j}")
        ax.axhline(ruler("full", 0.0), color="black", ls="--", lw=1, label="full cache")
        ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel(f"RULER average, ratio {ratio:g}")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0, 0].set_title(title, fontsize=9)
    save_figure(fig, path, dpi=120)


def _joined(paths: str) -> dict:
    """One library's result files (comma list: a run cut and continued on the other samples) as one: results
    concatenated, commands and commits joined with " ; "."""
    parts = [json.loads(Path(p).read_text()) for p in paths.split(",")]
    keys = [_key(r) for d in parts for r in d["results"]]
    if len(keys) != len(set(keys)):
        raise SystemExit(f"{paths}: the files share a cell; join runs of different samples only")
    return {**parts[0], "results": [r for d in parts for r in d["results"]],
            **{k: " ; ".join(dict.fromkeys(str(d.get(k)) for d in parts)) for k in ("command", "commit")}}


def merge(ours: str, theirs: str, out: str) -> None:
    """Both result files as one `attnlab ruler`-style run: rows attnlab:NAME and kvpress:NAME (and full; +q: the
    question pressed too), the paired comparisons beside it (table.txt, summary.json's "paired")."""
    from attnlab.eval.ruler_run import full_by_task, plot, table
    from attnlab.io import write_json, write_text
    a, b = _joined(ours), _joined(theirs)
    both = {_key(r)[3:] for r in a["results"]} & {_key(r)[3:] for r in b["results"]}  # a cut run: samples both did
    a["results"], b["results"] = [[r for r in x["results"] if _key(r)[3:] in both] for x in (a, b)]
    acc: dict = {}
    for lib, data in (("attnlab", a), ("kvpress", b)):
        for r in data["results"]:
            label = _label(r["press"], r.get("question", "out"))
            name = "full" if r["press"] == "full" and lib == "attnlab" else f"{lib}:{label}"
            acc.setdefault((r["task"], 4096, name, r["ratio"]), []).append(r["score"])
    rows = [{"task": t, "length": n, "policy": p, "ratio": r, "samples": len(v), "score": sum(v) / len(v)}
            for (t, n, p, r), v in acc.items()]
    samples = max(x["samples"] for x in rows)
    ratios = sorted({r["ratio"] for r in rows if r["ratio"]})
    paired = [p for r in ratios for p in best_against_best(a["results"], b["results"], r)]
    best = "\n".join(f"ratio {p['ratio']:g}, {p['scope']}: attnlab's best {p['attnlab_best']} - kvpress's best "
                     f"{p['kvpress_best']} = {p['mean']:+.1f} points, 95% bootstrap [{p['lo']:+.1f}, {p['hi']:+.1f}], "
                     f"{p['wins']} wins / {p['losses']} losses / {p['ties']} ties of {p['n']}, sign test p = "
                     f"{p['sign_p']:.3f}" for p in paired)
    n_all = len(both)
    text = (f"RULER 4K on {a['model']}: ours (attnlab, rows attnlab:NAME and full) and kvpress 0.5.5 (rows "
            f"kvpress:NAME) on the same {n_all} samples (up to {samples} per task); NAME+q: the question pressed "
            f"too\n\n"
            f"{side_by_side(a['results'], b['results'])}\n\nbest against best (paired, per sample):\n{best}\n\n"
            f"{table(rows)}\n\nfull cache per task:\n{full_by_task(rows)}\n\ncommands (commits {a.get('commit')} / "
            f"{b.get('commit')}):\n  {a['command']}\n  {b['command']}\n")
    out_dir = Path(out)
    write_text(out_dir / "table.txt", text)
    plot(rows, out_dir / "ruler.png", title=f"RULER 4K, attnlab vs kvpress presses, {samples} sample(s) per task")
    bars(rows, out_dir / "bars.png", f"RULER 4K on {Path(a['model']).name}, {n_all} samples; +q: the question pressed too")
    write_json(out_dir / "summary.json", {
        "command": a["command"] + " ; " + b["command"], "commit": a.get("commit"), "model": a["model"],
        "tasks": sorted({r["task"] for r in rows}), "lengths": [4096], "ratios": ratios, "samples": samples,
        "seed": 0, "cells": rows, "paired": paired})
    print(text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("samples", nargs="?")
    p.add_argument("--merge", nargs=2, metavar=("OURS", "KVPRESS"), help="result files (each a comma list of runs)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--presses", default="knorm,streaming_llm,snapkv,tova,expected_attention")
    p.add_argument("--extra", default="", help="presses only we score (h2o, sink_h2o, NAME:page=16, ...)")
    p.add_argument("--ratios", default="0.25,0.5,0.75")
    p.add_argument("--question", default="out", help="out, in, or out,in: press the question too (in)")
    p.add_argument("--quest", nargs="?", const="0", default="",
                   help="also Quest over the unpressed cache, reading (1 - ratio) of the prompt per step; "
                        "optional channel counts (0: Quest's bound; e.g. 0,16)")
    p.add_argument("--out", default=None)
    p.add_argument("--compare-kept", default=None, metavar="KVPRESS_PT", help="compare kept indices with kvpress's")
    a = p.parse_args()
    if a.compare_kept:
        compare_kept(a.samples, a.compare_kept, a.model, float(a.ratios.split(",")[0]))
    elif a.merge:
        merge(*a.merge, a.out)
    else:
        run(a.samples, a.out, a.presses.split(","), [float(r) for r in a.ratios.split(",")], a.model,
            [x for x in a.extra.split(",") if x], a.question.split(","), sys.argv[1:],
            tuple(int(c) for c in a.quest.split(",") if c))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
