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


def run(samples_path: str, out: str, presses: list[str], ratios: list[float], model: str, extra: list[str],
        question: str = "out") -> None:
    import attnlab
    from attnlab.eval.ruler_run import answer_batch
    from attnlab.io import write_json
    from attnlab.kv.press import PressRecorder, compress, make_press
    torch.set_num_threads(1)
    lm = attnlab.load(model, dtype="float32")
    samples = json.loads(Path(samples_path).read_text())
    cells = [("full", 0.0)] + [(n, r) for n in presses + extra for r in ratios]
    results = []
    for s in samples:
        start = time.process_time()
        n = s["context_tokens"] if question == "out" else len(s["ids"])  # in: the press sees the question
        made = {(name, r): make_press(name, r) for name, r in cells if name != "full"}
        # one recorder per press configuration (window / statistics) is enough: they read, never write
        recorders = {name: PressRecorder(p, None) for (name, r), p in made.items() if r == ratios[0]}
        cache = lm.new_cache(1, capacity=len(s["ids"]) + 64)
        for rec in recorders.values():
            rec.layers = cache.layers
        logits = lm.prefill(torch.tensor([s["ids"][:n]]), cache, chunk=512, observers=list(recorders.values()))
        prefill = time.process_time() - start
        for name, ratio in cells:
            t = time.process_time()
            pressed = copy.deepcopy(cache)
            if name != "full":
                compress(pressed, made[(name, ratio)], recorders[name])
            pred = answer_batch(lm, pressed, logits, [s["ids"][n:]], [s["max_new"]])[0]
            score = 100 * sum(a.lower() in pred.lower() for a in s["answers"]) / len(s["answers"])
            results.append({"press": name, "ratio": ratio, "task": s["task"], "index": s["index"], "score": score,
                            "pred": pred, "cpu_seconds": time.process_time() - t, "prefill_cpu_seconds": prefill})
            print(json.dumps(results[-1]), flush=True)
    write_json(Path(out), {"command": " ".join(["python"] + sys.argv), "model": model, "results": results})


def compare_kept(samples_path: str, theirs: str, model: str, ratio: float) -> None:
    """Our kept indices on the first sample against kvpress's (`kvpress_anchor.py --dump-kept`): per press,
    the share of (layer, KV head) whose kept sets are identical and the mean overlap."""
    import attnlab
    from attnlab.kv.press import PressRecorder, compress, make_press
    torch.set_num_threads(1)
    lm = attnlab.load(model, dtype="float32")
    s = json.loads(Path(samples_path).read_text())[0]
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


def side_by_side(ours: list[dict], theirs: list[dict]) -> str:
    """Per (press, ratio): RULER average (over every sample both ran) of each library, the difference, and in
    how many samples the two answers are the same string."""
    key = lambda r: (r["press"], r["ratio"], r["task"], r["index"])  # noqa: E731
    mine, other = {key(r): r for r in ours}, {key(r): r for r in theirs}
    cells = sorted({(k[0], k[1]) for k in mine if k in other}, key=lambda c: (c[0] != "full", c))
    lines = [f"{'press':<20} {'ratio':>5} {'attnlab':>8} {'kvpress':>8} {'diff':>6}  same answer"]
    for press, ratio in cells:
        ks = [k for k in mine if k[:2] == (press, ratio) and k in other]
        x = sum(mine[k]["score"] for k in ks) / len(ks)
        y = sum(other[k]["score"] for k in ks) / len(ks)
        same = sum(mine[k]["pred"] == other[k]["pred"] for k in ks)
        lines.append(f"{press:<20} {ratio:>5.2f} {x:>8.1f} {y:>8.1f} {x - y:>+6.1f}  {same}/{len(ks)}")
    return "\n".join(lines)


def merge(ours: str, theirs: str, out: str) -> None:
    """Both result files as one `attnlab ruler`-style run: rows attnlab:NAME and kvpress:NAME (and full)."""
    from attnlab.eval.ruler_run import full_by_task, plot, table
    from attnlab.io import write_json, write_text
    a, b = json.loads(Path(ours).read_text()), json.loads(Path(theirs).read_text())
    key = lambda r: (r["press"], r["ratio"], r["task"], r["index"])  # noqa: E731
    both = {key(r) for r in a["results"]} & {key(r) for r in b["results"]}  # a run cut short: what both did
    a["results"], b["results"] = [r for r in a["results"] if key(r) in both], [r for r in b["results"] if key(r) in both]
    acc: dict = {}
    for lib, data in (("attnlab", a), ("kvpress", b)):
        for r in data["results"]:
            name = "full" if r["press"] == "full" else f"{lib}:{r['press']}"
            if name == "full" and lib == "kvpress":
                name = "kvpress:full"
            acc.setdefault((r["task"], 4096, name, r["ratio"]), []).append(r["score"])
    rows = [{"task": t, "length": n, "policy": p, "ratio": r, "samples": len(v), "score": sum(v) / len(v)}
            for (t, n, p, r), v in acc.items()]
    samples = max(x["samples"] for x in rows)
    text = (f"RULER 4K on {a['model']}: ours (attnlab, rows attnlab:NAME and full) and kvpress 0.5.5 (rows "
            f"kvpress:NAME) on the same samples, {samples} per task, kvpress's question protocol\n\n"
            f"{side_by_side(a['results'], b['results'])}\n\n"
            f"{table(rows)}\n\nfull cache per task:\n{full_by_task(rows)}\n\ncommands:\n  {a['command']}\n"
            f"  {b['command']}\n")
    out_dir = Path(out)
    write_text(out_dir / "table.txt", text)
    plot(rows, out_dir / "ruler.png", title=f"RULER 4K, attnlab vs kvpress presses, {samples} sample(s) per task")
    write_json(out_dir / "summary.json", {
        "command": a["command"] + " ; " + b["command"], "model": a["model"], "tasks": sorted({r["task"] for r in rows}),
        "lengths": [4096], "ratios": sorted({r["ratio"] for r in rows if r["ratio"]}), "samples": samples, "seed": 0,
        "cells": rows})
    print(text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("samples", nargs="?")
    p.add_argument("--merge", nargs=2, metavar=("OURS", "KVPRESS"))
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--presses", default="knorm,streaming_llm,snapkv,tova,expected_attention")
    p.add_argument("--extra", default="", help="our presses kvpress has not (h2o, sink_h2o)")
    p.add_argument("--ratios", default="0.25,0.5,0.75")
    p.add_argument("--question", default="out", choices=["out", "in"], help="in: press the question too")
    p.add_argument("--out", default=None)
    p.add_argument("--compare-kept", default=None, metavar="KVPRESS_PT", help="compare kept indices with kvpress's")
    a = p.parse_args()
    if a.compare_kept:
        compare_kept(a.samples, a.compare_kept, a.model, float(a.ratios.split(",")[0]))
    elif a.merge:
        merge(*a.merge, a.out)
    else:
        run(a.samples, a.out, a.presses.split(","), [float(r) for r in a.ratios.split(",")], a.model,
            [x for x in a.extra.split(",") if x], a.question)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
