"""How much of each needle a press keeps, per layer: why whole pages help on RULER's NIAH tasks.

A needle's value is a run of tokens (a 7-digit number is 7 of Qwen's tokens). For each NIAH sample the
prompt is prefilled once, question included but its last token (the `+q` protocol), and every press
compresses a copy; per layer and KV head we count the share of the answer's tokens (found in the
context) still in the cache, and whether the whole value survived. No decoding: the count explains the
RULER scores of `press_anchor.py` (a value kept with a digit missing is copied with a digit missing).

    python benchmarks/press_needles.py samples.json --model DIR --presses tova,tova:page=16 --out runs/needles
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvpress_anchor import load_samples  # noqa: E402  (the samples file's one reader)


def needle_positions(decode, ids: list[int], n: int, answers: list[str]) -> list[list[int]]:
    """Per answer, the token positions (< n) whose text overlaps its occurrences in the context."""
    text, starts = "", []
    for t in ids[:n]:
        starts.append(len(text))
        text += decode([t])
    ends = starts[1:] + [len(text)]
    out = []
    for a in answers:
        at, found = text.find(a), set()
        while at >= 0:
            found |= {i for i in range(n) if starts[i] < at + len(a) and ends[i] > at}
            at = text.find(a, at + 1)
        out.append(sorted(found))
    return out


def run(samples_path: str, model: str, presses: list[str], ratio: float, out: str, argv: list[str]) -> None:
    import attnlab
    from attnlab.io import provenance, write_json
    from attnlab.kv.press import PressRecorder, compress, make_press
    torch.set_num_threads(1)
    prov = {**provenance(argv), "command": " ".join(["python", "benchmarks/press_needles.py"] + argv), "seed": 0}
    lm = attnlab.load(model, dtype="float32", tokenizer=True)
    made = {name: make_press(name, ratio) for name in presses}
    rows = []
    for s in load_samples(samples_path):
        if not s["task"].startswith("niah"):
            continue
        n, ids = s["context_tokens"], s["ids"]
        needle = needle_positions(lambda t: lm.tokenizer.decode(t), ids, n, s["answers"])
        cache = lm.new_cache(1, capacity=len(ids) + 8)
        recs = {name: PressRecorder(p, cache.layers) for name, p in made.items()}
        lm.prefill(torch.tensor([ids[:n]]), cache, chunk=512, observers=list(recs.values()))
        lm.prefill(torch.tensor([ids[n:-1]]), cache, chunk=512, observers=list(recs.values()))
        want = [torch.tensor(x) for x in needle if x]
        for name, press in made.items():
            pressed = copy.deepcopy(cache)
            compress(pressed, press, recs[name])
            share, whole = [], []
            for layer in pressed.layers:
                kept = [torch.isin(w[None], layer.pos[0, :, :layer.n]) for w in want]  # per value: [H, tokens]
                share.append(torch.cat(kept, 1).float().mean().item())
                whole.append(torch.stack([k.all(-1) for k in kept]).float().mean().item())
            rows.append({"task": s["task"], "index": s["index"], "press": name, "needle_tokens": [len(x) for x in needle],
                         "share": share, "whole": whole})
            print(f"{s['task']:<16} {s['index']} {name:<34} kept {100 * sum(share) / len(share):5.1f}% of the "
                  f"needles' tokens, {100 * sum(whole) / len(whole):5.1f}% of the needles whole (mean over layers and "
                  f"KV heads)", flush=True)
        write_json(Path(out) / "needles.json", {**prov, "model": model, "ratio": ratio, "rows": rows})
    plot(rows, Path(out) / "needles.png", ratio)


def plot(rows: list[dict], path: Path, ratio: float) -> None:
    """Per layer, mean over samples and KV heads: the share of needle tokens kept, and of needles kept whole."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from attnlab.io import save_figure
    presses = list(dict.fromkeys(r["press"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, key, title in ((axes[0], "share", "needle tokens kept"), (axes[1], "whole", "needles kept whole")):
        for i, p in enumerate(presses):
            per = torch.tensor([r[key] for r in rows if r["press"] == p]).mean(0)
            ax.plot(range(len(per)), 100 * per, marker=".", label=f"{p} ({100 * per.mean():.0f}%)", color=f"C{i}")
        ax.set_title(f"{title}, ratio {ratio:g} (mean over samples, KV heads)", fontsize=9)
        ax.set_xlabel("layer")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("% (of tokens | of needles)")
    axes[1].legend(fontsize=7)
    save_figure(fig, path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("samples")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--presses", default="snapkv,tova,tova:page=16,snapkv:window_size=32,snapkv:window_size=32:page=16")
    p.add_argument("--ratio", type=float, default=0.5)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    run(a.samples, a.model, a.presses.split(","), a.ratio, a.out, sys.argv[1:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
