"""Position Interpolation's result at CPU scale (Chen et al. 2023, issue 9).

A small Llama-style `Transformer` is trained from scratch on the Shakespeare training plays at
context C (256), then extended to 4C with the trainer as fine-tuner:
    base      the trained model, no scaling                 (its own perplexity at C is the target)
    pi        linear:4, no fine-tuning                      (c)
    ntk, yarn ntk:4 / yarn:4, no fine-tuning                (d)
    pi+ft     linear:4 + N steps at 4C                      (a)
    none+ft   no scaling + the same N steps                 (b, the control)
    yarn+ft   yarn:4 + the same N steps                     (e)
Each arm is scored with `attnlab.eval.perplexity` (disjoint windows, each from an empty cache) on
the same test-play tokens at windows C, 2C and 4C, and on a word-level passkey (see
`passkey_accuracy`; the other arms only if the base retrieves at C at all). The paper's claim: pi+ft at 4C within 10% of base at C, clearly below none+ft.

Everything is resumable: the trainer resumes its checkpoints, each arm's scores are cached in
OUT/scores/ARM.json (recomputed when the configuration changes).

    nice -n 19 python benchmarks/pi_repro.py --threads 1              # 25-35 min, shared machine
    nice -n 19 python benchmarks/pi_repro.py --ft-seed 2 --figure ''  # replicate fine-tunes
    python benchmarks/pi_repro.py --config tiny --out /tmp/pi         # seconds (the test's size)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import time
from pathlib import Path

import torch

CONFIGS = {
    # sized for a shared 2-core machine (a fraction of one core): word tokenizer (2,048 ids, ~18% of test
    # words <unk>), 3 layers, dim 96, head_dim 32; base 1,000 x 4 x 256 tokens, fine-tunes 200 x 1 x 1,024
    "cpu": dict(vocab=2048, dim=96, n_layers=3, n_heads=3, hidden_dim=256, context=256, factor=4,
                base_steps=1000, batch=4, lr=3e-3, warmup=50, ft_steps=200, ft_batch=1, ft_lr=3e-4,
                ft_warmup=10, eval_tokens=0, passkey_trials=10, eval_every=100, ft_eval_every=50),
    "tiny": dict(vocab=64, dim=16, n_layers=1, n_heads=2, hidden_dim=32, context=64, factor=4,
                 base_steps=2, batch=2, lr=1e-3, warmup=0, ft_steps=2, ft_batch=1, ft_lr=1e-3,
                 ft_warmup=0, eval_tokens=512, passkey_trials=2, eval_every=1, ft_eval_every=1),
}
# arm -> (scaling method of attnlab.train.extend, fine-tuned?)
ARMS = {"base": ("none", False), "pi": ("pi", False), "ntk": ("ntk", False), "yarn": ("yarn", False),
        "pi+ft": ("pi", True), "none+ft": ("none", True), "yarn+ft": ("yarn", True)}
DEPTHS = (0.1, 0.5, 0.9)


def base_config(p: dict):
    from attnlab.train.trainer import TrainConfig
    return TrainConfig(corpus="shakespeare:train", val_corpus="shakespeare:validation", tokenizer="word",
                       vocab_size=p["vocab"], dim=p["dim"], n_layers=p["n_layers"], n_heads=p["n_heads"],
                       hidden_dim=p["hidden_dim"], context=p["context"], batch=p["batch"], steps=p["base_steps"],
                       lr=p["lr"], schedule="cosine", warmup=p["warmup"], beta2=0.99, clip=1.0,
                       eval_every=p["eval_every"], eval_batches=4, ckpt_every=p["eval_every"], keep_checkpoints=1)


def ft_config(p: dict, scaling: dict | None):
    """The fine-tune at factor x context: same data, every arm the same steps, batch, lr."""
    return dataclasses.replace(base_config(p), context=p["context"] * p["factor"], batch=p["ft_batch"],
                               steps=p["ft_steps"], lr=p["ft_lr"], schedule="constant", warmup=p["ft_warmup"],
                               rope_scaling=scaling, eval_every=p["ft_eval_every"],
                               ckpt_every=p["ft_eval_every"], seed=p.get("ft_seed", 1))


def train_base(p: dict, out: Path, progress=None):
    """Train (or resume, or just load) the base model -> (model, tokenizer)."""
    from attnlab.train.trainer import Trainer, load_checkpoint
    cfg = base_config(p)
    tr = Trainer(cfg, out / "base", resume=True)
    if tr.step < cfg.steps:
        tr.run(progress=progress)
    model, tok, _ = load_checkpoint(out / "base")
    return model, tok


def run_name(p: dict, arm: str) -> str:
    """Folder/score name of an arm; fine-tunes with another data order (--ft-seed) get their own."""
    seed = p.get("ft_seed", 1)
    return arm if seed == 1 or not ARMS[arm][1] else f"{arm}@seed{seed}"


def arm_model(p: dict, out: Path, arm: str, progress=None):
    """The base model rescaled for `arm`, fine-tuned (resumably) if the arm says so."""
    from attnlab.train.extend import apply_scaling, extension_scaling
    from attnlab.train.trainer import Trainer, load_checkpoint
    method, tune = ARMS[arm]
    model, tok = train_base(p, out)
    if method == "none" and not tune:
        return model, tok
    scaling = extension_scaling(method, p["factor"], p["context"])
    apply_scaling(model, scaling, p["context"] * p["factor"])
    if not tune:
        return model, tok
    cfg = ft_config(p, scaling)
    tr = Trainer(cfg, out / run_name(p, arm), resume=True, tokenizer=tok, model=model)
    if tr.step < cfg.steps:
        tr.run(progress=progress)
    model, _, _ = load_checkpoint(out / run_name(p, arm))
    return model, tok


# the passkey prompt of attnlab.eval.passkey in words a 2,048-word Shakespeare vocabulary has
FILLER = "the night is dark . the sun is bright . the sea is deep . here we go . there and back again . "
NEEDLE = "the secret word is {key} . remember it . {key} is the secret word . "
QUESTION = "what is the secret word ? the secret word is"


def passkey_keys(tok, trials: int, seed: int = 0) -> list[str]:
    """Random one-word keys (a number would be <unk> to a word vocabulary): alphabetic words of rank
    100-1000, so the model has seen each often but none is predictable from the question."""
    words = [w for w in tok.vocab[1:1000] if w.isalpha()]
    words = words[100:] if len(words) >= 100 + trials else words  # (tiny vocabularies: all)
    return random.Random(seed).sample(words, trials)


def passkey_ids(tok, length: int, depth: float, key: str) -> list[int]:
    """At most `length` ids: filler with the needle after `depth` of it, then the question."""
    fixed, per = len(tok.encode(NEEDLE.format(key=key) + QUESTION)), len(tok.encode(FILLER))
    units = (length - fixed) // per
    if units < 1:
        raise ValueError(f"length {length} is too short for a passkey prompt (needs > {fixed + per} tokens)")
    before = round(depth * units)
    return tok.encode(FILLER * before + NEEDLE.format(key=key) + FILLER * (units - before) + QUESTION)


@torch.inference_mode()
def passkey_accuracy(model, tok, lengths: list[int], trials: int) -> dict:
    """{length: accuracy} over DEPTHS x trials keys: the greedy next word after the question is the key.
    A test of retrieval from anywhere in the window (an induction-style copy), as in the PI paper."""
    keys, acc = passkey_keys(tok, trials), {}
    for length in lengths:
        hits = 0
        for depth in DEPTHS:
            for key in keys:
                ids = passkey_ids(tok, length, depth, key)
                logits = model(torch.tensor([ids]), keep=slice(-1, None))
                hits += int(logits[0, -1].argmax()) == tok.index[key]
        acc[str(length)] = hits / (len(DEPTHS) * trials)
    return acc


@torch.inference_mode()
def ppl_by_position(model, ids: list[int], window: int, bucket: int) -> dict:
    """Perplexity per `bucket` positions of full `window`-token windows (the same disjoint windows as
    `perplexity`): does the model use the far context, or only tolerate it?"""
    from attnlab.eval.perplexity import token_nll
    ids = torch.tensor(ids)
    sums, n = torch.zeros(window // bucket, dtype=torch.float64), 0
    for w0 in range(0, ids.numel() - window, window):
        win = ids[w0:w0 + window + 1]
        nll = token_nll(model(win[None, :-1]), win[None, 1:])[0]
        sums += nll.double().view(-1, bucket).sum(1)
        n += bucket
    return {f"{i * bucket}-{(i + 1) * bucket - 1}": math.exp(float(v) / n) for i, v in enumerate(sums)}


def score_key(p: dict, arm: str) -> dict:
    return p if ARMS[arm][1] else {k: v for k, v in p.items() if k != "ft_seed"}  # shared by replicates


class ScoreStore:
    """OUT/scores/ARM.json, the cells of attnlab.scale for this benchmark (reused when the config matches)."""

    def __init__(self, out: Path):
        self.out = out

    def load(self, cell) -> dict | None:
        q = cell.params
        path = self.out / "scores" / f"{run_name(q['p'], q['arm'])}.json"
        if not path.exists():
            return None
        cached = json.loads(path.read_text())
        ok = cached.get("config") == score_key(q["p"], q["arm"]) and "by_position" in cached
        return {"result": cached} if ok and ("passkey" in cached or not q["passkey"]) else None

    def save(self, cell, payload: dict) -> dict:
        from attnlab.io import write_json
        write_json(self.out / "scores" / f"{run_name(cell.params['p'], cell.params['arm'])}.json", payload["result"])
        return payload


def score_arms(p: dict, out: Path, arms: list[str], passkey: bool) -> dict:
    """Each arm one cell (attnlab.scale: skipped when scored, written atomically), in order."""
    from attnlab.scale import Cell, run_cells
    cells = [Cell("benchmarks/pi_repro.py:score", dict(p=p, out=str(out), arm=arm, passkey=passkey), readable=arm,
                  func=score) for arm in arms]
    report = run_cells(cells, ScoreStore(out), desc="pi arms", threads=0)
    return {arm: r["result"] for arm, r in zip(arms, report.records)}


def score(p: dict, out: Path, arm: str, passkey: bool, progress=None) -> dict:
    """Perplexity at C, 2C, 4C on the first eval_tokens test tokens (+ passkey) of one arm."""
    from attnlab.data import corpus
    from attnlab.engine import LM
    from attnlab.eval.perplexity import perplexity
    out, key = Path(out), score_key(p, arm)
    model, tok = arm_model(p, out, arm, progress)
    model.eval()
    lengths = [p["context"] * m for m in (1, 2, p["factor"])]
    ids = tok.encode(corpus("shakespeare:test"))[:(p["eval_tokens"] or 10**12) + 1]  # 0: all
    t0 = time.perf_counter()
    row = {"arm": arm, "config": key, "scaling": model.cfg.rope_scaling,
           "ppl": {str(w): perplexity(LM(model), ids, window=w, chunk=w)["ppl"] for w in lengths},
           "by_position": ppl_by_position(model, ids, lengths[-1], p["context"])}
    if passkey:
        row["passkey"] = passkey_accuracy(model, tok, lengths, p["passkey_trials"])
    log = out / run_name(p, arm) / "metrics.jsonl"
    if ARMS[arm][1] and log.exists():  # the fine-tune's validation losses (at 4C), first and last
        rows = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        row["ft_val_loss"] = [rows[0]["val_loss"], rows[-1]["val_loss"]]
    row["eval_seconds"] = round(time.perf_counter() - t0, 1)
    return row


def summarise(p: dict, rows: dict) -> dict:
    c4 = str(p["context"] * p["factor"])
    own = rows["base"]["ppl"][str(p["context"])]
    a, b = rows["pi+ft"]["ppl"][c4], rows["none+ft"]["ppl"][c4]
    return {"base_ppl_at_C": own, "pi_ft_ppl_at_4C": a, "none_ft_ppl_at_4C": b, "ratio_a_to_base": a / own,
            "within_10pct": a <= 1.10 * own, "a_better_than_b": a < b}


def plot(p: dict, rows: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for (arm, row), marker in zip(rows.items(), "osD^vPX"):
        xs = [int(k) for k in row["ppl"]]
        style = "-" if ARMS[arm][1] else "--"  # solid: fine-tuned at 4C
        ax.plot(xs, list(row["ppl"].values()), style, marker=marker, label=arm, alpha=0.85)
    ax.axhline(rows["base"]["ppl"][str(p["context"])], color="grey", lw=0.8, ls=":")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("evaluation window (tokens)")
    ax.set_ylabel("test perplexity (dotted: base at its own context)")
    ax.set_title(f"trained at {p['context']}, extended x{p['factor']} ({p['ft_steps']} fine-tune steps)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="cpu", choices=list(CONFIGS))
    ap.add_argument("--out", default="runs/pi_repro")
    ap.add_argument("--figure", default="docs/figures/rope/pi_repro.png", help="'' for none")
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ",".join(ARMS))
    ap.add_argument("--ft-seed", type=int, default=1, help="fine-tunes' data-order seed (a replicate: "
                    "other folders, results-seedN.json)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    p, out = dict(CONFIGS[args.config]), Path(args.out)
    if args.ft_seed != 1:
        p["ft_seed"] = args.ft_seed
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if bad or "base" not in arms:
        ap.error(f"--arms must include base and name only {', '.join(ARMS)}; got {', '.join(bad) or 'no base'}")
    rows = score_arms(p, out, ["base"], passkey=True)  # trains the base every other arm starts from
    can = rows["base"]["passkey"][str(p["context"])] >= 0.5  # retrieval at its own context at all?
    rows.update(score_arms(p, out, [a for a in arms if a != "base"], passkey=can))
    for arm in rows:
        print(arm, json.dumps(rows[arm]["ppl"]), json.dumps(rows[arm].get("passkey", {})), flush=True)
    result = {"config": p, "arms": rows, "passkey_possible": can,
              "command": "nice -n 19 python benchmarks/pi_repro.py " + " ".join(argv or [])}
    if "pi+ft" in rows and "none+ft" in rows:
        result["claim"] = summarise(p, rows)
        print(json.dumps(result["claim"]))
    (out / ("results.json" if args.ft_seed == 1 else f"results-seed{args.ft_seed}.json")).write_text(json.dumps(result, indent=1) + "\n")
    if args.figure:
        plot(p, rows, Path(args.figure))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
